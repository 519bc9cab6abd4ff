"""The jitted programs of the loop: init, the training step, the end of a sync window, evaluation.

Each is a module-level factory over a task (:class:`tasks.Task`: its model, loss and metrics), the
optimizer (``optimizer.make_optimizer``) and the mesh (``mesh.make_mesh``); a task never needs to touch
this file. The training step exists as two programs, with and without the sync (``sync`` is static),
which the Python loop dispatches by step number; both donate the parameters and the optimizer state.
On a grouped mesh the programs pin the layout's shardings on their outputs, so they hold across sync and
non-sync steps; XLA's partitioner adds the group's collectives.

N replicas on D devices: each device runs its N / D replicas under ``vmap`` (:func:`_on_replicas`: the public
:func:`hdet_jax.over_replicas`, the replica axis ``'data'`` standing for the devices and each one's replicas);
with one replica per device the programs are a plain ``shard_map`` over ``'data'`` (no ``vmap``). Between
programs the optimizer state is a :class:`hdet_jax.packing.PackedState` (HDET's small fields in one vector),
unpacked inside each program, so a
step takes plain data parallel's input buffers plus one.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import hdet_jax as H
from hdet_jax.trainer import tasks as tasks_lib
from hdet_jax.trainer.mesh import AXIS, by_rules, grouped, layout, replica_sharding, replicated


class ProgramSettings(NamedTuple):
  """What the compiled programs read of a run (``run_settings.resolve`` reads it from the config). The defaults are
  a plain run of the byte LM: no regularization, the all-reduced gradient, each window's own losses as the scores."""

  task: tasks_lib.Task | None = None  # the workload (None: the byte LM)
  hyperparam_names: tuple[str, ...] = ('learning_rate',)  # the optimizer state's [G] order
  dropout: float = 0.0  # model.dropout, where it is not explored
  attn_temperature: float = 1.0  # model.attn_temperature, where it is not explored
  label_smoothing: float = 0.0  # optim.label_smoothing, where it is not explored
  shares_gradient: bool = True  # all-reduce the gradient (not hdet.low_communication)
  common_batch: bool = False  # a sync scores the replicas on a common batch
  rolls_back: bool = False  # a sync that backs off returns to the anchor
  plateau: bool = False  # optim.name='adam_plateau': its value= is the global loss
  schedule_free: bool = False  # optim.name='schedule_free_adamw': evaluated at its eval params

  def workload(self) -> tasks_lib.Task:
    return self.task or tasks_lib.get()


def make_init(
  task: tasks_lib.Task,
  settings: tasks_lib.TaskSettings,
  tx: optax.GradientTransformation,
  mesh: Mesh,
  num_replicas: int,
) -> Callable:
  """Jitted ``key -> (params, opt_state)``: the same random init on every replica (cold start)."""

  def init(key):
    _, params = task.init_model(settings, key)
    stacked = H.stack_replicas(params, num_replicas)
    return stacked, jax.vmap(packed_init(tx))(stacked)

  shardings = replica_sharding(mesh)
  if grouped(mesh):  # each group's copy is born sharded over 'fsdp': never whole on one device
    shardings = layout(mesh, *jax.eval_shape(init, jax.random.key(0)), task)
  return jax.jit(init, out_shardings=shardings)


def make_opt_init(tx: optax.GradientTransformation, mesh: Mesh, task: tasks_lib.Task | None = None) -> Callable:
  """Jitted ``stacked params -> opt_state`` (for a warm start)."""
  init = jax.vmap(packed_init(tx))
  if not grouped(mesh):
    return jax.jit(init, out_shardings=replica_sharding(mesh))

  def opt_init(params):
    shardings = by_rules(mesh, jax.eval_shape(init, params), task)
    return jax.jit(init, out_shardings=shardings)(params)

  return opt_init


def packed_init(tx: optax.GradientTransformation) -> Callable:
  """One replica's ``params -> PackedState``: ``tx.init``'s state with HDET's small fields packed."""
  return lambda params: H.packing.pack_state(tx.init(params))


