"""The HDET optimizer built from a config, and the jitted init, train and eval programs.

Every leaf of the parameters, the optimizer state and the batch carries a leading replica axis
of size N, sharded ``P('data')`` over a one-axis mesh. The training step exists as two
programs, with and without the sync (``sync`` is static), which the Python loop dispatches by
step number; both donate the parameters and the optimizer state.

With ``mesh.fsdp = F > 1`` and/or ``mesh.tensor = K > 1`` the mesh is ``('data', 'fsdp', 'tensor')``
of N x F x K devices (size-1 axes left out): a replica is a group of F x K devices, the replica axis
is still ``'data'``, and inside each group the parameters, the optimizer's moments and the batch are
sharded over ``'fsdp'``, and the attention and MLP kernels (and their moments) split over ``'tensor'``
by :data:`model.TENSOR_RULES` (:func:`layout`); the programs pin those shardings on their outputs, so
they hold across sync and non-sync steps. XLA's partitioner adds the group's collectives.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import hdet_jax as H
from hdet_jax import replicas
from hdet_jax import windows as window_lib
from hdet_jax.trainer import model as model_lib

AXIS = 'data'
INNER = 'fsdp'  # the FSDP axis inside a replica group (grouped meshes only)
TENSOR = 'tensor'  # the tensor-parallel axis inside a replica group (grouped meshes only)


def make_mesh(num_replicas: int, fsdp: int = 1, tensor: int = 1) -> Mesh:
  """``('data',)`` over the first ``num_replicas`` devices, or with groups ``('data', 'fsdp', 'tensor')``
  (axes of size 1 left out) over the first N x F x K: group r is devices r*F*K .. (r+1)*F*K-1,
  neighbours, which share the fastest links on real hardware and carry the every-step traffic (the
  tensor axis innermost: its all-reduces run in every layer). Auto axis types."""
  sizes = [(a, k) for a, k in ((INNER, fsdp), (TENSOR, tensor)) if k > 1]
  shape = (num_replicas,) + tuple(k for _, k in sizes)
  devices = np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape)
  return Mesh(devices, (AXIS,) + tuple(a for a, _ in sizes))


def rules(mesh: Mesh) -> dict:
  """group_shardings' rules on ``mesh``: the model's tensor-parallel rules, and its FSDP exceptions
  where the group also has a tensor axis (FSDP alone keeps its largest-dimension default)."""
  return dict(tensor_rules=model_lib.TENSOR_RULES, fsdp_rules=model_lib.FSDP_RULES if TENSOR in mesh.shape else ())


def grouped(mesh: Mesh) -> bool:
  """Whether a replica is a group of devices (the mesh has axes besides the replica axis)."""
  return len(mesh.axis_names) > 1


def layout(mesh: Mesh, params: Any, opt_state: Any) -> tuple[Any, Any] | None:
  """(parameter shardings, optimizer-state shardings) per leaf on a 2-D mesh; None on a 1-D one,
  where the programs keep the plain ``P('data')`` layout (and compile exactly as before).
  ``params`` and ``opt_state`` are stacked trees of arrays or shapes."""
  if not grouped(mesh):
    return None
  return (H.group_shardings(params, mesh, AXIS, INNER, **rules(mesh)),
          H.state_shardings(opt_state, mesh, AXIS, INNER, **rules(mesh)))


def param_layout(mesh: Mesh, abstract_params: Any, num_replicas: int) -> Any:
  """The stacked parameters' shardings given one replica's shapes (a prefix ``P('data')`` on 1-D meshes)."""
  if not grouped(mesh):
    return replica_sharding(mesh)
  stacked = jax.eval_shape(lambda p: H.stack_replicas(p, num_replicas), abstract_params)
  return H.group_shardings(stacked, mesh, AXIS, INNER, **rules(mesh))


def with_layout(mesh: Mesh, abstract: dict) -> dict:
  """``{'params', 'opt_state', ...}`` shapes given the shardings the run keeps them in (to restore)."""
  shardings = layout(mesh, abstract['params'], abstract['opt_state'])
  if shardings is None:
    shardings = tuple(jax.tree.map(lambda _: replica_sharding(mesh), abstract[k]) for k in ('params', 'opt_state'))
  put = lambda tree, sh: jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), tree, sh)
  return {**abstract, 'params': put(abstract['params'], shardings[0]),
          'opt_state': put(abstract['opt_state'], shardings[1])}


def replica_sharding(mesh: Mesh) -> NamedSharding:
  """The core's :func:`hdet_jax.replicas.replica_sharding` on the trainer's replica axis."""
  return replicas.replica_sharding(mesh, AXIS)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def sync_windows(config: Any) -> tuple[int, ...]:
  """The core's ``sync_every``: windows of ``hdet.early_sync_every`` steps for the first
  ``hdet.early_sync_steps`` steps, then of T. ``hdet.sync_every = 0`` means never sync (plain data
  parallel): T past the last step."""
  h = config.hdet
  period = int(h.sync_every) if h.sync_every > 0 else int(config.num_train_steps) + 1
  early = int(h.get('early_sync_every', 0))
  return (early,) * (int(h.get('early_sync_steps', 0)) // early) + (period,) if early > 0 else (period,)


def never_syncs(config: Any) -> bool:
  """Whether no step of the run averages the replicas."""
  return sync_windows(config)[0] > config.num_train_steps


def sync_index(config: Any, step: int) -> int:
  """How many syncs come before step ``step`` (0-based): 0 for the run's first sync, 1 for the second, ..."""
  return window_lib.syncs_through(sync_windows(config), step)


