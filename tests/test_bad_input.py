"""Every bad input to ``python train.py --config CONFIG --workdir DIR`` is one line: exit status 2, exactly one
``error: ...`` line on stderr naming the parameter (``--config``, ``data.path``) and the fix, no traceback, and
the workdir untouched (it is checked before anything is compiled or written).

The inputs: config files that give no config (missing, a directory, not Python, an import that fails, no
get_config, a get_config that raises or returns something else) and each task's ``data.path`` given a file of
another kind, a truncated, corrupt or empty one, or a directory. Each case is a train.py subprocess of ~2 s.
"""

import io
import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, 'configs', 'tiny.py')  # the LM task
MNIST1D = os.path.join(ROOT, 'configs', 'mnist1d.py')
BRACKET = os.path.join(ROOT, 'configs', 'bracket.py')  # the LM task


def _arrays() -> dict:
  rng = np.random.default_rng(0)
  return {
    'x': rng.normal(size=(64, 12)).astype(np.float32),
    'y': rng.integers(0, 10, 64),
    'x_test': rng.normal(size=(16, 12)).astype(np.float32),
    'y_test': rng.integers(0, 10, 16),
  }


def _npz_bytes(compressed: bool = False) -> bytes:
  buf = io.BytesIO()
  (np.savez_compressed if compressed else np.savez)(buf, **_arrays())
  return buf.getvalue()


def _corrupt_npz() -> bytes:
  """A compressed .npz whose zip directory is intact but one member's bytes are overwritten (its CRC fails)."""
  raw = bytearray(_npz_bytes(compressed=True))
  raw[200:260] = bytes(60)
  return bytes(raw)