def unpack(tx: optax.GradientTransformation, params: Any, packed: H.packing.PackedState) -> H.HDETState:
  """One replica's :class:`hdet_jax.HDETState` from its packed form (shapes from ``tx.init`` on ``params``)."""
  return H.packing.unpack_state(packed, jax.eval_shape(tx.init, params))


def make_step_count(tx: optax.GradientTransformation) -> Callable:
  """Jitted ``(params, opt_state) -> [N] int32``: every replica's optimizer step count."""
  return jax.jit(jax.vmap(lambda p, s: unpack(tx, p, s).count))


def _on_replicas(step: Callable, mesh: Mesh, check_vma: bool = True) -> Callable:
  """``step`` (one replica's program, its replica axis ``'data'``) over the stacked replicas of its arguments: the
  public :func:`hdet_jax.over_replicas`, as the add-to-trainer page has users map their step, with the N / D
  replicas per device read from the arguments when the program is traced. With one replica per device it is
  :func:`hdet_jax.shard_map_replicas`, the same map, checked (``check_vma``), which ``over_replicas`` never is."""

  def mapped(*args):
    k = jax.tree.leaves(args[0])[0].shape[0] // mesh.shape[AXIS]
    if k == 1:
      return H.shard_map_replicas(step, mesh, AXIS, check_vma=check_vma)(*args)
    return H.over_replicas(step, mesh, AXIS, batch_argnames=(), per_device=k)(*args)

  return mapped


def regularization(
  settings: ProgramSettings, seed: int, opt_state: Any, axis: Any = AXIS
) -> tuple[tasks_lib.Regularization, jax.Array]:
  """This replica's model regularization and label smoothing for the coming step.

  Explored values come from the optimizer state (each replica's own); the others from
  ``settings``. The dropout key depends only on (``seed``, the run's; step; replica), so a resumed run draws the
  same masks.
  """
  names = settings.hyperparam_names

  def value(name, default):
    return H.replica_value(opt_state, names.index(name), axis) if name in names else default

  rate = value('dropout', settings.dropout)
  key = None
  if 'dropout' in names or settings.dropout > 0:
    key = jax.random.fold_in(
      jax.random.fold_in(jax.random.key(seed + _DROPOUT_TAG), opt_state.count), H.axes.axis_index(axis)
    )
  reg = tasks_lib.Regularization(
    dropout_rate=rate, dropout_key=key, attn_temperature=value('attn_temperature', settings.attn_temperature)
  )
  return reg, value('label_smoothing', settings.label_smoothing)


_DROPOUT_TAG = 7919


class Each(NamedTuple):
  """A metric each replica computes for itself (its loss, its distance from the mean): its record holds every
  replica's value, ``[N, ...]``. Any other metric is read from what every replica holds the same copy of (the
  optimizer state, the average): its record holds replica 0's."""

  value: Any


def _emitted(records: dict, packer: MetricsPacker | None) -> Any:
  """A program's metrics ``{record: {key: value}}`` as it returns them: packed, or without a packer one flat dict
  ``{key: [N, ...]}`` (the keys are unique over a program's records)."""
  return _flat(records) if packer is None else packer.pack(records)


def _flat(records: dict) -> dict:
  return {k: getattr(v, 'value', v) for values in records.values() for k, v in values.items()}


class MetricsPacker:
  """Packs a program's metrics, ``{record: {key: value}}``, into one float32 vector per replica, and back on the host.

  One output array per step instead of a dozen: the host fetches a single ``[N, k]`` array per
  step, one transfer instead of one per metric (the metrics' share of the loop: results/benchmarks.md,
  '5. The trainer's overhead around the compiled step').
  """

  def __init__(self):
    # (record, key, shape, dtype, each replica's (:class:`Each`)) of each metric, in the order emitted
    self.layout: list[tuple[str, str, tuple[int, ...], Any, bool]] | None = None

  def pack(self, records: dict) -> jax.Array:
    flat = _flat(records)
    self.layout = [
      (r, k, tuple(jnp.shape(flat[k])), np.dtype(jnp.result_type(flat[k])), isinstance(v, Each))
      for r, values in records.items()
      for k, v in values.items()
    ]
    return jnp.concatenate([jnp.ravel(jnp.asarray(flat[k], jnp.float32)) for k in sorted(flat)])

  def unpack(self, rows: np.ndarray) -> dict:
    """``[N, k]`` host rows to the records, ``{record: {key: value}}`` in the order emitted: each value in the dtype
    it was emitted in, replica 0's, or every replica's ``[N, ...]`` for an :class:`Each` metric."""
    at, i = {}, 0
    for _, key, shape, dtype, _ in sorted(self.layout, key=lambda m: m[1]):  # (packed in sorted order)
      size = int(np.prod(shape, dtype=int))
      at[key] = rows[:, i : i + size].reshape((rows.shape[0],) + shape).astype(dtype, copy=False)
      i += size
    out = {}
    for record, key, _, _, each in self.layout:
      out.setdefault(record, {})[key] = at[key] if each else at[key][0]
    return out


