"""The auto-LR controllers as pure functions over a NamedTuple state.

Two variants (``AutoLR(controller=...)``):

* ``'paper'``: eqs. 4-9. A softmax over the replicas' losses weights their values; the base
  moves additively toward the better ones and decays geometrically (eq. 8), replacing the
  user's schedule once the controller starts.
* ``'fit'``: a line search. Between syncs the replicas sit on one line through the last
  average, ``theta_r = mean + (rho_r - 1) D``, so their losses sample the loss along the
  window's update at N step scales. A least-squares quadratic in each hyperparameter's offset
  ``u = rho - 1`` (all hyperparameters jointly, statistics carried over syncs with a forgetting
  factor) gives the best scale ``1 + u*``; a multiplicative correction of the user's schedule
  moves, in log space and within a trust region, toward ``1 + u*``. The schedule's shape (warmup,
  decay) is kept.

Nothing here communicates: the caller all-gathers the per-replica window losses and
passes them in, so the same math runs under ``shard_map``, ``pmap``, ``vmap``, in a
numpy-free test, or offline on recorded traces.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hdet_jax import multipliers


class ControllerState(NamedTuple):
  """What the controller carries from one sync to the next (G = explored hyperparameters, N = replicas)."""

  base: jax.Array  # [G] float32: the base value of each hyperparameter for the current window.
  # [G] float32: momentum of the base update (eq. 7); starts at 0, never reset; 'fit': the last fitted slope b.
  velocity: jax.Array
  perm: jax.Array  # [G, N] int32: replica r takes multiplier rho[g, perm[g, r]].
  key: jax.Array  # [2] uint32 raw PRNG key, identical on every replica; split at each draw.
  window_losses: jax.Array  # [N] float32: each replica's mean loss over the last window (eq. 4's L_r).
  weights: jax.Array  # [N] float32: the softmax weights of the last update (eq. 4).
  delta: jax.Array  # [G] float32: the last hypergradient signal (eq. 6); 'fit': the last step of the correction.
  # [G] float32 ('fit'): log-scale (multiplicative) or shift (additive) applied to the schedule; 0 for 'paper'.
  correction: jax.Array
  xtx: jax.Array  # [2G, 2G] float32 ('fit'): the regression's forgotten-over-syncs X^T X.
  xty: jax.Array  # [2G] float32 ('fit'): ... and X^T y.
  gain: jax.Array  # [G] float32 ('fit'): the last fitted step's gain, signed as that step (0: none yet).
  # [G] float32 ('fit'): the last fitted step, before the gain, the rise-only rule and the trust region (``delta`` is
  # the step taken).
  asked: jax.Array
  stderr: jax.Array  # [G] float32 ('fit'): the standard error of the last fitted slope (``velocity``).
  # [] float32 ('fit'): the replicas' mean training loss over the last window (NaN before the first sync): the back-off
  # compares the next window's with it.
  train_loss: jax.Array
  # [] float32 ('fit'): the standard error of ``train_loss``, from its steps' step-to-step changes (NaN before the first
  # sync).
  train_loss_se: jax.Array
  # [] bool ('fit'): whether the last sync's back-off stepped the LRs down (a trainer's rollback returns to the sync
  # before it then); at a sync on or after the run's last step it still returns, but the LRs hold.
  backed_off: jax.Array
  # [G] bool ('fit' with settle): the hyperparameter's climb has ended; its replicas train at the base (no spread) and
  # its correction holds.
  settled: jax.Array


class ControllerUpdate(NamedTuple):
  """The intermediate quantities of one controller update, for logging and tests."""

  weights: jax.Array  # [N]
  delta: jax.Array  # [G]
  velocity: jax.Array  # [G]
  base: jax.Array  # [G], after the floor


def softmax_weights(window_losses: jax.Array, temperature: float) -> jax.Array:
  """Eq. 4: ``w_r = softmax_r((mean(L) - L_r) / sigma)``; lower loss, higher weight.

  Non-finite losses get weight exactly 0 (a replica that blew up says its LR is too
  large, never that it is best); if every loss is non-finite the weights are uniform,
  which makes delta 0.
  """
  finite = jnp.isfinite(window_losses)
  any_finite = jnp.any(finite)
  count = jnp.maximum(jnp.sum(finite), 1)
  mean = jnp.sum(jnp.where(finite, window_losses, 0.0)) / count
  scores = jnp.where(finite, (mean - window_losses) / temperature, -jnp.inf)
  scores = jnp.where(any_finite, scores, 0.0)
  return jax.nn.softmax(scores)


def controller_update(
  base: jax.Array,
  velocity: jax.Array,
  window_losses: jax.Array,
  replica_values: jax.Array,
  *,
  temperature: float,
  lr_of_lr: float,
  momentum: float,
  decay: float,
  floor: jax.Array | float,
) -> ControllerUpdate:
  """One controller update, paper eqs. 4-7, for G hyperparameters at once.

  .. math::

    w &= \\mathrm{softmax}((\\bar L - L) / \\sigma) \\\\
    \\Delta_g &= \\textstyle\\sum_r w_r h_{g,r} - \\frac{1}{N}\\sum_r h_{g,r} \\\\
    v_g &\\leftarrow \\beta v_g + (1 - \\beta) \\Delta_g \\\\
    b_g &\\leftarrow \\max(\\bar h_g (1 - \\gamma) + \\lambda v_g,\\ \\mathrm{floor}_g)

  One weight vector serves all G hyperparameters (as in the paper and the reference);
  each hyperparameter has its own delta, velocity and base.

  Args:
    base: [G] the current base values (only its dtype is used; eq. 7 uses the replicas'
      mean value, which equals the base because the multipliers average to 1).
    velocity: [G] the velocity before the update.
    window_losses: [N] each replica's mean loss over the window.
    replica_values: [N, G] the value of each hyperparameter each replica trained with.
    temperature: sigma > 0.
    lr_of_lr: lambda, the step size of the base update.
    momentum: beta in [0, 1).
    decay: gamma, the per-sync geometric decay of the base (see :func:`decay_for_schedule`).
    floor: [G] or scalar lower bound that keeps the base (hence every replica's value) positive.

  Returns:
    A :class:`ControllerUpdate` with the weights, delta, new velocity and new base.
  """
  dtype = base.dtype
  w = softmax_weights(window_losses.astype(dtype), temperature)
  h = replica_values.astype(dtype)
  mean = jnp.mean(h, axis=0)
  # sum_r w_r h_r - mean_r h_r, written as sum_r (w_r - 1/N) h_r: no cancellation between two
  # nearly equal sums, and exactly 0 when the weights are uniform (no signal).
  delta = jnp.einsum('n,ng->g', w - 1.0 / w.shape[0], h)
  velocity = momentum * velocity + (1.0 - momentum) * delta
  new_base = mean * (1.0 - decay) + lr_of_lr * velocity
  new_base = jnp.maximum(new_base, jnp.asarray(floor, dtype))
  return ControllerUpdate(weights=w, delta=delta, velocity=velocity, base=new_base)


def decay_for_schedule(start_value: float, final_value: float, num_updates: float) -> float:
  """gamma such that ``num_updates`` decays by (1 - gamma) take start_value to final_value.

  .. math:: \\gamma = 1 - (v_\\mathrm{final} / v_\\mathrm{start})^{1/K}

  With no signal (v = 0) the controller then decays the base geometrically from its value
  when the controller starts to the base schedule's final value, which is what OneCycleLR
  would have reached. The paper's eq. 8 (and the reference code) uses
  ``1 - exp(-log(div/final_div) / K)``, which is negative for OneCycleLR's defaults
  (div 25 < final_div 1e4): it grows the LR 400x instead of decaying it. Pass that value
  explicitly (see :func:`reference_decay`) to reproduce the reference.
  """
  if not (start_value > 0 and final_value > 0):
    raise ValueError(f'decay needs positive start and final values, got {start_value!r} and {final_value!r}.')
  if num_updates <= 0:
    raise ValueError(f'num_updates must be positive, got {num_updates!r}.')
  return 1.0 - (final_value / start_value) ** (1.0 / num_updates)


def reference_decay(div_factor: float, final_div_factor: float, num_updates: float) -> float:
  """The reference's (and the paper's printed eq. 8) gamma, sign defect included."""
  return 1.0 - math.exp(-math.log(div_factor / final_div_factor) / num_updates)


def init_controller_state(
  base: jax.Array, num_replicas: int, key: jax.Array, correction: jax.Array | None = None
) -> ControllerState:
  """The state before any sync: identity permutations, zero velocity, uniform weights, and the
  given ('fit') correction of the schedule (default 0: none)."""
  g = base.shape[0]
  return ControllerState(
    base=base.astype(jnp.float32),
    velocity=jnp.zeros((g,), jnp.float32),
    perm=multipliers.identity_permutations(g, num_replicas),
    key=key,
    window_losses=jnp.zeros((num_replicas,), jnp.float32),
    weights=jnp.full((num_replicas,), 1.0 / num_replicas, jnp.float32),
    delta=jnp.zeros((g,), jnp.float32),
    correction=(
      jnp.zeros((g,), jnp.float32) if correction is None else jnp.asarray(correction, jnp.float32).reshape(g)
    ),
    xtx=jnp.zeros((2 * g, 2 * g), jnp.float32),
    xty=jnp.zeros((2 * g,), jnp.float32),
    gain=jnp.zeros((g,), jnp.float32),
    asked=jnp.zeros((g,), jnp.float32),
    stderr=jnp.zeros((g,), jnp.float32),
    train_loss=jnp.full((), jnp.nan, jnp.float32),
    train_loss_se=jnp.full((), jnp.nan, jnp.float32),
    backed_off=jnp.zeros((), bool),
    settled=jnp.zeros((g,), bool),
  )


VARIANTS = ('paper', 'fit')


# The one place a controller is told by its name (AutoLR.controller); the rest of the core asks these.
def is_fit(auto_lr) -> bool:
  """Whether ``auto_lr`` (an :class:`hdet_jax.AutoLR`, or None) runs the line search, ``'fit'``: a learned correction
  of the user's schedule."""
  return getattr(auto_lr, 'controller', None) == 'fit'


