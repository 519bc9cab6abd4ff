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
import zipfile

import numpy as np
import pytest
import cli_testing

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
  proc = cli_testing.run(
    [os.path.join(ROOT, 'train.py'), *args, '--workdir', str(workdir)],
    cwd=ROOT,
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
  proc = cli_testing.run(
    [os.path.join(ROOT, 'train.py'), '--config', str(bad), '--workdir', str(tmp_path / 'new')],
    cwd=ROOT,
    timeout=120,
  )
  assert proc.returncode == 2 and proc.stderr.startswith('error: --config '), proc.stderr
  assert not (tmp_path / 'new').exists()


def test_a_bracket_checks_its_runs_before_it_writes_its_record(tmp_path):
  """The LR bracket writes bracket.json into a new workdir before its first run; a bad data.path stops it first."""
  bad = tmp_path / 'bad.txt'
  bad.write_bytes(_npz_bytes())
  workdir = tmp_path / 'new'
  proc = cli_testing.run(
    [
      os.path.join(ROOT, 'train.py'),
      '--config',
      BRACKET,
      f'--config.data.path={bad}',
      '--workdir',
      str(workdir),
    ],
    cwd=ROOT,
    timeout=120,
  )
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error:')]
  assert proc.returncode == 2 and len(errors) == 1 and 'Traceback' not in proc.stderr, proc.stderr[-3000:]
  assert 'data.path' in errors[0] and 'not UTF-8 text' in errors[0], errors
  assert not workdir.exists() or not any(workdir.rglob('*')), sorted(workdir.rglob('*'))


# ---- Where a run writes: never the current folder or a project's files (issue 75, item 6). ----


def _cases_of_project_folders(tmp_path):
  project = tmp_path / 'someproject'  # another project's folder: its build file marks it
  project.mkdir()
  (project / 'pyproject.toml').write_text('[project]\nname = "x"\n')
  sources = tmp_path / 'sources'  # a folder of sources (as configs/ or tests/ are)
  sources.mkdir()
  (sources / 'model.py').write_text('x = 1\n')
  return [
    ('.', 'is the current folder'),
    ('', 'is the current folder'),
    ('./', 'is the current folder'),
    (ROOT, 'is the current folder'),
    (os.path.join(ROOT, 'configs'), "holds a project's files (bracket.py"),
    (os.path.join(ROOT, 'results'), "holds a project's files"),
    ('..', 'holds the current folder'),
    (str(project), "holds a project's files (pyproject.toml)"),
    (str(sources), "holds a project's files (model.py)"),
  ]


def test_a_workdir_among_the_projects_files_is_refused_before_anything_is_read(tmp_path, monkeypatch):
  from hdet_jax.trainer import config_lib, trainer as trainer_lib

  monkeypatch.chdir(ROOT)
  config = config_lib.load_config_file(TINY)
  for workdir, says in _cases_of_project_folders(tmp_path):
    with pytest.raises(config_lib.ConfigError, match=None) as e:
      trainer_lib.check_output_paths(config, workdir)
    line = str(e.value)
    assert line.startswith(f'--workdir {workdir!r}') and says in line and 'nothing was written' in line, line
    assert '--workdir=workdirs/NAME' in line and '\n' not in line
    with pytest.raises(config_lib.ConfigError, match=r'^--workdir '):  # the trainer's own entry points refuse it too
      trainer_lib.check(config, workdir)
  trainer_lib.check_output_paths(config, str(tmp_path / 'new'))  # a folder of its own (new or a run's) is fine
  (tmp_path / 'run').mkdir()
  (tmp_path / 'run' / 'metrics.jsonl').write_text('')
  trainer_lib.check_output_paths(config, str(tmp_path / 'run'))


def test_compilation_cache_in_the_current_folder_is_refused(tmp_path, monkeypatch):
  from hdet_jax.trainer import config_lib, trainer as trainer_lib

  monkeypatch.chdir(ROOT)
  for cache in ('.', ROOT, os.path.join(ROOT, 'hdet_jax')):
    config = config_lib.with_overrides(config_lib.load_config_file(TINY), {'compilation_cache': cache})
    with pytest.raises(config_lib.ConfigError, match=r'^--config\.compilation_cache .*~/\.cache/hdet_jax/xla'):
      trainer_lib.check_output_paths(config, str(tmp_path / 'w'))
  config = config_lib.with_overrides(config_lib.load_config_file(TINY), {'compilation_cache': str(tmp_path / 'c')})
  trainer_lib.check_output_paths(config, str(tmp_path / 'w'))  # '' (off, tiny.py's) and a cache of its own: fine


def test_train_py_refuses_workdir_dot_with_one_line_and_writes_nothing(tmp_path):
  """``python train.py --workdir .`` in a folder holding a run and other files: exit 2, one line, nothing changed."""
  folder = tmp_path / 'here'
  folder.mkdir()
  (folder / 'notes.txt').write_text('mine\n')
  (folder / 'config.json').write_text('{"training_fields": {}}\n')
  before = _snapshot(folder)
  proc = cli_testing.run(
    [os.path.join(ROOT, 'train.py'), '--config', TINY, '--workdir', '.'],
    cwd=folder,
    timeout=120,
  )
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error:')]
  assert proc.returncode == 2 and len(errors) == 1 and 'Traceback' not in proc.stderr, proc.stderr[-3000:]
  assert errors[0].startswith("error: --workdir '.' is the current folder"), errors
  assert _snapshot(folder) == before


# ---- Settings the run cannot honour: one error naming the field and the fix (issue 75, item 6). ----


def _tiny(**overrides):
  import trainer_testing

  return trainer_testing.load(TINY, **overrides)


def _check(config, workdir):
  """The trainer's checks of ``config`` (record form: its tuning fields given in Python)."""
  from hdet_jax.trainer import run_settings, trainer as trainer_lib

  config, tuning = run_settings.split(config)
  trainer_lib.check(config, workdir, tuning=tuning)


CANNOT_HONOUR = [
  ({'mesh.replicas': 4}, r'^mesh\.replicas=4 counts replica groups .*set hdet\.num_replicas=4'),
  ({'mesh.fsdp': 2, 'mesh.devices': 4}, r'^mesh\.devices=4 picks the devices of a 1-D mesh.*mesh\.replicas=2'),
  (
    {'hdet.explore.weight_decay': 0.5, 'optim.weight_decay': 0.0},
    r'^hdet\.explore\.weight_decay=0\.5 spreads optim\.weight_decay .*set optim\.weight_decay > 0',
  ),
  ({'hdet.spread': 0.0}, r'^hdet\.auto_lr=True .*hdet\.spread=0 .*set hdet\.spread > 0 .*or hdet\.auto_lr=False'),
  (
    {'hdet.sync_every': 0, 'hdet.num_syncs': 0},
    r'^hdet\.auto_lr=True .*hdet\.sync_every=0 and hdet\.num_syncs=0 the replicas never average.*hdet\.auto_lr=False',
  ),
  ({'hdet.sync_every': 100}, r'^hdet\.auto_lr=True .*hdet\.sync_every=100 leaves no sync inside num_train_steps=40'),
  ({'hdet.sync_every': 8, 'hdet.warmup_steps': 39}, r'^hdet\.auto_lr=True .*hdet\.warmup_steps=39 is step 40'),
  ({'model.kind': 'mlp'}, r"^model\.kind is a field of the mnist1d task's config .*set task='mnist1d'"),
]


@pytest.mark.parametrize('overrides, says', CANNOT_HONOUR, ids=[','.join(c[0]) for c in CANNOT_HONOUR])
def test_a_setting_the_run_cannot_honour_is_one_error_naming_the_field(overrides, says, tmp_path):
  from hdet_jax.trainer import config_lib

  with pytest.raises(config_lib.ConfigError, match=says) as e:  # the checks before any work: nothing compiles
    _check(_tiny(**overrides), str(tmp_path / 'w'))
  assert '\n' not in str(e.value) and not (tmp_path / 'w').exists()


def test_num_replicas_a_grouped_mesh_cannot_train_is_refused_before_any_work(tmp_path):
  from hdet_jax.trainer import config_lib

  with pytest.raises(
    config_lib.ConfigError, match=r'^hdet\.num_replicas=6 but mesh\.replicas=4 x mesh\.fsdp=2 trains 4'
  ):
    _check(_tiny(**{'hdet.num_replicas': 6, 'mesh.fsdp': 2}), str(tmp_path / 'w'))
  assert not (tmp_path / 'w').exists()


# ---- Settings legitimately unread: one warning line per cause, naming each field (issue 75, item 6). ----

IGNORED = [
  ({'hdet.auto_lr': False}, 'tiny', ['hdet.warmup_steps=10', 'hdet.trust=0.25'], 'hdet.auto_lr=False'),
  ({'hdet.controller': 'paper', 'hdet.trust': 0.5}, 'default', ['hdet.trust=0.5'], "hdet.controller='paper'"),
  ({'hdet.lr_of_lr': 0.1}, 'default', ['hdet.lr_of_lr=0.1'], "hdet.controller='fit'"),
  # the guard's margins where no 'fit' controller runs (with one, the core's check_auto_lr refuses them without the
  # back-off: tests/test_run_settings.py)
  ({'hdet.controller': 'paper', 'hdet.backoff_fraction': 0.1}, 'default', ['hdet.backoff_fraction=0.1'], "'paper'"),
  ({'hdet.auto_lr': False, 'hdet.backoff_stderrs': 3.0}, 'default', ['hdet.backoff_stderrs=3.0'], 'auto_lr=False'),
  ({'hdet.score': 'window', 'hdet.probe_windows': 4}, 'default', ['hdet.probe_windows=4'], "hdet.score='window'"),
  ({'hdet.sync_every': 25, 'hdet.num_syncs': 10}, 'default', ['hdet.num_syncs=10'], 'hdet.sync_every=25'),
  (
    {'hdet.sync_every': 0, 'hdet.num_syncs': 0, 'hdet.longest_window': 50, 'hdet.auto_lr': False},
    'default',
    ['hdet.longest_window=50'],
    'never average',
  ),
  ({'optim.schedule': 'constant', 'optim.div_factor': 10.0}, 'default', ['optim.div_factor=10.0'], 'constant'),
  ({'optim.name': 'adam', 'optim.weight_decay': 0.01}, 'default', ['optim.weight_decay=0.01'], "'adamw' has"),
  ({'optim.name': 'sgd', 'optim.b2': 0.99}, 'default', ['optim.b2=0.99'], "optim.name='sgd'"),
  ({'bracket.compare_steps': 5}, 'default', ['bracket.compare_steps=5'], 'bracket.points=0'),
  ({'warm_init.nu': 0.1}, 'default', ['warm_init.nu=0.1'], 'init_from is None'),
  ({'data.path': 'corpus.txt', 'data.corpus': 'wyc'}, 'default', ["data.corpus='wyc'"], 'data.path='),
  ({'data.path': 'd.npz', 'data.dataset_seed': 1}, 'mnist1d', ['data.dataset_seed=1'], 'generating MNIST-1D'),
  ({'model.hidden': 64}, 'mnist1d', ['model.hidden=64'], "model.kind='cnn'"),
  ({'model.kind': 'mlp', 'model.channels': 8}, 'mnist1d', ['model.channels=8'], "model.kind='mlp'"),
]


def _config(name, **overrides):
  import trainer_testing

  return trainer_testing.load(name, **overrides)


def _ignored(config, base=None):
  """``run_settings.ignored`` of ``config`` (record form: its tuning fields given in Python) and the file it started
  from (``base``, as shipped: without tuning)."""
  from hdet_jax.trainer import run_settings

  config, tuning = run_settings.split(config)
  return run_settings.ignored(config, base and run_settings.split(base)[0], tuning=tuning)


@pytest.mark.parametrize('overrides, name, fields, why', IGNORED, ids=[','.join(c[0]) for c in IGNORED])
def test_a_setting_the_run_does_not_read_is_one_warning_line_naming_it(overrides, name, fields, why):

  lines = _ignored(_config(name, **overrides), _config(name))
  assert len(lines) == 1, lines
  assert (
    all(f in lines[0] for f in fields) and why in lines[0].split(' is ignored: ')[-1].split(' are ignored: ')[-1]
  ), lines
  assert _ignored(_config(name, **overrides)) == lines or name != 'default'  # the schema's defaults


def test_no_warning_for_the_shipped_configs_or_for_defaults_that_do_not_apply():
  """Each shipped config as given warns of nothing (its own choices, e.g. tiny.py's controller settings), nor does
  a default left where it does not apply (tiny.py sets hdet.sync_every, leaving hdet.num_syncs at its default)."""

  for name in sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, 'configs')) if f.endswith('.py')):
    assert _ignored(_config(name), _config(name)) == [], name
  for name in ('default', 'tiny', 'mnist1d', 'bracket', 'finetune', 'hdet_explore'):
    assert _ignored(_config(name)) == [], name
  assert _ignored(_config('default', **{'optim.name': 'adam', 'optim.weight_decay': 0.0})) == []