def make_train_step(
  graphdef: Any,
  tx: optax.GradientTransformation,
  mesh: Mesh,
  *,
  sync: bool,
  seed: int,
  settings: ProgramSettings = ProgramSettings(),
  packer: MetricsPacker | None = None,
  chunk_steps: int = 0,
  shardings: tuple[Any, Any] | None = None,
) -> Callable:
  """Jitted ``(params, opt_state, batch) -> (params, opt_state, metrics)``, all stacked ``[N, ...]``.

  ``metrics`` holds each replica's loss and, read from each replica's (identical) optimizer
  state, every replica's LR, the base LR and the controller's weights, delta, velocity and
  window losses; the host reads row 0 of the replica-invariant ones. The sync program adds the
  window end's ``distance`` and ``mean_norm`` (see :func:`make_window_end`). With a ``packer``
  the metrics come back as one ``[N, k]`` float32 array (see :class:`MetricsPacker`).

  ``chunk_steps=K > 0``: the third argument holds K consecutive steps' batches ``[N, K, B, L+1]``
  (the chunk starting at a multiple of K) and step t reads its batch at ``t % K``, t being the
  optimizer's step count; the host then uploads data once every K steps instead of every step.

  ``shardings``: :func:`layout`'s (parameter, optimizer-state) shardings on a 2-D mesh, pinned on
  the outputs. With ``hdet.low_communication`` the gradient is not all-reduced across the replica
  axis: each group steps on its own (still averaged over its inner axis, by the partitioner).
  """
  task = settings.workload()

  axis = AXIS  # (over several replicas per device, over_replicas makes it stand for them all)

  def step(params, packed, data):
    opt_state = unpack(tx, params, packed)
    batch = data
    if chunk_steps:
      batch = jax.tree.map(lambda d: lax.dynamic_index_in_dim(d, opt_state.count % chunk_steps, keepdims=False), data)
    used = opt_state  # its values and base are what this step trains with
    loss, updates, opt_state = _update(task, graphdef, tx, settings, seed, params, opt_state, batch, axis, sync)
    stepped = optax.apply_updates(params, updates)  # (what apply_updates averages on a sync step)
    params = H.apply_updates(params, updates, opt_state, replica_axis=axis, sync=sync)
    records = {'train': _train_metrics(loss, used), 'controller': _controller_metrics(opt_state.controller)}
    if sync:
      records['distance'] = _distance_metrics(stepped, params)
    return params, H.packing.pack_state(opt_state), _emitted(records, packer)

  # optax.contrib.reduce_on_plateau's lax.cond returns constants in one branch and state-derived
  # (per-replica, 'varying') values in the other, which shard_map's type check rejects.
  return jax.jit(
    _on_replicas(step, mesh, check_vma=not settings.plateau), donate_argnums=(0, 1), **_pinned(mesh, shardings)
  )


