"""A corpus the project never tuned on: Python's own standard library source, as one UTF-8 text file.

    python -m research.heldout_corpus          # writes workdirs/pystdlib.txt (4.2 MB), in seconds
    python -m research.autolr --config.data.path=workdirs/pystdlib.txt --optim adamw,sgd \\
        --variants fit_K15_cap100_settle,fit_K15_cap100_rollback_se2_f5_settle --report-only --out results/heldout

(``python -m research.heldout [--report-only]`` is the study: the corpus, the runs, the report.)

The defaults were chosen on the KJV LM, mnist1d and the Wycliffe fine-tuning (``results/workloads.md``).
Source code is none of those: not prose, with its own byte statistics and long-range structure (indentation,
names defined far above). The file is the running Python's ``stdlib`` ``.py`` files (no tests, ``idlelib``
or ``site-packages``) in a fixed pseudo-random order (the MD5 of each relative path), concatenated until it
passes 4.2 MB, about the KJV's size; the trainer holds out its last 5% for validation.

The committed records (``results/autolr/runs/task-*`` of that path; ``results/heldout/``) were made from
CPython 3.11.7's stdlib (SHA-256 below); another Python version gives another file, and the runs then
train anew under the same cache key, so check the hash this prints.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import sysconfig

RECORDED_SHA256 = 'ff0731083ca39b29bf260533cbfddc736fd62c46414b7f0281fc497d4f1176ce'  # CPython 3.11.7
SIZE = 4_200_000  # bytes: stop after the file that passes this


def stdlib_sources(lib: str) -> list[str]:
  """The stdlib's ``.py`` files but tests, idlelib and site-packages, in the corpus's fixed order."""
  files = [
    f
    for f in glob.glob(os.path.join(lib, '**', '*.py'), recursive=True)
    if not any(part in '/' + os.path.relpath(f, lib) for part in ('/test', 'site-packages', 'idlelib'))
  ]
  return sorted(files, key=lambda f: hashlib.md5(os.path.relpath(f, lib).encode()).hexdigest())


def build(lib: str, size: int = SIZE) -> bytes:
  """The corpus: whole files in :func:`stdlib_sources` order until the total passes ``size`` bytes."""
  out, n = [], 0
  for f in stdlib_sources(lib):
    with open(f, encoding='utf-8') as fh:
      text = fh.read().encode('utf-8')
    out.append(text)
    n += len(text)
    if n > size:
      break
  return b''.join(out)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', default='workdirs/pystdlib.txt', help='where to write the corpus')
  args = parser.parse_args()
  if os.path.exists(args.out):
    raise SystemExit(f'error: --out {args.out} exists; remove it or pass another path (nothing is overwritten).')
  data = build(sysconfig.get_paths()['stdlib'])
  os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
  with open(args.out, 'wb') as f:
    f.write(data)
  sha = hashlib.sha256(data).hexdigest()
  same = "the recorded runs' corpus" if sha == RECORDED_SHA256 else "NOT the recorded runs' corpus (another Python)"
  print(f'wrote {args.out}: {len(data):,} bytes, sha256 {sha} ({same})')


if __name__ == '__main__':
  main()
