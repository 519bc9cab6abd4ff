"""The maps of stacked replicas: the leading-axis layout, and running one replica's step over a mesh.

HDET's replicas differ between syncs, so nothing per-replica may be declared replicated.
The layout that works everywhere: every leaf of the parameters and of the optimizer state
carries a leading replica axis of size N. Under ``shard_map`` that axis is sharded over the
mesh's replica axis and the body sees a slice of size 1; under ``pmap`` and
``vmap(axis_name=...)`` it is mapped away.

On a mesh with more axes than the replica axis (``('replica', 'fsdp')``), one replica is a *group*
of devices: ``shard_map`` is manual over the replica axis only and the others stay Auto, so
XLA's partitioner shards each leaf inside the group as its sharding says (:func:`~hdet_jax.stacked_shardings`).

N replicas on D devices (``per_device = N / D > 1``): ``shard_map`` over the devices and ``vmap`` over the
N / D replicas on each; the replica axis is then the pair ``(device axis, local axis)``, whose collectives
are :mod:`hdet_jax.axes`'. :func:`over_replicas` keeps the user's axis name, which resolves to the pair while
it traces the step; a ``lax`` collective called directly over the replica axis spans the devices only, so the
map refuses it (:func:`hdet_jax.axes.check_collectives`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from chex import ArrayTree  # by name: get_type_hints resolves its recursive reference to itself here
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from hdet_jax import arguments
from hdet_jax import axes as axes_lib
from hdet_jax import sync as sync_lib
from hdet_jax.param_groups import path_string

# 1.0's paths to the collectives (CHANGELOG 1.0: ``from hdet_jax.replicas import ...``) and the results pages'
# to the rollback's anchor: the names live in hdet_jax.axes and hdet_jax.sync.
from hdet_jax.axes import all_gather, axis_index, finite_mean, pmean, psum  # noqa: F401
from hdet_jax.sync import Anchor, share_anchors  # noqa: F401


def stack_replicas(tree: ArrayTree, num_replicas: int, *, per_device: int = 1) -> ArrayTree:
  """Copies every leaf N times along a new leading replica axis.

  ``per_device = k > 1`` (the map's, :func:`over_replicas`): an :class:`~hdet_jax.sync.Anchor` in ``tree`` (``hdet(...,
  rollback=True)``) is copied N / k times instead, one copy per device (see :func:`~hdet_jax.sync.share_anchors`).
  """
  num_replicas = arguments.count(num_replicas, 'num_replicas', who='stack_replicas', what=' (N, the leading axis)')
  per_device = arguments.count(per_device, 'per_device', who='stack_replicas', what=' (the replicas on each device)')
  if num_replicas % per_device:
    raise ValueError(
      f'stack_replicas: per_device={per_device} does not divide num_replicas={num_replicas} (N = D * per_device); '
      'pass the per_device of the map that runs them.'
    )
  stack = lambda n: lambda x: jnp.broadcast_to(x, (n,) + jnp.shape(x))
  if per_device == 1:
    return jax.tree.map(stack(num_replicas), tree)
  on = lambda node: jax.tree.map(stack(num_replicas // per_device if sync_lib._is_anchor(node) else num_replicas), node)
  return jax.tree.map(on, tree, is_leaf=sync_lib._is_anchor)


def average_replicas(stacked: ArrayTree) -> ArrayTree:
  """The ensemble's model: the mean over the leading replica axis, outside any mapped context.

  This is the exact average of the replicas, whatever they hold; evaluate and export this,
  not replica 0. Inside a mapped context use ``lax.pmean(tree, replica_axis)``. Integer and
  boolean leaves (step counters, flags of a whole train state) are replica 0's: they have no mean.
  """

  leading_axis(stacked, 'stacked', who='average_replicas')

  # x0 + mean(x - x0): bitwise x0 when the replicas agree (right after a sync the exported
  # model then equals every replica), and less rounding than summing the raw values otherwise.
  def mean(x):
    if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
      return x[0]
    x0 = x[:1]
    return (x0 + jnp.mean(x - x0, axis=0, keepdims=True, dtype=x.dtype))[0]

  return jax.tree.map(mean, stacked)


def replica(stacked: ArrayTree, index: int) -> ArrayTree:
  """Replica ``index``'s copy of a stacked tree."""
  n = leading_axis(stacked, 'stacked', who='replica')
  if n is not None:
    arguments.index(index, 'index', n, who='replica', of='replica, on the leading axis of size N')
  return jax.tree.map(lambda x: x[index], stacked)


