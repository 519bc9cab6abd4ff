"""8 simulated CPU devices, set before JAX starts (the device count cannot change later)."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# One persistent XLA compilation cache per test process, shared with the train.py subprocesses it starts
# (they inherit the environment): many tests compile the same small trainer programs, and a hit loads the
# executable the miss compiled, so results are unchanged. Removed when the process exits.
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _xla_cache = tempfile.mkdtemp(prefix='hdet-tests-xla-cache-')
  atexit.register(shutil.rmtree, _xla_cache, ignore_errors=True)
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _xla_cache
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
# JAX_NUM_CPU_DEVICES, if the caller's environment has it, would win over the XLA flag set below.
os.environ.pop('JAX_NUM_CPU_DEVICES', None)

import chex  # noqa: E402

# --xla_force_host_platform_device_count=8 in XLA_FLAGS (replacing any count already there); train.py run
# as a subprocess inherits it. chex raises if JAX's CPU backend already started with another count.
chex.set_n_cpu_devices(8)

# XLA's cheaper CPU code generation for the tests: about half of the suite's time is XLA compiling its many small
# programs, and these flags make that about a third cheaper (the suite about a fifth faster). The tests check the
# code's logic, each against an oracle or another run made under the same flags (subprocesses inherit them); the
# last bits of a result may differ from a run at XLA's defaults, which is what users run.
# HDET_XLA_DEFAULT_FLAGS=1 runs the suite at XLA's default CPU flags instead (.ci/run does so for some files): no
# test's outcome may depend on the flags, nor on any other source of a result's last bits (another CPU's).
FAST_COMPILE_FLAGS = '--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true'
# (Not XLA:CPU's older fusion emitters, --xla_cpu_use_fusion_emitters=false, on jaxlib 0.10.2: they compile the tiny
# run's programs in about two thirds of the time, but programs that should round alike no longer do: in-process
# bitwise checks of test_programs.py (chunked data) and test_optimizer.py (the wrapped sgd at scale s) fail;
# measured 2026-12-07.)
if os.environ.get('HDET_XLA_DEFAULT_FLAGS', '') not in ('', '0'):
  os.environ['XLA_FLAGS'] = ' '.join(
    f for f in os.environ.get('XLA_FLAGS', '').split() if f not in FAST_COMPILE_FLAGS.split()
  )
else:
  os.environ['XLA_FLAGS'] = f'{os.environ.get("XLA_FLAGS", "")} {FAST_COMPILE_FLAGS}'.strip()


# The slowest test files first, in the order of their summed test times in a 2-process run (2026-12-08, nothing else
# running: 189, 131, 94, 69, 65, 57, 44, 40, 34, 34, 32, 32, 31, 31, 30, 30, 29, 27, 25 and 24 s; the suite's sum
# 1345 s). pytest-xdist's --dist loadfile hands whole files to the processes in collection order, so the long ones
# first leave only short ones for the end and the two processes finish together (longest-processing-time-first
# scheduling).
_SLOWEST_FIRST = (
  'test_trainer.py',
  'test_benchmarks.py',
  'test_reliability.py',
  'test_trainer_controller.py',
  'test_sync.py',
  'test_second_style.py',
  'test_explore_trainer.py',
  'test_tasks.py',
  'test_program_cache.py',
  'test_transform.py',
  'test_doctests.py',
  'test_docs.py',
  'test_pmap_trainer.py',
  'test_mesh2d.py',
  'test_explore.py',
  'test_trainer_mesh2d.py',
  'test_optimizer.py',
  'test_add_to_trainer.py',
  'test_programs.py',
  'test_anneal.py',
)


def pytest_collection_modifyitems(config, items):
  del config
  rank = {name: i for i, name in enumerate(_SLOWEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


import pytest  # noqa: E402


def pytest_configure(config):
  config.addinivalue_line('markers', "own_programs: the test builds its runs' programs itself (it counts compilations)")


@pytest.fixture(autouse=True)
def _own_programs(request):
  """The trainer keeps a run's compiled programs for the next run in the process that builds the same
  (hdet_jax/trainer/program_cache.py), across tests too: the suite's many tiny runs then share their programs, as
  runs in a user's process do, and a kept program is the very executable, so their numbers are the same bit for
  bit. A test that counts compilations (marked ``own_programs``) must not depend on which tests ran before it in
  its process: it starts and ends with none kept."""
  import sys

  # (only where the trainer is imported: the core's tests also run where its extras are not installed, .ci/newest_jax)
  cache = lambda: sys.modules.get('hdet_jax.trainer.program_cache')
  own = request.node.get_closest_marker('own_programs') is not None
  if own and cache():
    cache().clear()
  yield
  if own and cache():
    cache().clear()


@pytest.fixture(scope='session')
def straight(tmp_path_factory):
  """configs/tiny.py trained by ``python train.py`` with the tests' tuning (trainer_testing.train_tiny_cli): 40 steps in
  one go, made once for the session (trainer_testing.shared_run), its workdir shared by the files that read it
  (test_trainer.py, test_tasks.py). ``(workdir, what train.py printed)``; the tests only read the workdir."""
  import trainer_testing

  return trainer_testing.shared_run(tmp_path_factory, 'tiny-straight', trainer_testing.train_tiny_cli)
