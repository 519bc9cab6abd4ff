"""The HDET optimizer built from a config: the schedule, the base optax optimizer, the hyperparameters
explored, the sync windows, and the controller's settings. Tasks never need to touch this file (a task's
parameter groups and explorable model hyperparameters are attributes of its :class:`tasks.Task`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

import hdet_jax as H
from hdet_jax import windows as window_lib
from hdet_jax.trainer import config_lib
from hdet_jax.trainer import tasks as tasks_lib
from hdet_jax.trainer.mesh import replica_axis

def sync_windows(config: Any) -> tuple[int, ...]:
  """The core's ``sync_every``, one window length T: ``hdet.sync_every`` when it is > 0, else with ``hdet.num_syncs
  = K > 0`` ``round(num_train_steps / K)`` (windows counted per run), at most ``hdet.longest_window`` steps
  (:func:`hdet_jax.windows.default_period`). Both 0 means never sync (plain data parallel): T past the last step."""
  h = config.hdet
  every = int(h.sync_every)
  if every == 0 and h.get('num_syncs', 0) > 0:
    every = window_lib.default_period(config.num_train_steps, h.num_syncs, h.get('longest_window', 0))
  return (every if every > 0 else int(config.num_train_steps) + 1,)


def never_syncs(config: Any) -> bool:
  """Whether no step of the run averages the replicas."""
  return sync_windows(config)[0] > config.num_train_steps


def sync_index(config: Any, step: int) -> int:
  """How many syncs come before step ``step`` (0-based): 0 for the run's first sync, 1 for the second, ..."""
  return window_lib.syncs_through(sync_windows(config), step)


def is_sync_step(config: Any, step: int) -> bool:
  """Whether the update of step ``step`` (0-based) averages the replicas."""
  return H.is_sync_step(sync_windows(config), step)


def schedule(config: Any, max_lr: float | None = None) -> optax.Schedule:
  """The base schedule: torch's one-cycle (cosine up over pct_start of the run, then down), a linear warmup over
  pct_start of the run then a cosine decay (the usual LM schedule; both from max_lr / div_factor to max_lr, ending
  at max_lr / (div_factor * final_div_factor) on the last step), or max_lr throughout. ``max_lr``: another peak
  than ``optim.max_lr`` (the programs' own under ``optim.runtime_lr_scale``: :func:`lr_unit`)."""
  o = config.optim
  peak = o.max_lr if max_lr is None else max_lr
  name = o.get('schedule', 'one_cycle')
  if name == 'constant':
    base = optax.constant_schedule(peak)
  elif name == 'warmup_cosine':
    initial = peak / o.div_factor
    base = optax.warmup_cosine_decay_schedule(
        init_value=initial, peak_value=peak, warmup_steps=int(round(o.pct_start * config.num_train_steps)),
        decay_steps=config.num_train_steps - 1, end_value=initial / o.final_div_factor)
  else:
    base = H.one_cycle(max_lr=peak, total_steps=config.num_train_steps, pct_start=o.pct_start,
                       div_factor=o.div_factor, final_div_factor=o.final_div_factor)
  return base


def lr_unit(config: Any) -> float:
  """The power of two ``2**e`` that ``optim.runtime_lr_scale`` applies at run time (1.0 when it is off).

  ``optim.max_lr = m * 2**e`` with ``m`` in [0.5, 1) (``math.frexp``, exact): the programs are built for the peak
  ``m`` and every learning rate is multiplied by ``2**e`` when the optimizer uses it. A product with a power of two
  is exact in floating point (away from overflow and subnormals), and every schedule here is linear in its peak, so
  the run's learning rates, and so its numbers, are the plain build's bit for bit; runs whose ``max_lr`` differ by
  a power of two (an LR bracket or sweep a factor 2 apart) build identical programs, and the persistent compilation
  cache compiles them once.
  """
  if not config.optim.get('runtime_lr_scale', False):
    return 1.0
  return math.ldexp(1.0, math.frexp(config.optim.max_lr)[1])


class RuntimeScaleState(NamedTuple):
  """The state of :func:`with_runtime_lr_scale`'s optimizer."""
  scale: jax.Array  # [] float32: the factor on the learning rate (1 from init; :func:`set_runtime_lr_scale`).
  inner: Any        # the wrapped optimizer's state.


def with_runtime_lr_scale(factory: Callable[..., optax.GradientTransformation]) -> Callable[..., Any]:
  """An optax factory like ``factory`` whose learning rate is multiplied by a factor held in its state.

  ``with_runtime_lr_scale(optax.adamw)(lr)`` updates as ``optax.adamw(lr * s)`` with ``s`` its state's ``scale``:
  a run-time value, so one compiled program serves every ``s``. ``init`` sets ``s = 1``; a run sets its own with
  :func:`set_runtime_lr_scale` before the first step (a checkpoint keeps it).
  """
  def make(learning_rate, **kwargs):
    def init(params):
      return RuntimeScaleState(jnp.ones([], jnp.float32), factory(learning_rate, **kwargs).init(params))

    def update(updates, state, params=None, **extra_args):
      inner = optax.with_extra_args_support(factory(learning_rate * state.scale, **kwargs))
      updates, inner_state = inner.update(updates, state.inner, params, **extra_args)
      return updates, state._replace(inner=inner_state)
    return optax.GradientTransformationExtraArgs(init, update)
  return make