def leading_axis(stacked: ArrayTree, name: str, *, who: str) -> int | None:
  """N, the leading replica axis every leaf of a stacked tree shares (None for a tree without leaves); one error
  line naming ``name`` where a leaf has no leading axis or the leaves disagree. An :class:`~hdet_jax.sync.Anchor`
  may be held once per device (:func:`~hdet_jax.sync.share_anchors`), so its leaves are not counted."""
  leaves = jax.tree_util.tree_leaves_with_path(stacked, is_leaf=sync_lib._is_anchor)
  shapes = [(path_string(p), jnp.shape(x)) for p, x in leaves if not sync_lib._is_anchor(x)]
  flat = next(((p, s) for p, s in shapes if not s), None)
  if flat is not None:
    raise ValueError(
      f'{who}: {name} must be a stacked tree, a leading replica axis [N, ...] on every leaf '
      f'(hdet_jax.stack_replicas(tree, N)); leaf {flat[0] or "(the root)"!r} has shape ().'
    )
  counts = sorted({s[0] for _, s in shapes})
  if len(counts) > 1:
    raise ValueError(
      f'{who}: the leaves of {name} disagree on the number of replicas (leading axes {counts}); stack every leaf '
      'with hdet_jax.stack_replicas(tree, N).'
    )
  return counts[0] if counts else None


def shard_map_replicas(
  fn: Callable[..., Any],
  mesh: jax.sharding.Mesh,
  replica_axis: str = 'data',
  *,
  stacked_argnums: tuple[int, ...] | None = None,
  batch_argnames: tuple[str, ...] = (),
  check_vma: bool = True,
  per_device: int = 1,
  local_axis: str = 'local',
) -> Callable[..., Any]:
  """Runs a per-replica function on stacked trees with ``jax.shard_map``.

  ``fn`` sees one replica's leaves (the leading axis dropped) and returns per-replica
  trees; the wrapper restores the leading axis, so every output is stacked ``[N, ...]``. Each
  argument of ``fn`` is, by default, stacked (a leading replica axis on every leaf). Others:

  - ``batch_argnames``: a *global batch*, split by rows over the replica axis: replica r sees rows
    ``[r B/N, (r+1) B/N)``, still a global array over the mesh's other axes (e.g. ``'data'`` for
    FSDP), so a global-batch train step keeps its batch layout (:doc:`/add_to_trainer`).
  - ``stacked_argnums`` (positions; default: all but the batch): the others are passed replicated.
  - An argument whose leaves are all scalars (a Python float under ``jit``) is passed replicated; one
    that holds anything but arrays (a ``static_argnames`` value of the enclosing jit, a Python flag or
    callable) is passed to ``fn`` as it is.

  The wrapper keeps ``fn``'s signature (``inspect.signature``, keyword calls), so
  ``jax.jit(wrapped, donate_argnames=..., static_argnames=...)`` works as on ``fn`` itself.

  ``per_device = N / D > 1``: N replicas on the D devices of ``replica_axis``, each device
  running its N / D consecutive replicas under ``jax.vmap(..., axis_name=local_axis)``. ``fn``'s
  collectives then span the pair ``(replica_axis, local_axis)`` (build ``hdet`` with that tuple as
  its ``replica_axis`` and use :mod:`hdet_jax.axes`' ``psum``, ``pmean``, ``all_gather``, ``axis_index``).
  This map runs unchecked (``check_vma=False``): jax 0.10 cannot type a collective over a vmap axis
  inside a checked shard_map (it asserts in ``pvary``), and the check's subject, values that vary
  over the *mesh* axis, is the same per-replica function as at ``per_device=1``, where it runs checked.

  On a mesh with further axes (e.g. ``('replica', 'fsdp')``) the map is manual over
  ``replica_axis`` only: ``fn`` then sees one group's leaves as global arrays over the inner
  axes, which XLA partitions as their shardings say (put them with :func:`~hdet_jax.group_shardings` or
  :func:`~hdet_jax.stacked_shardings` and pass those as the jit's ``out_shardings`` so they stay put), and
  ``with_sharding_constraint`` over the inner axes works inside ``fn``. Collectives over
  ``replica_axis`` in ``fn`` then run between groups, and a mean over a leaf sharded on an
  inner axis is the group's mean. Why a map manual over the replica axis and not ``jax.vmap(fn,
  spmd_axis_name=replica_axis)``: :func:`over_replicas` says.

  Example:
    One replica on each of 8 devices:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, hdet_jax
    >>> from jax.sharding import Mesh
    >>> mesh = Mesh(np.array(jax.devices()), ('data',))
    >>> tx = hdet_jax.hdet(optax.sgd, 0.1, num_replicas=8)
    >>> def train_step(params, opt_state, batch):  # one replica's view
    ...   loss, grads = jax.value_and_grad(lambda p: jnp.mean((batch @ p['w'] - 1) ** 2))(params)
    ...   updates, opt_state = tx.update(hdet_jax.pmean_finite(grads, 'data'), opt_state, params, value=loss)
    ...   return optax.apply_updates(params, updates), opt_state, loss
    >>> params = hdet_jax.stack_replicas({'w': jnp.zeros(2)}, 8)
    >>> opt_state = jax.vmap(tx.init)(params)
    >>> step = jax.jit(hdet_jax.shard_map_replicas(train_step, mesh, 'data'))
    >>> for _ in range(2):
    ...   params, opt_state, loss = step(params, opt_state, jnp.ones((8, 4, 2)))  # all stacked [N, ...]
    >>> [f'{x:.2f}' for x in loss.tolist()]  # the second step's loss, after each replica's own first step
    ['0.49', '0.45', '0.41', '0.38', '0.34', '0.31', '0.28', '0.25']

    A global-batch step on a ``('replica', 'data')`` mesh is ``shard_map_replicas(train_step, mesh,
    'replica', batch_argnames=('batch',))`` (see :func:`over_replicas`); 8 replicas on 2 devices are
    ``shard_map_replicas(train_step, mesh, 'data', per_device=4)``, with ``train_step``'s ``hdet`` built
    with ``replica_axis=('data', 'local')``.
  """
  who = 'shard_map_replicas'
  arguments.axis_name(local_axis, 'local_axis', who=who, pair=False)
  if local_axis == replica_axis or (isinstance(mesh, jax.sharding.Mesh) and local_axis in mesh.shape):
    raise ValueError(f'{who}: local_axis={local_axis!r} names a mesh axis; name the local vmap axis apart.')
  check_vma = arguments.flag(check_vma, 'check_vma', who=who)
  if stacked_argnums is not None and not (
    isinstance(stacked_argnums, tuple) and all(arguments.is_int(i) and i >= 0 for i in stacked_argnums)
  ):
    raise ValueError(
      f'{who}: stacked_argnums must be None or a tuple of argument positions >= 0, got {stacked_argnums!r}.'
    )
  return _map_replicas(
    fn,
    mesh,
    replica_axis,
    stacked_argnums=stacked_argnums,
    batch_argnames=batch_argnames,
    check_vma=check_vma,
    per_device=per_device,
    local_axis=local_axis,
    who='shard_map_replicas',
  )