def is_paper(auto_lr) -> bool:
  """Whether ``auto_lr`` runs the paper's eqs. 4-9, ``'paper'``: the controller's own base, replacing the schedule."""
  return getattr(auto_lr, 'controller', None) == 'paper'


class FitUpdate(NamedTuple):
  """The intermediate quantities of one ``'fit'`` update, for logging and tests."""

  slope: jax.Array  # [G] b: d loss / d u at u = 0
  curvature: jax.Array  # [G] c: (1/2) d^2 loss / d u^2
  stderr: jax.Array  # [G] the standard error of b (from this sync's residuals)
  step: jax.Array  # [G] the change of the correction (log units, or value units if additive)
  xtx: jax.Array  # [2G, 2G] the updated statistics
  xty: jax.Array  # [2G]


def fit_features(offsets: jax.Array) -> jax.Array:
  """[N, 2G] regressors ``[u - mean u, u^2 - mean u^2]`` of offsets u [N, G] (centred: no intercept)."""
  u = offsets
  return jnp.concatenate([u - jnp.mean(u, 0), u * u - jnp.mean(u * u, 0)], axis=1)


def penalize_nonfinite(scores: jax.Array) -> jax.Array:
  """Non-finite scores become the worst finite score plus the finite range (a replica that blew up
  says its values are too large, never best); all non-finite gives all zeros (no signal)."""
  finite = jnp.isfinite(scores)
  hi = jnp.max(jnp.where(finite, scores, -jnp.inf))
  lo = jnp.min(jnp.where(finite, scores, jnp.inf))
  penalty = hi + jnp.maximum(hi - lo, 1e-3)
  out = jnp.where(finite, scores, penalty)
  return jnp.where(jnp.any(finite), out, jnp.zeros_like(scores))