def is_sync_step(config: Any, step: int) -> bool:
  """Whether the update of step ``step`` (0-based) averages the replicas."""
  return H.is_sync_step(sync_windows(config), step)


def schedule(config: Any) -> optax.Schedule:
  o = config.optim
  if o.get('schedule', 'one_cycle') == 'constant':
    return optax.constant_schedule(o.max_lr)
  return H.one_cycle(max_lr=o.max_lr, total_steps=config.num_train_steps, pct_start=o.pct_start,
                     div_factor=o.div_factor, final_div_factor=o.final_div_factor)


def _decay_mask(params: Any) -> Any:
  """Weight decay on matrices (kernels, embeddings, positions) only, not on biases and norms."""
  return jax.tree.map(lambda x: jnp.ndim(x) >= 2, params)


# The paper's kind of parameter groups for this model (regexes on parameter paths such as
# 'blocks/0/attn/qkv/kernel'): the byte embedding and positions, the biases and norm scales
# (no weight decay), and the attention/MLP weight matrices.
PARAM_GROUPS = {
    'embedding': r'^(embed|pos)(/|$)',
    'no_decay': r'(bias|scale)$',
    'weights': r'^blocks/.*kernel$',
}


def explored(config: Any) -> dict[str, H.Explore]:
  """The hyperparameters besides the learning rate(s) that the config explores, in order."""
  e, o, m = config.hdet.explore, config.optim, config.model
  out = {}
  if e.weight_decay > 0:
    out['weight_decay'] = H.Explore(o.weight_decay, e.weight_decay, low=0.0)
  if e.dropout > 0:  # additive: a base rate of 0 must still be explorable
    out['dropout'] = H.Explore(m.dropout, e.dropout, additive=True, low=0.0, high=0.9, to_optimizer=False)
  if e.label_smoothing > 0:
    out['label_smoothing'] = H.Explore(o.label_smoothing, e.label_smoothing, additive=True, low=0.0,
                                       high=0.5, to_optimizer=False)
  if e.attn_temperature > 0:
    out['attn_temperature'] = H.Explore(m.attn_temperature, e.attn_temperature, low=0.05, to_optimizer=False)
  return out


def param_groups(config: Any) -> dict[str, str] | None:
  return dict(PARAM_GROUPS) if config.hdet.param_groups else None


def hyperparam_names(config: Any) -> tuple[str, ...]:
  """The order of the optimizer state's [G] fields (and of the logged ``values``/``bases``)."""
  return H.hyperparam_names(param_groups=param_groups(config), explore=explored(config))


