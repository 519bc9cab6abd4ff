"""Helpers the trainer's end-to-end tests share: the tiny config, and a checkpoint read back as plain arrays."""

import importlib.util
import json
import os
import shutil

import numpy as np

import cli_testing
from hdet_jax.trainer import config_lib, run_settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, 'configs', 'tiny.py')
TUNED_TRAIN = os.path.join(ROOT, 'tests', 'tuned_train.py')  # train.py with TINY_TUNING given in Python
_spec = importlib.util.spec_from_file_location('hdet_chaos', os.path.join(ROOT, 'scripts', 'chaos.py'))
chaos = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chaos)
restore_raw = chaos.read_checkpoint  # a checkpoint's items as plain arrays (no target: enough to compare bits)


# configs/tiny.py's controller before its tuning left the config (after 1.0, issue 75): the scenarios these tests
# build on it (the controller from the sync at step 16, log-steps of at most 0.25, the plain fit, acting to the end)
# and the traces they recorded. train.py --config configs/tiny.py runs the default controller.
TINY_TUNING = {
  'hdet.trust': 0.25,
  'hdet.after_stop': 'hold',
  'hdet.step_growth': 1.0,
  'hdet.warmup_steps': 10,
  'hdet.stop_fraction': 1.0,
  'hdet.anneal_fraction': 0.0,  # (1.0 had no anneal rule, issue 86's)
}


def tiny(**overrides):
  """configs/tiny.py as a record holds it, its tuning fields in it (:data:`TINY_TUNING`), with ``overrides`` (any
  field, tuning ones too); :func:`train_and_evaluate` and :func:`resolve` split them out again."""
  return load(TINY, **overrides)


def load(path, **overrides):
  """A config file (a path, or a name in configs/) as a record holds it, with ``overrides`` (any field): its tuning
  fields at their defaults, configs/tiny.py's at :data:`TINY_TUNING`."""
  if not path.endswith('.py'):
    path = os.path.join(ROOT, 'configs', path + '.py')
  tuning = TINY_TUNING if os.path.abspath(path) == TINY else {}
  config = run_settings.recorded_config(config_lib.load_config_file(path), tuning)
  return config_lib.with_overrides(config, overrides)


def train_and_evaluate(config, workdir, **kwargs):
  """The trainer's ``train_and_evaluate`` on ``config``, its tuning fields (if any) given in Python."""
  from hdet_jax.trainer import trainer

  config, tuning = run_settings.split(config)
  return trainer.train_and_evaluate(config, workdir, tuning={**tuning, **kwargs.pop('tuning', {})}, **kwargs)


def run_bracket(config, workdir):
  """The trainer's LR bracket of ``config``, its tuning fields (if any) given in Python."""
  from hdet_jax.trainer import bracket

  config, tuning = run_settings.split(config)
  return bracket.run_bracket(config, workdir, tuning=tuning)


resolve = run_settings.resolve_recorded  # (``run_settings.resolve`` of ``config``, its tuning fields given in Python)


def leaves(tree):
  import jax

  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def compiled(fn):
  """(what ``fn()`` returns, how many XLA programs it compiled or loaded from the persistent compilation cache)."""
  import jax

  count, active = [0], [True]

  def on_compile(event, duration, **kwargs):
    del duration, kwargs
    if active[0] and event == '/jax/core/compile/backend_compile_duration':
      count[0] += 1

  def on_cache(event, **kwargs):  # a program loaded from the persistent cache counts too
    del kwargs
    if active[0] and event == '/jax/compilation_cache/cache_hits':
      count[0] += 1

  jax.monitoring.register_event_duration_secs_listener(on_compile)
  jax.monitoring.register_event_listener(on_cache)
  try:
    return fn(), count[0]
  finally:
    active[0] = False


def shared_run(tmp_path_factory, name, make):
  """``(workdir, result)`` of ``make(workdir)``, made once for the whole test session: with pytest-xdist once over all
  its worker processes (the first to ask makes it, holding a file lock; the others wait and read its workdir), so that
  test files in different workers share a run instead of each training it. ``result`` is what ``make`` returned, as
  JSON keeps it. The tests that read the workdir must not write to it (copy it first).

  Example: ``workdir, stdout = shared_run(tmp_path_factory, 'tiny', lambda w: train(w))``.
  """
  root = tmp_path_factory.getbasetemp()
  try:
    import fcntl
  except ImportError:  # no POSIX file locks (Windows): each process makes its own
    fcntl = None
  if fcntl and os.environ.get('PYTEST_XDIST_WORKER'):
    root = root.parent  # the session's base folder, above each worker's own
  workdir, done = root / f'shared-{name}', root / f'shared-{name}.json'
  with open(root / f'shared-{name}.lock', 'w') as lock:
    if fcntl:
      fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if not done.exists():
      shutil.rmtree(workdir, ignore_errors=True)  # what a failed attempt left (it would be resumed otherwise)
      result = make(str(workdir))
      done.write_text(json.dumps(result))
  return str(workdir), json.loads(done.read_text())


def train_tiny_cli(workdir):
  """``python train.py --config configs/tiny.py`` as a subprocess with the tests' tuning (tests/tuned_train.py): 40
  steps in one go, on 8 CPU devices. Returns what it printed."""
  env = dict(os.environ, JAX_NUM_CPU_DEVICES='8')
  proc = cli_testing.run(
    [TUNED_TRAIN, '--config', TINY, '--workdir', workdir],
    cwd=ROOT,
    env=env,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout
