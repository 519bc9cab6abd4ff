"""The auto-LR controller (eqs. 4-9) against a numpy oracle and the reference's recorded traces."""

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import hdet_jax as H
from hdet_jax import controller as ctrl
from oracles import numpy_accelerate, numpy_controller, numpy_fit

DATA = pathlib.Path(__file__).parent / 'data' / 'onecycleautolr_traces.npz'


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
      jnp.zeros(g, jnp.float32),
      jnp.asarray(v0, jnp.float32),
      jnp.asarray(losses, jnp.float32),
      jnp.asarray(lrs, jnp.float32),
      temperature=sigma,
      lr_of_lr=lam,
      momentum=beta,
      decay=gamma,
      floor=floor,
    )
    w, delta, v, base = numpy_controller(v0, losses.astype(np.float32), lrs, sigma, lam, beta, gamma, floor)
    np.testing.assert_allclose(out.weights, w, rtol=2e-4, atol=1e-7)
    np.testing.assert_allclose(out.delta, delta, rtol=2e-3, atol=1e-10)
    np.testing.assert_allclose(out.velocity, v, rtol=2e-3, atol=1e-10)
    np.testing.assert_allclose(out.base, base, rtol=1e-5)


def test_weights_closed_form_two_replicas():
  # N = 2: w_0 = 1 / (1 + exp((L_0 - L_1) / sigma)).
  out = ctrl.controller_update(
    jnp.zeros(1),
    jnp.zeros(1),
    jnp.array([1.0, 1.02]),
    jnp.array([[1.0], [2.0]]),
    temperature=0.01,
    lr_of_lr=1.0,
    momentum=0.0,
    decay=0.0,
    floor=0.0,
  )
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
  gamma = H.controller.reference_decay(25.0, 1e4, k_syncs)
  assert gamma == pytest.approx(-0.0688, abs=1e-4)  # the sign defect, reproduced on purpose
  rho = H.multipliers.spread_multipliers(n, meta['alpha'])
  steps = d[f'{run}/gathered_steps']
  sync_steps = list(d[f'{run}/sync_steps'])
  velocity = d[f'{run}/velocity']
  perms = d[f'{run}/perms_rank'][0]  # identical on all ranks
  np.testing.assert_array_equal(d[f'{run}/perms_rank'], np.broadcast_to(perms, d[f'{run}/perms_rank'].shape))
  lr_after = d[f'{run}/lr_after']
  g = lr_after.shape[-1]
  checked = 0
  for k, step in enumerate(steps):
    j = sync_steps.index(step)
    v_before = jnp.asarray(velocity[j - 1] if j > 0 else np.zeros(g), jnp.float32)
    out = ctrl.controller_update(
      jnp.zeros(g, jnp.float32),
      v_before,
      jnp.asarray(d[f'{run}/gathered_loss'][k], jnp.float32),
      jnp.asarray(d[f'{run}/gathered_lr'][k], jnp.float32),
      temperature=meta['loss_scale'],
      lr_of_lr=meta['lr_of_lr'],
      momentum=meta['mom'],
      decay=gamma,
      floor=-jnp.inf,
    )  # the reference has no floor
    # Velocity: 5 significant digits relative to its scale in this run.
    scale = np.max(np.abs(velocity)) + 1e-30
    np.testing.assert_allclose(np.asarray(out.velocity) / scale, velocity[j] / scale, atol=1e-5)
    # The LRs the reference assigned: base * rho[perm[r]] per group.
    for gi in range(g):
      perm = perms[k * g + gi]
      ours = np.asarray(out.base[gi]) * rho[perm]
      np.testing.assert_allclose(
        ours, lr_after[:, step, gi], rtol=1e-5, atol=1e-5 * np.max(np.abs(lr_after[:, step, gi]))
      )
    checked += 1
  assert checked == len(steps) >= 80


def test_direction():
  """A loss that favours larger LRs raises the base; one that favours smaller LRs lowers it."""
  rho = H.multipliers.spread_multipliers(8, 0.25)
  for sign in (+1, -1):
    base, v = jnp.array([1e-3]), jnp.zeros(1)
    for _ in range(20):
      lrs = base[0] * rho
      losses = 2.0 - sign * 100.0 * (lrs - lrs.mean())  # higher LR -> lower loss when sign = +1
      out = ctrl.controller_update(
        base,
        v,
        jnp.asarray(losses, jnp.float32),
        jnp.asarray(lrs[:, None]),
        temperature=0.01,
        lr_of_lr=0.5,
        momentum=0.9,
        decay=0.0,
        floor=1e-6,
      )
      base, v = out.base, out.velocity
      assert np.sign(float(out.delta[0])) == sign
    assert (float(base[0]) - 1e-3) * sign > 0


