"""The shardings of stacked replicas, one family: a stacked tree's and a split batch's.

- :func:`stacked_shardings`: a stacked tree ``[N, ...]``, the replica axis first and each replica laid out as your
  trainer lays out one (its shardings given), or by HDET's rules on a mesh of replica groups (``mesh=``: FSDP over
  ``inner_axis``, tensor-parallel rules, an :class:`~hdet_jax.HDETState`'s own fields whole in each group);
- :func:`batch_shardings`: a global batch split by rows over the replicas.

``group_shardings`` and ``state_shardings`` (1.0) are :func:`stacked_shardings` with ``mesh=`` under their old
names, kept until the next major release. HDET's rules for a mesh of replica groups close the module: one leaf's
sharding (:func:`rule_sharding`), its spec (:func:`inner_spec`) and the dimension a rule splits (:func:`tensor_dim`).
"""

from __future__ import annotations

import re
import warnings
from typing import Any

from chex import ArrayTree
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hdet_jax import arguments
from hdet_jax.param_groups import path_string
from hdet_jax.transform import HDETState


def stacked_shardings(
  tree: ArrayTree,
  replica_axis: str = 'data',
  *,
  mesh: jax.sharding.Mesh | None = None,
  inner_axis: str | None = 'fsdp',
  tensor_axis: str = 'tensor',
  tensor_rules: tuple[tuple[str, int], ...] = (),
  fsdp_rules: tuple[tuple[str, int], ...] = (),
) -> ArrayTree:
  """The shardings of a stacked tree ``[N, ...]``: the replica axis first, each replica laid out as one is.

  Two ways to say how one replica is laid out:

  - ``tree`` holds one replica's shardings (``NamedSharding`` or ``PartitionSpec`` leaves: your trainer's own, from
    ``nn.get_sharding`` or your rules): ``P(*spec)`` becomes ``P(replica_axis, *spec)``, so each replica's copy
    lives, sharded as before, on its own slice of the mesh;
  - ``tree`` is the stacked tree itself (arrays or ``jax.ShapeDtypeStruct``) and ``mesh`` a mesh of replica groups:
    HDET's rules lay each replica out inside its group. Leaves matching a tensor-parallel rule (``(regex, dim)``
    pairs searched in the leaf's path; Megatron style: column-parallel kernels split on their output dimension,
    row-parallel ones on their input) are split over ``tensor_axis``; FSDP then shards the dimension an FSDP rule
    names, or else the largest other dimension ``inner_axis`` divides. An :class:`~hdet_jax.HDETState` anywhere in
    the tree keeps its own fields (a count, ``[G, N]`` values, the controller's few numbers) whole in each group,
    where every device reads them each step, and lays its wrapped optimizer's state out as the parameters. With
    neither axis in the mesh (or both of size 1) every leaf is ``P(replica_axis)``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, hdet_jax
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('replica', 'data'))  # the step's mesh: (8,), ('data',)
    >>> state_sharding = {'w': NamedSharding(mesh, P(None, 'data')), 'count': NamedSharding(mesh, P())}
    >>> jax.tree.map(lambda s: tuple(s.spec), hdet_jax.stacked_shardings(state_sharding, 'replica'))
    {'count': ('replica',), 'w': ('replica', None, 'data')}

    By HDET's rules, 4 replica groups of 2 devices, FSDP and then tensor parallel inside each group:

    >>> params = hdet_jax.stack_replicas({'fc1': {'kernel': jnp.ones((4, 6)), 'bias': jnp.ones(6)},
    ...                                   'fc2': {'kernel': jnp.ones((6, 4))}}, 4)
    >>> mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('replica', 'fsdp'))
    >>> params = jax.device_put(params, hdet_jax.stacked_shardings(params, 'replica', mesh=mesh))
    >>> jax.tree.map(lambda x: tuple(x.sharding.spec), params)
    {'fc1': {'bias': ('replica', 'fsdp'), 'kernel': ('replica', None, 'fsdp')},
     'fc2': {'kernel': ('replica', 'fsdp')}}
    >>> mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('replica', 'tensor'))
    >>> rules = ((r'fc1/(kernel|bias)$', -1), (r'fc2/kernel$', 0))  # column-, then row-parallel
    >>> shardings = hdet_jax.stacked_shardings(params, 'replica', mesh=mesh, inner_axis=None, tensor_rules=rules)
    >>> jax.tree.map(lambda s: tuple(s.spec), shardings)
    {'fc1': {'bias': ('replica', 'tensor'), 'kernel': ('replica', None, 'tensor')},
     'fc2': {'kernel': ('replica', 'tensor')}}
  """
  arguments.axis_name(replica_axis, 'replica_axis', who='stacked_shardings')
  if mesh is None:
    return jax.tree.map(lambda s: _map_spec(s, lambda spec: P(replica_axis, *spec)), tree, is_leaf=_is_sharding)
  arguments.mesh_axis(mesh, replica_axis, 'replica_axis', who='stacked_shardings')
  rules = dict(tensor_axis=tensor_axis, tensor_rules=tensor_rules, fsdp_rules=fsdp_rules)

  def place(path, node):
    if isinstance(node, HDETState):
      return _state_by_rules(node, mesh, replica_axis, inner_axis, rules)
    return rule_sharding(path, node, mesh, replica_axis, inner_axis, **rules)

  return jax.tree_util.tree_map_with_path(place, tree, is_leaf=lambda x: isinstance(x, HDETState))


