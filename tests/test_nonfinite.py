"""A non-finite replica must not poison the ensemble (issue: reliability)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import hdet_jax as H

N, AX = 8, 'data'


@pytest.fixture(scope='module')
def mesh():
  return Mesh(np.array(jax.devices()[:N]), (AX,))


def _run(mesh, tx, loss_fn, steps, params, guard, inject=None, exact=False):
  def step(p, s, t):
    loss, g = jax.value_and_grad(loss_fn)(p)
    if inject is not None:  # NaN into replica inject[1]'s gradient and loss at step inject[0]
      bad = jnp.logical_and(t == inject[0], lax.axis_index(AX) == inject[1])
      g = jax.tree.map(lambda x: jnp.where(bad, jnp.nan, x), g)
      loss = jnp.where(bad, jnp.nan, loss)
    g = H.pmean_finite(g, AX) if guard else lax.pmean(g, AX)
    u, s = tx.update(g, s, p, value=loss)
    p = H.apply_updates(p, u, s, replica_axis=AX, guard_nonfinite=guard) if exact else optax.apply_updates(p, u)
    return p, s, loss
  sp = H.stack_replicas(params, N)
  ss = jax.jit(jax.vmap(tx.init))(sp)
  sharding = NamedSharding(mesh, P(AX))
  sp, ss = jax.device_put((sp, ss), sharding)
  f = jax.jit(H.shard_map_replicas(step, mesh, AX, stacked_argnums=(0, 1)))
  history = []
  for t in range(steps):
    sp, ss, loss = f(sp, ss, jnp.int32(t))
    history.append((np.asarray(sp['w']), np.asarray(loss), jax.tree.map(np.asarray, ss)))
  return history


def quad(p):
  return 0.5 * jnp.sum((p['w'] - 1.0) ** 2)


@pytest.mark.parametrize('exact', [False, True])
def test_injected_nan_is_contained(mesh, exact):
  params = {'w': jnp.zeros(4)}
  mk = lambda guard: H.hdet(optax.sgd, 0.1, num_replicas=N, spread=0.25, sync_every=4, replica_axis=AX,
                            auto_lr=H.AutoLR(total_steps=100, warmup_steps=0, temperature=0.1),
                            guard_nonfinite=guard, exact_sync=exact)
  guarded = _run(mesh, mk(True), quad, 12, params, True, inject=(5, 3), exact=exact)
  clean = _run(mesh, mk(True), quad, 12, params, True, exact=exact)
  unguarded = _run(mesh, mk(False), quad, 12, params, False, inject=(5, 3), exact=exact)
  # Step 5 (window 4..7): replica 3's loss is NaN; the gradient all-reduce leaves it out.
  w, _, st = guarded[7]  # right after the sync ending that window
  assert np.all(np.isfinite(w)) and np.max(np.abs(w - w[0])) <= 1e-6
  assert int(st.finite_replicas[0]) == N - 1 and not st.replica_ok[3] and st.replica_ok[0]
  weights = st.controller.weights[0]
  assert weights[3] == 0.0 and abs(weights.sum() - 1) < 1e-6  # zero controller weight
  # Training continues and ends close to the clean run (one step used 7/8 of the replicas' gradients).
  np.testing.assert_allclose(guarded[-1][0], clean[-1][0], rtol=0.02)
  assert int(guarded[-1][2].finite_replicas[0]) == N
  # Without the protection the NaN reaches every replica for good.
  assert np.all(np.isnan(unguarded[-1][0]))


def barrier(p):
  # A loss defined only on |w| < 1 (like an overflow): a replica that overshoots gets a NaN
  # loss and a NaN gradient (through the sqrt).
  return jnp.sum(0.5 * (p['w'] - 0.9) ** 2 - 0.02 * jnp.log(jnp.sqrt(1.0 - p['w'] ** 2)))


def test_highest_lr_replica_diverges_for_real(mesh):
  params = {'w': jnp.zeros(2)}
  mk = lambda guard: H.hdet(optax.sgd, 0.7, num_replicas=N, spread=0.8, sync_every=5, replica_axis=AX,
                            auto_lr=H.AutoLR(total_steps=200, warmup_steps=0, temperature=0.05, decay=0.0),
                            guard_nonfinite=guard)
  guarded = _run(mesh, mk(True), barrier, 40, params, True)
  unguarded = _run(mesh, mk(False), barrier, 40, params, False)
  losses = np.stack([h[1] for h in guarded])
  # The top-LR replicas really went out of the domain during fan-out...
  assert np.isnan(losses).any()
  went_nan = np.isnan(losses[:5]).any(0)
  rho_index = guarded[0][2].controller.perm[0, 0]
  assert 0 < went_nan.sum() < N
  assert rho_index[went_nan].min() > rho_index[~went_nan].max()  # ...exactly the high-LR ones.
  # ...yet every sync restored a finite, agreeing ensemble, and training converged.
  for t in range(4, 40, 5):
    w = guarded[t][0]
    assert np.all(np.isfinite(w)) and np.max(np.abs(w - w[0])) <= 1e-6
  final = guarded[-1][0][0]
  grid = np.linspace(0.0, 0.999, 100000)  # the optimum of the barrier loss, by brute force
  optimum = grid[np.argmin(0.5 * (grid - 0.9) ** 2 - 0.01 * np.log1p(-grid ** 2))]
  np.testing.assert_allclose(final, optimum, atol=2e-3)
  # The controller lowered the base LR in response.
  assert float(guarded[-1][2].base[0, 0]) < 0.7
  # Without the protection, the ensemble is lost.
  assert np.all(np.isnan(unguarded[-1][0]))


def test_all_replicas_nonfinite_is_reported(mesh):
  params = {'w': jnp.zeros(2)}
  tx = H.hdet(optax.sgd, 0.1, num_replicas=N, spread=0.25, sync_every=2, replica_axis=AX)
  hist = _run(mesh, tx, lambda p: jnp.sum(p['w'] * jnp.nan), 2, params, True)
  w, _, st = hist[-1]
  assert int(st.finite_replicas[0]) == 0 and np.all(np.isnan(w))


def test_finite_mean_equals_pmean_when_all_finite(mesh):
  x = jax.random.normal(jax.random.key(0), (N, 33))
  f = lambda fn: jax.jit(jax.shard_map(lambda a: fn(a), mesh=mesh, in_specs=P(AX), out_specs=P(AX)))
  a = f(lambda a: H.pmean_finite(a, AX))(x)
  b = f(lambda a: lax.pmean(a, AX))(x)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