def fit_update(
  xtx: jax.Array,
  xty: jax.Array,
  scores: jax.Array,
  offsets: jax.Array,
  multiplicative: jax.Array,
  *,
  memory: float,
  trust: jax.Array | float,
) -> FitUpdate:
  """One ``'fit'`` update: a quadratic line search along every hyperparameter at once.

  .. math::

    y_r &= L_r - \\bar L = \\textstyle\\sum_g b_g \\tilde u_{g,r} + c_g \\tilde q_{g,r}
      \\quad(\\tilde u = u - \\bar u,\\ \\tilde q = u^2 - \\overline{u^2}) \\\\
    S &\\leftarrow \\mu S + X^\\top X, \\quad s \\leftarrow \\mu s + X^\\top y, \\quad
      (b, c) = S^{-1} s \\\\
    u^*_g &= -b_g / (2 c_g) \\ \\text{if } c_g > 0 \\\\
    \\text{step}_g &= \\mathrm{clip}(\\log(1 + u^*_g), -\\tau_g, \\tau_g)
      \\ \\text{(multiplicative)}, \\quad \\mathrm{clip}(u^*_g, -\\tau_g, \\tau_g)\\ \\text{(additive)}

  where u is each replica's offset (``value / base - 1``, or ``value - base`` if additive). Where
  the fit has no interior minimum (``c <= 0``, or ``1 + u* <= 0``) the step is the full trust
  region against the slope. Scores that
  agree to within 1e-5 of their magnitude (float32 rounding) give no step.

  Args:
    xtx, xty: the statistics carried from the last sync ([2G, 2G], [2G]).
    scores: [N] each replica's loss (non-finite ones are penalized, see :func:`penalize_nonfinite`).
    offsets: [N, G] each replica's offset u from the base, for every hyperparameter.
    multiplicative: [G] bool: a log-space step, or an additive one.
    memory: mu in [0, 1): the forgetting factor of the statistics (0: this sync alone).
    trust: [G] or scalar tau > 0: the largest step per sync.

  Returns:
    A :class:`FitUpdate`.
  """
  y = penalize_nonfinite(scores.astype(jnp.float32))
  # Scores that agree to float32 rounding carry no signal (e.g. identical models on one batch): the
  # fit's step is scale-free, so rounding noise alone would otherwise take full trust-region steps.
  signal = jnp.max(y) - jnp.min(y) > 1e-5 * (jnp.mean(jnp.abs(y)) + 1e-6)
  y = jnp.where(signal, y - jnp.mean(y), 0.0)
  x = fit_features(offsets.astype(jnp.float32))
  g = offsets.shape[1]
  xtx = memory * xtx + x.T @ x
  xty = memory * xty + x.T @ y
  # A tiny ridge keeps the solve defined before the design has full rank (first syncs, N < 2G + 1).
  ridge = 1e-6 * jnp.trace(xtx) / (2 * g) + 1e-12
  theta = jnp.linalg.solve(xtx + ridge * jnp.eye(2 * g, dtype=xtx.dtype), xty)
  b, c = theta[:g], theta[g:]
  step = _step_to_fitted_best(b, c, multiplicative, trust=jnp.broadcast_to(jnp.asarray(trust, jnp.float32), (g,)))
  step = jnp.where(jnp.isfinite(step) & signal, step, 0.0)
  return FitUpdate(slope=b, curvature=c, stderr=_slope_stderr(x, y, ridge), step=step, xtx=xtx, xty=xty)


