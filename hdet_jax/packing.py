"""HDET's small state in one buffer: the non-sync step then takes plain data parallel's inputs plus one.

An :class:`hdet_jax.HDETState` carries, besides the wrapped optimizer's state, about twenty small arrays
(counters, the ``[G, N]`` values, the controller's few numbers). Passed as they are, each is one more
input buffer of every step program, and on a GPU that costs a fixed few microseconds per call
(results/benchmarks_gpu.md), whatever the model's size. :class:`PackedState` keeps the wrapped
optimizer's state as it is and bit-casts every other leaf to ``uint32`` in one vector, exactly
(``float32`` and ``int32`` bit for bit, ``bool`` as 0/1), so a program unpacks it on entry and packs it
on exit at the cost of a slice and a concatenate of a few hundred bytes.

:func:`packed` wraps ``hdet(...)`` as an optax transformation over packed states: a drop-in for step
programs that never read the state's fields. A loop that reads them (its values, count or controller
for logging) calls :func:`unpack_state` / :func:`pack_state` itself inside the mapped program.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from hdet_jax.transform import HDETState


class PackedState(NamedTuple):
  """An :class:`hdet_jax.HDETState` with its own small fields in one vector (on one replica)."""

  inner_state: Any  # the wrapped optimizer's state, as in HDETState.
  small: jax.Array  # [M] uint32: every other HDETState leaf, in tree order, bit-cast and flattened.


_EXACT = (np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.bool_))


def _to_words(x: jax.Array) -> jax.Array:
  x = jnp.asarray(x)
  if x.dtype == jnp.bool_:
    return jnp.ravel(x.astype(jnp.uint32))
  if np.dtype(x.dtype) not in _EXACT:
    raise ValueError(
      f'pack_state: a leaf of dtype {x.dtype} has no exact 32-bit word (float32, int32, uint32 and bool have).'
    )
  return jnp.ravel(x if x.dtype == jnp.uint32 else lax.bitcast_convert_type(x, jnp.uint32))


def _from_words(words: jax.Array, like: Any) -> jax.Array:
  x = words.reshape(like.shape)
  if like.dtype == jnp.bool_:
    return x != 0
  return x if like.dtype == jnp.uint32 else lax.bitcast_convert_type(x, like.dtype)


def _small(state: HDETState) -> HDETState:
  # The rollback's anchor (a copy of the parameters and optimizer state) is no small field: a caller that packs
  # keeps it apart (the trainer passes it to its window end alone).
  return state._replace(inner_state=None, anchor=None)


def pack_state(state: HDETState) -> PackedState:
  """One replica's state with its small fields packed (exactly; see :func:`unpack_state`).

  For a stacked state ``[N, ...]``, ``jax.vmap(pack_state)(stacked)``.
  """
  leaves = jax.tree.leaves(_small(state))
  return PackedState(state.inner_state, jnp.concatenate([_to_words(x) for x in leaves]))


def unpack_state(packed: PackedState, like: HDETState) -> HDETState:
  """The :class:`hdet_jax.HDETState` ``pack_state`` packed, given its shapes: ``like`` is one replica's
  state or its ``jax.eval_shape`` (e.g. ``jax.eval_shape(tx.init, params)``).

  Example:
    >>> import jax, jax.numpy as jnp, optax, hdet_jax
    >>> from hdet_jax.packing import pack_state, unpack_state
    >>> tx, params = hdet_jax.hdet(optax.adam, 1e-3, num_replicas=4), {'w': jnp.ones(3)}
    >>> state = tx.init(params)
    >>> packed = pack_state(state)
    >>> packed.small.dtype, packed.small.shape
    (dtype('uint32'), (44,))
    >>> back = unpack_state(packed, jax.eval_shape(tx.init, params))
    >>> same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b, equal_nan=True)), back, state)
    >>> jax.tree.all(same)  # leaf for leaf, bit for bit (last_loss is NaN before the first step)
    True
  """
  small = _small(like)
  leaves, treedef = jax.tree.flatten(small)
  sizes = [int(np.prod(x.shape, dtype=np.int64)) for x in leaves]
  if packed.small.shape != (sum(sizes),):
    raise ValueError(
      f'unpack_state: the packed vector has shape {packed.small.shape}, the state it should '
      f'hold needs ({sum(sizes)},): was it packed from another hdet() configuration?'
    )
  bounds = np.cumsum([0] + sizes)
  out = [_from_words(packed.small[a:b], x) for a, b, x in zip(bounds[:-1], bounds[1:], leaves)]
  return jax.tree.unflatten(treedef, out)._replace(inner_state=packed.inner_state)


def packed(tx: optax.GradientTransformationExtraArgs) -> optax.GradientTransformationExtraArgs:
  """``tx`` (an :func:`hdet_jax.hdet` transformation) over :class:`PackedState` states.

  ``init`` packs ``tx.init``'s state; ``update`` unpacks it (the shapes from ``jax.eval_shape(tx.init,
  params)``, so ``params`` is required, as ``hdet`` requires it anyway), runs ``tx.update`` and packs the
  result. The numbers are ``tx``'s bit for bit; only the state's tree differs.

  Example:
    >>> import jax, jax.numpy as jnp, optax, hdet_jax
    >>> tx = hdet_jax.packed(hdet_jax.hdet(optax.adam, 1e-3, num_replicas=4, sync_every=100))
    >>> params = hdet_jax.stack_replicas({'w': jnp.ones(3)}, 4)
    >>> opt_state = jax.vmap(tx.init)(params)
    >>> type(opt_state).__name__, opt_state.small.shape  # [N, M]: one small buffer per replica
    ('PackedState', (4, 44))
    >>> update = lambda grads, opt_state, params: tx.update(grads, opt_state, params, sync=False)
    >>> updates, opt_state = jax.vmap(update, axis_name='data')(params, opt_state, params)
    >>> [f'{u:.3g}' for u in updates['w'][:, 0].tolist()]  # Adam's first step at each replica's LR
    ['-0.00075', '-0.000917', '-0.00108', '-0.00125']
  """

  if not (callable(getattr(tx, 'init', None)) and callable(getattr(tx, 'update', None))):
    raise ValueError(f'packed: tx must be an hdet_jax.hdet(...) transformation, got {tx!r}.')

  def init_fn(params):
    state = tx.init(params)
    if not isinstance(state, HDETState):
      raise ValueError(
        f'packed: tx must be an hdet_jax.hdet(...) transformation (its init gives an HDETState), got a '
        f'{type(state).__name__} from its init; wrap hdet itself, then chain or multi_steps around packed(...).'
      )
    if state.anchor is not None:
      raise ValueError(
        "packed(hdet(..., rollback=True)): the packed state has no room for the rollback's anchor (a copy of the "
        'parameters and optimizer state); use the hdet transformation itself, or rollback=False.'
      )
    return pack_state(state)

  def update_fn(updates, state, params=None, **kwargs):
    if params is None:
      raise ValueError('packed(hdet): update() needs params (they give the packed state its shapes).')
    like = jax.eval_shape(tx.init, params)
    updates, new_state = tx.update(updates, unpack_state(state, like), params, **kwargs)
    return updates, pack_state(new_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