def _map_replicas(
  fn, mesh, replica_axis, *, stacked_argnums, batch_argnames, check_vma, per_device, local_axis, who, keep_name=False
):
  """:func:`shard_map_replicas`; ``keep_name`` (:func:`over_replicas`): with ``per_device > 1`` the name
  ``replica_axis`` stands for the pair ``(replica_axis, local_axis)`` in this module's helpers while ``fn`` is
  traced, and ``fn``'s collectives are checked. Either way the stacked arguments must hold D * per_device
  replicas (at ``per_device=1`` a device would otherwise drop all but the first of the replicas it is given)."""
  batch_argnames, signature = _checked_map_args(fn, mesh, replica_axis, batch_argnames, per_device, who)
  role = functools.partial(_role, batch_argnames=batch_argnames, stacked_argnums=stacked_argnums)

  def wrapped(*args, **kwargs):
    bound = _bind(signature, args, kwargs)
    roles, traced = [], []
    for i, (name, value) in enumerate(bound):
      if _holds_arrays(value):
        roles.append(role(i, name, value))
        traced.append(value)
      else:
        roles.append('static')
    specs = tuple(P() if r == 'replicated' else P(replica_axis) for r in roles if r != 'static')
    _check_replica_count(bound, roles, mesh.shape[replica_axis], per_device, replica_axis, who)
    _check_batch_rows(bound, roles, mesh.shape[replica_axis] * per_device, who)

    def body(*local):
      local = iter(local)
      values = [
        value if r == 'static' else _local_view(next(local), r, per_device) for r, (_, value) in zip(roles, bound)
      ]
      if per_device > 1:  # [N / D, ...] here: the local replicas, mapped by vmap
        local_axes = (replica_axis, local_axis, per_device)
        return _on_local_replicas(fn, bound, values, roles, local_axes, keep_name=keep_name, who=who)
      return jax.tree.map(lambda a: jnp.asarray(a)[None], _call(fn, bound, values))

    # Manual over the replica axis: on a 1-D mesh that is every axis (the plain case); on a 2-D
    # mesh the inner axes stay Auto and the partitioner shards inside each group. Axes of size 1
    # go manual too: nothing to shard there, and an Auto axis still runs the partitioner, whose
    # rewrites may change the rounding of some ops; fully manual keeps the 1-D path's numbers bit for
    # bit (tests/test_mesh2d.py, test_group_size_one_equals_the_1d_path_bit_for_bit).
    manual = {replica_axis} | {a for a, size in mesh.shape.items() if size == 1}
    return jax.shard_map(
      body,
      mesh=mesh,
      in_specs=specs,
      out_specs=P(replica_axis),
      check_vma=check_vma and per_device == 1,
      axis_names=frozenset(manual),
    )(*traced)

  if signature is not None:
    wrapped = functools.wraps(fn)(wrapped)  # inspect.signature(wrapped) is fn's: jit's *_argnames resolve
  return wrapped


