"""The auto-LR controller (eqs. 4-9) against a numpy oracle and the reference's recorded traces."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hdet_jax as H
from hdet_jax import controller as ctrl

DATA = pathlib.Path(__file__).parent / 'data' / 'onecycleautolr_traces.npz'


def numpy_controller(v, losses, lrs, sigma, lam, beta, gamma, floor=-np.inf):
  """Eqs. 4-7 written independently in float64 numpy. lrs: [N, G]."""
  losses = np.asarray(losses, np.float64)
  s = (losses.mean() - losses) / sigma
  w = np.exp(s - s.max())
  w /= w.sum()
  eta_tilde = (w[:, None] * lrs).sum(0)
  eta_bar = lrs.mean(0)
  delta = eta_tilde - eta_bar
  v = beta * v + (1 - beta) * delta
  base = np.maximum(eta_bar * (1 - gamma) + v * lam, floor)
  return w, delta, v, base


def test_against_numpy_oracle():
  rng = np.random.default_rng(0)
  for trial in range(50):
    n, g = rng.integers(1, 9), rng.integers(1, 4)
    losses = rng.normal(3.0, 0.05, n)
    lrs = np.abs(rng.normal(1e-3, 3e-4, (n, g)))
    v0 = rng.normal(0, 1e-5, g)
    sigma, lam, beta, gamma = rng.uniform(0.01, 0.2), rng.uniform(0, 1), rng.uniform(0, 0.99), rng.uniform(-0.1, 0.1)
    floor = 1e-5
    out = ctrl.controller_update(
        jnp.zeros(g, jnp.float32), jnp.asarray(v0, jnp.float32), jnp.asarray(losses, jnp.float32),
        jnp.asarray(lrs, jnp.float32), temperature=sigma, lr_of_lr=lam, momentum=beta, decay=gamma, floor=floor)
    w, delta, v, base = numpy_controller(v0, losses.astype(np.float32), lrs, sigma, lam, beta, gamma, floor)
    np.testing.assert_allclose(out.weights, w, rtol=2e-4, atol=1e-7)
    np.testing.assert_allclose(out.delta, delta, rtol=2e-3, atol=1e-10)
    np.testing.assert_allclose(out.velocity, v, rtol=2e-3, atol=1e-10)
    np.testing.assert_allclose(out.base, base, rtol=1e-5)


def test_weights_closed_form_two_replicas():
  # N = 2: w_0 = 1 / (1 + exp((L_0 - L_1) / sigma)).
  out = ctrl.controller_update(jnp.zeros(1), jnp.zeros(1), jnp.array([1.0, 1.02]), jnp.array([[1.0], [2.0]]),
                               temperature=0.01, lr_of_lr=1.0, momentum=0.0, decay=0.0, floor=0.0)
  w0 = 1 / (1 + np.exp(-2.0))
  np.testing.assert_allclose(out.weights, [w0, 1 - w0], rtol=1e-5)
  np.testing.assert_allclose(out.delta, [w0 * 1 + (1 - w0) * 2 - 1.5], rtol=1e-5)


def test_non_finite_losses_get_zero_weight():
  out = ctrl.softmax_weights(jnp.array([1.0, jnp.nan, 1.0, jnp.inf]), 0.1)
  np.testing.assert_array_equal(out, [0.5, 0.0, 0.5, 0.0])
  out = ctrl.softmax_weights(jnp.array([jnp.nan, jnp.nan]), 0.1)
  np.testing.assert_array_equal(out, [0.5, 0.5])


def _runs():
  d = np.load(DATA)
  return [r for r in ['A_above', 'B_below', 'C_mixed', 'I_adam'] if f'{r}/gathered_loss' in d.files]


@pytest.mark.parametrize('run', _runs())
def test_against_reference_traces(run):
  """Fed the reference's gathered losses, LRs, permutations and gamma, every per-sync update
  reproduces its velocity and the LRs it assigned, to at least 5 significant digits."""
  d = np.load(DATA)
  meta = json.loads(str(d[f'{run}/meta']))
  n = meta['world']
  k_syncs = (meta['total_steps'] - meta['warm']) / meta['T']
  gamma = H.reference_decay(25.0, 1e4, k_syncs)
  assert gamma == pytest.approx(-0.0688, abs=1e-4)  # the sign defect, reproduced on purpose
  rho = H.spread_multipliers(n, meta['alpha'])
  steps = d[f'{run}/gathered_steps']
  sync_steps = list(d[f'{run}/sync_steps'])
  velocity = d[f'{run}/velocity']
  perms = d[f'{run}/perms_rank'][0]  # identical on all ranks
  np.testing.assert_array_equal(d[f'{run}/perms_rank'], np.broadcast_to(perms, d[f'{run}/perms_rank'].shape))
  lr_after = d[f'{run}/lr_after']
  g = lr_after.shape[-1]
  v = jnp.zeros(g, jnp.float32)
  checked = 0
  for k, step in enumerate(steps):
    j = sync_steps.index(step)
    v_before = jnp.asarray(velocity[j - 1] if j > 0 else np.zeros(g), jnp.float32)
    out = ctrl.controller_update(
        jnp.zeros(g, jnp.float32), v_before, jnp.asarray(d[f'{run}/gathered_loss'][k], jnp.float32),
        jnp.asarray(d[f'{run}/gathered_lr'][k], jnp.float32), temperature=meta['loss_scale'],
        lr_of_lr=meta['lr_of_lr'], momentum=meta['mom'], decay=gamma, floor=-jnp.inf)  # the reference has no floor
    # Velocity: 5 significant digits relative to its scale in this run.
    scale = np.max(np.abs(velocity)) + 1e-30
    np.testing.assert_allclose(np.asarray(out.velocity) / scale, velocity[j] / scale, atol=1e-5)
    # The LRs the reference assigned: base * rho[perm[r]] per group.
    for gi in range(g):
      perm = perms[k * g + gi]
      ours = np.asarray(out.base[gi]) * rho[perm]
      np.testing.assert_allclose(ours, lr_after[:, step, gi], rtol=1e-5, atol=1e-5 * np.max(np.abs(lr_after[:, step, gi])))
    checked += 1
  assert checked == len(steps) >= 80


def test_direction():
  """A loss that favours larger LRs raises the base; one that favours smaller LRs lowers it."""
  rho = H.spread_multipliers(8, 0.25)
  for sign in (+1, -1):
    base, v = jnp.array([1e-3]), jnp.zeros(1)
    for _ in range(20):
      lrs = base[0] * rho
      losses = 2.0 - sign * 100.0 * (lrs - lrs.mean())  # higher LR -> lower loss when sign = +1
      out = ctrl.controller_update(base, v, jnp.asarray(losses, jnp.float32), jnp.asarray(lrs[:, None]),
                                   temperature=0.01, lr_of_lr=0.5, momentum=0.9, decay=0.0, floor=1e-6)
      base, v = out.base, out.velocity
      assert np.sign(float(out.delta[0])) == sign
    assert (float(base[0]) - 1e-3) * sign > 0


def test_decay_for_schedule_and_reference_sign():
  g = H.decay_for_schedule(1e-3, 1e-3 / 400, 90)
  assert g > 0 and (1 - g) ** 90 == pytest.approx(1 / 400, rel=1e-12)
  assert H.reference_decay(25.0, 1e4, 90) < 0  # it grows the LR 400x: the reference's defect 3
  with pytest.raises(ValueError):
    H.decay_for_schedule(1e-3, 0.0, 10)
