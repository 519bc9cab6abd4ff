"""Every script in examples/ runs, as a user would run it, in its quick mode (a fresh process each)."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / 'examples').glob('*.py'))


def test_examples_exist_and_stay_short():
  assert {p.name for p in EXAMPLES} >= {'nnx_shard_map.py', 'pmap_vmap.py'}
  for path in EXAMPLES:
    assert len(path.read_text().splitlines()) <= 110, f'{path.name}: an example is meant to be read whole'


@pytest.mark.parametrize('path', EXAMPLES, ids=lambda p: p.name)
def test_example_runs_quick(path, tmp_path):
  env = dict(os.environ)
  env.pop('XLA_FLAGS', None)  # the example sets its own 8 simulated devices (jax_num_cpu_devices)
  env['JAX_PLATFORMS'] = 'cpu'
  proc = subprocess.run(
    [sys.executable, str(path), '--quick'], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  out = proc.stdout
  if path.name == 'nnx_shard_map.py':
    assert 'averaged model: validation loss' in out and '(2 syncs)' in out, out
    accuracy = float(out.rsplit('accuracy ', 1)[1].split()[0])
    assert accuracy > 0.5, out  # 4 classes: chance is 0.25
  if path.name == 'pmap_vmap.py':
    assert 'pmap: 8 replicas on 8 devices' in out and 'largest difference' in out, out