def _on_local_replicas(fn, bound, values, roles, local_axes, *, keep_name: bool, who: str):
  """One device's k = ``per_device`` replicas of ``fn`` under ``jax.vmap(axis_name=local_axis)`` (``local_axes``:
  ``(replica_axis, local_axis, per_device)``); an anchor held once per device
  (:func:`~hdet_jax.sync.share_anchors`) is not batched, and comes back one copy per device. ``keep_name``:
  :func:`over_replicas`' alias and check."""
  replica_axis, local_axis, per_device = local_axes
  views = [
    sync_lib._anchor_axes(v, per_device) if r == 'stacked' else (v, 0 if r == 'batch' else None, False)
    for v, r in zip(values, roles)
  ]
  values, axes, shared = [v[0] for v in views], [v[1] for v in views], any(v[2] for v in views)
  mapped = jax.vmap(lambda *v: _call(fn, bound, v), in_axes=tuple(axes), axis_name=local_axis)
  aliases = {replica_axis: (replica_axis, local_axis)} if keep_name else {}
  token = sync_lib._SHARED_ANCHORS.set(shared)
  try:
    with axes_lib._mapped(aliases, frozenset({local_axis})):
      if keep_name:
        static = [r == 'static' for r in roles]
        out = axes_lib.checked_call(mapped, values, static, replica_axis, per_device, who)
      else:
        out = mapped(*values)
  finally:
    sync_lib._SHARED_ANCHORS.reset(token)
  return sync_lib._anchors_to_devices(out) if shared else out


def _checked_map_args(fn, mesh, replica_axis, batch_argnames, per_device, who) -> tuple[tuple[str, ...], Any]:
  """The map's arguments checked before anything is traced: ``(batch_argnames as a tuple, fn's signature)``."""
  if not callable(fn):
    param = {'over_replicas': 'train_step', 'evaluate_over_replicas': 'eval_step'}.get(who, 'fn')
    raise ValueError(f"{who}: {param} must be a function of one replica's arguments, got {fn!r}.")
  if not arguments.is_int(per_device) or per_device < 1:
    raise ValueError(
      f'{who}: per_device must be a positive integer, got {per_device!r} (the number of replicas on each device '
      f'of the replica axis: N / D).'
    )
  if isinstance(batch_argnames, str):
    batch_argnames = (batch_argnames,)
  signature = _signature(fn)
  unknown = [n for n in batch_argnames if signature is None or n not in signature.parameters]
  if unknown:
    names = 'none readable' if signature is None else tuple(signature.parameters)
    raise ValueError(
      f'{who}: batch_argnames {tuple(unknown)} are not parameters of '
      f'{getattr(fn, "__name__", fn)!r} (its parameters: {names}); name the batch argument(s).'
    )
  if not isinstance(mesh, jax.sharding.Mesh):
    raise ValueError(f'{who}: mesh must be a jax.sharding.Mesh with a replica axis, got {type(mesh).__name__}.')
  arguments.axis_name(replica_axis, 'replica_axis', who=who, pair=False)
  arguments.mesh_axis(mesh, replica_axis, 'replica_axis', who=who)
  if not all(isinstance(n, str) for n in batch_argnames):
    raise ValueError(f'{who}: batch_argnames must be parameter names (strings), got {batch_argnames!r}.')
  return tuple(batch_argnames), signature


def _role(position: int, name: str | None, value, *, batch_argnames, stacked_argnums) -> str:
  """How an argument with arrays goes through the map: ``'batch'``, ``'stacked'`` or ``'replicated'``."""
  if name in batch_argnames:
    return 'batch'
  if all(jnp.ndim(x) == 0 for x in jax.tree.leaves(value)):
    return 'replicated'  # scalars (a Python float under jit, a step number) cannot carry the replica axis
  if stacked_argnums is None or position in stacked_argnums:
    return 'stacked'
  return 'replicated'


