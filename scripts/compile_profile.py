"""Where the test suite's time goes to XLA: a pytest plugin that counts compiled programs, by name and by test file.

    python -m pytest -q -n 2 --dist loadfile -p scripts.compile_profile tests
    HDET_COMPILE_PROFILE=report.txt python -m pytest -q -p scripts.compile_profile tests/test_sync.py

Each test process adds up JAX's ``/jax/core/compile/backend_compile_duration`` events (one per program XLA
compiles, or loads from the persistent compilation cache: a hit is counted too, with its short load time) and its
``/jax/compilation_cache/cache_misses``, by the program's name (``jit(wrapped)`` is the trainer's step, window end
and evaluation) and by the test file that was running. At the end each process prints its tables (a pytest-xdist
worker appends them to ``$HDET_COMPILE_PROFILE``, default ``compile_profile.txt`` in the working directory, as its
output is not shown). Compiles in the ``train.py`` subprocesses some tests start are not seen.

Why: about half of the suite's time is compiling. On the 2-core AMD EPYC of 2026-11-28 the in-process compiles took
about 950 s of the suite's 1,900 s of test time (2 workers, 16 minutes of wall), spread over about 2,500 distinct
programs. A compilation cache shared by the two workers left the misses at 2,523 (the workers compile different
programs) and saved no wall time.
"""

from __future__ import annotations

import collections
import os

_by_program: collections.Counter = collections.Counter()  # program name -> seconds
_programs: collections.Counter = collections.Counter()  # program name -> compiles (and cache hits)
_by_file: collections.Counter = collections.Counter()  # test file -> seconds
_misses: collections.Counter = collections.Counter()  # test file -> persistent-cache misses
_running = ['(collection)']


def _on_duration(event: str, duration: float, **kwargs) -> None:
  if event == '/jax/core/compile/backend_compile_duration':
    name = kwargs.get('fun_name', '?')
    _by_program[name] += duration
    _programs[name] += 1
    _by_file[_running[0]] += duration


def _on_event(event: str, **kwargs) -> None:
  del kwargs
  if event == '/jax/compilation_cache/cache_misses':
    _misses[_running[0]] += 1


def pytest_configure(config) -> None:
  del config
  import jax

  jax.monitoring.register_event_duration_secs_listener(_on_duration)
  jax.monitoring.register_event_listener(_on_event)


def pytest_runtest_setup(item) -> None:
  _running[0] = item.path.name


def report(top: int = 25) -> str:
  """The tables: seconds and compiles per program name, seconds and cache misses per test file."""
  lines = [
    f'XLA compiles in process {os.getpid()}: {sum(_by_program.values()):.1f} s, {sum(_programs.values())} programs'
  ]
  lines += [f'  {s:8.1f} s {_programs[name]:6d}  {name}' for name, s in _by_program.most_common(top)]
  lines.append('by test file (seconds, persistent-cache misses):')
  lines += [f'  {s:8.1f} s {_misses[name]:6d}  {name}' for name, s in _by_file.most_common(top)]
  return '\n'.join(lines) + '\n'


def pytest_unconfigure(config) -> None:
  if not _programs:  # (an xdist controller runs no tests)
    return
  worker = hasattr(config, 'workerinput')  # a pytest-xdist worker: its terminal output is not shown
  path = os.environ.get('HDET_COMPILE_PROFILE', 'compile_profile.txt' if worker else '')
  if not worker:
    print('\n' + report())
  if path:
    with open(path, 'a', encoding='utf-8') as f:
      f.write(report())
