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


# The slowest test files first, in the order of their summed test times in a 2-process run (2026-11-26, with a
# bracket training beside it: 259, 224, 210, 133, 105, 101, 77, 62, 57, 57, 55, 51, 50, 48, 47, 43, 41, 41, 39 and
# 38 s; the suite's sum 1946 s). pytest-xdist's --dist loadfile hands whole files to the processes in collection
# order, so the long ones first leave only short ones for the end and the two processes finish together
# (longest-processing-time-first scheduling).
_SLOWEST_FIRST = ('test_trainer.py', 'test_reliability.py', 'test_trainer_controller.py', 'test_sync.py',
                  'test_programs.py', 'test_bracket.py', 'test_explore_trainer.py', 'test_transform.py', 'test_mesh2d.py',
                  'test_explore.py', 'test_program_cache.py', 'test_tasks.py', 'test_trainer_mesh2d.py', 'test_examples.py',
                  'test_benchmarks.py')


def pytest_collection_modifyitems(config, items):
  del config
  rank = {name: i for i, name in enumerate(_SLOWEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _own_programs():
  """Each test builds its runs' programs itself: the trainer keeps a run's compiled programs for the next run in the
  process that builds the same (hdet_jax/trainer/program_cache.py), and a test that counts compilations must not
  depend on which tests ran before it in its process. Within a test they are shared, as in a user's process."""
  import sys
  # (only where the trainer is imported: the core's tests also run where its extras are not installed, .ci/newest_jax)
  cache = lambda: sys.modules.get('hdet_jax.trainer.program_cache')
  if cache():
    cache().clear()
  yield
  if cache():
    cache().clear()