def _update(
  task: tasks_lib.Task,
  graphdef: Any,
  tx: optax.GradientTransformation,
  settings: ProgramSettings,
  seed: int,
  params: Any,
  opt_state: Any,
  batch: Any,
  axis: Any,
  sync: bool,
) -> tuple[jax.Array, Any, Any]:
  """One replica's (loss, updates, opt_state) of a training step on ``batch`` (the all-reduce included, if
  ``settings.shares_gradient``); the loss is plain cross-entropy, what the controller compares (see ``Task.losses``)."""
  reg, smoothing = regularization(settings, seed, opt_state, axis)
  (_, loss), grads = jax.value_and_grad(lambda p: task.losses(graphdef, p, batch, reg, smoothing), has_aux=True)(params)
  if settings.shares_gradient:
    grads = H.pmean_finite(grads, axis)  # the all-reduce, skipping replicas whose gradient is not finite
  if settings.plateau:
    # reduce_on_plateau keeps state from value=, which must then agree across replicas: the global loss.
    loss = H.axes.pmean(loss, axis)
  updates, opt_state = tx.update(grads, opt_state, params, value=loss, sync=sync)
  return loss, updates, opt_state


def _common_score(
  task: tasks_lib.Task,
  graphdef: Any,
  settings: ProgramSettings,
  seed: int,
  params: Any,
  opt_state: Any,
  windows: Any,
  axis: Any,
) -> jax.Array:
  """This replica's loss on the common batch ``windows``, with its own attention temperature and no dropout."""
  reg, _ = regularization(settings, seed, opt_state, axis)
  reg = reg._replace(dropout_rate=0.0, dropout_key=None)  # compare the models, not their noise
  return task.loss(graphdef, params, windows, reg)


def _pinned(mesh: Mesh, shardings: tuple[Any, Any] | None) -> dict:
  """jit's ``out_shardings`` for (params, opt_state, metrics) under a 2-D layout; none on 1-D meshes."""
  return {} if shardings is None else {'out_shardings': (shardings[0], shardings[1], replica_sharding(mesh))}


def make_window_end(
  tx: optax.GradientTransformation,
  mesh: Mesh,
  *,
  seed: int,
  packer: MetricsPacker | None = None,
  graphdef: Any = None,
  settings: ProgramSettings = ProgramSettings(),
  shardings: tuple[Any, Any] | None = None,
) -> Callable:
  """Jitted ``(params, opt_state) -> (params, opt_state, metrics)``: the end of a sync window alone.

  With ``graphdef`` and ``settings.common_batch`` (``hdet.score='common'``) the program takes a third
  argument, the common batch ``[N, W, L+1]`` (the same windows in every row): each replica's loss on
  it, with its own attention temperature and no dropout, computed before the average, is the score
  the controller compares (``tx.update(..., score=)``).
  With ``settings.rolls_back`` (the guard's ``hdet.rollback``; ``tx`` built with ``rollback=True``) a last argument
  and a last output, the library's :class:`hdet_jax.sync.Anchor`, one copy per device (see :func:`make_anchor`):
  where this sync's back-off fires the replicas return to it (``tx.update`` does it; the controller keeps its new,
  lower LR), else it moves to the sync's average. The packed state leaves the anchor out, so the step between
  syncs never carries it.

  Run it right after the non-sync step program on a sync step: it averages the replicas and runs
  the controller (``tx.update(None, ..., sync=True)``). The step is then compiled once, and the sync
  is a program of its own without the model in it, instead of a second compilation of the whole step
  (results/benchmarks.md: less compile time and a lower peak host memory, for a slightly dearer sync
  step). ``metrics`` are the controller's, as in the sync step's, and ``distance``: each replica's L2
  distance from the replicas' average just before it, with ``mean_norm``, the average's L2 norm
  (computed from the parameters before and after the average: no extra communication).
  """
  probe = graphdef is not None and settings.common_batch
  anchored = settings.rolls_back
  task = settings.workload()

  axis = AXIS

  def window_end(params, packed, *extra):
    extra = list(extra)
    windows = extra.pop(0) if probe else None
    opt_state = unpack(tx, params, packed)
    if anchored:
      opt_state = opt_state._replace(anchor=extra.pop(0))
    score = None
    if probe:
      score = _common_score(task, graphdef, settings, seed, params, opt_state, windows, axis)
    updates, opt_state = tx.update(None, opt_state, params, sync=True, score=score)
    stepped = optax.apply_updates(params, updates)  # (what apply_updates averages)
    params = H.apply_updates(params, updates, opt_state, replica_axis=axis, sync=True)
    records = {'controller': _controller_metrics(opt_state.controller), 'distance': _distance_metrics(stepped, params)}
    out = (params, H.packing.pack_state(opt_state), _emitted(records, packer))
    return (*out, opt_state.anchor) if anchored else out

  donate = (0, 1, 3 if probe else 2) if anchored else (0, 1)
  pinned = _pinned(mesh, shardings)
  if anchored and pinned:
    pinned = {'out_shardings': (*pinned['out_shardings'], shardings[2])}
  return jax.jit(_on_replicas(window_end, mesh), donate_argnums=donate, **pinned)