def make_optimizer(config: Any, num_replicas: int) -> optax.GradientTransformationExtraArgs:
  """``hdet_jax.hdet`` around the configured optax optimizer, schedule and HDET settings."""
  o, h = config.optim, config.hdet
  factories = {
      'adamw': lambda learning_rate, weight_decay=o.weight_decay: optax.adamw(
          learning_rate, b1=o.b1, b2=o.b2, weight_decay=weight_decay, mask=_decay_mask),
      'adam': lambda learning_rate: optax.adam(learning_rate, b1=o.b1, b2=o.b2),
      'sgd': lambda learning_rate: optax.sgd(learning_rate, momentum=o.b1),
      # LR-free and adaptive methods at their documented defaults (for comparisons).
      'prodigy': lambda learning_rate: optax.contrib.prodigy(learning_rate),
      'dog': lambda learning_rate: optax.contrib.dog(learning_rate),
      'dadapt_adamw': lambda learning_rate: optax.contrib.dadapt_adamw(learning_rate),
      'mechanize_adam': lambda learning_rate: optax.contrib.mechanize(optax.adam(learning_rate)),
      'schedule_free_adamw': lambda learning_rate: optax.contrib.schedule_free_adamw(learning_rate),
      'adam_plateau': lambda learning_rate: optax.chain(
          optax.adam(learning_rate), optax.contrib.reduce_on_plateau()),
  }
  if o.name not in factories:
    raise ValueError(f'optim.name={o.name!r} is not one of {sorted(factories)}.')
  if h.explore.weight_decay > 0 and o.name != 'adamw':
    raise ValueError(f'hdet.explore.weight_decay needs optim.name=adamw, got {o.name!r}.')
  base = factories[o.name]
  if o.grad_clip_norm > 0:
    factory = lambda learning_rate, **kw: optax.chain(
        optax.clip_by_global_norm(o.grad_clip_norm), base(learning_rate, **kw))
  else:
    factory = base
  return H.hdet(
      factory, schedule(config), num_replicas=num_replicas, spread=h.spread,
      sync_every=sync_windows(config), replica_axis=AXIS, auto_lr=auto_lr_settings(config), exact_sync=True,
      seed=config.seed, param_groups=param_groups(config), explore=explored(config) or None,
      average_opt_state=bool(h.get('average_opt_state', False)))


def auto_lr_settings(config: Any) -> H.AutoLR | None:
  """The auto-LR controller's settings from ``config.hdet``, or None when it is off."""
  h = config.hdet
  if not h.auto_lr:
    return None
  stop = h.get('stop_fraction', 1.0)
  return H.AutoLR(
      total_steps=config.num_train_steps, warmup_steps=h.warmup_steps, temperature=h.temperature,
      lr_of_lr=h.lr_of_lr, momentum=h.momentum, smooth_decay=h.smooth_decay,
      controller=h.get('controller', 'paper'), overshoot=h.get('overshoot', 1.5), trust=h.get('trust', 0.25),
      memory=h.get('memory', 0.5), stop_steps=None if stop >= 1 else int(stop * config.num_train_steps),
      initial_scale=h.get('initial_scale', 1.0), after_stop=h.get('after_stop', 'hold'),
      step_growth=h.get('step_growth', 1.0), max_gain=h.get('max_gain', 4.0))


def make_init(config: Any, tx: optax.GradientTransformation, mesh: Mesh, num_replicas: int) -> Callable:
  """Jitted ``key -> (params, opt_state)``: the same random init on every replica (cold start)."""
  def init(key):
    _, params = model_lib.split_model(config.model, config.data.seq_len, key)
    stacked = H.stack_replicas(params, num_replicas)
    return stacked, jax.vmap(tx.init)(stacked)
  shardings = replica_sharding(mesh)
  if grouped(mesh):  # each group's copy is born sharded over 'fsdp': never whole on one device
    shardings = layout(mesh, *jax.eval_shape(init, jax.random.key(0)))
  return jax.jit(init, out_shardings=shardings)


def make_opt_init(tx: optax.GradientTransformation, mesh: Mesh) -> Callable:
  """Jitted ``stacked params -> opt_state`` (for a warm start)."""
  if not grouped(mesh):
    return jax.jit(jax.vmap(tx.init), out_shardings=replica_sharding(mesh))
  def opt_init(params):
    shardings = H.state_shardings(jax.eval_shape(jax.vmap(tx.init), params), mesh, AXIS, INNER,
                                  **rules(mesh))
    return jax.jit(jax.vmap(tx.init), out_shardings=shardings)(params)
  return opt_init