def over_replicas(
  train_step: Callable[..., Any],
  mesh: jax.sharding.Mesh,
  replica_axis: str = 'data',
  *,
  batch_argnames: tuple[str, ...] = ('batch',),
  per_device: int = 1,
) -> Callable[..., Any]:
  """Runs a global-batch train step (one ``jit`` with shardings) as N diverging HDET replicas.

  The step stays as it is: its ``jit``, in/out shardings, donation, ``with_sharding_constraint``
  calls on your mesh, its axis names, and FSDP or tensor parallelism inside each replica. HDET adds
  one mesh axis for the replicas (``replica_axis``, a name your step does not use; ``'data'`` by default, as
  everywhere in the library: a step whose mesh already has a ``'data'`` axis names another, e.g. ``'replica'``,
  here and in ``hdet(replica_axis=...)``), and:

  - the state stacked on a leading ``[N]`` axis (:func:`stack_replicas`), sharded with
    :func:`~hdet_jax.stacked_shardings` (your shardings with ``replica_axis`` in front);
  - the batch (the arguments in ``batch_argnames``) stays global ``[B, ...]``, put with
    :func:`~hdet_jax.batch_shardings`; replica r trains on its ``B / N`` rows;
  - one line in the step, ``grads = hdet_jax.pmean_finite(grads, replica_axis)`` (``jax.lax.pmean`` works
    too with one replica per device), and ``value=loss`` passed to ``tx.update``;
  - every output comes back stacked ``[N, ...]`` (a metric: one value per replica).

  ``per_device = k > 1`` runs N replicas on the D = N / k devices (or groups) of ``replica_axis``: each
  runs its k consecutive replicas under ``jax.vmap`` (replica r = d k + v), and the step, ``hdet(...,
  replica_axis=replica_axis, num_replicas=N)`` and the shardings stay as they are; only the mesh's
  replica axis is D long. While the step is traced the name ``replica_axis`` stands for the device axis
  and the vmap's axis together in :mod:`hdet_jax.axes`' collectives (:func:`~hdet_jax.pmean_finite`, and those
  ``hdet`` runs), and ``hdet``'s sync stays under a ``lax.cond`` (:func:`~hdet_jax.axes.unbatched`), so the window's
  all-reduce still runs only at the end of a window. A ``jax.lax`` collective over ``replica_axis`` in the
  step would span the devices only, not each device's k replicas: the map refuses it with a ``ValueError``
  (it reads the traced step once, :func:`~hdet_jax.axes.check_collectives`).

  It is :func:`shard_map_replicas`, manual over ``replica_axis`` only (the other axes stay under
  XLA's partitioner) and unchecked (``check_vma=False``): a ``with_sharding_constraint`` naming your
  concrete mesh fails jax's varying-type check inside a partly manual map. Why a map and not
  ``jax.vmap(step, spmd_axis_name=replica_axis)``, which would also add the axis to your shardings:
  under ``vmap`` the per-replica step count is batched, so ``hdet``'s ``lax.cond`` on it becomes a
  select and the window's parameter all-reduce would run on every step (measured in
  results/benchmarks.md); here each device reads its own replica's count and the all-reduce runs
  only at the end of a window. The signature is ``train_step``'s, so ``donate_argnames`` and
  ``static_argnames`` work as before.

  Example:
    A step written for a ``('data',)`` mesh of 8 devices, run as 4 replicas of 2 devices each:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, hdet_jax
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('replica', 'data'))  # the step's mesh: (8,), ('data',)
    >>> tx = hdet_jax.hdet(optax.sgd, 0.1, num_replicas=4, replica_axis='replica')
    >>> def train_step(state, batch):  # the global-batch step, its rows sharded over 'data'
    ...   params, opt_state = state
    ...   loss, grads = jax.value_and_grad(lambda p: jnp.mean((batch @ p - 1) ** 2))(params)
    ...   grads = hdet_jax.pmean_finite(grads, 'replica')  # the line HDET adds
    ...   updates, opt_state = tx.update(grads, opt_state, params, value=loss)
    ...   return (optax.apply_updates(params, updates), opt_state), loss
    >>> state = hdet_jax.stack_replicas((jnp.zeros(2), tx.init(jnp.zeros(2))), 4)
    >>> step = jax.jit(hdet_jax.over_replicas(train_step, mesh, 'replica'),
    ...                in_shardings=(hdet_jax.stacked_shardings(NamedSharding(mesh, P()), 'replica'),
    ...                              hdet_jax.batch_shardings(NamedSharding(mesh, P('data')), 'replica')),
    ...                donate_argnames=('state',))
    >>> for _ in range(2):
    ...   state, loss = step(state, jnp.ones((16, 2)))  # replica r trains on rows [4 r, 4 r + 4)
    >>> [f'{x:.2f}' for x in loss.tolist()]  # one loss per replica
    ['0.49', '0.40', '0.32', '0.25']

    The same 4 replicas, 2 on each of 2 groups of 4 devices: only the mesh and ``per_device`` change.

    >>> mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ('replica', 'data'))
    >>> step = jax.jit(hdet_jax.over_replicas(train_step, mesh, 'replica', per_device=2))
    >>> state = hdet_jax.stack_replicas((jnp.zeros(2), tx.init(jnp.zeros(2))), 4)
    >>> for _ in range(2):
    ...   state, loss = step(state, jnp.ones((16, 2)))
    >>> [f'{x:.2f}' for x in loss.tolist()]
    ['0.49', '0.40', '0.32', '0.25']
  """
  return _map_replicas(
    train_step,
    mesh,
    replica_axis,
    stacked_argnums=None,
    batch_argnames=batch_argnames,
    check_vma=False,
    per_device=per_device,
    local_axis=axes_lib.LOCAL_AXIS,
    who='over_replicas',
    keep_name=True,
  )


