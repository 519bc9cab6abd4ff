"""optax conventions: extra arguments reach the wrapped optimizer, HDET chains with reduce_on_plateau both ways,
and hdet_jax.hyperparams reads every replica's and the base values the way optax users look for them."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

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
  rho = H.multipliers.spread_multipliers(N, 0.25)  # no sync yet: replica r keeps multiplier rho[r]
  np.testing.assert_allclose(updates, _expected(rho), rtol=2e-5, atol=1e-9)
  plateau = state.inner_state[1]
  chex.assert_trees_all_close(plateau.scale, jnp.full((N,), FACTOR ** ((STEPS - 1) // PATIENCE)))
  chex.assert_trees_all_close(plateau.best_value, jnp.ones((N,)))


def test_reduce_on_plateau_chained_after_hdet():
  hdet = H.hdet(optax.adam, LR, num_replicas=N, spread=0.25, sync_every=100, replica_axis=AX)
  tx = optax.chain(hdet, _plateau())
  updates, state = _run(tx, value=2.0)
  np.testing.assert_allclose(updates, _expected(H.multipliers.spread_multipliers(N, 0.25)), rtol=2e-5, atol=1e-9)
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
  rho = H.multipliers.spread_multipliers(N, 0.25)
  g = np.stack([np.asarray(_grads(t)['w']) for t in range(2)])  # [2, dim]
  np.testing.assert_allclose(updates, -3.0 * LR * rho[None, :, None] * g[:, None, :], rtol=1e-6)


# --- hdet_jax.hyperparams ---------------------------------------------------------------------------
