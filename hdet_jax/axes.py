"""The collectives of the replica axis, which know how many replicas each device runs.

HDET's replicas differ between syncs, so nothing per-replica may be declared replicated; the collectives here
average, sum, gather and index over the replica axis, and cast varying types where a ``lax.cond``'s branches
must agree (:func:`match_vma`).

N replicas on D devices (N a multiple of D, :func:`~hdet_jax.shard_map_replicas` with ``per_device = N / D > 1``):
``shard_map`` over the devices and ``vmap`` over the N / D replicas on each. The replica axis is then
the pair of axes ``(device axis, local axis)``, and replica r = d * (N / D) + v. A tuple axis name
across a shard_map axis and a vmap axis is not a collective JAX can take in one call (jax 0.10), so
:func:`axis_index`, :func:`psum`, :func:`pmean` and :func:`all_gather` take the axes one at a time,
innermost (the vmap axis) first; with a single axis name they are ``lax``'s own calls:

.. math::

  r = d \\cdot k + v, \\qquad \\mathrm{psum}_{(d, v)}(x) = \\mathrm{psum}_d(\\mathrm{psum}_v(x)),
  \\qquad k = N / D.

:func:`~hdet_jax.over_replicas` with ``per_device > 1`` keeps the user's axis name: while it traces the step, the
name (``'replica'``) *resolves* to the pair ``('replica', LOCAL_AXIS)`` in every helper here, so ``hdet``
built with ``replica_axis='replica'`` and a step calling :func:`pmean_finite` (grads, 'replica') run
unchanged at any number of replicas per device. A ``lax`` collective called directly cannot span both
axes; the map refuses a step that calls one over the replica axis (:func:`check_collectives`).

Example:
  8 replicas, 2 on each of 4 devices: the pair ``('data', 'local')`` is the replica axis.

  >>> import jax, jax.numpy as jnp, numpy as np, hdet_jax
  >>> from hdet_jax import axes
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ('data',))
  >>> def per_replica(x):
  ...   pair = ('data', 'local')
  ...   return axes.axis_index(pair), axes.psum(x, pair)
  >>> index, total = hdet_jax.shard_map_replicas(per_replica, mesh, 'data', per_device=2)(jnp.arange(8.0))
  >>> index.tolist(), total.tolist()  # replica r = 2 d + v; the sum of the 8 replicas' values, 0 + ... + 7
  ([0, 1, 2, 3, 4, 5, 6, 7], [28.0, 28.0, 28.0, 28.0, 28.0, 28.0, 28.0, 28.0])
"""

from __future__ import annotations

import contextlib
import contextvars

import chex
from chex import ArrayTree  # by name: get_type_hints resolves its recursive reference to itself here
import jax
import jax.extend
import jax.numpy as jnp
from jax import lax

from hdet_jax import arguments


AxisName = str | tuple[str, ...]  # a replica axis: one mapped axis, or (outer, ..., inner) taken together


# While a replica map traces its function: {axis name: (mesh axis, local axis)} (over_replicas with several replicas
# per device; empty otherwise) and the local vmap axes it binds.
_MAPPED: contextvars.ContextVar[tuple[dict[str, tuple[str, ...]], frozenset[str]]] = contextvars.ContextVar(
  'hdet_jax_mapped_replicas', default=({}, frozenset())
)
# The name scope of this module's collectives while an alias is set: check_collectives tells them from a step's own.
_SCOPE = 'hdet_replica_collective'


@contextlib.contextmanager
def _mapped(aliases: dict[str, tuple[str, ...]], local_axes: frozenset[str]):
  """Sets the axis aliases and local axes while a replica map traces its function."""
  outer_aliases, outer_local = _MAPPED.get()
  token = _MAPPED.set(({**outer_aliases, **aliases}, outer_local | local_axes))
  try:
    yield
  finally:
    _MAPPED.reset(token)


def _axes(axis_name: AxisName) -> tuple[str, ...]:
  """The axes ``axis_name`` stands for, outermost first (an alias set by :func:`over_replicas` expanded)."""
  aliases = _MAPPED.get()[0]
  names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
  return tuple(a for name in names for a in aliases.get(name, (name,)))


def _scope():
  """A name scope on this module's collectives while an alias is set (none otherwise: programs stay as they were)."""
  return jax.named_scope(_SCOPE) if _MAPPED.get()[0] else contextlib.nullcontext()


def axis_size(axis_name: AxisName) -> int:
  """The number of replicas on ``axis_name`` (a tuple: the product of its axes' sizes)."""
  size = 1
  for a in _axes(axis_name):
    size *= lax.axis_size(a)
  return size


def axis_index(axis_name: AxisName) -> jax.Array:
  """[] int32: this replica's index on ``axis_name``; for ``(outer, inner)``, ``outer * size(inner) + inner``."""
  axes = _axes(axis_name)
  with _scope():
    if len(axes) == 1:
      return lax.axis_index(axes[0])
    index = jnp.zeros([], jnp.int32)
    for a in axes:
      index = index * lax.axis_size(a) + lax.axis_index(a)
    return index