def regularization(config: Any, opt_state: Any) -> tuple[model_lib.Regularization, jax.Array]:
  """This replica's model regularization and label smoothing for the coming step.

  Explored values come from the optimizer state (each replica's own); the others from the
  config. The dropout key depends only on (seed, step, replica), so a resumed run draws the
  same masks.
  """
  names = hyperparam_names(config)
  def value(name, default):
    return H.replica_value(opt_state, names.index(name), AXIS) if name in names else default
  rate = value('dropout', config.model.dropout)
  key = None
  if 'dropout' in names or config.model.dropout > 0:
    key = jax.random.fold_in(jax.random.fold_in(
        jax.random.key(config.seed + _DROPOUT_TAG), opt_state.count), lax.axis_index(AXIS))
  reg = model_lib.Regularization(
      dropout_rate=rate, dropout_key=key, attn_temperature=value('attn_temperature', config.model.attn_temperature))
  return reg, value('label_smoothing', config.optim.label_smoothing)


_DROPOUT_TAG = 7919


class MetricsPacker:
  """Packs a step's metrics dict into one float32 vector per replica, and back on the host.

  One output array per step instead of a dozen: the host fetches a single ``[N, k]`` array per
  step, which is most of the trainer's per-step host cost on small models.
  """

  def __init__(self):
    self.layout: list[tuple[str, tuple[int, ...]]] | None = None

  def pack(self, metrics: dict) -> jax.Array:
    keys = sorted(metrics)
    self.layout = [(k, tuple(jnp.shape(metrics[k]))) for k in keys]
    return jnp.concatenate([jnp.ravel(jnp.asarray(metrics[k], jnp.float32)) for k in keys])

  def unpack(self, rows: np.ndarray) -> dict:
    """``[N, k]`` host rows to the stacked metrics dict (each value ``[N, *shape]``)."""
    out, i = {}, 0
    for key, shape in self.layout:
      size = int(np.prod(shape, dtype=int))
      out[key] = rows[:, i:i + size].reshape((rows.shape[0],) + shape)
      i += size
    return out


def make_train_step(graphdef: Any, tx: optax.GradientTransformation, mesh: Mesh, *, sync: bool,
                    config: Any = None, packer: MetricsPacker | None = None, chunk_steps: int = 0,
                    shardings: tuple[Any, Any] | None = None) -> Callable:
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
  shared = config is None or not config.hdet.get('low_communication', False)

  def step(params, opt_state, data):
    batch = data
    if chunk_steps:
      batch = lax.dynamic_index_in_dim(data, opt_state.count % chunk_steps, keepdims=False)
    if config is None:
      reg, smoothing = model_lib.Regularization(), 0.0
    else:
      reg, smoothing = regularization(config, opt_state)
    (_, loss), grads = jax.value_and_grad(
        lambda p: model_lib.losses(graphdef, p, batch, reg, smoothing), has_aux=True)(params)
    if shared:
      grads = H.pmean_finite(grads, AXIS)  # the all-reduce, skipping replicas whose gradient is not finite
    # The controller compares replicas on plain cross-entropy (see model_lib.losses).
    used = opt_state  # its values and base are what this step trains with
    if config is not None and config.optim.name == 'adam_plateau':
      # reduce_on_plateau keeps state from value=, which must then agree across replicas: the global loss.
      loss = lax.pmean(loss, AXIS)
    updates, opt_state = tx.update(grads, opt_state, params, value=loss, sync=sync)
    stepped = optax.apply_updates(params, updates)  # (what apply_updates averages on a sync step)
    params = H.apply_updates(params, updates, opt_state, replica_axis=AXIS, sync=sync)
    metrics = {
        'loss': loss, 'lrs': used.learning_rates, 'base_lr': used.base_learning_rate,
        'values': used.values, 'bases': used.base, **_controller_metrics(opt_state.controller),
    }
    if sync:
      metrics.update(_distance_metrics(stepped, params))
    if packer is not None:
      metrics = packer.pack(metrics)
    return params, opt_state, metrics
  # optax.contrib.reduce_on_plateau's lax.cond returns constants in one branch and state-derived
  # (per-replica, 'varying') values in the other, which shard_map's type check rejects.
  check_vma = config is None or config.optim.name != 'adam_plateau'
  return jax.jit(H.shard_map_replicas(step, mesh, AXIS, check_vma=check_vma), donate_argnums=(0, 1),
                 **_pinned(mesh, shardings))


