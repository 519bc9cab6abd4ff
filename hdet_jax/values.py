"""The hyperparameter values of a step: the base (schedule or controller), and each replica's under the spread.

.. math::

  v_{g,r} = \\mathrm{clip}(b_g \\rho_{g,\\pi_g(r)} + o_{g,\\pi_g(r)}, \\mathrm{low}_g, \\mathrm{high}_g)

with ``rho`` the eq. 1 multipliers (1 for additive hyperparameters), ``o`` the additive offsets (0 for
multiplicative ones) and ``pi_g`` hyperparameter g's permutation of the window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hdet_jax import controller as ctrl
from hdet_jax import windows
from hdet_jax.settings import Plan


def replica_values(plan: Plan, base: jax.Array, perm: jax.Array, settled: jax.Array | None = None) -> jax.Array:
  """[G, N]: every replica's value for base [G] under permutations perm [G, N]; a settled hyperparameter
  ([G] bool, see ``AutoLR.settle``) takes the base on every replica."""
  v = base[:, None] * jnp.take_along_axis(jnp.asarray(plan.scale), perm, axis=1) + jnp.take_along_axis(
    jnp.asarray(plan.offset), perm, axis=1
  )
  if settled is not None:
    v = jnp.where(settled[:, None], base[:, None], v)
  return jnp.clip(v, np.asarray(plan.lows, np.float32)[:, None], np.asarray(plan.highs, np.float32)[:, None])


def base_values(plan: Plan, t: jax.Array, controller: ctrl.ControllerState) -> jax.Array:
  """[G] base values for step t: the schedule, or the controller's base once it has started."""
  scheduled = jnp.stack([jnp.asarray(s(t) if callable(s) else s, jnp.float32) for s in plan.schedules])
  if plan.auto_lr is None:
    return scheduled
  if ctrl.is_fit(plan.auto_lr):  # the user's schedule under the controller's correction
    add = jnp.asarray(plan.additive)
    corrected = jnp.where(add, scheduled + controller.correction, scheduled * jnp.exp(controller.correction))
    return jnp.clip(corrected, jnp.asarray(plan.lows, jnp.float32), jnp.asarray(plan.highs, jnp.float32))
  if plan.auto_lr.smooth_decay:
    # From base_k / (1 - gamma) at the sync (the previous base, with no signal) to base_k at
    # the next sync, so the no-signal path is one continuous geometric curve.
    start, length = windows.window_of(plan.sync_windows, t)
    into_window = (t - start).astype(jnp.float32) / length
    controlled = controller.base * jnp.asarray(1.0 - np.asarray(plan.decay), jnp.float32) ** (into_window - 1.0)
  else:
    controlled = controller.base
  return jnp.where(t >= plan.controller_start, controlled, scheduled)