def _slope_stderr(x: jax.Array, y: jax.Array, ridge: jax.Array) -> jax.Array:
  """[G] the standard error of each slope b fitted on this sync alone, from its residuals (the signal's
  noise: the accelerated fit grows its gain only on slopes at least twice it)."""
  g = x.shape[1] // 2
  eye = jnp.eye(2 * g, dtype=x.dtype)
  this = jnp.linalg.solve(x.T @ x + ridge * eye, x.T @ y)
  resid = y - x @ this
  dof = jnp.maximum(y.shape[0] - 1 - 2 * g, 1)
  cov = jnp.linalg.inv(x.T @ x + ridge * eye) * (jnp.sum(resid**2) / dof)
  return jnp.sqrt(jnp.maximum(jnp.diag(cov)[:g], 0.0))


def _step_to_fitted_best(b, c, multiplicative, *, trust) -> jax.Array:
  """[G] the step toward the fitted quadratic's minimum (log(1 + u*) or u*) within the trust
  region, or the full trust region against the slope where the fit has no interior minimum."""
  interior = c > 0
  u_star = jnp.where(interior, -b / (2 * jnp.where(interior, c, 1.0)), 0.0)
  scale = 1.0 + u_star
  away = -jnp.sign(b) * trust  # no interior minimum: the full step against the slope
  log_target = jnp.where(interior & (scale > 0), jnp.log(jnp.maximum(scale, 1e-30)), away)
  add_target = jnp.where(interior, u_star, away)
  return jnp.clip(jnp.where(multiplicative, log_target, add_target), -trust, trust)