def _pinned(mesh: Mesh, shardings: tuple[Any, Any] | None) -> dict:
  """jit's ``out_shardings`` for (params, opt_state, metrics) under a 2-D layout; none on 1-D meshes."""
  return {} if shardings is None else {'out_shardings': (*shardings, replica_sharding(mesh))}


def common_batch(config: Any) -> bool:
  """Whether replicas are compared on one common batch at each sync (``hdet.score='common'``)."""
  return bool(config.hdet.auto_lr) and config.hdet.get('score', 'window') == 'common'


def score_tail(config: Any) -> float:
  """The fraction of each window over which a replica's parameters are averaged before the comparison
  (``hdet.score_tail``; 0: the comparison sees the last iterates)."""
  return float(config.hdet.get('score_tail', 0.0)) if common_batch(config) else 0.0


def tail_weight(config: Any, step: int) -> float:
  """``1/k`` when step ``step`` (0-based) is the k-th of its window's averaged tail, else 0.

  The tail is the window's last ``m = max(1, round(score_tail * T_w))`` steps (T_w: the window's length),
  so the compared point is the uniform mean of the parameters after each of them.
  """
  fraction = score_tail(config)
  if fraction <= 0:
    return 0.0
  start, length = (int(v) for v in window_lib.window_of(sync_windows(config), step))
  k = step + 1 - (start + length - max(1, round(fraction * length)))
  return 1.0 / k if k >= 1 else 0.0


def make_tail_update(shardings: tuple[Any, Any] | None = None) -> Callable:
  """Jitted ``(tail, params, weight) -> tail``: the running mean ``tail + weight (params - tail)``;
  weight 1 restarts it at ``params`` exactly (the first step of a window's tail)."""
  def update(tail, params, weight):
    return jax.tree.map(lambda a, b: jnp.where(weight >= 1, b, a + (b - a) * weight).astype(a.dtype), tail, params)
  return jax.jit(update, donate_argnums=0, **({} if shardings is None else {'out_shardings': shardings[0]}))


def make_window_end(tx: optax.GradientTransformation, mesh: Mesh, *,
                    packer: MetricsPacker | None = None, graphdef: Any = None, config: Any = None,
                    shardings: tuple[Any, Any] | None = None) -> Callable:
  """Jitted ``(params, opt_state) -> (params, opt_state, metrics)``: the end of a sync window alone.

  With ``graphdef`` and a config whose ``hdet.score`` is ``'common'`` the program takes a third
  argument, the common batch ``[N, W, L+1]`` (the same windows in every row): each replica's loss on
  it, with its own attention temperature and no dropout, computed before the average, is the score
  the controller compares (``tx.update(..., score=)``). With ``hdet.score_tail > 0`` a fourth, each
  replica's mean parameters over the window's tail (see :func:`tail_weight`), is what is scored.

  Run it right after the non-sync step program on a sync step: it averages the replicas and runs
  the controller (``tx.update(None, ..., sync=True)``). The step is then compiled once, and the sync
  is a program of its own without the model in it, instead of a second compilation of the whole step
  (results/benchmarks.md: less compile time and a lower peak host memory, for a slightly dearer sync
  step). ``metrics`` are the controller's, as in the sync step's, and ``distance``: each replica's L2
  distance from the replicas' average just before it, with ``mean_norm``, the average's L2 norm
  (computed from the parameters before and after the average: no extra communication).
  """
  probe = graphdef is not None and config is not None and common_batch(config)

  def window_end(params, opt_state, windows=None, tail=None):
    score = None
    if probe:
      reg, _ = regularization(config, opt_state)
      reg = reg._replace(dropout_rate=0.0, dropout_key=None)  # compare the models, not their noise
      # The tail means lie on the replicas' line too (A + u_r Dbar), so the line search reads them alike.
      score = model_lib.loss_fn(graphdef, params if tail is None else tail, windows, reg)
    updates, opt_state = tx.update(None, opt_state, params, sync=True, score=score)
    stepped = optax.apply_updates(params, updates)  # (what apply_updates averages)
    params = H.apply_updates(params, updates, opt_state, replica_axis=AXIS, sync=True)
    metrics = {**_controller_metrics(opt_state.controller), **_distance_metrics(stepped, params)}
    if packer is not None:
      metrics = packer.pack(metrics)
    return params, opt_state, metrics
  return jax.jit(H.shard_map_replicas(window_end, mesh, AXIS), donate_argnums=(0, 1), **_pinned(mesh, shardings))


