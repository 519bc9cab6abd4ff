"""The auto-LR controller (paper eqs. 4-9) as pure functions over a NamedTuple state.

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
  base: jax.Array        # [G] float32: the base value of each hyperparameter for the current window.
  velocity: jax.Array    # [G] float32: momentum of the base update (eq. 7); starts at 0, never reset.
  perm: jax.Array        # [G, N] int32: replica r takes multiplier rho[g, perm[g, r]].
  key: jax.Array         # [2] uint32 raw PRNG key, identical on every replica; split at each draw.
  window_losses: jax.Array  # [N] float32: each replica's mean loss over the last window (eq. 4's L_r).
  weights: jax.Array     # [N] float32: the softmax weights of the last update (eq. 4).
  delta: jax.Array       # [G] float32: the last hypergradient signal (eq. 6).


class ControllerUpdate(NamedTuple):
  """The intermediate quantities of one controller update, for logging and tests."""
  weights: jax.Array     # [N]
  delta: jax.Array       # [G]
  velocity: jax.Array    # [G]
  base: jax.Array        # [G], after the floor


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
    raise ValueError(
        f'decay needs positive start and final values, got {start_value!r} and {final_value!r}.')
  if num_updates <= 0:
    raise ValueError(f'num_updates must be positive, got {num_updates!r}.')
  return 1.0 - (final_value / start_value) ** (1.0 / num_updates)


def reference_decay(div_factor: float, final_div_factor: float, num_updates: float) -> float:
  """The reference's (and the paper's printed eq. 8) gamma, sign defect included."""
  return 1.0 - math.exp(-math.log(div_factor / final_div_factor) / num_updates)


def init_controller_state(base: jax.Array, num_replicas: int, key: jax.Array) -> ControllerState:
  """The state before any sync: identity permutations, zero velocity, uniform weights."""
  g = base.shape[0]
  return ControllerState(
      base=base.astype(jnp.float32),
      velocity=jnp.zeros((g,), jnp.float32),
      perm=multipliers.identity_permutations(g, num_replicas),
      key=key,
      window_losses=jnp.zeros((num_replicas,), jnp.float32),
      weights=jnp.full((num_replicas,), 1.0 / num_replicas, jnp.float32),
      delta=jnp.zeros((g,), jnp.float32),
  )