def test_train_py_prints_each_warning_once_at_the_start(tmp_path):
  """The warnings come before any check of the workdir: here one that holds another config's run stops it (exit 2),
  after one warning line per cause; the workdir is left as it was."""
  workdir = tmp_path / 'other'
  workdir.mkdir()
  (workdir / 'config.json').write_text(json.dumps({'training_fields': {'seed': 123}}) + '\n')
  before = _snapshot(workdir)
  proc = cli_testing.run(
    [
      os.path.join(ROOT, 'train.py'),
      '--config',
      TINY,
      '--config.hdet.auto_lr=False',
      '--config.hdet.initial_scale=0.5',
      '--config.num_cpu_devices=4',
      '--workdir',
      str(workdir),
    ],
    cwd=ROOT,
    # the suite's XLA_FLAGS set the devices; a JAX_NUM_CPU_DEVICES left by another test's import would win
    env={k: v for k, v in os.environ.items() if k != 'JAX_NUM_CPU_DEVICES'},
    timeout=120,
  )
  warnings = [line for line in proc.stderr.splitlines() if line.startswith('warning:')]
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error:')]
  assert proc.returncode == 2 and len(errors) == 1 and 'different config' in errors[0], proc.stderr[-3000:]
  assert len(warnings) == 2, warnings
  assert 'hdet.initial_scale=0.5' in warnings[0] and 'hdet.auto_lr=False' in warnings[0]
  assert warnings[1].startswith('warning: num_cpu_devices=4 is ignored: XLA_FLAGS sets the CPU devices'), warnings
  assert _snapshot(workdir) == before