def _state_by_rules(state: HDETState, mesh, replica_axis, inner_axis, rules) -> HDETState:
  """An HDETState's shardings: its own fields whole in each group; the wrapped optimizer's state (Adam's moments:
  the parameters' shapes, paths that end with the parameters') and the rollback's copy laid out as what they copy."""
  split = lambda tree: _by_rules(tree, mesh, replica_axis, inner_axis, rules)
  whole = jax.tree.map(lambda x: replica_sharding(mesh, replica_axis), state)
  if getattr(state, 'anchor', None) is not None:
    anchor = whole.anchor._replace(params=split(state.anchor.params), inner_state=split(state.anchor.inner_state))
    whole = whole._replace(anchor=anchor)
  return whole._replace(inner_state=split(state.inner_state))


def _by_rules(tree: ArrayTree, mesh, replica_axis, inner_axis, rules) -> ArrayTree:
  """Every leaf of a stacked tree laid out by HDET's rules (:func:`rule_sharding`)."""
  return jax.tree_util.tree_map_with_path(
    lambda path, x: rule_sharding(path, x, mesh, replica_axis, inner_axis, **rules), tree
  )


def batch_shardings(shardings: ArrayTree, replica_axis: str = 'data') -> ArrayTree:
  """The shardings of a global batch split by rows over the replicas: the replica axis joins the
  leading dimension's axes (``P('data')`` becomes ``P(('replica', 'data'))``), so each replica's rows
  are on its own devices and split as before inside them.

  Example:
    >>> import jax, numpy as np, hdet_jax
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('replica', 'data'))
    >>> tuple(hdet_jax.batch_shardings(NamedSharding(mesh, P('data')), 'replica').spec)
    (('replica', 'data'),)
  """

  arguments.axis_name(replica_axis, 'replica_axis', who='batch_shardings', pair=False)

  def spec(spec):
    first = spec[0] if len(spec) else None
    first = () if first is None else (first,) if isinstance(first, str) else tuple(first)
    return P((replica_axis, *first), *spec[1:])

  return jax.tree.map(lambda s: _map_spec(s, spec), shardings, is_leaf=_is_sharding)


def state_shardings(
  state: HDETState, mesh: jax.sharding.Mesh, replica_axis: str = 'data', inner_axis: str | None = 'fsdp', **tensor
) -> HDETState:
  """Deprecated (1.0's name): ``stacked_shardings(state, replica_axis, mesh=mesh, inner_axis=inner_axis, ...)``,
  which lays out any stacked tree, an :class:`~hdet_jax.HDETState` in it included."""
  _deprecated('state_shardings(state, mesh, ...)', 'stacked_shardings(state, replica_axis, mesh=mesh, ...)')
  return stacked_shardings(state, replica_axis, mesh=mesh, inner_axis=inner_axis, **tensor)


def group_shardings(
  stacked: ArrayTree,
  mesh: jax.sharding.Mesh,
  replica_axis: str = 'data',
  inner_axis: str | None = 'fsdp',
  *,
  tensor_axis: str = 'tensor',
  tensor_rules: tuple[tuple[str, int], ...] = (),
  fsdp_rules: tuple[tuple[str, int], ...] = (),
) -> ArrayTree:
  """Deprecated (1.0's name): ``hdet_jax.stacked_shardings(stacked, replica_axis, mesh=mesh, inner_axis=...)``,
  the same per-leaf ``NamedSharding`` of a stacked tree on a mesh of replica groups (FSDP and/or tensor parallel;
  :mod:`hdet_jax.shardings` says how). Kept until the next major release."""
  _deprecated('group_shardings(stacked, mesh, ...)', 'stacked_shardings(stacked, replica_axis, mesh=mesh, ...)')
  arguments.mesh_axis(mesh, replica_axis, 'replica_axis', who='group_shardings')
  rules = dict(tensor_axis=tensor_axis, tensor_rules=tensor_rules, fsdp_rules=fsdp_rules)
  return _by_rules(stacked, mesh, replica_axis, inner_axis, rules)


def _deprecated(old: str, new: str) -> None:
  warnings.warn(f'hdet_jax.{old} is deprecated: use hdet_jax.{new}, the same shardings.', DeprecationWarning, 3)


def _is_sharding(x: Any) -> bool:
  return isinstance(x, (NamedSharding, P))