def test_decay_for_schedule_and_reference_sign():
  g = H.controller.decay_for_schedule(1e-3, 1e-3 / 400, 90)
  assert g > 0 and (1 - g) ** 90 == pytest.approx(1 / 400, rel=1e-12)
  assert H.controller.reference_decay(25.0, 1e4, 90) < 0  # it grows the LR 400x: the reference's defect 3
  with pytest.raises(ValueError):
    H.controller.decay_for_schedule(1e-3, 0.0, 10)


@pytest.mark.parametrize('num_updates', [0, -1, 0.0])
def test_decay_for_schedule_needs_updates(num_updates):
  with pytest.raises(ValueError, match=rf'num_updates must be positive, got {num_updates!r}'):
    H.controller.decay_for_schedule(1.0, 0.25, num_updates)
  # Syncs are counted continuously, so a fraction of one update is valid: (1 - g)^0.5 = 0.25, g = 1 - 0.25^2.
  assert H.controller.decay_for_schedule(1.0, 0.25, 0.5) == pytest.approx(1 - 0.0625, rel=1e-15)
  assert H.controller.decay_for_schedule(1.0, 0.25, 1) == pytest.approx(0.75, rel=1e-15)


# ---- The 'fit' controller (a quadratic line search along the replicas' line). ----