def _truncated_member_npz() -> bytes:
  """A well-formed zip whose x.npy holds half an array (its header promises more bytes than follow)."""
  buf = io.BytesIO()
  with zipfile.ZipFile(buf, 'w') as z:
    for k, v in _arrays().items():
      npy = io.BytesIO()
      np.save(npy, v)
      z.writestr(f'{k}.npy', npy.getvalue()[: len(npy.getvalue()) // 2] if k == 'x' else npy.getvalue())
  return buf.getvalue()


def _npy_bytes() -> bytes:
  buf = io.BytesIO()
  np.save(buf, _arrays()['x'])
  return buf.getvalue()


DIR, ABSENT, NO_PATH = 'a directory', 'no file', 'an empty path'  # what the bad path is, besides a file
TEXT = ('In the beginning God created the heaven and the earth. ' * 200).encode()
NOT_PYTHON = b'\x00\x01\x02 binary \xff\xfe'

# (id, config, what the bad path holds, where the path goes, words the error line must hold)
# The bad path is tmp_path / 'bad' (+ a suffix), passed as --config or --config.data.path: a bytes value is the
# file's content, a str a config file's source; DIR makes a directory there, ABSENT nothing, NO_PATH passes ''.
CASES = [
  # ---- --config: the config file itself ----
  ('config_syntax_error', None, 'def get_config(:\n  pass\n', '--config', ['not Python source', 'line 1']),
  ('config_missing', None, ABSENT, '--config', ['no such file']),
  ('config_directory', None, DIR, '--config', ['is a directory']),
  ('config_empty_path', None, NO_PATH, '--config', ['--config is empty']),
  ('config_binary', None, NOT_PYTHON, '--config', ['not Python source']),
  (
    'config_import_error',
    None,
    'import ml_collections\nimport hdet_no_such_module\n\ndef get_config():\n  return ml_collections.ConfigDict()\n',
    '--config',
    ['ModuleNotFoundError', 'hdet_no_such_module', 'line 2'],
  ),
  (
    'config_without_get_config',
    None,
    'import ml_collections\nCONFIG = ml_collections.ConfigDict()\n',
    '--config',
    ['defines no get_config()'],
  ),
  ('config_empty_file', None, b'', '--config', ['defines no get_config()']),
  (
    'config_get_config_raises',
    None,
    'def get_config():\n  raise RuntimeError("no such experiment")\n',
    '--config',
    ['get_config() raised RuntimeError: no such experiment', 'line 2'],
  ),
  (
    'config_returns_dict',
    None,
    'def get_config():\n  return {"seed": 0}\n',
    '--config',
    ['returned dict', 'not an ml_collections.ConfigDict'],
  ),
  (
    'config_returns_none',
    None,
    'def get_config():\n  config = 1\n',
    '--config',
    ['returned NoneType', 'not an ml_collections.ConfigDict'],
  ),
  (
    'config_incomplete',
    None,
    'import ml_collections\n\ndef get_config():\n  return ml_collections.ConfigDict({"seed": 0})\n',
    '--config',
    ['its config lacks', 'build it on configs/default.py'],
  ),
  # ---- data.path of the mnist1d task: an .npz ----
  ('npz_text_file', MNIST1D, TEXT, 'data.path', ['not an .npz file']),
  ('npz_short_text_file', MNIST1D, b'hi\n', 'data.path', ['not an .npz file']),
  ('npz_binary_file', MNIST1D, bytes(range(256)) * 20, 'data.path', ['not an .npz file']),
  ('npz_empty_file', MNIST1D, b'', 'data.path', ['is empty']),
  ('npz_directory', MNIST1D, DIR, 'data.path', ['is a directory']),
  ('npz_single_array', MNIST1D, _npy_bytes(), 'data.path', ['a single array (.npy)']),
  ('npz_truncated', MNIST1D, _npz_bytes()[: len(_npz_bytes()) // 2], 'data.path', ['truncated or corrupt .npz']),
  ('npz_corrupt_member', MNIST1D, _corrupt_npz(), 'data.path', ['not a readable .npz', 'CRC']),
  ('npz_truncated_member', MNIST1D, _truncated_member_npz(), 'data.path', ['not a readable .npz']),
  # ---- data.path of the LM task: a UTF-8 text corpus ----
  ('text_binary_file', TINY, _npz_bytes(), 'data.path', ['not UTF-8 text']),
  ('text_nul_bytes', TINY, bytes(8192), 'data.path', ['binary, not text']),
  ('text_truncated_utf8', TINY, (TEXT + 'Grü'.encode())[:-1], 'data.path', ['not UTF-8 text', 'end of data']),
  ('text_empty_file', TINY, b'', 'data.path', ['is empty']),
  ('text_directory', TINY, DIR, 'data.path', ['is a directory']),
]


def _make(tmp_path, content, suffix: str) -> str:
  path = tmp_path / f'bad{suffix}'
  if content == NO_PATH:
    return ''
  if content == DIR:
    path.mkdir()
  elif isinstance(content, bytes):
    path.write_bytes(content)
  elif content != ABSENT:
    path.write_text(content)
  return str(path)


def _snapshot(workdir) -> dict:
  """Every file and folder under ``workdir``: its bytes and times (a write, even of the same bytes, shows)."""
  out = {}
  for root, dirs, files in os.walk(workdir):
    for name in dirs + files:
      p = os.path.join(root, name)
      st = os.stat(p)
      out[os.path.relpath(p, workdir)] = (open(p, 'rb').read() if name in files else None, st.st_mtime_ns, st.st_mode)
  return out


@pytest.mark.parametrize('case, config, content, param, says', CASES, ids=[c[0] for c in CASES])
def test_a_bad_input_is_one_error_line_and_exit_2_with_the_workdir_untouched(
  tmp_path, case, config, content, param, says
):
  workdir = tmp_path / 'workdir'  # a run's workdir already there: nothing in it may change
  workdir.mkdir()
  (workdir / 'sentinel.txt').write_text('left alone\n')
  (workdir / 'metrics.jsonl').write_text(json.dumps({'kind': 'train', 'step': 0, 'loss': 5.5}) + '\n')
  before = _snapshot(workdir)
  if param == '--config':
    path = _make(tmp_path, content, '.py')
    args = [f'--config={path}']
  else:
    path = _make(tmp_path, content, '.npz' if config == MNIST1D else '.txt')
    args = ['--config', config, f'--config.data.path={path}']
  proc = subprocess.run(
    [sys.executable, os.path.join(ROOT, 'train.py'), *args, '--workdir', str(workdir)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 2, (case, proc.stderr[-3000:])
  assert 'Traceback' not in proc.stderr, proc.stderr[-3000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1, proc.stderr
  line = errors[0]
  assert param in line and os.path.basename(path) in line, line  # names the parameter and the path
  assert all(s in line for s in says), (says, line)
  assert _snapshot(workdir) == before


def test_a_bad_config_file_leaves_no_new_workdir(tmp_path):
  """A new workdir is not created when the input is refused."""
  bad = tmp_path / 'bad.py'
  bad.write_text('def get_config(:\n')
  proc = subprocess.run(
    [sys.executable, os.path.join(ROOT, 'train.py'), '--config', str(bad), '--workdir', str(tmp_path / 'new')],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 2 and proc.stderr.startswith('error: --config '), proc.stderr
  assert not (tmp_path / 'new').exists()


def test_a_bracket_checks_its_runs_before_it_writes_its_record(tmp_path):
  """The LR bracket writes bracket.json into a new workdir before its first run; a bad data.path stops it first."""
  bad = tmp_path / 'bad.txt'
  bad.write_bytes(_npz_bytes())
  workdir = tmp_path / 'new'
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, 'train.py'),
      '--config',
      BRACKET,
      f'--config.data.path={bad}',
      '--workdir',
      str(workdir),
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error:')]
  assert proc.returncode == 2 and len(errors) == 1 and 'Traceback' not in proc.stderr, proc.stderr[-3000:]
  assert 'data.path' in errors[0] and 'not UTF-8 text' in errors[0], errors
  assert not workdir.exists() or not any(workdir.rglob('*')), sorted(workdir.rglob('*'))
