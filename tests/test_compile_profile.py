"""scripts/compile_profile.py: the pytest plugin counts each compiled program by name and each cache miss by file."""

import os
import subprocess
import sys

from trainer_testing import ROOT

_TESTS = """
import jax, jax.numpy as jnp

def test_two_programs():
  f = jax.jit(lambda x: jnp.sin(x) * 2)
  f(jnp.ones(3)); f(jnp.ones(3))  # the same shapes: compiled once
  jax.jit(jnp.cumsum)(jnp.ones(5))
"""


def _profile(tmp_path, run):
  report = tmp_path / f'report{run}.txt'
  env = dict(
    os.environ,
    JAX_PLATFORMS='cpu',
    HDET_COMPILE_PROFILE=str(report),
    JAX_COMPILATION_CACHE_DIR=str(tmp_path / 'cache'),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
  )
  proc = subprocess.run(
    [
      sys.executable,
      '-m',
      'pytest',
      '-q',
      '-p',
      'scripts.compile_profile',
      '-p',
      'no:cacheprovider',
      '--rootdir',
      str(tmp_path),
      str(tmp_path / 'test_tiny.py'),
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  lines = report.read_text().splitlines()
  programs = {
    line.split()[-1]: int(line.split()[2])
    for line in lines
    if line.strip().startswith(tuple('0123456789')) and 'jit(' in line
  }
  misses = [int(line.split()[2]) for line in lines if line.rstrip().endswith('test_tiny.py')]
  assert lines[0].startswith('XLA compiles in process') and sum('XLA compiles' in line for line in lines) == 1
  return programs, misses, int(lines[0].split()[-2])


def test_counts_programs_by_name_and_misses_by_file(tmp_path):
  (tmp_path / 'test_tiny.py').write_text(_TESTS)
  programs, misses, total = _profile(tmp_path, 1)
  assert programs['jit(<lambda>)'] == 1 and programs['jit(cumsum)'] == 1
  assert misses == [total] and total >= 2  # a fresh cache: every program (the test's two and jax's own) misses
  again, misses, total_again = _profile(tmp_path, 2)  # the same programs, now in the cache: loaded and counted
  assert (again, total_again, misses) == (programs, total, [0])
