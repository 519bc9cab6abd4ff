"""The README's examples run as written (with a loss, initial parameters and batches supplied)."""

import pathlib
import re
import textwrap

import jax
import numpy as np

import hdet_jax

README = pathlib.Path(__file__).parent.parent / 'README.md'

# What the example leaves to the reader: a loss, initial parameters and batches.
PRELUDE = '''
import jax, jax.numpy as jnp
def loss_fn(params, batch):
  x, y = batch
  return jnp.mean((x @ params['w'] + params['b'] - y) ** 2)
init_params = {'w': jnp.zeros((4, 1)), 'b': jnp.zeros((1,))}
_key = jax.random.key(0)
_x = jax.random.normal(_key, (8, 16, 4))
_y = _x @ (0.05 * jnp.arange(1.0, 5.0)[:, None])
class _OneStepInFlight:
  # The batches, handed out only once the step before has finished (it blocks on the loop's params). Dispatched
  # asynchronously, the 200 steps queue up as multi-device programs with collectives, and on a loaded 2-core
  # machine XLA:CPU's in-process all-reduce has deadlocked among them (aborted after its 60 s collective timeout,
  # in a clean-clone CI run of 2026-11-26; README, "Known XLA:CPU limit"). One program in flight avoids that and
  # changes no number.
  def __init__(self, items):
    self.items = items
  def __iter__(self):
    for item in self.items:
      jax.block_until_ready(globals().get('params'))
      yield item
    jax.block_until_ready(globals().get('params'))  # (the last step too, before the example averages)
batches = _OneStepInFlight([(_x, _y)] * 200)
'''


def _blocks():
  """The README's python blocks, dedented (some sit inside list items)."""
  return [textwrap.dedent(b) for b in re.findall(r' *```python\n(.*?) *```', README.read_text(), re.S)]


def _run_example():
  main = next(b for b in _blocks() if 'shard_map_replicas' in b)
  scope = {}
  exec(compile(PRELUDE + main, 'README.md', 'exec'), scope)
  return scope


def test_readme_example_runs():
  scope = _run_example()
  opt_state = scope['opt_state']
  assert int(opt_state.sync_count[0]) == 10
  np.testing.assert_allclose(np.asarray(opt_state.controller.perm[0]), np.asarray(opt_state.controller.perm[-1]))
  initial = float(scope['loss_fn'](scope['init_params'], (scope['_x'][0], scope['_y'][0])))
  assert float(scope['loss'].mean()) < 0.8 * initial, (float(scope['loss'].mean()), initial)


def test_readme_window_end_snippet_averages_without_a_step():
  """The window-end snippet, run after the example's last step, averages the replicas once more."""
  scope = _run_example()
  snippet = next(b for b in _blocks() if 'def window_end' in b)
  exec(compile(snippet, 'README.md', 'exec'), scope)
  end = jax.jit(hdet_jax.shard_map_replicas(scope['window_end'], scope['mesh'], 'data'))
  params, opt_state = end(scope['params'], scope['opt_state'])
  assert int(opt_state.sync_count[0]) == 11 and int(opt_state.count[0]) == 200  # a sync, no step
  w = np.asarray(params['w'])
  np.testing.assert_allclose(w, np.broadcast_to(w.mean(0), w.shape), rtol=1e-6, atol=1e-7)
