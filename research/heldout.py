"""The default HDET on a corpus never tuned on: research.autolr's sweep and controllers on Python's stdlib source.

    python -m research.heldout                # the corpus, then the runs it lacks (hours), then the report
    python -m research.heldout --report-only  # redraw results/heldout/autolr.{md,json} from the committed records

Run from the repository root: the corpus is ``workdirs/pystdlib.txt`` (``research.heldout_corpus``, whose docstring
says which Python's stdlib the records were made from), the path the runs' configs name. The runs are
``research.autolr``'s on it, AdamW and SGD: the sweep, the default HDET (``DEFAULT_VARIANT``) and the default before
the guard (``UNGUARDED_DEFAULT``) from every start, and the peers. Their records are
``results/autolr/runs/task-<hash>/`` (the hash of the override ``data.path=workdirs/pystdlib.txt`` as written: the
report reads no data); the report reads every record there, the screens of the default at other windows from the
best (trained apart, ``research/workloads_discussion.md``) too. ``--out DIR`` writes the report into DIR.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sysconfig

from research import autolr
from research import heldout_corpus

CORPUS = 'workdirs/pystdlib.txt'  # relative to the repository root, as the records' configs name it
# research.autolr's command for this study, less --report-only and --out.
ARGS = (
  f'--config.data.path={CORPUS}',
  '--optim',
  'adamw,sgd',
  '--variants',
  f'{autolr.UNGUARDED_DEFAULT},{autolr.DEFAULT_VARIANT}',
)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--report-only', action='store_true', help='read the records, train nothing')
  p.add_argument('--out', default=None, help="the report's folder (default: results/heldout/)")
  args = p.parse_args(argv)
  if not args.report_only and not os.path.exists(CORPUS):
    data = heldout_corpus.build(sysconfig.get_paths()['stdlib'])
    if hashlib.sha256(data).hexdigest() != heldout_corpus.RECORDED_SHA256:
      raise SystemExit(
        "error: this Python's stdlib is not the corpus the records were made from "
        '(research.heldout_corpus: CPython 3.11.7); its runs would all train anew.'
      )
    os.makedirs(os.path.dirname(CORPUS), exist_ok=True)
    with open(CORPUS, 'wb') as f:
      f.write(data)
  autolr.main(
    [
      *ARGS,
      *(['--report-only'] if args.report_only else []),
      '--out',
      args.out or os.path.join(autolr.REPO, 'results', 'heldout'),
    ]
  )


if __name__ == '__main__':
  main()
