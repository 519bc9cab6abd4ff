"""Base schedules. Any optax schedule works as HDET's base; this adds torch's OneCycleLR."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import optax

from hdet_jax import arguments


def one_cycle(
  max_lr: float,
  total_steps: int,
  pct_start: float = 0.3,
  anneal_strategy: str = 'cos',
  div_factor: float = 25.0,
  final_div_factor: float = 1e4,
  three_phase: bool = False,
) -> optax.Schedule:
  """torch's ``OneCycleLR`` as an optax schedule, with torch's argument names.

  The value at step t equals torch's learning rate after ``t`` calls of
  ``scheduler.step()`` (t = 0 is the value set by the constructor):

  .. math::

    \\eta_0 = \\eta_{max} / d, \\quad \\eta_{min} = \\eta_0 / f, \\quad
    \\eta(t) = \\mathrm{anneal}(\\eta_0 \\to \\eta_{max}) \\text{ until } p S - 1,
    \\text{ then } \\mathrm{anneal}(\\eta_{max} \\to \\eta_{min}) \\text{ until } S - 1.

  Past ``total_steps - 1`` it stays at the final value (torch raises instead).
  ``optax.cosine_onecycle_schedule`` is close but one step off from torch.

  Args:
    max_lr: the peak learning rate.
    total_steps: S, the number of steps in the cycle.
    pct_start: fraction of the cycle spent increasing the learning rate.
    anneal_strategy: 'cos' or 'linear'.
    div_factor: d; the initial value is max_lr / d.
    final_div_factor: f; the final value is max_lr / (d * f).
    three_phase: torch's three-phase variant (up, back down to the initial value, then to the minimum).

  Returns:
    A schedule ``step -> learning rate`` (float32).

  Example:
    >>> import hdet_jax
    >>> sched = hdet_jax.one_cycle(max_lr=1e-3, total_steps=2000)
    >>> [f'{float(sched(t)):.3g}' for t in (0, 599, 1999)]  # max_lr / d, max_lr at p S - 1, max_lr / (d f)
    ['4e-05', '0.001', '4e-09']
  """
  _check_one_cycle(max_lr, total_steps, pct_start, anneal_strategy, div_factor, final_div_factor)
  three_phase = arguments.flag(three_phase, 'three_phase', who='one_cycle')
  starts, ends, values = _phases(max_lr, total_steps, pct_start, div_factor, final_div_factor, three_phase)

  def schedule(count: chex.Numeric) -> chex.Array:
    t = jnp.asarray(count, jnp.float32)
    # The phase index: the first phase whose end is >= t (the last one past the end).
    phase = jnp.minimum(jnp.sum(t > jnp.asarray(ends[:-1], jnp.float32)), len(ends) - 1)
    s0 = jnp.asarray(starts, jnp.float32)[phase]
    s1 = jnp.asarray(ends, jnp.float32)[phase]
    v0 = jnp.asarray(values[:-1], jnp.float32)[phase]
    v1 = jnp.asarray(values[1:], jnp.float32)[phase]
    # Written in the fraction of the phase still to go, q = 1 - pct, and with
    # (cos(pi pct) + 1) / 2 = sin(pi q / 2)**2: float32 then keeps full relative precision
    # near the end of the cycle, where the LR falls to max_lr / 2.5e5.
    q = jnp.clip((s1 - t) / (s1 - s0), 0.0, 1.0)
    if anneal_strategy == 'cos':
      return v1 + (v0 - v1) * jnp.sin(jnp.pi / 2 * q) ** 2
    return v1 + (v0 - v1) * q

  return schedule


def _check_one_cycle(max_lr, total_steps, pct_start, anneal_strategy, div_factor, final_div_factor) -> None:
  if not max_lr > 0:
    raise ValueError(f'max_lr must be > 0, got {max_lr!r}.')
  if not arguments.is_int(total_steps) or total_steps < 2:
    raise ValueError(f'total_steps must be an integer >= 2, got {total_steps!r}.')
  if not 0.0 < pct_start < 1.0:
    raise ValueError(f'pct_start must be in (0, 1), got {pct_start!r}.')
  if anneal_strategy not in ('cos', 'linear'):
    raise ValueError(f"anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}.")
  if not div_factor > 0 or not final_div_factor > 0:
    raise ValueError(f'div_factor and final_div_factor must be > 0, got {div_factor!r}, {final_div_factor!r}.')


def _phases(max_lr, total_steps, pct_start, div_factor, final_div_factor, three_phase):
  """(starts [P], ends [P], values [P + 1]): phase p anneals values[p] -> values[p + 1] over starts[p]..ends[p]."""
  initial = max_lr / div_factor
  minimum = initial / final_div_factor
  up_end = float(pct_start * total_steps) - 1
  if three_phase:
    ends = [up_end, float(2 * pct_start * total_steps) - 2, total_steps - 1]
    values = [initial, max_lr, initial, minimum]
  else:
    ends = [up_end, total_steps - 1]
    values = [initial, max_lr, minimum]
  if not all(b > a for a, b in zip([0.0] + ends[:-1], ends)):
    raise ValueError(
      f'pct_start={pct_start!r} with total_steps={total_steps!r} leaves an empty phase; '
      'increase total_steps or move pct_start away from 0 and 1.'
    )
  return np.array([0.0] + ends[:-1]), np.array(ends), values
