"""Every script in examples/ runs, as a user would run it, in its quick mode (a fresh process each).

``python SCRIPT --quick`` through cli_testing.run: a child forked from a server that has imported jax, flax and
hdet_jax once (no JAX backend started: the example's own ``jax_num_cpu_devices`` still takes), with the status,
stdout and stderr of a real subprocess (``HDET_TESTS_FORK=0``: one).
"""

import os
import pathlib

import cli_testing
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
  # The example sets its own 8 simulated devices (jax_num_cpu_devices): not the suite's device count flag. The
  # suite's other XLA flags stay (conftest.py: its cheaper CPU code generation, a third of the examples' time;
  # .ci/run runs this file again at XLA's defaults, as users run the examples).
  flags = [f for f in env.get('XLA_FLAGS', '').split() if not f.startswith('--xla_force_host_platform_device')]
  env['XLA_FLAGS'] = ' '.join(flags)
  env['JAX_PLATFORMS'] = 'cpu'
  proc = cli_testing.run([path, '--quick'], cwd=tmp_path, env=env, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  out = proc.stdout
  if path.name == 'nnx_shard_map.py':
    assert 'averaged model: validation loss' in out and '(2 syncs)' in out, out
    accuracy = float(out.rsplit('accuracy ', 1)[1].split()[0])
    assert accuracy > 0.5, out  # 4 classes: chance is 0.25
  if path.name == 'pmap_vmap.py':
    assert 'pmap: 8 replicas on 8 devices' in out and 'largest difference' in out, out