def evaluate_over_replicas(
  eval_step: Callable[..., Any],
  mesh: jax.sharding.Mesh,
  replica_axis: str = 'data',
  *,
  batch_argnames: tuple[str, ...] = ('batch',),
  per_device: int = 1,
  reduce: Any = 'mean',
) -> Callable[..., Any]:
  """The trainer's eval step on the replicas' average, each replica group evaluating its share of the batch.

  ``eval_step(params, batch)`` stays as it is. The returned function takes the *stacked* parameters
  (``state.params``, ``[N, ...]``) and the global eval batch ``[B, ...]``: under :func:`over_replicas` every
  replica averages the stacked arguments across replicas (``pmean``: one all-reduce of the parameters, as at a
  sync), runs ``eval_step`` on its ``B / N`` rows, and the N results are averaged. Every replica holds
  ``B / N`` rows, so the mean of their row means is the global batch's mean (a sum over rows comes back
  divided by N). The result is ``eval_step(average_replicas(params), batch)`` on one device to float32
  rounding (``pmean`` is a sum divided by N, :func:`average_replicas` ``x0 + mean(x - x0)``).

  ``reduce`` says how the N shards' results of each output become the batch's:

  .. math::

    \\mathrm{mean}: \\frac{1}{N} \\sum_r y_r, \\qquad \\mathrm{sum}: \\sum_r y_r, \\qquad
    \\text{a callable } f: f([y_0, \\ldots, y_{N-1}])

  - ``'mean'`` (the default): right for a mean over the rows (every shard holds ``B / N`` rows), wrong for a
    count, a sum, or a mean over masked tokens whose count differs between the shards.
  - ``'sum'``: sums and counts (``jnp.sum(loss * mask)``, ``jnp.sum(mask)``), summed over the shards; an
    integer count stays an exact integer. The count-weighted mean ``loss_sum / tokens`` is then the one
    device's to float32 rounding (tests/test_eval_pattern.py, masks that differ per shard: 1.4e-7 measured, 4e-6
    the bound).
  - a callable: gets the shards' results stacked ``[N, ...]`` (row r: rows ``[r B/N, (r+1) B/N)`` of the batch)
    and returns the output, e.g. a count-weighted mean from each shard's mean and count,
    ``lambda y: {'loss': jnp.sum(y['loss'] * y['tokens']) / jnp.sum(y['tokens']), 'tokens': jnp.sum(y['tokens'])}``.
  - a pytree of those, a prefix of the eval step's outputs: ``{'loss_sum': 'sum', 'tokens': 'sum', 'acc':
    'mean'}``; a string applies to every output below it, a callable gets its part of the outputs whole.

  ``jax.jit(eval_step)`` of :func:`average_replicas` splits the batch over every device only while nothing
  pins its rows to the trainer's axes: a ``with_sharding_constraint(batch, P('data'))`` in the eval step,
  or an eval batch put on ``P('data')``, leaves each replica group evaluating the whole batch. Here each
  group evaluates its rows whatever the step constrains. ``per_device`` and ``batch_argnames`` are
  :func:`over_replicas`'; jit the result, with the batch put with :func:`~hdet_jax.batch_shardings` where it can be.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, hdet_jax
    >>> from jax.sharding import Mesh
    >>> mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('replica', 'data'))
    >>> def eval_step(params, batch):  # the trainer's own, unchanged
    ...   return jnp.mean((batch @ params['w'] - 1) ** 2)
    >>> params = {'w': jnp.arange(8.0).reshape(4, 2) / 8}  # 4 replicas' weights, stacked [N, 2]
    >>> batch = jnp.linspace(0.0, 1.0, 32).reshape(16, 2)  # replica r evaluates rows [4 r, 4 r + 4)
    >>> evaluate = jax.jit(hdet_jax.evaluate_over_replicas(eval_step, mesh, 'replica'))
    >>> f'{evaluate(params, batch):.5f}'
    '0.38186'
    >>> f'{jax.jit(eval_step)(hdet_jax.average_replicas(params), batch):.5f}'  # the average on one device
    '0.38186'

    A masked eval step returning sums and counts, summed over the shards, whose counts differ:

    >>> def masked_step(params, batch):
    ...   err = (batch['x'] @ params['w'] - 1) ** 2
    ...   return {'loss_sum': jnp.sum(err * batch['mask']), 'tokens': jnp.sum(batch['mask'])}
    >>> masked = {'x': batch, 'mask': (jnp.arange(16) % 4 < jnp.arange(16) // 4).astype(jnp.int32)}
    >>> out = jax.jit(hdet_jax.evaluate_over_replicas(masked_step, mesh, 'replica', reduce='sum'))(params, masked)
    >>> f'{out["loss_sum"] / out["tokens"]:.5f}', int(out['tokens'])  # the count-weighted mean: 0 + 1 + 2 + 3 rows
    ('0.21304', 6)
    >>> one = jax.jit(masked_step)(hdet_jax.average_replicas(params), masked)
    >>> f'{one["loss_sum"] / one["tokens"]:.5f}'
    '0.21304'
  """
  batch_argnames, signature = _checked_map_args(
    eval_step, mesh, replica_axis, batch_argnames, per_device, 'evaluate_over_replicas'
  )
  _check_reduce(reduce, 'evaluate_over_replicas')
  mean = lambda x: axes_lib.pmean(x, replica_axis) if jnp.issubdtype(jnp.result_type(x), jnp.inexact) else x

  @functools.wraps(eval_step)
  def evaluate(*args, **kwargs):
    bound = _bind(signature, args, kwargs)
    stacked = [
      n not in batch_argnames and _holds_arrays(v) and any(jnp.ndim(x) for x in jax.tree.leaves(v)) for n, v in bound
    ]

    @functools.wraps(eval_step)
    def on_average(*args, **kwargs):  # one replica: its rows, and the replicas' mean of the stacked arguments
      local = _bind(signature, args, kwargs)
      return _call(eval_step, local, [jax.tree.map(mean, v) if s else v for s, (_, v) in zip(stacked, local)])

    mapped = over_replicas(on_average, mesh, replica_axis, batch_argnames=batch_argnames, per_device=per_device)
    return reduce_replicas(mapped(*args, **kwargs), reduce, 'evaluate_over_replicas')

  return evaluate