def _map_spec(sharding, fn):
  if isinstance(sharding, NamedSharding):
    return NamedSharding(sharding.mesh, fn(sharding.spec), memory_kind=sharding.memory_kind)
  if isinstance(sharding, P):
    return fn(sharding)
  raise ValueError(
    f'stacked_shardings/batch_shardings: expected NamedSharding or PartitionSpec leaves, got '
    f'{type(sharding).__name__}; build the shardings on a jax.sharding.Mesh, or pass mesh= to lay out a stacked '
    "tree of arrays by HDET's rules."
  )


def rule_sharding(
  path: Any,
  x: Any,
  mesh: jax.sharding.Mesh,
  replica_axis: str,
  inner_axis: str | None,
  *,
  tensor_axis: str = 'tensor',
  tensor_rules: tuple[tuple[str, int], ...] = (),
  fsdp_rules: tuple[tuple[str, int], ...] = (),
) -> NamedSharding:
  """One stacked leaf's sharding by HDET's rules (``hdet_jax.stacked_shardings(..., mesh=)``): the replica axis
  first, the tensor-parallel rule's dimension over ``tensor_axis``, FSDP over ``inner_axis`` (:func:`inner_spec`)."""
  shape = tuple(x.shape)
  name = path_string(path)
  size = mesh.shape.get(inner_axis, 1) if inner_axis else 1
  dim = tensor_dim(name, shape, tensor_rules, mesh.shape.get(tensor_axis, 1)) if tensor_rules else None
  fdim = tensor_dim(name, shape, fsdp_rules, size, 'fsdp') if fsdp_rules else None
  return NamedSharding(
    mesh, inner_spec(shape, replica_axis, inner_axis, size, tensor_axis=tensor_axis, tensor_dim=dim, inner_dim=fdim)
  )


def replica_sharding(mesh: jax.sharding.Mesh, replica_axis: str = 'data') -> NamedSharding:
  """The sharding of a stacked leaf: leading axis over the replica axis, the rest replicated."""
  return NamedSharding(mesh, P(replica_axis))


def inner_spec(
  shape: tuple[int, ...],
  replica_axis: str,
  inner_axis: str | None,
  inner_size: int,
  *,
  tensor_axis: str | None = None,
  tensor_dim: int | None = None,
  inner_dim: int | None = None,
) -> P:
  """The spec of a stacked leaf ``[N, ...]``: replica axis first, the inner axes on one dim each.

  ``tensor_dim`` (a dimension of the unstacked leaf, from a tensor-parallel rule) is split over
  ``tensor_axis``. The inner (FSDP) axis goes on ``inner_dim`` if given (from an FSDP rule), else on
  the largest other dimension after the leading one that it divides (the first such on ties), so
  parameters and the optimizer state built from them (Adam's moments share their shapes) shard the
  same way. A leaf with no such dimension (a scalar count, a vector shorter than the group) stays
  whole over that axis: it is small. ``-1`` for either dim (a rule's None) keeps the leaf whole.
  """
  axes: dict[int, str] = {}
  if inner_dim == _WHOLE:
    inner_axis = None
  if tensor_axis is not None and tensor_dim == _WHOLE:
    tensor_dim = None
  if tensor_axis is not None and tensor_dim is not None:
    axes[tensor_dim + 1] = tensor_axis
  dims = [
    i
    for i in range(1, len(shape))
    if inner_axis
    and inner_size > 1
    and shape[i] % inner_size == 0
    and i not in axes
    and (inner_dim is None or i == inner_dim + 1)
  ]
  if dims:
    axes[max(dims, key=lambda i: (shape[i], -i))] = inner_axis
  if not axes:
    return P(replica_axis)
  return P(replica_axis, *[axes.get(i) for i in range(1, max(axes) + 1)])


_WHOLE = -1  # tensor_dim's answer for a rule whose dimension is None


def tensor_dim(path: str, shape: tuple[int, ...], rules, tensor_size: int, what: str = 'tensor') -> int | None:
  """The unstacked dimension a tensor-parallel (or FSDP) rule splits, for a leaf at ``path`` of stacked ``shape``.

  ``rules`` are ``(regex, dim)`` pairs (``dim`` None: keep the leaf whole over the axis), searched in
  order in the leaf's path (``'blocks/0/fc1/kernel'``;
  an optimizer state's moments end with their parameter's path, so they match the same rule). The
  first match wins; no match, or a size-1 axis, is None. A matched dimension the axis does not divide
  raises, naming the rule: the partitioner would otherwise pad it silently.
  """
  if tensor_size <= 1:
    return None
  for pattern, dim in rules:
    if re.search(pattern, path):
      if dim is None:  # the rule keeps this leaf whole over the axis
        return _WHOLE
      dim = dim + len(shape) - 1 if dim < 0 else dim  # -1: the last dimension
      if not 0 <= dim < len(shape) - 1 or shape[dim + 1] % tensor_size:
        raise ValueError(
          f'{"tensor-parallel" if what == "tensor" else what} rule ({pattern!r}, {dim}) matches {path!r} of '
          f'shape {tuple(shape[1:])}, whose dimension {dim} is not split evenly by the {what} axis of size '
          f'{tensor_size}; choose a {what} size that divides it or change the rule.'
        )
      return dim
  return None
