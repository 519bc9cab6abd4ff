"""The device layout: the mesh, the shardings of the stacked replicas, and moving arrays on and off it.

Every leaf of the parameters, the optimizer state and the batch carries a leading replica axis of size
N, sharded ``P('data')`` over a one-axis mesh of D devices, N a multiple of D: each device holds N / D
consecutive replicas, which the programs map with ``vmap`` over the axis ``'local'``; the replica axis is
then the pair ``('data', 'local')`` (:func:`replica_axis`; just ``'data'`` with one replica per device).
With ``mesh.fsdp = F > 1`` and/or ``mesh.tensor = K > 1``
the mesh is ``('data', 'fsdp', 'tensor')`` of N x F x K devices (size-1 axes left out): a replica is a
group of F x K devices, the replica axis is still ``'data'``, and inside each group the parameters, the
optimizer's moments and the batch are sharded over ``'fsdp'``, and the kernels a task's
``tensor_rules`` name split over ``'tensor'`` (:func:`layout`). Tasks never need to touch this file.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import hdet_jax as H
from hdet_jax.trainer import tasks as tasks_lib

AXIS = 'data'


INNER = 'fsdp'  # the FSDP axis inside a replica group (grouped meshes only)


TENSOR = 'tensor'  # the tensor-parallel axis inside a replica group (grouped meshes only)


def per_device(mesh: Mesh, num_replicas: int) -> int:
  """N / D: the replicas each device of ``mesh``'s replica axis holds."""
  return num_replicas // mesh.shape[AXIS]


def make_mesh(num_replicas: int, fsdp: int = 1, tensor: int = 1, devices: int | None = None) -> Mesh:
  """``('data',)`` over the first ``devices`` devices (default ``num_replicas``: one replica each), or with groups
  ``('data', 'fsdp', 'tensor')`` (axes of size 1 left out) over the first N x F x K: group r is devices
  r*F*K .. (r+1)*F*K-1, neighbours, which share the fastest links on real hardware and carry the every-step traffic
  (the tensor axis innermost: its all-reduces run in every layer). Auto axis types."""
  sizes = [(a, k) for a, k in ((INNER, fsdp), (TENSOR, tensor)) if k > 1]
  shape = ((devices or num_replicas) if not sizes else num_replicas,) + tuple(k for _, k in sizes)
  devices = np.asarray(jax.devices()[: int(np.prod(shape))]).reshape(shape)
  return Mesh(devices, (AXIS,) + tuple(a for a, _ in sizes))


def rules(mesh: Mesh, task: tasks_lib.Task | None = None) -> dict:
  """``stacked_shardings``' rules on ``mesh``: the task's tensor-parallel rules, and its FSDP exceptions
  where the group also has a tensor axis (FSDP alone keeps its largest-dimension default).
  ``task`` None: the LM's."""
  task = task or tasks_lib.get()
  return dict(tensor_rules=task.tensor_rules, fsdp_rules=task.fsdp_rules if TENSOR in mesh.shape else ())


def by_rules(mesh: Mesh, stacked: Any, task: tasks_lib.Task | None = None) -> Any:
  """A stacked tree's shardings on a grouped ``mesh`` by the task's rules (``hdet_jax.stacked_shardings(mesh=)``)."""
  return H.stacked_shardings(stacked, AXIS, mesh=mesh, inner_axis=INNER, **rules(mesh, task))


def grouped(mesh: Mesh) -> bool:
  """Whether a replica is a group of devices (the mesh has axes besides the replica axis)."""
  return len(mesh.axis_names) > 1


def layout(mesh: Mesh, params: Any, opt_state: Any, task: tasks_lib.Task | None = None) -> tuple[Any, Any] | None:
  """(parameter shardings, optimizer-state shardings) per leaf on a 2-D mesh; None on a 1-D one,
  where the programs keep the plain ``P('data')`` layout (no shardings pinned on their outputs).
  ``params`` and ``opt_state`` are stacked trees of arrays or shapes."""
  if not grouped(mesh):
    return None
  return (
    by_rules(mesh, params, task),
    by_rules(mesh, opt_state, task),
  )


def param_layout(mesh: Mesh, abstract_params: Any, num_replicas: int, task: tasks_lib.Task | None = None) -> Any:
  """The stacked parameters' shardings given one replica's shapes (a prefix ``P('data')`` on 1-D meshes)."""
  if not grouped(mesh):
    return replica_sharding(mesh)
  stacked = jax.eval_shape(lambda p: H.stack_replicas(p, num_replicas), abstract_params)
  return by_rules(mesh, stacked, task)


