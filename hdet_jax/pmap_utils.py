"""HDET in a ``jax.pmap`` trainer: the stacked state between the host and the devices, the average for evaluation,
and per-replica state outside the optimizer (BatchNorm's ``batch_stats``) averaged at the syncs.

Under ``jax.pmap(step, axis_name='batch')`` one replica runs on each device: the step is written for one replica,
the pmap's ``axis_name`` is HDET's ``replica_axis``, and ``num_replicas`` is the number of devices the pmap runs on
(``jax.device_count()``, every host's devices, where it spans hosts). What the docs' pmap page (``docs/pmap.md``)
says, in short:

- **The state is mapped like the batch.** The train state is stacked, ``[N, ...]`` on every leaf
  (:func:`hdet_jax.stack_replicas`), because the replicas differ between syncs; pmap maps it over its leading axis,
  ``in_axes=0`` (pmap's default), never ``None``. With ``in_axes=None`` every device would get the whole stacked
  state: the step fails while it is traced (a flax model's shape check names the ``[N, ...]`` parameter, and
  ``tx.update`` refuses the stacked state in one line).
- **Checkpoints hold every replica.** :func:`replicas_to_host` replaces a pmap trainer's
  ``jax.device_get(jax.tree.map(lambda x: x[0], state))`` (replica 0 alone: under HDET a silent loss of the other
  N - 1) with the ``[N, ...]`` state as host numpy arrays; :func:`replicas_to_devices` replaces
  ``flax.jax_utils.replicate`` after a restore, putting replica r back on device r in the sharding pmap gives its
  outputs (pmap refuses arrays committed to one device, as a checkpoint restores them). Both refuse a state that
  holds one replica.
- **Evaluate the average.** :func:`pmap_average` is the replicas' mean on every device, one compiled pmap
  (two all-reduces of the tree's bytes): the input of the trainer's pmapped eval step.
- **BatchNorm's statistics stay per replica and are averaged at the syncs.** :func:`average_at_sync`, in the step:
  each replica's running statistics follow its own parameters (its own learning rate) between syncs, and at a sync,
  where HDET averages the parameters, the statistics are averaged too, under the same non-finite guard.

Example:
  >>> import jax, jax.numpy as jnp, numpy as np, hdet_jax
  >>> state = hdet_jax.stack_replicas({'w': jnp.arange(3.0)}, 8)  # [N, ...] with N = 8 devices
  >>> on_devices = hdet_jax.replicas_to_devices(state)  # what a restore gives pmap
  >>> on_devices['w'].sharding.spec == jax.sharding.PartitionSpec('replica'), len(on_devices['w'].devices())
  (True, 8)
  >>> on_host = hdet_jax.replicas_to_host(on_devices)  # what a checkpoint saves: every replica
  >>> type(on_host['w']).__name__, on_host['w'].shape
  ('ndarray', (8, 3))
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from chex import ArrayTree
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hdet_jax import arguments
from hdet_jax import axes
from hdet_jax import replicas
from hdet_jax import views

# The mesh axis of the sharding replicas_to_devices gives: pmap reads only the devices and the leading axis's split,
# so any name works with any pmap axis_name; pmap names its outputs' axis after its own.
AXIS = 'replica'


def _one_replica_error(who: str, shape: tuple[int, ...]) -> ValueError:
  return ValueError(
    f"{who}: the state holds one replica (its HDETState's count has shape {shape}, not [N]): pass the stacked "
    '[N, ...] state the pmapped step returns, every replica (not jax.tree.map(lambda x: x[0], state), which keeps '
    'replica 0 alone), and restore into a stacked target (hdet_jax.stack_replicas(state, N)).'
  )


def _replica_count(tree: ArrayTree, name: str, who: str) -> int | None:
  """N, the leading axis of a stacked tree; one error line where an HDETState in it holds one replica, or where a
  leaf has no leading axis or the leaves disagree."""
  for found in jax.tree.leaves(tree, is_leaf=views._is_hdet_state):
    if views._is_hdet_state(found):
      count = found.count if hasattr(found, 'count') else found['count']
      if jnp.ndim(count) != 1:
        raise _one_replica_error(who, tuple(jnp.shape(count)))
  return replicas.leading_axis(tree, name, who=who)


def _hdet_replicas(tree: ArrayTree) -> int | None:
  """N as an HDETState in ``tree`` knows it (its ``values`` are [..., G, N]), else None."""
  for found in jax.tree.leaves(tree, is_leaf=views._is_hdet_state):
    if views._is_hdet_state(found):
      values = found.values if hasattr(found, 'values') and not callable(found.values) else found['values']
      return int(jnp.shape(values)[-1])
  return None


def _process_local(x) -> bool:
  """Whether ``x`` is a pmap output across processes: this process's replicas only, ``[local devices, ...]``, one
  on each of its devices (pmap gives each process its own rows of a multi-process pmap)."""
  return (
    jax.process_count() > 1
    and isinstance(x, jax.Array)
    and x.is_fully_addressable
    and jnp.ndim(x) >= 1
    and x.shape[0] == jax.local_device_count() == len(x.devices())
  )


def _devices(devices: Sequence[jax.Device] | None, n: int | None, who: str) -> tuple[jax.Device, ...]:
  """The devices the replicas go to (every process's, ``jax.devices()``, by default): one per replica."""
  if devices is not None and not (
    isinstance(devices, Sequence) and devices and all(isinstance(d, jax.Device) for d in devices)
  ):
    raise ValueError(f"{who}: devices must be a non-empty sequence of jax devices (the pmap's), got {devices!r}.")
  devices = tuple(jax.devices() if devices is None else devices)
  if n is not None and n != len(devices):
    raise ValueError(
      f'{who}: the state holds {n} replicas but there are {len(devices)} devices; pmap runs one replica per device: '
      f'build hdet(num_replicas={len(devices)}) and stack_replicas(state, {len(devices)}), or pass the {n} devices '
      'the pmap runs on as devices= (and to jax.pmap).'
    )
  return devices


def replicas_to_host(state: ArrayTree) -> ArrayTree:
  """The stacked ``[N, ...]`` state as host numpy arrays, every replica: what a pmap trainer saves.

  A pmap trainer saves ``jax.device_get(jax.tree.map(lambda x: x[0], state))``, device 0's copy, since its devices
  hold the same state. Under HDET device r holds replica r, which differs from the others between syncs (its
  parameters, BatchNorm statistics and HDET's own per-replica fields), so that save keeps replica 0 and drops the
  rest without a word, and the restore returns a state of one replica. This gives every replica instead; save it
  with ``flax.training.checkpoints.save_checkpoint`` or orbax as before, and put it back with
  :func:`replicas_to_devices`. The values are the devices' own, bit for bit.

  Where the pmap spans processes (multi-host pmap), it gives each process its own replicas, ``[local devices,
  ...]``; this gathers every process's, in order (``jax.experimental.multihost_utils.process_allgather``, a
  collective: every process must call this), and each process then holds the whole ``[N, ...]`` state and saves it
  as on one host. A state that holds fewer replicas than its HDETState counts is refused.

  Args:
    state: the stacked train state the pmapped step returns (or any stacked tree: the parameters alone).

  Returns:
    The same tree, numpy arrays ``[N, ...]``.

  Raises:
    ValueError: where the state holds one replica (an HDETState's ``count`` is not ``[N]``), or a leaf has no
      leading replica axis.

  Example:
    >>> import jax, jax.numpy as jnp, optax, hdet_jax
    >>> tx = hdet_jax.hdet(optax.sgd(0.1), num_replicas=8, replica_axis='batch', auto_lr=hdet_jax.AutoLR(100))
    >>> params = hdet_jax.stack_replicas({'w': jnp.ones(2)}, 8)
    >>> state = {'params': params, 'opt_state': jax.vmap(tx.init)(params)}
    >>> hdet_jax.replicas_to_host(state)['params']['w'].shape
    (8, 2)
    >>> one = jax.tree.map(lambda x: x[0], state)  # a pmap trainer's usual save: replica 0
    >>> hdet_jax.replicas_to_host(one)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: replicas_to_host: the state holds one replica (its HDETState's count has shape (), not [N]): ...
  """
  _replica_count(state, 'state', 'replicas_to_host')

  def get(x):
    if isinstance(x, jax.Array) and (not x.is_fully_addressable or _process_local(x)):
      from jax.experimental import multihost_utils  # (jax's own; only where the state spans processes)

      return np.asarray(multihost_utils.process_allgather(x, tiled=True))  # every process's replicas, in order
    return np.asarray(jax.device_get(x))

  out = jax.tree.map(get, state)
  n, want = replicas.leading_axis(out, 'state', who='replicas_to_host'), _hdet_replicas(out)
  if want is not None and n != want:
    raise ValueError(
      f'replicas_to_host: the state holds {n} of its {want} replicas (HDETState.values has N = {want}): pass the '
      'whole stacked state, every process calling this where the pmap spans processes.'
    )
  return out


def replicas_to_devices(state: ArrayTree, devices: Sequence[jax.Device] | None = None) -> ArrayTree:
  """The stacked ``[N, ...]`` state with replica r on device r, as pmap takes it and gives its outputs.

  It replaces ``flax.jax_utils.replicate(state)`` of a pmap trainer, which copies one state to every device: the
  HDET state is already stacked, one replica per device. It takes the state from the host (numpy arrays, as
  :func:`replicas_to_host` gave them to a checkpoint) or from anywhere on the devices (a restore commits its arrays
  to one device, which pmap refuses: ``Sharding passed to jit does not match the sharding on the respective arg``),
  and puts leaf ``x[r]`` on ``devices[r]``: a ``NamedSharding`` over a 1-D mesh of the devices, split on the
  leading axis, pmap's own output sharding. The values are kept bit for bit.

  Across processes (multi-host pmap) every process passes the whole state and keeps the replicas of its own
  devices (``jax.make_array_from_callback``).

  Args:
    state: a stacked tree, ``[N, ...]`` on every leaf, N the number of devices.
    devices: the devices the pmap runs on, in its order (its ``devices=``); by default ``jax.devices()``, pmap's.

  Returns:
    The same tree, jax arrays sharded one replica per device.

  Raises:
    ValueError: where the state holds one replica (an HDETState's ``count`` is not ``[N]``), a leaf has no
      leading replica axis, or N is not the number of devices.

  Example:
    >>> import jax, jax.numpy as jnp, hdet_jax
    >>> state = hdet_jax.stack_replicas({'w': jnp.ones(2)}, 4)
    >>> hdet_jax.replicas_to_devices(state)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: replicas_to_devices: the state holds 4 replicas but there are 8 devices; pmap runs one replica ...
    >>> placed = hdet_jax.replicas_to_devices(state, jax.devices()[:4])
    >>> [shard.device.id for shard in placed['w'].addressable_shards], placed['w'].addressable_shards[1].data.shape
    ([0, 1, 2, 3], (1, 2))
  """
  n = _replica_count(state, 'state', 'replicas_to_devices')
  devices = _devices(devices, n, 'replicas_to_devices')
  sharding = NamedSharding(Mesh(np.array(devices, dtype=object), (AXIS,)), P(AXIS))

  def put(x):
    if sharding.is_fully_addressable:
      return jax.device_put(x, sharding)
    x = np.asarray(jax.device_get(x))  # every process holds the whole state; each keeps its devices' rows
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  return jax.tree.map(put, state)


def pmap_average(tree: ArrayTree, devices: Sequence[jax.Device] | None = None) -> ArrayTree:
  """The replicas' average on every device, ``[N, ...]`` with every row the mean: what a pmap trainer evaluates.

  .. math::

    \\bar x = x_{r_0} + \\frac{1}{|F|} \\sum_{r \\in F} (x_r - x_{r_0})

  for each floating leaf, F the replicas whose floating leaves are all finite and r_0 the first of them; integer
  and boolean leaves (step counters) are left as they are. ``x_{r_0} +`` the mean offset, as
  :func:`hdet_jax.average_replicas` computes it: where the replicas agree (right after a sync) the average is
  every replica's value bit for bit. It is one compiled ``jax.pmap`` (two all-reduces of the tree's bytes, kept
  for the next call), so it costs what an all-reduce costs, unlike ``average_replicas`` of a whole stacked train
  state outside jit. Give it what the eval step reads: the parameters and BatchNorm's statistics,
  ``pmap_average({'params': state.params, 'batch_stats': state.batch_stats})``, and keep training on ``state``
  (averaging it mid-window would be a sync HDET did not make). A replica with a non-finite leaf is left out, so
  one that blew up does not poison the evaluation; if none is finite, the leaves are NaN.

  Across processes each passes its own replicas, as the pmapped step gave them (``[local devices, ...]``), and
  gets them back averaged over all N.

  Args:
    tree: a stacked tree on the devices, ``[N, ...]`` on every leaf (what the pmapped step returns).
    devices: the devices the pmap runs on (its ``devices=``); by default ``jax.devices()``, pmap's.

  Returns:
    The same tree, every replica's row replaced by the average, one replica per device.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, hdet_jax
    >>> w = jnp.arange(8.0)[:, None] * jnp.ones((8, 2))  # replica r holds [r, r]
    >>> out = hdet_jax.pmap_average({'w': w, 'step': jnp.arange(8)})
    >>> np.asarray(out['w'][:, 0]).tolist(), np.asarray(out['step']).tolist()  # the mean 3.5; counters kept
    ([3.5, 3.5, 3.5, 3.5, 3.5, 3.5, 3.5, 3.5], [0, 1, 2, 3, 4, 5, 6, 7])
    >>> np.round(hdet_jax.pmap_average({'w': w.at[7, 0].set(jnp.nan)})['w'][0], 5).tolist()  # replica 7 sits out
    [3.0, 3.0]
  """
  n = _replica_count(tree, 'tree', 'pmap_average')
  local = jax.process_count() > 1 and all(_process_local(x) for x in jax.tree.leaves(tree))
  devices = _devices(devices, None if local else n, 'pmap_average')  # across processes: this one's replicas
  return _averaged(devices)(tree)


@functools.lru_cache(maxsize=16)
def _averaged(devices: tuple[jax.Device, ...]):
  """The compiled average over these devices (pmap compiles once per tree structure and shapes)."""

  def average(tree):
    leaves, treedef = jax.tree.flatten(tree)
    floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if not floats:
      return tree
    xs = [leaves[i] for i in floats]
    ok = axes.all_finite(xs)
    me = lax.axis_index(AXIS)
    first = lax.pmin(jnp.where(ok, me, len(devices)), AXIS)  # the first finite replica, r_0
    x0 = lax.psum([jnp.where(me == first, x, jnp.zeros_like(x)) for x in xs], AXIS)  # its values, exactly
    offsets, _ = axes.finite_mean([x - a for x, a in zip(xs, x0)], AXIS, ok)
    out = list(leaves)
    for i, a, d in zip(floats, x0, offsets):
      out[i] = (a + d).astype(leaves[i].dtype)
    return jax.tree.unflatten(treedef, out)

  return jax.pmap(average, axis_name=AXIS, devices=list(devices))


def average_at_sync(tree: ArrayTree, opt_state: Any, axis_name: axes.AxisName) -> ArrayTree:
  """``tree`` (one replica's, e.g. BatchNorm's ``batch_stats``) averaged over the replicas where HDET's update just
  synced, else as it is. Call it in the step, after the update.

  .. math::

    s_r \\leftarrow \\frac{1}{|F|} \\sum_{q \\in F} s_q \\ \\text{at a sync}, \\qquad s_r \\ \\text{otherwise}

  with F the replicas that entered the sync's parameter average (``HDETState.replica_ok``) and whose leaves of
  ``tree`` are all finite. State the model keeps beside its parameters, such as BatchNorm's running mean and
  variance, is per replica under HDET: each replica's statistics follow its own parameters, trained at its own
  learning rate, so they stay its own between syncs (a ``lax.pmean`` of them on every step would mix the
  replicas' models). At a sync HDET replaces every replica's parameters with their average, and this gives the
  statistics the same: after it every replica holds the same model again, statistics included. The guard is the
  parameters' (:func:`hdet_jax.axes.finite_mean`, as the sync uses): a replica the sync left out (its
  parameters or its loss non-finite), or whose statistics are not finite, sits out and gets the others' average.
  On other steps it sends nothing (a ``lax.cond`` on the state's ``synced`` flag). Under
  :func:`hdet_jax.multi_steps` or ``optax.MultiSteps`` it averages only on the micro-batch whose update synced.

  Args:
    tree: this replica's state to average at the syncs (floating leaves are averaged; others left as they are).
    opt_state: this replica's optimizer state after the update (``state.opt_state`` of the new ``TrainState``),
      holding one :class:`hdet_jax.HDETState`.
    axis_name: the replica axis, HDET's ``replica_axis`` (the pmap's ``axis_name``).

  Returns:
    ``tree``, averaged where the update synced.

  Example:
    >>> import jax, jax.numpy as jnp, optax, hdet_jax
    >>> tx = hdet_jax.hdet(optax.sgd(0.1), num_replicas=4, sync_every=2, replica_axis='batch',
    ...                    auto_lr=hdet_jax.AutoLR(100))
    >>> def step(params, opt_state, stats):
    ...   grads = {'w': jnp.ones(2)}
    ...   updates, opt_state = tx.update(grads, opt_state, params, value=jnp.sum(params['w']))
    ...   stats = hdet_jax.average_at_sync(stats + 1.0, opt_state, 'batch')  # per replica; averaged at syncs
    ...   return optax.apply_updates(params, updates), opt_state, stats
    >>> params = hdet_jax.stack_replicas({'w': jnp.ones(2)}, 4)
    >>> opt_state, stats = jax.vmap(tx.init)(params), jnp.arange(4.0)  # replica r's statistic: r
    >>> mapped = jax.vmap(step, axis_name='batch')
    >>> params, opt_state, stats = mapped(params, opt_state, stats)  # step 1: no sync
    >>> stats.tolist()
    [1.0, 2.0, 3.0, 4.0]
    >>> params, opt_state, stats = mapped(params, opt_state, stats)  # step 2 ends the window
    >>> stats.tolist()
    [3.5, 3.5, 3.5, 3.5]
  """
  who = 'average_at_sync'
  arguments.axis_name(axis_name, 'axis_name', who=who)
  try:
    state = views.find_state(opt_state)
  except ValueError as e:
    raise ValueError(
      f"{who}: opt_state must hold one HDETState (this replica's optimizer state after tx.update), {e}"
    ) from None
  if jnp.ndim(state.count) != 0:
    raise ValueError(
      f"{who}: opt_state must be one replica's (its HDETState's count has shape {jnp.shape(state.count)}): call it "
      "inside the pmapped step, on the state the step's update returned, not on the stacked [N, ...] state."
    )
  axes.axis_size_or_raise(axis_name, who=who, name='axis_name')
  synced = axes.unbatched(state.synced, axis_name)
  accumulating = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_multi_steps) if _is_multi_steps(x)]
  if accumulating:  # the update ran on this micro-batch only where the accumulation just completed a step
    synced = jnp.logical_and(synced, axes.unbatched(accumulating[0].mini_step, axis_name) == 0)

  leaves, treedef = jax.tree.flatten(tree)
  floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  if not floats:
    return tree

  def average(xs):
    ok = jnp.logical_and(state.replica_ok, axes.all_finite(xs))
    mean, _ = axes.finite_mean(xs, axis_name, ok)
    return axes.match_vma([m.astype(x.dtype) for m, x in zip(mean, xs)], xs)

  xs = lax.cond(synced, average, lambda xs: xs, [leaves[i] for i in floats])
  out = list(leaves)
  for i, x in zip(floats, xs):
    out[i] = x
  return jax.tree.unflatten(treedef, out)


def _is_multi_steps(x) -> bool:
  return isinstance(x, optax.MultiStepsState)
