"""research.heldout_corpus: which stdlib files, in which order, and where it stops."""

import hashlib
import os
import subprocess
import sys

from research import heldout_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _lib(tmp_path):
  files = {
    'a.py': 'A' * 30,
    'zeta.py': 'Z' * 30,
    'pkg/e.py': 'E' * 30,
    'test/b.py': 'B',
    'pkg/tests/t.py': 'T',
    'idlelib/c.py': 'C',
    'site-packages/d.py': 'D',
    'notes.txt': 'N',
  }
  for rel, text in files.items():
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
  return str(tmp_path)


def test_sources_leave_out_tests_idlelib_and_site_packages_in_md5_order(tmp_path):
  lib = _lib(tmp_path)
  got = [os.path.relpath(f, lib) for f in heldout_corpus.stdlib_sources(lib)]
  kept = ['a.py', 'zeta.py', 'pkg/e.py']
  assert got == sorted(kept, key=lambda r: hashlib.md5(r.encode()).hexdigest())


def test_build_takes_whole_files_until_the_size_is_passed(tmp_path):
  lib = _lib(tmp_path)
  order = [open(f).read() for f in heldout_corpus.stdlib_sources(lib)]
  assert heldout_corpus.build(lib, size=10) == order[0].encode()  # the first file passes 10 bytes
  assert heldout_corpus.build(lib, size=30) == ''.join(order[:2]).encode()  # 30 is not passed by one file
  assert heldout_corpus.build(lib, size=10**6) == ''.join(order).encode()  # all of them


def test_an_existing_output_is_refused_untouched(tmp_path):
  out = tmp_path / 'corpus.txt'
  out.write_text('mine')
  r = subprocess.run(
    [sys.executable, '-m', 'research.heldout_corpus', '--out', str(out)], cwd=ROOT, capture_output=True, text=True
  )
  assert r.returncode != 0 and 'exists' in r.stderr and r.stderr.count('\n') == 1
  assert out.read_text() == 'mine'
