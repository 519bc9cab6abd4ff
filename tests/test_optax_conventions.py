"""optax conventions: extra arguments reach the wrapped optimizer, HDET chains with reduce_on_plateau both ways,
and hdet_jax.hyperparams reads every replica's and the base values the way optax users look for them."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hdet_jax as H

N = 8
AX = 'data'
LR = 1e-2
STEPS = 7
PATIENCE, FACTOR = 2, 0.5


def _grads(t, dim=5):
  """Step t's (already all-reduced, so common to every replica) gradient."""
  return {'w': jnp.sin(jnp.arange(dim, dtype=jnp.float32) + t)}


def _run(tx, value=1.0, steps=STEPS, **extra):
  """``steps`` updates under vmap over 8 replicas (same gradient and the same scalar value on each)."""
  params = H.stack_replicas({'w': jnp.zeros(5)}, N)
  state = jax.jit(jax.vmap(tx.init))(params)

  def step(p, s, g):
    return tx.update(g, s, p, value=jnp.float32(value), **extra)

  f = jax.jit(jax.vmap(step, in_axes=(0, 0, None), axis_name=AX))
  updates = []
  for t in range(steps):
    u, state = f(params, state, _grads(t))
    updates.append(np.asarray(u['w']))
    params = optax.apply_updates(params, u)
  return np.stack(updates), state  # updates [steps, N, dim]


def _plain_adam_updates(lr, steps=STEPS):
  """optax.adam(lr)'s updates on the same gradients, one replica, no HDET and no plateau."""
  tx = optax.adam(lr)
  p = {'w': jnp.zeros(5)}
  s = tx.init(p)
  out = []
  for t in range(steps):
    u, s = tx.update(_grads(t), s, p)
    out.append(np.asarray(u['w']))
    p = optax.apply_updates(p, u)
  return np.stack(out)


def _expected(rho):
  """Replica r: adam at LR * rho[r], scaled by reduce_on_plateau's scale at step t.

  With a constant loss the first value is the best one and every later step counts towards the
  plateau, so the scale is FACTOR after PATIENCE more steps, FACTOR**2 after 2 PATIENCE, ...
  """
  scale = FACTOR ** (np.arange(STEPS) // PATIENCE)  # [1, 1, .5, .5, .25, .25, .125]
  per_replica = np.stack([_plain_adam_updates(LR * r) for r in rho], axis=1)  # [steps, N, dim]
  return per_replica * scale[:, None, None]


def _plateau():
  return optax.contrib.reduce_on_plateau(factor=FACTOR, patience=PATIENCE, cooldown=0, accumulation_size=1)


def test_reduce_on_plateau_inside_hdet_gets_the_value():
  factory = lambda learning_rate: optax.chain(optax.adam(learning_rate), _plateau())
  tx = H.hdet(factory, LR, num_replicas=N, spread=0.25, sync_every=100, replica_axis=AX)
  updates, state = _run(tx)
  rho = H.spread_multipliers(N, 0.25)  # no sync yet: replica r keeps multiplier rho[r]
  np.testing.assert_allclose(updates, _expected(rho), rtol=2e-5, atol=1e-9)
  plateau = state.inner_state[1]
  chex.assert_trees_all_close(plateau.scale, jnp.full((N,), FACTOR ** ((STEPS - 1) // PATIENCE)))
  chex.assert_trees_all_close(plateau.best_value, jnp.ones((N,)))


def test_reduce_on_plateau_chained_after_hdet():
  hdet = H.hdet(optax.adam, LR, num_replicas=N, spread=0.25, sync_every=100, replica_axis=AX)
  tx = optax.chain(hdet, _plateau())
  updates, state = _run(tx, value=2.0)
  np.testing.assert_allclose(updates, _expected(H.spread_multipliers(N, 0.25)), rtol=2e-5, atol=1e-9)
  hstate, plateau = state
  chex.assert_trees_all_close(plateau.scale, jnp.full((N,), FACTOR ** ((STEPS - 1) // PATIENCE)))
  # HDET got the value too (chain passes every extra argument to each member): its window loss sum.
  chex.assert_trees_all_close(hstate.loss_sum, jnp.full((N,), 2.0 * STEPS))


def _gain():
  """A transformation that needs an extra argument of its own: updates times ``gain``."""
  def init(params):
    del params
    return optax.EmptyState()

  def update(updates, state, params=None, *, gain, **extra):
    del params, extra
    return jax.tree.map(lambda u: gain * u, updates), state
  return optax.GradientTransformationExtraArgs(init, update)


def test_any_extra_argument_is_forwarded_and_value_is_optional():
  factory = lambda learning_rate: optax.chain(optax.sgd(learning_rate), _gain())
  tx = H.hdet(factory, LR, num_replicas=N, spread=0.25, sync_every=100, replica_axis=AX)
  updates, _ = _run(tx, steps=2, gain=jnp.float32(3.0))
  rho = H.spread_multipliers(N, 0.25)
  g = np.stack([np.asarray(_grads(t)['w']) for t in range(2)])  # [2, dim]
  np.testing.assert_allclose(updates, -3.0 * LR * rho[None, :, None] * g[:, None, :], rtol=1e-6)


# --- hdet_jax.hyperparams ---------------------------------------------------------------------------

def test_hyperparams_reads_every_replica_and_the_base_for_the_coming_step():
  tx = H.hdet(optax.adam, H.one_cycle(max_lr=0.1, total_steps=50), num_replicas=N, spread=0.25, sync_every=3,
              replica_axis=AX)
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
  np.testing.assert_allclose(hp['learning_rate'], base * H.spread_multipliers(N, 0.25)[perm], rtol=1e-6)
  # The same view as the state's own fields, and the same from one replica's state inside the step.
  np.testing.assert_array_equal(hp['learning_rate'], np.asarray(state.learning_rates[0]))
  inside = jax.vmap(lambda s: H.hyperparams(s)['learning_rate'], axis_name=AX)(state)
  np.testing.assert_array_equal(np.asarray(inside), np.broadcast_to(hp['learning_rate'], (N, N)))


def test_hyperparams_with_groups_and_explored_values_inside_a_chain():
  groups = {'kernel': r'w$', 'bias': r'b$'}
  explore = {'weight_decay': (1e-2, 0.5)}
  names = H.hyperparam_names(param_groups=groups, explore=explore)
  assert names == ('learning_rate/kernel', 'learning_rate/bias', 'weight_decay')
  hdet = H.hdet(optax.adamw, 0.1, num_replicas=N, spread=0.2, sync_every=10, replica_axis=AX,
                param_groups=groups, explore=explore)
  tx = optax.chain(optax.clip_by_global_norm(1.0), hdet)
  params = H.stack_replicas({'w': jnp.zeros(3), 'b': jnp.zeros(1)}, N)
  state = jax.vmap(tx.init)(params)
  hp = H.hyperparams(state, names)  # found inside the chain's state
  assert list(hp) == list(names) + [f'base_{n}' for n in names]
  rho_lr, rho_wd = H.spread_multipliers(N, 0.2), H.spread_multipliers(N, 0.5)
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
  np.testing.assert_allclose(H.hyperparams(state)['learning_rate'], LR * H.spread_multipliers(N, 0.25), rtol=1e-6)
