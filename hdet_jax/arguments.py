"""The checks of the public API's arguments, one per class: counts, flags, spreads, axis names, a mesh's axes,
indices, and the settings under which HDET is only plain training.

Each public function checks its arguments with these before any work (at build time, or where a shape is only
known then, at trace time): a bad one raises a ``ValueError`` of one line that names the function, the argument
and the fix. One checker per class, so that every count, say, refuses zero, negatives, ``True`` and ``2.0`` alike,
and says so in the same words.

Example:
  >>> from hdet_jax import arguments
  >>> arguments.count(4, 'every_k', who='multi_steps')
  4
  >>> arguments.count(0, 'every_k', who='multi_steps', what=' (the micro-batches per optimizer step)')
  Traceback (most recent call last):
  ...
  ValueError: multi_steps: every_k must be a positive integer (the micro-batches per optimizer step), got 0.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np


class PlainTrainingWarning(UserWarning):
  """``hdet()`` was built with settings under which every replica trains alike and nothing is compared: one
  replica, or no spread and no controller. The result is plain data-parallel training (the updates equal the
  wrapped optimizer's); HDET only costs its syncs. Silence it where that is meant (a baseline run) with
  ``warnings.filterwarnings('ignore', category=hdet_jax.arguments.PlainTrainingWarning)``."""


def is_int(x: Any) -> bool:
  """Whether ``x`` is an integer (Python's or numpy's), ``True`` and ``False`` not included."""
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
  """Whether ``x`` is a real Python or numpy number, ``True`` and ``False`` not included."""
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def is_spread(x: Any) -> bool:
  """Whether ``x`` is a multiplicative spread (eq. 1's alpha, or an explored hyperparameter's): a number in
  ``[0, 1)``, so that the lowest multiplier ``1 - x`` stays positive."""
  return is_number(x) and 0.0 <= x < 1.0


def count(value: Any, name: str, *, who: str, minimum: int = 1, what: str = '') -> int:
  """``value`` as an int where it is an integer >= ``minimum``; else one error line naming ``who`` and ``name``
  (``what``: what the count counts, said after the range)."""
  if not is_int(value) or value < minimum:
    kind = 'a positive integer' if minimum == 1 else f'an integer >= {minimum}'
    raise ValueError(f'{who}: {name} must be {kind}{what}, got {value!r}.')
  return int(value)


def flag(value: Any, name: str, *, who: str) -> bool:
  """``value`` as a bool where it is one (numpy's too); else one error line (a string such as ``'no'`` would read
  as True)."""
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f'{who}: {name} must be True or False, got {value!r}.')
  return bool(value)


def axis_name(value: Any, name: str, *, who: str, pair: bool = True) -> None:
  """A mapped axis's name: a non-empty string or, with ``pair``, a tuple of distinct ones (device axis, local
  vmap axis); else one error line."""
  names = (value,) if isinstance(value, str) else value if pair else None
  ok = isinstance(names, tuple) and names and len(set(names)) == len(names)
  if not (ok and all(isinstance(a, str) and a for a in names)):
    kind = 'a mesh/map axis name, or a tuple of distinct ones (device axis, local vmap axis)' if pair else None
    raise ValueError(f'{who}: {name} must be {kind or "a mesh axis name (a non-empty string)"}, got {value!r}.')


def mesh_axis(mesh: Any, value: Any, name: str, *, who: str) -> None:
  """An axis of ``mesh`` (``name``: the argument that names it); else one error line listing the mesh's axes."""
  if value not in mesh.shape:
    axes = tuple(mesh.axis_names)
    raise ValueError(f'{who}: the mesh has no axis {value!r} (axes: {axes}); pass {name}= one of them.')


def index(value: Any, name: str, size: int, *, who: str, of: str) -> None:
  """An index into an axis of ``size`` (``of``: what it counts): an integer in ``[-size, size)``, or a traced
  integer scalar (not checkable before it runs; jax clamps it). A Python index past the end would be clamped to
  the last entry without a word, so it raises."""
  if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer) and value.ndim == 0:
    value = value.item() if np.issubdtype(value.dtype, np.integer) else value
  if isinstance(value, jax.core.Tracer) and value.ndim == 0 and np.issubdtype(value.dtype, np.integer):
    return
  if not is_int(value) or not -size <= value < size:
    raise ValueError(f'{who}: {name} must be an integer in [0, {size}) (the {of}), got {value!r}.')


def warn_plain_training(who: str, why: str, *, stacklevel: int = 3) -> None:
  """One :class:`PlainTrainingWarning` for a build whose settings make HDET plain training (``why``: which)."""
  warnings.warn(
    f'{who}: {why}, so every replica trains alike and nothing is compared: this is plain data-parallel training. '
    'Set num_replicas > 1 and spread > 0 (or explore=, or auto_lr=) for HDET, or silence '
    'hdet_jax.arguments.PlainTrainingWarning for a baseline.',
    PlainTrainingWarning,
    stacklevel=stacklevel,
  )