def psum(tree: ArrayTree, axis_name: AxisName) -> ArrayTree:
  """``lax.psum`` over ``axis_name``; a tuple is summed one axis at a time, the innermost first."""
  axes = _axes(axis_name)
  with _scope():
    if len(axes) == 1:
      return lax.psum(tree, axes[0])
    for a in reversed(axes):
      tree = lax.psum(tree, a)
    return tree


def pmean(tree: ArrayTree, axis_name: AxisName) -> ArrayTree:
  """``lax.pmean`` over ``axis_name`` (a tuple: :func:`psum` divided by the replica count)."""
  axes = _axes(axis_name)
  if len(axes) == 1:
    with _scope():
      return lax.pmean(tree, axes[0])
  size = axis_size(axes)
  return jax.tree.map(lambda s: s / size, psum(tree, axes))


def all_gather(x: ArrayTree, axis_name: AxisName) -> ArrayTree:
  """``lax.all_gather`` over ``axis_name``: ``[N, ...]`` in replica order (a tuple: gathered innermost first,
  then tiled over the outer axes, so row r is replica r = outer * size(inner) + inner)."""
  axes = _axes(axis_name)
  with _scope():
    if len(axes) == 1:
      return lax.all_gather(x, axes[0])
    x = lax.all_gather(x, axes[-1])
    for a in reversed(axes[:-1]):
      x = lax.all_gather(x, a, tiled=True)
    return x


def unbatched(x: chex.Array, axis_name: AxisName | None = None) -> chex.Array:
  """``x``, a value every replica holds alike (a step count), as one the replicas' local ``vmap`` does not batch.

  Where a map runs several replicas per device (``per_device > 1``) each device's replicas are a ``vmap``, under
  which a ``lax.cond`` on a batched predicate becomes a select that runs both branches, the sync's all-reduce
  included, on every step. A collective over the vmap's own axis returns an unbatched value, so a predicate
  built from ``unbatched(count)`` keeps the cond a cond. ``x`` is taken through ``lax.pmax`` over the local vmap
  axes of ``axis_name`` (None: every local axis bound by the map); elsewhere it is returned as it is.
  """
  local = _MAPPED.get()[1]
  axes = [a for a in (local if axis_name is None else _axes(axis_name)) if a in local]
  if not axes:
    return x
  as_int = jnp.asarray(x).dtype == jnp.bool_
  y = jnp.asarray(x, jnp.int32) if as_int else x
  for a in sorted(axes):
    y = lax.pmax(y, a)
  return y > 0 if as_int else y


def vma(x: chex.Array) -> frozenset:
  """The mesh axes a value varies over (empty outside shard_map and under vmap/pmap)."""
  aval = jax.typeof(x)
  mat = getattr(aval, 'mat', None)  # the varying axes: aval.mat.varying (jax >= 0.10), else aval.vma
  return frozenset(getattr(mat, 'varying', ()) if mat is not None else getattr(aval, 'vma', ()))


def match_vma(x: ArrayTree, like: ArrayTree) -> ArrayTree:
  """Casts each leaf of x to vary over the axes its counterpart in ``like`` varies over.

  The two branches of a ``lax.cond`` must agree in varying-ness under ``check_vma``; a
  ``pmean`` result is invariant while the parameters it replaces vary. ``lax.pcast`` fails
  under ``vmap(axis_name=...)``, so only the missing axes are cast, and under vmap/pmap
  nothing is missing.
  """

  def cast(a, b):
    missing = tuple(sorted(vma(b) - vma(a)))
    return lax.pcast(a, missing, to='varying') if missing else a

  return jax.tree.map(cast, x, like)


def axis_size_or_raise(
  axis_name: AxisName, expected: int | None = None, who: str = 'hdet', name: str = 'replica_axis'
) -> int:
  """The size of a bound mapped axis (or pair), with a clear error when it is not bound or does not match
  (``name``: the argument that named it)."""
  try:
    size = axis_size(axis_name)
  except (NameError, KeyError, ValueError) as e:
    raise ValueError(
      f'{who}: {name}={axis_name!r} is not bound here. Call the update inside '
      f'jax.shard_map over a mesh with an axis named {axis_name!r}, jax.pmap(..., axis_name='
      f'{axis_name!r}) or jax.vmap(..., axis_name={axis_name!r}), or pass the right replica_axis.'
    ) from e
  if expected is not None and size != expected:
    raise ValueError(
      f'{who}: num_replicas={expected} but the axis {axis_name!r} has size {size}. '
      f'Set num_replicas={size} or map over {expected} replicas.'
    )
  return size