# reduce='mean' | 'sum' over the leading [N] axis (jnp here; numpy on the host, views.host_metrics).
_REDUCTIONS = {'mean': lambda x: jnp.mean(x, axis=0), 'sum': lambda x: jnp.sum(x, axis=0)}


def _is_reduction(how) -> bool:
  return callable(how) or (isinstance(how, str) and how in _REDUCTIONS)


def _check_reduce(reduce, who: str) -> None:
  """One clear error for a ``reduce=`` whose leaves are not ``'mean'``, ``'sum'`` or callables, before any work."""
  leaves = jax.tree.leaves(reduce, is_leaf=callable)
  bad = [how for how in leaves if not _is_reduction(how)]
  if not leaves or bad:
    raise ValueError(
      f"{who}: reduce={(bad[0] if bad else reduce)!r} is not a reduction; pass reduce='mean' (a mean over rows), "
      "'sum' (sums and counts), a callable of the replicas' stacked [N, ...] results, or a pytree of those "
      "matching the outputs (e.g. {'loss_sum': 'sum', 'tokens': 'sum'})."
    )


def reduce_replicas(stacked: ArrayTree, reduce: Any = 'mean', who: str = 'reduce_replicas') -> ArrayTree:
  """Each output's N stacked results ``[N, ...]`` reduced over the leading axis as ``reduce`` says (see
  :func:`evaluate_over_replicas`: ``'mean'``, ``'sum'``, a callable of the stacked part, or a pytree prefix of
  ``stacked`` holding those)."""
  if not _is_reduction(reduce):  # a pytree: one reduction per output, or per part of them
    try:
      parts = jax.tree.structure(reduce, is_leaf=callable).flatten_up_to(stacked)
    except (ValueError, TypeError) as e:
      raise ValueError(
        f'{who}: reduce={reduce!r} does not match the outputs {jax.tree.structure(stacked)}; give one of '
        "'mean', 'sum' or a callable for each output (a dict with the outputs' keys), or one for all."
      ) from e
    hows = jax.tree.leaves(reduce, is_leaf=callable)
    return jax.tree.unflatten(
      jax.tree.structure(reduce, is_leaf=callable), [reduce_replicas(p, h, who) for h, p in zip(hows, parts)]
    )
  if callable(reduce):
    return reduce(stacked)
  return jax.tree.map(_REDUCTIONS[reduce], stacked)


