"""The shardings of stacked replicas, one family: a stacked tree's and a split batch's.

- :func:`stacked_shardings`: a stacked tree ``[N, ...]``, the replica axis first and each replica laid out as your
  trainer lays out one (its shardings given), or by HDET's rules on a mesh of replica groups (``mesh=``: FSDP over
  ``inner_axis``, tensor-parallel rules, an :class:`~hdet_jax.HDETState`'s own fields whole in each group);
- :func:`batch_shardings`: a global batch split by rows over the replicas.

``group_shardings`` and ``state_shardings`` (1.0) are :func:`stacked_shardings` with ``mesh=`` under their old
names, kept until the next major release.
"""

from __future__ import annotations

import warnings
from typing import Any

from chex import ArrayTree
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hdet_jax import arguments
from hdet_jax import replicas
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
  if replica_axis not in mesh.shape:
    raise ValueError(
      f'stacked_shardings: the mesh has no axis {replica_axis!r} (axes: {tuple(mesh.axis_names)}); pass '
      'replica_axis= one of them.'
    )
  rules = dict(tensor_axis=tensor_axis, tensor_rules=tensor_rules, fsdp_rules=fsdp_rules)

  def place(path, node):
    if isinstance(node, HDETState):
      return _state_by_rules(node, mesh, replica_axis, inner_axis, rules)
    return replicas.rule_sharding(path, node, mesh, replica_axis, inner_axis, **rules)

  return jax.tree_util.tree_map_with_path(place, tree, is_leaf=lambda x: isinstance(x, HDETState))


def _state_by_rules(state: HDETState, mesh, replica_axis, inner_axis, rules) -> HDETState:
  """An HDETState's shardings: its own fields whole in each group; the wrapped optimizer's state (Adam's moments:
  the parameters' shapes, paths that end with the parameters') and the rollback's copy laid out as what they copy."""
  split = lambda tree: jax.tree_util.tree_map_with_path(
    lambda path, x: replicas.rule_sharding(path, x, mesh, replica_axis, inner_axis, **rules), tree
  )
  whole = jax.tree.map(lambda x: replicas.replica_sharding(mesh, replica_axis), state)
  if getattr(state, 'anchor', None) is not None:
    anchor = whole.anchor._replace(params=split(state.anchor.params), inner_state=split(state.anchor.inner_state))
    whole = whole._replace(anchor=anchor)
  return whole._replace(inner_state=split(state.inner_state))


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