def all_finite(tree: ArrayTree) -> chex.Array:
  """[] bool: whether every element of every leaf is finite (on this replica)."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.ones([], bool)


def finite_mean(tree: ArrayTree, axis_name: AxisName, ok: chex.Array | None = None) -> tuple[ArrayTree, chex.Array]:
  """The mean over ``axis_name`` of the replicas whose leaves are all finite.

  Replicas with any NaN or inf are left out of the sum and the count (when ``ok`` is given, it
  decides instead: this replica enters iff ``ok``),
  so one replica that blew up does not poison the others. With every replica finite the
  result equals ``lax.pmean`` bit for bit (both are a psum divided by N). If no replica is
  finite the leaves come back NaN, so the failure stays visible.

  Returns:
    ``(mean, count)``: the mean tree and the number of replicas that entered it.
  """
  mine = all_finite(tree) if ok is None else ok
  count = psum(mine.astype(jnp.int32), axis_name)
  total = psum(jax.tree.map(lambda x: jnp.where(mine, x, jnp.zeros_like(x)), tree), axis_name)

  def divide(s):
    return jnp.where(count > 0, s / count.astype(s.dtype), jnp.full_like(s, jnp.nan))

  return jax.tree.map(divide, total), count


def pmean_finite(tree: ArrayTree, axis_name: AxisName) -> ArrayTree:
  """``lax.pmean`` over the replicas whose values are all finite (see :func:`finite_mean`).

  Use it for the data-parallel gradient all-reduce under HDET: every replica shares the
  averaged gradient and the optimizer state built from it, so a single non-finite gradient
  would otherwise poison every replica at once.
  """
  arguments.axis_name(axis_name, 'axis_name', who='pmean_finite')
  axis_size_or_raise(axis_name, who='pmean_finite', name='axis_name')
  return finite_mean(tree, axis_name)[0]


LOCAL_AXIS = '_hdet_local'  # over_replicas' vmap axis over each device's replicas (per_device > 1)

# Primitives that name an axis but send nothing (varying-type casts).
_TYPE_CASTS = frozenset({'pvary', 'pcast', 'pbroadcast'})


def check_collectives(jaxpr, replica_axis: str, per_device: int, who: str = 'over_replicas') -> None:
  """Raises if a traced step (a jaxpr, sub-jaxprs included) holds a collective over ``replica_axis`` that did not
  come from this module's collectives.

  With several replicas per device the replica axis is the mesh axis and a local ``vmap`` axis together; a
  ``jax.lax`` collective named after the mesh axis alone spans the devices only and gives a wrong result
  (``lax.pmean(grads, 'replica')`` would average each device's replica v with the other devices' replica v only).
  They carry a name scope while :func:`~hdet_jax.over_replicas` traces the step.
  """
  for eqn in jaxpr.eqns:
    named = eqn.params.get('axes', eqn.params.get('axis_name'))
    named = (named,) if isinstance(named, str) else named if isinstance(named, (tuple, list)) else ()
    ours = _SCOPE in str(eqn.source_info.name_stack)
    if replica_axis in named and eqn.primitive.name not in _TYPE_CASTS and not ours:
      raise ValueError(
        f'{who}: with per_device={per_device} the step calls {eqn.primitive.name} over {replica_axis!r} directly'
        f'{_where(eqn)}, which spans the devices only and not the {per_device} replicas on each; use '
        f'hdet_jax.pmean_finite(grads, {replica_axis!r}) for the gradient (hdet_jax.axes.psum, pmean, '
        'all_gather and axis_index for others), which span both.'
      )
  for sub in jax.extend.core.subjaxprs(jaxpr):
    check_collectives(sub, replica_axis, per_device, who)


def _where(eqn) -> str:
  """' (at file.py:line)': the innermost frame of the call outside jax, optax and this package ('' if unknown)."""
  frames = getattr(getattr(eqn.source_info, 'traceback', None), 'frames', None) or ()
  for frame in frames:
    name = frame.file_name.replace('\\', '/')
    if '/jax/' not in name and '/hdet_jax/' not in name and '/optax/' not in name:
      return f' (at {name.rsplit("/", 1)[-1]}:{frame.line_num})'
  return ''


def checked_call(fn, args, static, replica_axis: str, per_device: int, who: str):
  """``fn(*args)``, traced once into a jaxpr that :func:`check_collectives` reads, then evaluated in place; the
  ``args`` where ``static`` is True are not arrays and reach ``fn`` as they are."""
  arrays = [a for a, s in zip(args, static) if not s]

  def on_arrays(*arrays):
    given = iter(arrays)
    return fn(*[a if s else next(given) for a, s in zip(args, static)])

  closed, shapes = jax.make_jaxpr(on_arrays, return_shape=True)(*arrays)
  check_collectives(closed.jaxpr, replica_axis, per_device, who)
  out = jax.extend.core.jaxpr_as_fun(closed)(*jax.tree.leaves(arrays))
  return jax.tree.unflatten(jax.tree.structure(shapes), out)
