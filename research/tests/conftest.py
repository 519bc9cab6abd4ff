"""The research suite's setup, as the product's tests/conftest.py sets up its own: 8 simulated CPU devices (set
before JAX starts: the device count cannot change later), one persistent XLA compilation cache per test process,
the slowest files first, and each test building its runs' programs itself.

The research tests may import the product's test helpers (tests/trainer_testing.py, tests/oracles.py, ...): the
product's tests/ folder goes on sys.path here. The product never imports the research."""

import atexit
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _path in (os.path.join(ROOT, 'tests'), ROOT):  # the product's test helpers; `import research` from any cwd
  if _path not in sys.path:
    sys.path.insert(0, _path)

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# One persistent XLA compilation cache per test process, shared with the subprocesses it starts (they inherit the
# environment): many tests compile the same small trainer programs, and a hit loads the executable the miss
# compiled, so results are unchanged. Removed when the process exits.
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _xla_cache = tempfile.mkdtemp(prefix='hdet-research-tests-xla-cache-')
  atexit.register(shutil.rmtree, _xla_cache, ignore_errors=True)
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _xla_cache
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
# JAX_NUM_CPU_DEVICES, if the caller's environment has it, would win over the XLA flag set below.
os.environ.pop('JAX_NUM_CPU_DEVICES', None)

import chex  # noqa: E402

# --xla_force_host_platform_device_count=8 in XLA_FLAGS (replacing any count already there); a subprocess
# inherits it. chex raises if JAX's CPU backend already started with another count.
chex.set_n_cpu_devices(8)


# The slowest test files first (research/archive/tests/ shares this setup: its conftest.py), in the order of their
# summed test times in a 2-process run (2026-11-28, before the archived studies' files left: about 200, 80, 80, 70, 60,
# 50, 50, 50, 25, 20 and 10 s; test_reports_regenerate.py, about 25 s since it redraws the workload screens and
# autolr's task pages too, 2026-11-29). pytest-xdist's --dist loadfile hands whole files to the processes in
# collection order, so the long ones first leave only short ones for the end and the two processes finish together.
_SLOWEST_FIRST = (
  'test_workloads.py',
  'test_autolr.py',
  'test_wider_rung.py',
  'test_bracket_straddle.py',
  'test_reports_regenerate.py',
  'test_bracket_mode.py',
)


def pytest_collection_modifyitems(config, items):
  del config
  rank = {name: i for i, name in enumerate(_SLOWEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _own_programs():
  """Each test builds its runs' programs itself (as in tests/conftest.py): the trainer keeps a run's compiled
  programs for the next run in the process that builds the same (hdet_jax/trainer/program_cache.py), and a test
  that counts compilations must not depend on which tests ran before it in its process."""
  cache = lambda: sys.modules.get('hdet_jax.trainer.program_cache')
  if cache():
    cache().clear()
  yield
  if cache():
    cache().clear()
