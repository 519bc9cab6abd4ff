"""Base schedules. Any optax schedule works as HDET's base; this adds torch's OneCycleLR, and reads schedules at
build time: their values at given steps in one compiled call, and where one anneals (:func:`anneal_start`)."""

from __future__ import annotations

import chex
import jax
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


def anneal_start(schedule, total_steps: int, fraction: float) -> int | None:
  """The first step after a schedule's peak at which it is below ``fraction`` of that peak, or None (no such step
  before ``total_steps``: a constant or rising schedule, a number, or ``fraction`` 0).

  .. math:: t_a = \\min\\{t > t_p : s(t) < f\\, s(t_p)\\}, \\quad t_p = \\operatorname{argmax}_{0 \\le t < S} s(t)

  From the first sync at or after ``t_a`` on, the 'fit' controller's learning-rate factor no longer rises (falls are
  still taken): the anneal from ``f`` of the peak down keeps the schedule's shape, ``lr_t / s(t)`` non-increasing.
  The schedule is evaluated at every step, in one compiled call.

  Args:
    schedule: an optax schedule (a function of the step) or a number.
    total_steps: S, the steps evaluated (0 to S - 1).
    fraction: f in [0, 1).

  Example:
    >>> import optax
    >>> from hdet_jax import schedules
    >>> cosine = optax.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=10, decay_steps=111)
    >>> schedules.anneal_start(cosine, 111, 0.5)  # past the cosine's midpoint (60.5): its peak is at step 10
    61
    >>> schedules.anneal_start(optax.constant_schedule(1.0), 110, 0.5) is None  # nothing decays
    True
  """
  if not callable(schedule) or fraction <= 0:
    return None
  values = _schedule_path(schedule, int(total_steps))
  peak = int(np.argmax(values))
  below = np.nonzero(values[peak + 1 :] < fraction * values[peak])[0]
  return peak + 1 + int(below[0]) if below.size else None


def _schedule_path(schedule, total_steps: int) -> np.ndarray:
  """[S] float32: the schedule at steps 0 .. S - 1, vectorized in one compiled call where it maps over steps
  (optax's schedules do), else step by step (:func:`evaluate_schedules`)."""
  try:
    path = lambda: jax.vmap(lambda t: jnp.asarray(schedule(t), jnp.float32))(jnp.arange(total_steps))
    consts = jax.make_jaxpr(path)().consts
  except _TRACED_ERRORS:  # a schedule with Python control flow on the step: one step at a time
    return np.asarray(evaluate_schedules([schedule], list(range(total_steps)))[0], np.float32)
  if any(isinstance(c, jax.core.Tracer) for c in consts):
    evaluate_schedules([schedule], [0])  # (its one error line)
  return np.asarray(jax.jit(path).lower().compile()(), np.float32)


# What jax raises where a value needed at build time is traced (hdet() built from arrays computed under jit).
_TRACED_ERRORS = (
  jax.errors.ConcretizationTypeError,
  jax.errors.TracerArrayConversionError,
  jax.errors.TracerBoolConversionError,
  jax.errors.TracerIntegerConversionError,
)


def evaluate_schedules(schedules, steps) -> list[list[float]]:
  """Values of several schedules (floats or callables) at several steps, in one compiled call.

  Evaluating an optax schedule eagerly compiles each of its ops as a separate program, each one's
  host memory kept in JAX's caches; one jit of all of them compiles a single program.
  """
  fns = [s for s in schedules if callable(s)]
  table = lambda: jnp.stack([jnp.stack([jnp.asarray(f(t), jnp.float32) for t in steps]) for f in fns])
  # A compiled executable runs at once even when hdet() is built under jit, eval_shape or vmap (a
  # trainer's jitted init), where calling the jitted function would stage it into the enclosing trace;
  # the values are the same bits either way.
  if fns and any(isinstance(c, jax.core.Tracer) for c in jax.make_jaxpr(table)().consts):
    raise ValueError(
      'hdet: a schedule depends on a traced value, so it cannot be evaluated when hdet() is built; '
      'pass Python numbers (or a schedule of them), not arrays computed under jit, or build hdet() '
      'outside the traced function.'
    )
  got = iter(np.asarray(jax.jit(table).lower().compile()()).tolist() if fns else [])
  return [next(got) if callable(s) else [_as_float(s)] * len(steps) for s in schedules]


def _as_float(value) -> float:
  """A scalar setting as a Python float: one error line where it is a traced value."""
  try:
    return float(value)
  except _TRACED_ERRORS:
    raise ValueError(
      f'hdet: got a traced value ({jax.typeof(value)}) where a number is needed at build time; '
      'pass a Python number, or build hdet() outside the traced function.'
    ) from None
