"""The flax helpers of docs/add_to_trainer.md (hdet_jax.flax_utils): apply_gradients is a TrainState's update with
``value=`` passed on, and dense_general_ok works with the core and flax alone (issue 84: without the trainer
extra's orbax and ml_collections)."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

import hdet_jax
import hdet_jax.trainer.linen


def test_apply_gradients_is_sgd_at_each_replicas_learning_rate():
  """Around optax.sgd(0.1), replica r steps -0.1 c rho_r g, c = 0.1 before the first sync (the climb starts at a
  tenth of the learning rate passed); numpy's multipliers."""
  n, lr = 4, 0.1
  tx = hdet_jax.hdet(optax.sgd(lr), num_replicas=n, replica_axis='replica', auto_lr=hdet_jax.AutoLR(100))
  w0 = np.array([1.0, -2.0, 0.5], np.float32)
  x = np.random.default_rng(0).normal(size=(n, 8, 3)).astype(np.float32)

  def train_step(state, x):
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p['w'] - 1.0) ** 2))(state.params)
    grads = hdet_jax.pmean_finite(grads, 'replica')
    return hdet_jax.apply_gradients(state, grads, value=loss)

  state = jax.vmap(lambda p: TrainState.create(apply_fn=None, params=p, tx=tx))(hdet_jax.stack_replicas({'w': w0}, n))
  state = jax.vmap(train_step, axis_name='replica')(state, x)
  grad = np.mean([2 * xr.T @ (xr @ w0 - 1.0) / len(xr) for xr in x], axis=0)  # the all-reduced gradient
  rho = 1 + 0.25 * (np.arange(n) - 1.5) / 1.5
  c = 0.1  # AutoLR(100)'s start: initial_scale=None is a tenth, around a built optimizer as around a factory
  np.testing.assert_allclose(np.asarray(state.params['w']), w0 - c * lr * rho[:, None] * grad, rtol=1e-6, atol=1e-7)
  assert np.asarray(state.step).tolist() == [1] * n
  assert float(np.asarray(state.opt_state.loss_sum)[0]) > 0  # value= reached hdet: the window's loss sum


def test_apply_gradients_equals_train_states_own_method_without_hdet():
  state = TrainState.create(apply_fn=None, params={'w': jnp.arange(3.0)}, tx=optax.adam(1e-2))
  grads = {'w': jnp.array([0.5, -1.0, 2.0])}
  ours, flax_own = hdet_jax.apply_gradients(state, grads), state.apply_gradients(grads=grads)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(flax_own)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_apply_gradients_sets_a_states_own_fields_as_flax_does_and_passes_the_rest_to_the_update():
  """A TrainState subclass's batch_stats= is set on the new state (flax's apply_gradients(grads=..., **kwargs) gives
  its keywords to replace), not dropped into tx.update's extra arguments; value= still reaches hdet."""

  class BNState(TrainState):
    batch_stats: dict

  n = 4
  tx = hdet_jax.hdet(optax.sgd(0.1), num_replicas=n, replica_axis='replica', auto_lr=hdet_jax.AutoLR(100))

  def train_step(state, x):
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p['w']) ** 2))(state.params)
    grads = hdet_jax.pmean_finite(grads, 'replica')
    return hdet_jax.apply_gradients(state, grads, value=loss, batch_stats={'mean': jnp.mean(x, axis=0)})

  create = lambda p: BNState.create(apply_fn=None, params=p, tx=tx, batch_stats={'mean': jnp.zeros(3)})
  state = jax.vmap(create)(hdet_jax.stack_replicas({'w': jnp.ones(3)}, n))
  x = np.random.default_rng(0).normal(size=(n, 8, 3)).astype(np.float32)
  state = jax.vmap(train_step, axis_name='replica')(state, x)
  np.testing.assert_allclose(np.asarray(state.batch_stats['mean']), x.mean(axis=1), rtol=1e-6)
  assert float(np.asarray(state.opt_state.loss_sum)[0]) > 0  # value= reached hdet
  plain = BNState.create(apply_fn=None, params={'w': jnp.ones(3)}, tx=optax.sgd(0.1), batch_stats={})
  ours = hdet_jax.apply_gradients(plain, {'w': jnp.ones(3)}, batch_stats={'m': jnp.ones(1)})
  flax_own = plain.apply_gradients(grads={'w': jnp.ones(3)}, batch_stats={'m': jnp.ones(1)})
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(flax_own)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(TypeError, match=r'apply_gradients: params= is what the update itself sets; drop it'):
    hdet_jax.apply_gradients(plain, {'w': jnp.ones(3)}, params={'w': jnp.zeros(3)})


def test_apply_gradients_names_what_the_state_lacks():
  with pytest.raises(TypeError, match=r"apply_gradients: state has no 'tx'; pass a flax TrainState"):
    hdet_jax.apply_gradients({'w': jnp.ones(2)}, {'w': jnp.ones(2)})


def test_the_trainer_name_is_the_core_helper():
  assert hdet_jax.trainer.linen.dense_general_ok is hdet_jax.dense_general_ok


BLOCKED = textwrap.dedent(
  """
  import sys, importlib.abc
  class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
      if name.split('.')[0] in ('orbax', 'ml_collections'):
        raise ImportError(f'blocked: {name} (the trainer extra is not installed)')
  sys.meta_path.insert(0, Block())
  import jax
  jax.config.update('jax_num_cpu_devices', 2)
  import hdet_jax
  assert 'flax' not in sys.modules, 'import hdet_jax imported flax'
  import jax.numpy as jnp, numpy as np, flax.linen as nn
  from jax.sharding import Mesh
  init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, None, 'data'))
  layer = nn.DenseGeneral((2, 4), kernel_init=init)
  x = jnp.ones((3, 5))
  with jax.set_mesh(Mesh(np.array(jax.devices()), ('data',))):
    try:
      jax.jit(layer.init)(jax.random.key(0), x)
      print('flax fixed')
    except ValueError as e:
      print('flax raises:', 'only valid for values of rank at least 3' in str(e))
    params = jax.jit(hdet_jax.dense_general_ok(layer.init))(jax.random.key(0), x)
    y = jax.jit(hdet_jax.dense_general_ok(layer.apply))(params, x)
  kernel = params['params']['kernel']
  print(y.shape, kernel.names, kernel.value.shape)
  print(sorted(m for m in sys.modules if m.split('.')[0] in ('orbax', 'ml_collections')))
  """
)


def test_dense_general_ok_needs_the_core_and_flax_only():
  """In a process where orbax and ml_collections cannot be imported (absl can: optax, a core dependency, imports
  it): import hdet_jax does not import flax,
  flax raises on a 3-D DenseGeneral kernel under a mesh (issue 3676), and dense_general_ok builds and applies it,
  the kernel 3-D and boxed with its annotation."""
  out = subprocess.run([sys.executable, '-c', BLOCKED], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.splitlines()
  assert lines[0] in ('flax raises: True', 'flax fixed'), lines  # 'flax fixed': the workaround can go
  assert lines[1:] == ["(3, 2, 4) (None, None, 'data') (5, 2, 4)", '[]'], lines
