"""hdet_jax.hyperparams (hdet_jax.views): every replica's and the base values, the way optax users look for them."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hdet_jax as H
from test_optax_conventions import AX, LR, N, _run


def test_hyperparams_reads_every_replica_and_the_base_for_the_coming_step():
  tx = H.hdet(
    optax.adam, H.one_cycle(max_lr=0.1, total_steps=50), num_replicas=N, spread=0.25, sync_every=3, replica_axis=AX
  )
  _, state = _run(tx, steps=4)  # one sync after step 3 reshuffled the multipliers
  hp = H.hyperparams(state)
  assert set(hp) == {'learning_rate', 'base_learning_rate'}
  chex.assert_shape(hp['learning_rate'], (N,))
  chex.assert_shape(hp['base_learning_rate'], ())
  # The coming step is step 4: base = the schedule at 4, replica r = base * rho[perm[r]].
  base = float(H.one_cycle(max_lr=0.1, total_steps=50)(4))
  perm = np.asarray(state.controller.perm[0, 0])
  assert sorted(perm.tolist()) == list(range(N)) and perm.tolist() != list(range(N))  # reshuffled
  np.testing.assert_allclose(hp['base_learning_rate'], base, rtol=1e-6)
  np.testing.assert_allclose(hp['learning_rate'], base * H.multipliers.spread_multipliers(N, 0.25)[perm], rtol=1e-6)
  # The same view as the state's own fields, and the same from one replica's state inside the step.
  np.testing.assert_array_equal(hp['learning_rate'], np.asarray(state.learning_rates[0]))
  inside = jax.vmap(lambda s: H.hyperparams(s)['learning_rate'], axis_name=AX)(state)
  np.testing.assert_array_equal(np.asarray(inside), np.broadcast_to(hp['learning_rate'], (N, N)))


def test_hyperparams_with_groups_and_explored_values_inside_a_chain():
  groups = {'kernel': r'w$', 'bias': r'b$'}
  explore = {'weight_decay': (1e-2, 0.5)}
  names = H.hyperparam_names(param_groups=groups, explore=explore)
  assert names == ('learning_rate/kernel', 'learning_rate/bias', 'weight_decay')
  hdet = H.hdet(
    optax.adamw, 0.1, num_replicas=N, spread=0.2, sync_every=10, replica_axis=AX, param_groups=groups, explore=explore
  )
  tx = optax.chain(optax.clip_by_global_norm(1.0), hdet)
  params = H.stack_replicas({'w': jnp.zeros(3), 'b': jnp.zeros(1)}, N)
  state = jax.vmap(tx.init)(params)
  hp = H.hyperparams(state, names)  # found inside the chain's state
  assert list(hp) == list(names) + [f'base_{n}' for n in names]
  rho_lr, rho_wd = H.multipliers.spread_multipliers(N, 0.2), H.multipliers.spread_multipliers(N, 0.5)
  for group in groups:
    np.testing.assert_allclose(hp[f'learning_rate/{group}'], 0.1 * rho_lr, rtol=1e-6)
    np.testing.assert_allclose(hp[f'base_learning_rate/{group}'], 0.1, rtol=1e-6)
  np.testing.assert_allclose(hp['weight_decay'], 1e-2 * rho_wd, rtol=1e-6)
  np.testing.assert_allclose(hp['base_weight_decay'], 1e-2, rtol=1e-6)
  with pytest.raises(ValueError, match='hyperparam_names'):
    H.hyperparams(state)  # three rows, no names
  with pytest.raises(ValueError, match='2 names'):
    H.hyperparams(state, names[:2])


def test_why_the_usual_optax_lookups_do_not_apply():
  """What views.py's docstring says: tree_get finds no learning rate and two 'base' fields."""
  tx = H.hdet(optax.adam, LR, num_replicas=N, sync_every=5, replica_axis=AX)
  state = jax.vmap(tx.init)(H.stack_replicas({'w': jnp.zeros(3)}, N))
  assert optax.tree_utils.tree_get(state, 'learning_rate') is None
  with pytest.raises(KeyError, match='multiple'):
    optax.tree_utils.tree_get(state, 'base')
  np.testing.assert_allclose(
    H.hyperparams(state)['learning_rate'], LR * H.multipliers.spread_multipliers(N, 0.25), rtol=1e-6
  )


def test_find_state_needs_exactly_one_hdet_state():
  tx = H.hdet(optax.adam, LR, num_replicas=N, sync_every=5, replica_axis=AX)
  state = jax.eval_shape(tx.init, {'w': jnp.zeros(3)})  # shapes only: find_state reads no values
  assert H.views.find_state(state) is state
  assert H.views.find_state((optax.EmptyState(), {'opt': state})) is state
  with pytest.raises(ValueError, match='expected one HDETState in the optimizer state, found 0'):
    H.hyperparams((optax.EmptyState(), {'w': jnp.zeros(3)}))
  with pytest.raises(ValueError, match='expected one HDETState in the optimizer state, found 2'):
    H.hyperparams((state, state))


def test_hyperparams_finds_the_state_under_multisteps_and_names_a_built_optimizers_rows():
  """Around a built optimizer the rows are factors on its own LR ('lr_scale'); found under MultiSteps, in a chain."""
  built = H.hdet(optax.adam(1e-3), num_replicas=4, spread=0.5)
  factory = H.hdet(optax.adam, 1e-3, num_replicas=4, spread=0.5)
  for tx, name, base in ((built, 'lr_scale', 1.0), (factory, 'learning_rate', 1e-3)):
    outer = optax.MultiSteps(optax.chain(optax.clip(1.0), tx), 2)
    state = jax.vmap(outer.init)(H.stack_replicas({'w': jnp.zeros(2)}, 4))
    hp = H.hyperparams(state)
    assert set(hp) == {name, f'base_{name}'}
    np.testing.assert_allclose(hp[name], base * np.array([0.5, 5 / 6, 7 / 6, 1.5]), rtol=1e-6)