def test_fit_update_against_numpy_oracle():
  rng = np.random.default_rng(1)
  checked_interior = 0
  for trial in range(40):
    n, g = 8, int(rng.integers(1, 3))
    offsets = np.stack([rng.permutation(H.multipliers.spread_multipliers(n, 0.25) - 1.0) for _ in range(g)], 1)
    # Losses from a random quadratic per hyperparameter plus noise, so the fit has a real answer.
    b_true, c_true = rng.normal(0, 0.2, g), rng.uniform(-0.5, 2.0, g)
    scores = 3.0 + offsets @ b_true + (offsets**2) @ c_true + rng.normal(0, 1e-3, n)
    xtx0 = np.eye(2 * g) * rng.uniform(0, 0.01)
    xty0 = rng.normal(0, 1e-3, 2 * g)
    mult = rng.random(g) < 0.7
    trust = rng.uniform(0.05, 0.5, g)
    memory = rng.uniform(0, 0.9)
    out = ctrl.fit_update(
      jnp.asarray(xtx0, jnp.float32),
      jnp.asarray(xty0, jnp.float32),
      jnp.asarray(scores, jnp.float32),
      jnp.asarray(offsets, jnp.float32),
      jnp.asarray(mult),
      memory=memory,
      trust=jnp.asarray(trust, jnp.float32),
    )
    b, c, step, xtx, xty = numpy_fit(xtx0, xty0, scores, offsets, mult, memory, trust)
    np.testing.assert_allclose(out.xtx, xtx, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(out.slope, b, rtol=2e-2, atol=2e-3)
    np.testing.assert_allclose(out.curvature, c, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(out.step, step, rtol=2e-2, atol=5e-3)
    checked_interior += int(np.sum((c > 0) & (np.abs(step) < trust - 1e-3)))
  assert checked_interior >= 5  # the interior-minimum branch was compared, not only the clipped one


def test_fit_closed_form_quadratic():
  """Exact quadratic losses along one LR: slope and curvature are recovered, and the step aims at the
  minimum's scale: L = (rho - 0.8)^2 has its minimum at rho = 0.8, a log-step of log(0.8)."""
  rho = H.multipliers.spread_multipliers(8, 0.25)
  u = rho - 1.0
  scores = (rho - 0.8) ** 2
  out = ctrl.fit_update(
    jnp.zeros((2, 2)),
    jnp.zeros(2),
    jnp.asarray(scores, jnp.float32),
    jnp.asarray(u[:, None], jnp.float32),
    jnp.array([True]),
    memory=0.0,
    trust=1.0,
  )
  np.testing.assert_allclose(out.slope, [2 * 0.2], rtol=1e-3)  # d/du (u + 0.2)^2 at u = 0
  np.testing.assert_allclose(out.curvature, [1.0], rtol=1e-3)
  np.testing.assert_allclose(out.step, [np.log(0.8)], rtol=1e-3)
  # No interior minimum (losses falling linearly with rho): the full trust step up.
  out = ctrl.fit_update(
    jnp.zeros((2, 2)),
    jnp.zeros(2),
    jnp.asarray(-rho, jnp.float32),
    jnp.asarray(u[:, None], jnp.float32),
    jnp.array([True]),
    memory=0.0,
    trust=0.2,
  )
  np.testing.assert_allclose(out.step, [0.2], rtol=1e-6)


def test_fit_nonfinite_replica_counts_as_worst():
  rho = H.multipliers.spread_multipliers(8, 0.25)
  scores = np.full(8, 2.0)
  scores[-1] = np.nan  # the largest multiplier blew up: the step must go down
  out = ctrl.fit_update(
    jnp.zeros((2, 2)),
    jnp.zeros(2),
    jnp.asarray(scores, jnp.float32),
    jnp.asarray((rho - 1)[:, None], jnp.float32),
    jnp.array([True]),
    memory=0.0,
    trust=0.2,
  )
  assert float(out.step[0]) < 0 and np.isfinite(out.step).all()
  np.testing.assert_allclose(ctrl.penalize_nonfinite(jnp.array([1.0, jnp.nan, 3.0])), [1.0, 5.0, 3.0])
  np.testing.assert_allclose(ctrl.penalize_nonfinite(jnp.array([jnp.nan, jnp.inf])), [0.0, 0.0])


@pytest.mark.parametrize('growth,max_gain', [(2.0, 4.0), (1.5, 10.0), (1.0, 4.0)])
def test_accelerate_against_numpy_oracle(growth, max_gain):
  """The gain grows while the fitted steps keep one sign, is capped, resets on a reversal and after a
  zero step, and every taken step stays within the trust region; growth 1 takes the fitted steps."""
  steps = np.array([0.1, 0.2, 0.05, 0.3, 0.4, -0.1, -0.2, 0.0, -0.05, -0.05, 0.6, -0.01])
  trust = 0.5
  want = numpy_accelerate(steps, growth, max_gain, trust)
  gain, got = jnp.zeros(1, jnp.float32), []
  for s in steps:
    taken, gain = ctrl.accelerate(jnp.asarray([s], jnp.float32), gain, growth=growth, max_gain=max_gain, trust=trust)
    got.append(float(taken[0]))
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  # An unconfident step is taken at gain 1 and the next agreeing one starts growing again.
  sure = [True, True, False, True, True, True, True, True, True, True, True, True]
  gain, unsure = jnp.zeros(1, jnp.float32), []
  for s, ok in zip(steps, sure):
    taken, gain = ctrl.accelerate(
      jnp.asarray([s], jnp.float32), gain, growth=growth, max_gain=max_gain, trust=trust, confident=jnp.asarray([ok])
    )
    unsure.append(float(taken[0]))
  np.testing.assert_allclose(unsure, numpy_accelerate(steps, growth, max_gain, trust, sure), rtol=1e-6, atol=1e-7)
  assert unsure[2] == pytest.approx(0.05)
  if growth == 1.0:
    np.testing.assert_allclose(got, np.clip(steps, -trust, trust), rtol=1e-6)
  else:  # hand-checked: 0.1, then 0.2 x growth, 0.05 x growth^2 (capped), ...
    assert got[0] == pytest.approx(0.1) and got[1] == pytest.approx(0.2 * growth)
    assert got[5] == pytest.approx(-0.1)  # the reversal resets the gain
    assert max(abs(g) for g in got) <= trust + 1e-7


def test_accelerate_gain_stops_at_max_gain():
  """Small agreeing confident steps (no clipping): the gain runs 1, 2, 4 and stays at max_gain = 4 (closed
  form: taken = min(2^k, 4) x 0.01); with max_gain = 3 it stops at 3."""
  for max_gain, want in ((4.0, [0.01, 0.02, 0.04, 0.04, 0.04, 0.04]), (3.0, [0.01, 0.02, 0.03, 0.03, 0.03, 0.03])):
    gain, got = jnp.zeros(1, jnp.float32), []
    for _ in range(6):
      taken, gain = ctrl.accelerate(jnp.asarray([0.01], jnp.float32), gain, growth=2.0, max_gain=max_gain, trust=1.0)
      got.append(float(taken[0]))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert float(gain[0]) == max_gain
