"""``hdet(..., rollback=True)``: a sync whose guard backs off returns every replica to the last sync's state.

The divergence is built on purpose: replica r's loss is ``0.5 |w - c_t|^2``, and in the fourth window the
targets ``c_t`` jump far away, so that window's training loss rises past any margin whatever the parameters do.
The oracle is the run's own state at the sync before (steps 14 and 19 end windows 3 and 4, T = 5).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hdet_jax as H

N, T, DIM = 4, 5, 3
AX = 'data'
JUMP = 15  # the first step of the window whose loss rises


def _targets(steps):
  c = jax.random.normal(jax.random.key(1), (steps, N, DIM))
  return c.at[JUMP:].add(100.0)


def _run(steps, exact, rollback=True):
  """Every step's (params, state) of N replicas under ``jax.vmap``."""
  tx = H.hdet(
    optax.sgd(0.05, momentum=0.9),
    num_replicas=N,
    sync_every=T,
    replica_axis=AX,
    auto_lr=H.AutoLR(total_steps=40, initial_scale=1.0),  # the scenario's jump sized for a start at SGD's own LR
    exact_sync=exact,
    rollback=rollback,
  )

  def step(p, s, c):
    loss, g = jax.value_and_grad(lambda p: 0.5 * jnp.sum((p['w'] - c) ** 2))(p)
    u, s = tx.update(H.pmean_finite(g, AX), s, p, value=loss)
    p = H.apply_updates(p, u, s, replica_axis=AX) if exact else optax.apply_updates(p, u)
    return p, s

  f = jax.jit(jax.vmap(step, axis_name=AX))
  p = H.stack_replicas({'w': jnp.zeros(DIM)}, N)
  s = jax.vmap(tx.init)(p)
  out, c = [], _targets(steps)
  for t in range(steps):
    p, s = f(p, s, c[t])
    out.append((p, s))
  return out


@pytest.fixture(scope='module')
def exact_run():
  return _run(20, exact=True)


def test_a_backed_off_sync_lands_on_the_last_syncs_state_bit_for_bit(exact_run):
  before, after = exact_run[JUMP - 1], exact_run[JUMP + T - 1]  # the syncs ending windows 3 and 4
  assert bool(before[1].synced[0]) and bool(after[1].synced[0])
  assert not bool(before[1].controller.backed_off[0]) and bool(after[1].controller.backed_off[0])
  np.testing.assert_array_equal(after[0]['w'], before[0]['w'])  # every replica on the last sync's average
  for a, b in zip(jax.tree.leaves(after[1].inner_state), jax.tree.leaves(before[1].inner_state)):
    np.testing.assert_array_equal(a, b)  # the momentum too
  np.testing.assert_array_equal(after[1].controller.train_loss, before[1].controller.train_loss)  # the baseline
  # and the guard stepped the learning rate down (trust = 1 in log units)
  np.testing.assert_allclose(
    after[1].controller.correction[:, 0], before[1].controller.correction[:, 0] - 1.0, rtol=1e-6
  )


def test_an_ordinary_sync_moves_the_anchor_to_its_average(exact_run):
  p, s = exact_run[JUMP - 1]
  np.testing.assert_array_equal(s.anchor.params['w'], p['w'])  # the average, every replica alike
  assert np.all(np.asarray(p['w']) == np.asarray(p['w'])[0])
  for a, b in zip(jax.tree.leaves(s.anchor.inner_state), jax.tree.leaves(s.inner_state)):
    np.testing.assert_array_equal(a, b)
  between = exact_run[JUMP + 1][0]['w']  # between syncs the replicas run apart, the anchor stays
  assert not np.all(np.asarray(between) == np.asarray(between)[0])
  np.testing.assert_array_equal(exact_run[JUMP + 1][1].anchor.params['w'], p['w'])