def accelerate(
  step: jax.Array,
  last_gain: jax.Array,
  *,
  growth: float,
  max_gain: float,
  trust: jax.Array | float,
  confident: jax.Array | bool = True,
) -> tuple[jax.Array, jax.Array]:
  """(the step taken, its signed gain): the fitted step, amplified while the fit keeps asking one way.

  .. math::

    m_k &= \\min(m_{k-1}\\, \\eta,\\ m_\\max) \\ \\text{if}\\ \\mathrm{sign}(s_k) = \\mathrm{sign}(s_{k-1})
      \\text{ and } |b_k| > 2\\,\\mathrm{se}(b_k), \\ \\text{else}\\ 1 \\\\
    \\text{taken}_k &= \\mathrm{clip}(m_k s_k, -\\tau, \\tau)

  Rprop's rule (Riedmiller and Braun, 1993) on the fit's steps s: the fitted step's sign is reliable but
  its size is compressed by short-horizon bias, and consecutive asks keep their sign until the LR is near
  where the line search wants it (results/autolr.md, "Why amplify the line search's steps"). A reversal
  resets the gain to 1, so the acceleration undoes itself as soon as it overshoots. Only a confident step
  grows the gain (the fitted slope b at least twice its standard error): a hyperparameter the losses carry
  no signal about would otherwise random-walk at up to ``max_gain`` times its noise. ``growth = 1`` is the plain fit.

  Args:
    step: [G] this sync's fitted step s_k (from :func:`fit_update`).
    last_gain: [G] the previous gain m_{k-1}, signed as s_{k-1} (0 before any step).
    growth: eta >= 1, the gain's factor per agreeing sync.
    max_gain: m_max >= 1, the largest gain.
    trust: [G] or scalar tau, the largest step per sync.
    confident: [G] bool or scalar: whether this step may grow the gain (e.g. ``|b| > 2 se(b)``); an
      unconfident step is taken at gain 1.

  Returns:
    (the step taken [G], the new signed gain [G]; 0 where the fit asked for nothing).
  """
  agree = (jnp.sign(step) * jnp.sign(last_gain) > 0) & confident
  gain = jnp.where(agree, jnp.minimum(jnp.abs(last_gain) * growth, max_gain), 1.0)
  taken = jnp.clip(gain * step, -trust, trust)
  return taken, jnp.sign(step) * gain
