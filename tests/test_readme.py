"""The README's example runs as written (with a loss, initial parameters and batches supplied)."""

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).parent.parent / 'README.md'


def test_readme_example_runs():
  text = README.read_text()
  block = next(b for b in re.findall(r'```python\n(.*?)```', text, re.S) if 'shard_map_replicas' in b)
  prelude = '''
import jax, jax.numpy as jnp
def loss_fn(params, batch):
  x, y = batch
  return jnp.mean((x @ params['w'] + params['b'] - y) ** 2)
init_params = {'w': jnp.zeros((4, 1)), 'b': jnp.zeros((1,))}
_key = jax.random.key(0)
_x = jax.random.normal(_key, (8, 16, 4))
_y = _x @ (0.05 * jnp.arange(1.0, 5.0)[:, None])
batches = [(_x, _y)] * 200
'''
  scope = {}
  exec(compile(prelude + block, 'README.md', 'exec'), scope)
  model, opt_state = scope['model'], scope['opt_state']
  assert int(opt_state.sync_count[0]) == 10
  np.testing.assert_allclose(np.asarray(opt_state.controller.perm[0]), np.asarray(opt_state.controller.perm[-1]))
  initial = float(scope['loss_fn'](scope['init_params'], (scope['_x'][0], scope['_y'][0])))
  assert float(scope['loss'].mean()) < 0.8 * initial, (float(scope['loss'].mean()), initial)