def _check_replica_count(bound, roles, devices: int, per_device: int, replica_axis: str, who: str) -> None:
  """The stacked arguments hold ``devices * per_device`` replicas on their leading axis, or one clear error."""
  counts = sorted(
    {
      jnp.shape(x)[0]
      for (_, value), r in zip(bound, roles)
      if r == 'stacked'
      for x in jax.tree.leaves(value, is_leaf=sync_lib._is_anchor)  # (an anchor may be held once per device)
      if not sync_lib._is_anchor(x) and jnp.ndim(x)
    }
  )
  if len(counts) > 1:
    raise ValueError(
      f'{who}: the stacked arguments disagree on the number of replicas (leading axes {counts}); stack every '
      'leaf of the state with hdet_jax.stack_replicas(tree, N).'
    )
  if counts and counts[0] != devices * per_device:
    n = counts[0]
    fix = (
      f'pass per_device={n // devices} (N / D)'
      if n % devices == 0
      else f'use a multiple of {devices} replicas, or a mesh whose {replica_axis!r} axis divides {n}'
    )
    raise ValueError(
      f'{who}: the state holds N={n} replicas and the mesh axis {replica_axis!r} has D={devices} devices, so '
      f'per_device={per_device} does not fit (N = D * per_device); {fix}.'
    )


def _check_batch_rows(bound, roles, n: int, who: str) -> None:
  """Every batch leaf's rows split evenly over the ``n`` replicas, at least one row each (an empty batch would
  give every replica the mean of no rows, NaN, without a word)."""
  for (name, value), r in zip(bound, roles):
    rows = sorted({jnp.shape(x)[0] if jnp.ndim(x) else 0 for x in jax.tree.leaves(value)}) if r == 'batch' else []
    bad = next((b for b in rows if b < n or b % n), None)
    if bad is not None:
      raise ValueError(
        f'{who}: the batch {name!r} has {bad} rows, which {n} replicas cannot share (replica r trains on rows '
        f'[r B/N, (r+1) B/N)); pass a batch of a positive multiple of {n} rows.'
      )


def _signature(fn) -> inspect.Signature | None:
  try:
    return inspect.signature(fn)
  except (TypeError, ValueError):  # some builtins and C callables have none: positional calls only
    return None


def _bind(signature, args, kwargs) -> list[tuple[str | None, Any]]:
  """The call's arguments in ``fn``'s parameter order, as (parameter name, value) pairs.

  Keyword arguments bind as ``fn`` would bind them; ``*args`` and ``**kwargs`` parameters are
  expanded, so each value keeps its own role.
  """
  if signature is None:
    if kwargs:
      raise TypeError('shard_map_replicas: this function has no readable signature; call it positionally.')
    return [(None, a) for a in args]
  bound = signature.bind(*args, **kwargs)
  bound.apply_defaults()  # every parameter present, so positions stay fn's when some are left out
  pairs = []
  for name, value in bound.arguments.items():
    kind = signature.parameters[name].kind
    if kind is inspect.Parameter.VAR_POSITIONAL:
      pairs += [(None, v) for v in value]
    elif kind is inspect.Parameter.VAR_KEYWORD:
      pairs += [(k, v) for k, v in value.items()]
    else:
      pairs.append((name, value))
  return pairs


def _call(fn, bound, values):
  """Calls ``fn`` with ``values`` in place of the bound arguments: positional where they came positionally
  in ``fn``'s order, by keyword for keyword-only parameters and ``**kwargs`` entries."""
  signature = _signature(fn)
  if signature is None:
    return fn(*values)
  args, kwargs = [], {}
  kinds = {name: p.kind for name, p in signature.parameters.items()}
  for (name, _), value in zip(bound, values):
    kind = kinds.get(name) if name is not None else None
    if name is None:
      args.append(value)
    elif kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) and not kwargs:
      args.append(value)
    else:
      kwargs[name] = value
  return fn(*args, **kwargs)


def _holds_arrays(value) -> bool:
  """Whether an argument goes through the map: a pytree of arrays (or tracers). Anything else (a Python
  number, a string, a callable: a jit's static argument) reaches ``fn`` as it is."""
  leaves = jax.tree.leaves(value)
  return bool(leaves) and all(isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves)


def _local_view(value, role: str, per_device: int):
  """One device's view of an argument: a stacked tree without its size-1 leading axis; a batch split
  into [N / D, rows per replica, ...] where the device runs several replicas."""
  if role == 'stacked' and per_device == 1:
    return jax.tree.map(lambda a: a[0], value)
  if role == 'batch' and per_device > 1:
    return jax.tree.map(lambda a: a.reshape((per_device, a.shape[0] // per_device) + a.shape[1:]), value)
  return value
