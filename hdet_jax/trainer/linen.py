"""flax linen models under a mesh: :func:`dense_general_ok`, for ``nn.DenseGeneral`` kernels of 3 or more dimensions
annotated with ``nn.with_partitioning`` (or ``nn.with_logical_partitioning``).

``nn.DenseGeneral`` initializes its kernel flattened to 2-D, calls ``unbox()`` on the box the annotated initializer
returns, then reshapes (flax issue 3676). While a mesh is set (``jax.set_mesh``, or inside ``jax.shard_map``, as
under :func:`hdet_jax.over_replicas`) ``unbox()`` constrains the value to the box's partition spec, and a spec of 3
names does not fit a 2-D value: ``ValueError: ... spec=P('data', None, None) is only valid for values of rank at
least 3, but was applied to a value of rank 2``. flax runs that initializer on every ``apply`` too (its parameter
shape check, under ``jax.eval_shape``), so the step fails even with the parameters given. Outside a mesh (a plain
``jax.jit`` with shardings) flax applies no constraints and the model runs.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable

import jax.numpy as jnp
from flax.core import meta
from flax.linen import spmd

_BOXES = (meta.Partitioned, spmd.LogicallyPartitioned)
_LOCK = threading.RLock()


@contextlib.contextmanager
def _flat_values_unconstrained():
  """While active, a partitioning box whose names outnumber its value's dimensions unboxes without a constraint
  (where flax would raise); every other box unboxes as flax does."""
  with _LOCK:
    saved = {cls: cls.__dict__['unbox'] for cls in _BOXES}

    def patched(original):
      def unbox(self, apply_constraint=True):
        return original(self, apply_constraint and len(self.names) <= jnp.ndim(self.value))

      return unbox

    try:
      for cls, original in saved.items():
        cls.unbox = patched(original)
      yield
    finally:
      for cls, original in saved.items():
        cls.unbox = original


def dense_general_ok(train_step: Callable[..., Any]) -> Callable[..., Any]:
  """``train_step`` with flax's flattened ``nn.DenseGeneral`` kernels left unconstrained while it is traced.

  The step, its signature (``donate_argnames``, ``static_argnames``) and every other sharding constraint stay as
  they are; only the constraint flax would apply to DenseGeneral's 2-D intermediate kernel (an error, flax issue
  3676) is skipped. The parameters themselves (3-D) are still constrained to their annotations when unboxed.
  Wrap the step where it is mapped: ``hdet_jax.over_replicas(hdet_jax.trainer.linen.dense_general_ok(train_step),
  mesh, 'replica')``; it works under ``jax.set_mesh`` alone as well.
  """

  @functools.wraps(train_step)
  def step(*args, **kwargs):
    with _flat_values_unconstrained():
      return train_step(*args, **kwargs)

  return step
