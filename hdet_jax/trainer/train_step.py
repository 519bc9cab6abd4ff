"""The HDET optimizer built from a config, and the jitted init, train and eval programs.

Every leaf of the parameters, the optimizer state and the batch carries a leading replica axis
of size N, sharded ``P('data')`` over a one-axis mesh. The training step exists as two
programs, with and without the sync (``sync`` is static), which the Python loop dispatches by
step number; both donate the parameters and the optimizer state.
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
from hdet_jax.trainer import model as model_lib

AXIS = 'data'


def make_mesh(num_replicas: int) -> Mesh:
  """A one-axis mesh ``('data',)`` over the first ``num_replicas`` devices (Auto axis type)."""
  return Mesh(np.asarray(jax.devices()[:num_replicas]), (AXIS,))


def replica_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def sync_every(config: Any) -> int:
  """T; ``hdet.sync_every = 0`` means never sync (plain data parallel): T past the last step."""
  return int(config.hdet.sync_every) if config.hdet.sync_every > 0 else int(config.num_train_steps) + 1


def is_sync_step(config: Any, step: int) -> bool:
  """Whether the update of step ``step`` (0-based) averages the replicas."""
  return (step + 1) % sync_every(config) == 0


def schedule(config: Any) -> optax.Schedule:
  o = config.optim
  return H.one_cycle(max_lr=o.max_lr, total_steps=config.num_train_steps, pct_start=o.pct_start,
                     div_factor=o.div_factor, final_div_factor=o.final_div_factor)


def _decay_mask(params: Any) -> Any:
  """Weight decay on matrices (kernels, embeddings, positions) only, not on biases and norms."""
  return jax.tree.map(lambda x: jnp.ndim(x) >= 2, params)


def make_optimizer(config: Any, num_replicas: int) -> optax.GradientTransformationExtraArgs:
  """``hdet_jax.hdet`` around the configured optax optimizer, schedule and HDET settings."""
  o, h = config.optim, config.hdet
  factories = {
      'adamw': lambda learning_rate: optax.adamw(
          learning_rate, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=_decay_mask),
      'adam': lambda learning_rate: optax.adam(learning_rate, b1=o.b1, b2=o.b2),
      'sgd': lambda learning_rate: optax.sgd(learning_rate, momentum=o.b1),
  }
  if o.name not in factories:
    raise ValueError(f'optim.name={o.name!r} is not one of {sorted(factories)}.')
  base = factories[o.name]
  if o.grad_clip_norm > 0:
    factory = lambda learning_rate: optax.chain(
        optax.clip_by_global_norm(o.grad_clip_norm), base(learning_rate))
  else:
    factory = base
  auto_lr = None
  if h.auto_lr:
    auto_lr = H.AutoLR(
        total_steps=config.num_train_steps, warmup_steps=h.warmup_steps, temperature=h.temperature,
        lr_of_lr=h.lr_of_lr, momentum=h.momentum, smooth_decay=h.smooth_decay)
  return H.hdet(
      factory, schedule(config), num_replicas=num_replicas, spread=h.spread,
      sync_every=sync_every(config), replica_axis=AXIS, auto_lr=auto_lr, exact_sync=True,
      seed=config.seed)


def make_init(config: Any, tx: optax.GradientTransformation, mesh: Mesh, num_replicas: int) -> Callable:
  """Jitted ``key -> (params, opt_state)``: the same random init on every replica (cold start)."""
  def init(key):
    _, params = model_lib.split_model(config.model, config.data.seq_len, key)
    stacked = H.stack_replicas(params, num_replicas)
    return stacked, jax.vmap(tx.init)(stacked)
  return jax.jit(init, out_shardings=replica_sharding(mesh))


def make_opt_init(tx: optax.GradientTransformation, mesh: Mesh) -> Callable:
  """Jitted ``stacked params -> opt_state`` (for a warm start)."""
  return jax.jit(jax.vmap(tx.init), out_shardings=replica_sharding(mesh))


def make_train_step(graphdef: Any, tx: optax.GradientTransformation, mesh: Mesh, *, sync: bool) -> Callable:
  """Jitted ``(params, opt_state, batch) -> (params, opt_state, metrics)``, all stacked ``[N, ...]``.

  ``metrics`` holds each replica's loss and, read from each replica's (identical) optimizer
  state, every replica's LR, the base LR and the controller's weights, delta, velocity and
  window losses; the host reads row 0 of the replica-invariant ones.
  """
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: model_lib.loss_fn(graphdef, p, batch))(params)
    grads = H.pmean_finite(grads, AXIS)  # the all-reduce, skipping replicas whose gradient is not finite
    updates, opt_state = tx.update(grads, opt_state, params, value=loss, sync=sync)
    params = H.apply_updates(params, updates, opt_state, replica_axis=AXIS, sync=sync)
    c = opt_state.controller
    metrics = {
        'loss': loss, 'lrs': opt_state.learning_rates, 'base_lr': opt_state.base_learning_rate,
        'weights': c.weights, 'delta': c.delta[0], 'velocity': c.velocity[0],
        'window_losses': c.window_losses,
    }
    return params, opt_state, metrics
  return jax.jit(H.shard_map_replicas(step, mesh, AXIS), donate_argnums=(0, 1))


def make_eval_step(graphdef: Any, mesh: Mesh) -> Callable:
  """Jitted ``(params, windows) -> [N]``: the averaged model's mean loss on each replica's windows."""
  def evaluate(params, windows):
    avg = lax.pmean(params, AXIS)
    return model_lib.loss_fn(graphdef, avg, windows)
  return jax.jit(H.shard_map_replicas(evaluate, mesh, AXIS))


def make_average(mesh: Mesh) -> Callable:
  """Jitted exact replica average (the ensemble's model), replicated on every device."""
  return jax.jit(H.average_replicas, out_shardings=replicated(mesh))


def put_stacked(x: np.ndarray, mesh: Mesh) -> jax.Array:
  """A host array ``[N, ...]`` (the same on every process) as a global array sharded ``P('data')``."""
  sharding = replica_sharding(mesh)
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def fetch(tree: Any) -> Any:
  """Global arrays to host numpy, gathering across processes when needed."""
  def get(a):
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
      from jax.experimental import multihost_utils
      return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return np.asarray(a)
  return jax.tree.map(get, tree)