def with_layout(mesh: Mesh, abstract: dict, task: tasks_lib.Task | None = None) -> dict:
  """``{'params', 'opt_state', ...}`` shapes given the shardings the run keeps them in (to restore)."""
  shardings = layout(mesh, abstract['params'], abstract['opt_state'], task)
  if shardings is None:
    shardings = tuple(jax.tree.map(lambda _: replica_sharding(mesh), abstract[k]) for k in ('params', 'opt_state'))
  put = lambda tree, sh: jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), tree, sh)
  return {
    **abstract,
    'params': put(abstract['params'], shardings[0]),
    'opt_state': put(abstract['opt_state'], shardings[1]),
  }


def unstacked_layout(mesh: Mesh, stacked: Any, task: tasks_lib.Task | None = None) -> Any:
  """The shardings of one copy of a stacked tree (its leading replica axis dropped), replicated over the replica
  axis and, on a 2-D mesh, split inside each group as the stacked leaves are (e.g. the rollback's anchor).
  ``stacked`` holds arrays or shapes."""
  if not grouped(mesh):
    return jax.tree.map(lambda _: replicated(mesh), stacked)
  groups = by_rules(mesh, stacked, task)
  return jax.tree.map(lambda s: NamedSharding(mesh, P(*s.spec[1:])), groups)


def anchor_layout(mesh: Mesh, params: Any, inner: Any, task: tasks_lib.Task | None = None) -> dict:
  """The rollback anchor's shardings given the stacked ``params`` and wrapped optimizer state ``inner``: one copy
  of each (:func:`unstacked_layout`), and the training loss of the window it ends with its standard error,
  replicated."""
  return {
    **unstacked_layout(mesh, {'params': params, 'inner': inner}, task),
    'train_loss': replicated(mesh),
    'train_loss_se': replicated(mesh),
  }


def stacked_anchor_layout(mesh: Mesh, anchor: Any, task: tasks_lib.Task | None = None) -> Any:
  """The shardings of the anchor the loop holds (one copy per device or group, ``[D, ...]``; arrays or shapes):
  ``P('data')``, and on a 2-D mesh split inside each group as the state it copies."""
  if not grouped(mesh):
    return jax.tree.map(lambda _: replica_sharding(mesh), anchor)
  return by_rules(mesh, anchor, task)


def anchor_shapes(mesh: Mesh, abstract: dict, task: tasks_lib.Task | None = None) -> dict:
  """The rollback anchor's shapes in the layout the run keeps it in (:func:`anchor_layout`; to restore it)."""
  params, inner = abstract['params'], abstract['opt_state'].inner_state
  one = lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype)  # a replica's
  scalar = jax.ShapeDtypeStruct((), np.float32)
  shapes = {
    'params': jax.tree.map(one, params),
    'inner': jax.tree.map(one, inner),
    'train_loss': scalar,
    'train_loss_se': scalar,
  }
  return jax.tree.map(
    lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), shapes, anchor_layout(mesh, params, inner, task)
  )


def replica_sharding(mesh: Mesh) -> NamedSharding:
  """The core's :func:`hdet_jax.shardings.replica_sharding` on the trainer's replica axis."""
  return H.shardings.replica_sharding(mesh, AXIS)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def put_stacked(x: Any, mesh: Mesh, batch_dim: int | None = None) -> Any:
  """A host array ``[N, ...]`` (the same on every process), or a pytree of them (a task's batch), as
  global arrays sharded ``P('data')``; on a 2-D mesh their ``batch_dim`` is also split over 'fsdp'
  (each device of a group gets its share of the group's examples) when the group's size divides it."""
  if not isinstance(x, np.ndarray):
    return jax.tree.map(lambda a: put_stacked(np.asarray(a), mesh, batch_dim), x)
  sharding = replica_sharding(mesh)
  if INNER in mesh.shape and batch_dim is not None and x.shape[batch_dim] % mesh.shape[INNER] == 0:
    sharding = NamedSharding(mesh, P(AXIS, *[None] * (batch_dim - 1), INNER))
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def barrier(name: str) -> None:
  """Every process waits here until all have reached ``name`` (a no-op with one process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def fetch(tree: Any) -> Any:
  """Global arrays to host numpy, gathering across processes when needed."""
  leaves = jax.tree.leaves(tree)
  if all(not isinstance(a, jax.Array) or a.is_fully_addressable for a in leaves):
    return jax.tree.map(np.asarray, jax.device_get(tree))  # all copies started before any wait

  def get(a):
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
      from jax.experimental import multihost_utils

      return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return np.asarray(a)

  return jax.tree.map(get, tree)