def set_runtime_lr_scale(opt_state: Any, scale: jax.Array) -> Any:
  """``opt_state`` with every :class:`RuntimeScaleState`'s ``scale`` set to ``scale`` (a jit argument)."""
  is_scaled = lambda x: isinstance(x, RuntimeScaleState)
  return jax.tree.map(lambda x: x._replace(scale=jnp.full_like(x.scale, scale)) if is_scaled(x) else x,
                      opt_state, is_leaf=is_scaled)


def _decay_mask(params: Any) -> Any:
  """Weight decay on matrices (kernels, embeddings, positions) only, not on biases and norms."""
  return jax.tree.map(lambda x: jnp.ndim(x) >= 2, params)


def explored(config: Any) -> dict[str, H.Explore]:
  """The hyperparameters besides the learning rate(s) that the config explores, in order."""
  e, o, m = config.hdet.explore, config.optim, config.model
  task, out = tasks_lib.get(config), {}
  for name in ('dropout', 'attn_temperature'):
    if e.get(name, 0.0) > 0 and name not in task.explorable:
      raise ValueError(f'hdet.explore.{name}: the {task.name} task\'s model has no {name}; set it to 0.')
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
  return dict(tasks_lib.get(config).param_groups) if config.hdet.param_groups else None


def hyperparam_names(config: Any) -> tuple[str, ...]:
  """The order of the optimizer state's [G] fields (and of the logged ``values``/``bases``)."""
  return H.hyperparam_names(param_groups=param_groups(config), explore=explored(config))


def make_optimizer(config: Any, num_replicas: int, devices: int | None = None) -> optax.GradientTransformationExtraArgs:
  """``hdet_jax.hdet`` around the configured optax optimizer, schedule and HDET settings, for N replicas on
  ``devices`` devices (default N: one each; fewer: the replica axis is the pair of :func:`mesh.replica_axis`)."""
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
  if o.get('runtime_lr_scale', False):
    base = with_runtime_lr_scale(base)
  if o.grad_clip_norm > 0:
    factory = lambda learning_rate, **kw: optax.chain(
        optax.clip_by_global_norm(o.grad_clip_norm), base(learning_rate, **kw))
  else:
    factory = base
  return H.hdet(
      factory, schedule(config, config.optim.max_lr / lr_unit(config)), num_replicas=num_replicas, spread=h.spread,
      sync_every=sync_windows(config), replica_axis=replica_axis(num_replicas, devices or num_replicas), auto_lr=auto_lr_settings(config), exact_sync=True,
      seed=config.seed, param_groups=param_groups(config), explore=explored(config) or None,
      average_opt_state=bool(h.get('average_opt_state', False)))


def auto_lr_settings(config: Any) -> H.AutoLR | None:
  """The auto-LR controller's settings from ``config.hdet``, or None when it is off: ``hdet.controller='fit'`` at
  the config's defaults is ``hdet_jax.AutoLR(total_steps=num_train_steps)``, the guarded climb; ``'paper'`` is
  ``hdet_jax.AutoLR.paper(...)`` (the 'fit' fields then do not apply)."""
  h = config.hdet
  if not h.auto_lr:
    return None
  stop = h.get('stop_fraction', 1.0)
  stop_steps = None if stop >= 1 else int(stop * config.num_train_steps)
  if h.get('controller', 'paper') == 'paper':
    return H.AutoLR.paper(total_steps=config.num_train_steps, warmup_steps=h.warmup_steps, temperature=h.temperature,
                          lr_of_lr=h.lr_of_lr, momentum=h.momentum, smooth_decay=h.smooth_decay, stop_steps=stop_steps)
  guard = config_lib.guard(h)  # the back-off's fields, those left at None resolved
  return H.AutoLR(
      total_steps=config.num_train_steps, controller='fit', warmup_steps=h.warmup_steps,
      initial_scale=h.initial_scale, trust=h.trust, memory=h.memory, step_growth=h.step_growth,
      max_gain=h.max_gain, stop_steps=stop_steps, after_stop=h.after_stop, backoff=guard['backoff'],
      backoff_stderrs=guard['backoff_stderrs'], backoff_fraction=guard['backoff_fraction'],
      settle=config_lib.settles(h), temperature=h.temperature, lr_of_lr=h.lr_of_lr, momentum=h.momentum,
      smooth_decay=h.smooth_decay)


def common_batch(config: Any) -> bool:
  """Whether replicas are compared on one common batch at each sync (``hdet.score='common'``)."""
  return bool(config.hdet.auto_lr) and config.hdet.get('score', 'window') == 'common'


def rolls_back(config: Any) -> bool:
  """Whether a sync that backs off returns the replicas to the previous sync's state (``hdet.rollback``, resolved:
  :func:`config_lib.guard`), so the trainer keeps that state (the anchor) on the devices."""
  return config_lib.guard(config.hdet, config.optim.get('name'))['rollback']
