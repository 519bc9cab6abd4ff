"""When the sync windows end: a fixed T, or a schedule of window lengths whose last one repeats.

``sync_every=100`` averages after steps 100, 200, ...; ``sync_every=(25, 25, 25, 25, 100)`` averages after
steps 25, 50, 75, 100, then every 100 (200, 300, ...). Short early windows let a controller compare the
replicas more often while the learning rate may still be far off, at one average per window.

Steps are 0-based: step t belongs to the window ``[start, start + length)``, and the sync after it happens
when ``t + 1 == start + length`` (``count``, the steps done, equals the window's end). Every function here
takes Python/numpy integers (the trainer's host loop) or JAX arrays (inside ``jit``).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hdet_jax import arguments

# The default windows: NUM_SYNCS syncs a run, each window at most LONGEST_WINDOW steps (the trainer's
# hdet.num_syncs and hdet.longest_window), so a short run gets as many controller decisions as a long one
# (why 15 and 100: research/workloads_discussion.md, "What changed: windows counted per run").
NUM_SYNCS = 15
LONGEST_WINDOW = 100


def default_period(total_steps: int, num_syncs: int = NUM_SYNCS, longest_window: int = LONGEST_WINDOW) -> int:
  """T for a run of ``total_steps`` steps: ``round(total_steps / num_syncs)``, at least 1, at most
  ``longest_window`` (0: no cap). ``default_period(1500)`` is 100, ``default_period(300)`` is 20."""
  period = max(1, int(round(total_steps / num_syncs)))
  return min(period, int(longest_window)) if longest_window > 0 else period


def as_windows(sync_every: int | Sequence[int]) -> tuple[int, ...]:
  """``sync_every`` as a tuple of window lengths (the last one repeats), validated."""
  lengths = (sync_every,) if arguments.is_int(sync_every) else tuple(sync_every) if _is_seq(sync_every) else ()
  if not lengths or not all(arguments.is_int(w) and w >= 1 for w in lengths):
    raise ValueError(
      f'sync_every (T) must be an integer >= 1, or a sequence of them (window lengths in order, the last '
      f'repeating, e.g. (25, 25, 100)); got {sync_every!r}.'
    )
  return tuple(int(w) for w in lengths)


def _layout(windows: tuple[int, ...]) -> tuple[np.ndarray, int, int]:
  """([K] the listed windows' starts, the last one repeating; ``tail``, where the repeats begin; their length)."""
  starts = np.cumsum((0,) + windows[:-1])
  return starts, int(starts[-1]), windows[-1]


def window_of(windows: tuple[int, ...], t: Any) -> tuple[Any, Any]:
  """(start, length) of the window holding step ``t`` (0-based; scalars or arrays)."""
  xp, int_type = (jnp, jnp.int32) if isinstance(t, jax.Array) else (np, np.int64)
  t = xp.asarray(t)
  listed_starts, tail, period = _layout(windows)
  starts, lengths = xp.asarray(listed_starts, int_type), xp.asarray(windows, int_type)
  i = (t[..., None] >= starts[1:]).sum(-1)  # which of the listed windows (the last: any repeat)
  start = xp.where(t >= tail, tail + (t - tail) // period * period, starts[i])
  return start, lengths[i]


def ends_window(windows: tuple[int, ...], count: Any) -> Any:
  """Whether a sync follows the step that made ``count`` steps done (count >= 1)."""
  start, length = window_of(windows, count - 1)
  return count == start + length


def window_length(windows: tuple[int, ...], count: Any) -> Any:
  """The length of the window that the step making ``count`` steps done belongs to."""
  return window_of(windows, count - 1)[1]


def syncs_through(windows: tuple[int, ...], count: int) -> int:
  """How many syncs have happened once ``count`` steps are done (host side)."""
  starts, tail, period = _layout(windows)
  return int((starts[1:] <= count).sum()) + max(count - tail, 0) // period  # listed windows ended, then repeats


def first_sync_at_or_after(windows: tuple[int, ...], count: int) -> int:
  """The first sync's ``count`` (steps done) that is >= ``count`` and >= 1 (host side)."""
  start, length = window_of(windows, max(int(count), 1) - 1)
  return int(start + length)


def syncs_between(windows: tuple[int, ...], first: int, last: int) -> float:
  """Syncs from step ``first`` to step ``last`` counted continuously: each step adds 1 / its window's length
  (for a fixed T, ``(last - first) / T``)."""
  if last <= first:
    return 0.0
  _, lengths = window_of(windows, np.arange(first, last))
  length, steps = np.unique(lengths, return_counts=True)  # exact for a fixed T: (last - first) / T
  return float(sum(int(c) / int(w) for w, c in zip(length, steps)))


def _is_seq(x: Any) -> bool:
  return isinstance(x, (tuple, list)) or (isinstance(x, np.ndarray) and x.ndim == 1)


def is_sync_step(sync_every: int | Sequence[int], step: Any) -> Any:
  """Whether the update of (0-based) step ``step`` averages the replicas, for ``hdet``'s ``sync_every``.

  For a training loop that compiles the sync step apart (``tx.update(..., sync=True)``).

  Example:
    >>> import hdet_jax
    >>> [t for t in range(300) if hdet_jax.is_sync_step((25, 25, 100), t)]
    [24, 49, 149, 249]
  """
  if not isinstance(step, jax.Array) and not (arguments.is_int(step) and step >= 0):
    raise ValueError(f'is_sync_step: step must be an integer >= 0 (the 0-based step) or an int array, got {step!r}.')
  ends = ends_window(as_windows(sync_every), step + 1)
  return ends if isinstance(ends, jax.Array) else bool(ends)