def make_anchor(mesh: Mesh, tx: optax.GradientTransformation, shardings: Any = None) -> Callable:
  """Jitted ``(params, opt_state) -> anchor``: where the rollback returns to before the first sync (see
  :func:`make_window_end`, which moves it on), the library's :func:`hdet_jax.sync.anchor_at` of the state, held
  once per device (:func:`hdet_jax.sync.share_anchors`): the replicas' parameters and wrapped optimizer state
  are the same on every replica there (the start, and an optimizer of ``run_settings.SHARED_STATE_OPTIMIZERS`` on
  the shared gradient; ``run_settings.guard`` turns the rollback off elsewhere), so N replicas on one device keep
  one copy of the state instead of N. ``shardings``: :func:`hdet_jax.trainer.mesh.anchor_layout`'s (a 2-D mesh).
  """

  return jax.jit(first_anchor(tx, mesh), out_shardings=replica_sharding(mesh) if shardings is None else shardings)


def first_anchor(tx: optax.GradientTransformation, mesh: Mesh) -> Callable:
  """``(params, opt_state) -> anchor``, :func:`make_anchor`'s function (unjitted: its shapes for a layout)."""

  def anchor(params, packed):
    anchors = jax.vmap(lambda p, s: H.sync.anchor_at(p, unpack(tx, p, s)))(params, packed)
    return H.sync.share_anchors(anchors, jax.tree.leaves(params)[0].shape[0] // mesh.shape[AXIS])

  return anchor


def make_saved_anchor(mesh: Mesh, shardings: Any) -> Callable:
  """Jitted ``anchor -> {'params', 'inner', 'train_loss', 'train_loss_se'}``: the anchor as a checkpoint holds it
  (one copy, replicated over the replica axis; ``shardings``: :func:`hdet_jax.trainer.mesh.anchor_layout`'s). Each
  device holds the same copy, so each takes its own, with no communication (the map is unchecked: it declares
  replicated what it knows to be equal)."""

  def first(anchor):
    a = jax.tree.map(lambda x: x[0], anchor)
    return {'params': a.params, 'inner': a.inner_state, 'train_loss': a.train_loss, 'train_loss_se': a.train_loss_se}

  manual = frozenset({AXIS} | {a for a, size in mesh.shape.items() if size == 1})
  saved = jax.shard_map(first, mesh=mesh, in_specs=P(AXIS), out_specs=P(), check_vma=False, axis_names=manual)
  return jax.jit(saved, out_shardings=shardings)


def make_restored_anchor(mesh: Mesh, shardings: Any = None) -> Callable:
  """Jitted inverse of :func:`make_saved_anchor`: a checkpoint's copy to the anchor the window end takes, one copy
  per device (each device keeps its own replicated copy: no communication)."""
  copies = mesh.shape[AXIS]

  def restored(saved):
    anchor = H.sync.Anchor(saved['params'], saved['inner'], saved['train_loss'], saved['train_loss_se'])
    return H.stack_replicas(anchor, copies)

  return jax.jit(restored, out_shardings=replica_sharding(mesh) if shardings is None else shardings)


# ---------------------------------------------------------------------------------------------
# The metrics, by record: adding one is one line here
# ---------------------------------------------------------------------------------------------
# Each program returns ``{record: {key: value}}`` (the step: 'train' and 'controller', the window end: 'controller'
# and 'distance'); the host writes each record's keys as they are named here, in this order (metrics.write_step: a
# step's 'train' record, and on a sync step the window end's others), and TensorBoard shows each
# (metrics.TensorBoardWriter). A value is replica 0's, or each replica's where it is an :class:`Each`.


def _train_metrics(loss: jax.Array, used: Any) -> dict:
  """The 'train' record: each replica's loss, and every replica's LR, the base LR, every replica's explored values
  and their bases, as the step trained with them (``used``: the optimizer state before it)."""
  return {
    'loss': Each(loss),
    'lr': used.learning_rates,
    'base_lr': used.base_learning_rate,
    'values': used.values,
    'bases': used.base,
  }


def _controller_metrics(c: Any) -> dict:
  """The 'controller' record: the controller's state as logged: weights, window losses, delta and velocity (first
  and all groups), and the 'fit' controller's own quantities: its log-correction of the schedule, the step it asked,
  the slope's standard error, the gain, the back-off's window loss and its standard error and whether it fired, and
  which climbs have settled."""
  return {
    'weights': c.weights,
    'window_losses': c.window_losses,
    'delta': c.delta[0],
    'velocity': c.velocity[0],
    'deltas': c.delta,
    'velocities': c.velocity,
    'corrections': c.correction,
    'asks': c.asked,
    'stderrs': c.stderr,
    'gains': c.gain,
    'train_loss': c.train_loss,
    'train_loss_se': c.train_loss_se,
    'backed_off': c.backed_off,
    'settled': c.settled,
  }


def _distance_metrics(params: Any, mean: Any) -> dict:
  """The 'distance' record: this replica's L2 distance from the replicas' mean (``distance``) and the mean's L2 norm
  (``mean_norm``)."""
  return {'distance': Each(_tree_norm(jax.tree.map(jnp.subtract, params, mean))), 'mean_norm': _tree_norm(mean)}


def make_distance(mesh: Mesh, packer: MetricsPacker | None = None) -> Callable:
  """Jitted ``params -> {'distance': [N], 'mean_norm': [N]}`` (see :func:`_distance_metrics`; with a ``packer``
  packed, as the step's metrics), for runs that never average: the window end measures it for the others."""

  def distance(params):
    return _emitted({'distance': _distance_metrics(params, H.axes.pmean(params, AXIS))}, packer)

  return jax.jit(_on_replicas(distance, mesh))


def _tree_norm(tree: Any) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def make_eval_params(settings: ProgramSettings, mesh: Mesh) -> Callable | None:
  """Jitted ``(params, opt_state) -> params`` to evaluate in place of the parameters, or None.

  Schedule-free AdamW trains one sequence of points and is evaluated at another (its eval params).
  """
  if not settings.schedule_free:
    return None
  to_eval = lambda p, s: optax.contrib.schedule_free_eval_params(s.inner_state, p)
  return jax.jit(jax.vmap(to_eval), out_shardings=replica_sharding(mesh))


def make_eval_step(graphdef: Any, mesh: Mesh, task: tasks_lib.Task | None = None) -> Callable:
  """Jitted ``(params, eval batch) -> {name: [N]}``: the averaged model's :meth:`Task.eval_metrics` on each
  replica's share of the held-out examples (``'loss'``: its mean loss); ``task`` None: the LM."""
  task = task or tasks_lib.get()

  def evaluate(params, batch):
    return task.eval_metrics(graphdef, H.axes.pmean(params, AXIS), batch)

  return jax.jit(_on_replicas(evaluate, mesh))


def make_average(mesh: Mesh, params: Any = None, task: tasks_lib.Task | None = None) -> Callable:
  """Jitted exact replica average (the ensemble's model), replicated on every device; on a 2-D mesh
  (give the stacked ``params``) still sharded over 'fsdp' as each group's copy is, never whole."""
  if not grouped(mesh):
    return jax.jit(H.average_replicas, out_shardings=replicated(mesh))
  inner = lambda sh: NamedSharding(mesh, P(*sh.spec[1:]))
  shardings = by_rules(mesh, params, task)
  return jax.jit(H.average_replicas, out_shardings=jax.tree.map(inner, shardings))