def _controller_metrics(c: Any) -> dict:
  """The controller's state as logged: weights, window losses, delta and velocity (first and all groups)."""
  return {'weights': c.weights, 'delta': c.delta[0], 'velocity': c.velocity[0],
          'window_losses': c.window_losses, 'deltas': c.delta, 'velocities': c.velocity}


def _distance_metrics(params: Any, mean: Any) -> dict:
  """This replica's L2 distance from the replicas' mean (``distance``) and the mean's L2 norm (``mean_norm``)."""
  return {'distance': _tree_norm(jax.tree.map(jnp.subtract, params, mean)), 'mean_norm': _tree_norm(mean)}


def make_distance(mesh: Mesh) -> Callable:
  """Jitted ``params -> {'distance': [N], 'mean_norm': [N]}`` (see :func:`_distance_metrics`), for runs
  that never average: the window end measures it for the others."""
  def distance(params):
    return _distance_metrics(params, jax.tree.map(lambda p: lax.pmean(p, AXIS), params))
  return jax.jit(H.shard_map_replicas(distance, mesh, AXIS))


def _tree_norm(tree: Any) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def make_eval_params(config: Any, mesh: Mesh) -> Callable | None:
  """Jitted ``(params, opt_state) -> params`` to evaluate in place of the parameters, or None.

  Schedule-free AdamW trains one sequence of points and is evaluated at another (its eval params).
  """
  if config.optim.name != 'schedule_free_adamw':
    return None
  to_eval = lambda p, s: optax.contrib.schedule_free_eval_params(s.inner_state, p)
  return jax.jit(jax.vmap(to_eval), out_shardings=replica_sharding(mesh))


def make_eval_step(graphdef: Any, mesh: Mesh) -> Callable:
  """Jitted ``(params, windows) -> [N]``: the averaged model's mean loss on each replica's windows."""
  def evaluate(params, windows):
    avg = lax.pmean(params, AXIS)
    return model_lib.loss_fn(graphdef, avg, windows)
  return jax.jit(H.shard_map_replicas(evaluate, mesh, AXIS))


def make_average(mesh: Mesh, params: Any = None) -> Callable:
  """Jitted exact replica average (the ensemble's model), replicated on every device; on a 2-D mesh
  (give the stacked ``params``) still sharded over 'fsdp' as each group's copy is, never whole."""
  if not grouped(mesh):
    return jax.jit(H.average_replicas, out_shardings=replicated(mesh))
  inner = lambda sh: NamedSharding(mesh, P(*sh.spec[1:]))
  shardings = H.group_shardings(params, mesh, AXIS, INNER, **rules(mesh))
  return jax.jit(H.average_replicas, out_shardings=jax.tree.map(inner, shardings))


def put_stacked(x: np.ndarray, mesh: Mesh, batch_dim: int | None = None) -> jax.Array:
  """A host array ``[N, ...]`` (the same on every process) as a global array sharded ``P('data')``;
  on a 2-D mesh its ``batch_dim`` is also split over 'fsdp' (each device of a group gets its share
  of the group's windows) when the group's size divides it."""
  sharding = replica_sharding(mesh)
  if INNER in mesh.shape and batch_dim is not None and x.shape[batch_dim] % mesh.shape[INNER] == 0:
    sharding = NamedSharding(mesh, P(AXIS, *[None] * (batch_dim - 1), INNER))
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


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