def test_with_optax_apply_updates_it_lands_within_an_ulp():
  run = _run(20, exact=False)
  before, after = np.asarray(run[JUMP - 1][0]['w']), np.asarray(run[JUMP + T - 1][0]['w'])
  risen = np.asarray(run[JUMP + T - 2][0]['w'])  # where the replicas were, one step before the sync
  assert bool(run[JUMP + T - 1][1].controller.backed_off[0])
  # p + (anchor - p) rounds like any sync: |p' - anchor| <= eps (|anchor| + |anchor - p|), eps = 2**-24 (float32);
  # the bound doubles it for the last step's own update
  assert np.all(np.abs(after - before) <= 2.0**-23 * (np.abs(before) + np.abs(before - risen))), after - before
  assert np.abs(after - before).max() < 1e-5 < np.abs(risen - before).max() / 1e6


def test_without_rollback_the_backed_off_sync_averages_the_risen_window():
  run = _run(20, exact=True, rollback=False)
  after, before = run[JUMP + T - 1][0]['w'], run[JUMP - 1][0]['w']
  assert bool(run[JUMP + T - 1][1].controller.backed_off[0]) and run[JUMP + T - 1][1].anchor is None
  assert np.abs(np.asarray(after) - np.asarray(before)).max() > 1.0  # it followed the jumped targets


def test_rollback_needs_the_guard():
  with pytest.raises(ValueError, match='rollback=True .* needs the guard'):
    H.hdet(optax.adam(1e-3), num_replicas=2, rollback=True)
  with pytest.raises(ValueError, match='rollback=True .* needs the guard'):
    H.hdet(
      optax.adam(1e-3),
      num_replicas=2,
      rollback=True,
      auto_lr=H.AutoLR(100, backoff=False, backoff_stderrs=0, backoff_fraction=0),
    )


def _run_over_replicas(steps, devices, per_device, share):
  """The same run under ``over_replicas`` on ``devices`` devices, ``per_device`` replicas each; ``share``: the anchor
  held once per device (``stack_replicas(..., per_device=)``)."""
  from jax.sharding import Mesh

  mesh = Mesh(np.array(jax.devices()[:devices]), ('replica',))
  tx = H.hdet(
    optax.sgd(0.05, momentum=0.9),
    num_replicas=N,
    sync_every=T,
    replica_axis='replica',
    auto_lr=H.AutoLR(total_steps=40, initial_scale=1.0),  # as _run's
    exact_sync=True,
    rollback=True,
  )

  def step(state, batch):
    p, s = state
    loss, g = jax.value_and_grad(lambda p: 0.5 * jnp.sum((p['w'] - batch[0]) ** 2))(p)
    u, s = tx.update(H.pmean_finite(g, 'replica'), s, p, value=loss)
    return (H.apply_updates(p, u, s, replica_axis='replica'), s)

  f = jax.jit(H.over_replicas(step, mesh, 'replica', per_device=per_device), donate_argnames='state')
  w = {'w': jnp.zeros(DIM)}
  state = H.stack_replicas((w, tx.init(w)), N, per_device=per_device if share else 1)
  out, c = [], _targets(steps)
  for t in range(steps):
    state = f(state, c[t])
    out.append(jax.tree.map(np.asarray, state))
  return out


@pytest.mark.parametrize('devices, share', [(2, True), (2, False), (1, True), (4, False)])
def test_several_replicas_per_device_hold_one_anchor_each_and_roll_back_alike(exact_run, devices, share):
  run = _run_over_replicas(20, devices, N // devices, share)
  copies = devices if share else N
  for p, s in run:
    assert s.anchor.params['w'].shape == (copies, DIM) and s.anchor.train_loss.shape == (copies,)
    assert s.count.shape == (N,)
  before, after = run[JUMP - 1], run[JUMP + T - 1]
  assert bool(after[1].controller.backed_off[0]) and not bool(before[1].controller.backed_off[0])
  np.testing.assert_array_equal(after[0]['w'], before[0]['w'])  # landed on the last sync's state, bit for bit
  for a, b in zip(jax.tree.leaves(after[1].inner_state), jax.tree.leaves(before[1].inner_state)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(before[1].anchor.params['w'], before[0]['w'][:copies])
  # the trajectory is the vmapped run's (the all-reduce sums in another order: float32 rounding)
  for (p, s), (p0, s0) in zip(run, exact_run):
    np.testing.assert_allclose(p['w'], p0['w'], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(s.controller.correction, s0.controller.correction, rtol=1e-6, atol=1e-6)
