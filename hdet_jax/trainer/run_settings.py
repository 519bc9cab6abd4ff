"""The config, checked and resolved once: each part of the trainer gets its own settings.

``resolve(config)`` runs every check of ``config_lib.check_values``, then reads the ConfigDict once and returns a
:class:`RunSettings`: the optimizer's (:class:`optimizer.OptimizerSettings`), the compiled programs'
(:class:`programs.ProgramSettings`), the loop's (:class:`LoopSettings`), the device layout's
(:class:`MeshSettings`) and the start's. Defaults that depend on other fields (the sync window, the back-off guard,
``hdet.settle``, the LR's power of two) are resolved here and nowhere else, as ``hdet_jax.hdet()`` resolves its
``Plan``. After it, only the task reads the ConfigDict, and only its own fields (``data.*``, ``model.*``).

Example::

  run = resolve(config)
  tx = optimizer.make_optimizer(run.optimizer, num_replicas=8)
  run.loop.windows        # (100,): the sync window T
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import optax

import hdet_jax as H
from hdet_jax import windows as window_lib
from hdet_jax.trainer import config_lib
from hdet_jax.trainer import tasks as tasks_lib
from hdet_jax.trainer.optimizer import OptimizerSettings
from hdet_jax.trainer.programs import ProgramSettings


class MeshSettings(NamedTuple):
  """The device layout asked for (``mesh.*``, ``hdet.num_replicas``); ``trainer`` resolves it against the devices."""
  num_replicas: int                  # hdet.num_replicas (0: one per device, or per group)
  devices: int                       # mesh.devices (0: every visible device)
  replicas: int                      # mesh.replicas: groups on a grouped mesh (0: as many as the devices hold)
  fsdp: int                          # mesh.fsdp: devices each replica's copy is sharded over
  tensor: int                        # mesh.tensor: tensor-parallel devices inside a group
  batch_size: int                    # data.batch_size: examples per replica (group) and step


class LoopSettings(NamedTuple):
  """What the training loop reads: its length, its intervals, the sync windows and what a sync step carries."""
  num_train_steps: int               # the run's length
  stop_at_step: int                  # stop (as if preempted) at this step; 0: run to the end
  log_every: int                     # steps between the metrics' fetches
  eval_every: int                    # steps between evaluations (0: only at the end)
  checkpoint_every: int              # steps between checkpoints (0: only at the end)
  max_checkpoints: int               # checkpoints kept (0: all)
  stop_on_nan: bool                  # stop where every replica's loss is NaN/inf
  progress_bar: bool
  plots: bool                        # draw the workdir's plots at the end
  tensorboard: bool                  # TensorBoard event files beside metrics.jsonl
  windows: tuple[int, ...]           # the sync windows (``hdet_jax.hdet``'s sync_every)
  common_batch: bool                 # a sync scores the replicas on a common batch (hdet.score='common')
  rolls_back: bool                   # the loop keeps the last sync's state on the devices (the guard's rollback)
  lr_unit: float                     # optim.runtime_lr_scale's power of two (1.0: off)
  hyperparam_names: tuple[str, ...]  # the order of the logged [G] values
  controller: str | None             # the auto-LR controller's name, None without auto-LR

  @property
  def end(self) -> int:
    """The step this call trains to: ``stop_at_step`` where it is set, else the run's end."""
    return self.num_train_steps if self.stop_at_step <= 0 else min(self.stop_at_step, self.num_train_steps)

  @property
  def never_syncs(self) -> bool:
    """Whether no step of the run averages the replicas."""
    return self.windows[0] > self.num_train_steps

  def is_sync_step(self, step: int) -> bool:
    """Whether the update of step ``step`` (0-based) averages the replicas."""
    return H.is_sync_step(self.windows, step)

  def sync_index(self, step: int) -> int:
    """How many syncs come before step ``step`` (0-based): 0 for the run's first sync, 1 for the second, ..."""
    return window_lib.syncs_through(self.windows, step)


class RunSettings(NamedTuple):
  """Every part's settings of one run (:func:`resolve`)."""
  config: Any                        # the ConfigDict as given: config.json records it, the task reads its fields
  task: tasks_lib.Task               # config.task's workload
  seed: int                          # the run's key: init, warm-start noise, data order
  init_from: str | None              # a workdir whose averaged model a warm start reads (None: random init)
  warm_init_nu: float                # the warm start's noise scale (eq. 10)
  mesh: MeshSettings
  optimizer: OptimizerSettings
  programs: ProgramSettings
  loop: LoopSettings


def resolve(config: Any) -> RunSettings:
  """``config`` checked (``config_lib.check_values``: raises ConfigError naming the field) and resolved once."""
  config_lib.check_values(config)
  try:
    return _resolve(config)
  except ValueError as e:  # a combination no single field's rule sees (e.g. a model hyperparameter the task lacks)
    raise config_lib.ConfigError(f'config: {e}') from None


def _resolve(config: Any) -> RunSettings:
  task = tasks_lib.get(config)
  h, m = config.hdet, config.mesh if 'mesh' in config else {}
  guard = config_lib.guard(h, config.optim.get('name'))
  optimizer = optimizer_settings(config, guard)
  windows, auto_lr = optimizer.windows, optimizer.auto_lr
  names = H.hyperparam_names(param_groups=optimizer.param_groups, explore=optimizer.explore or {})
  common = bool(h.auto_lr) and h.get('score', 'window') == 'common'
  programs = ProgramSettings(
      task=task, seed=int(config.seed), hyperparam_names=names, dropout=config.model.get('dropout', 0.0),
      attn_temperature=config.model.get('attn_temperature', 1.0), label_smoothing=config.optim.label_smoothing,
      shares_gradient=not h.get('low_communication', False), common_batch=common, rolls_back=guard['rollback'],
      plateau=config.optim.name == 'adam_plateau', schedule_free=config.optim.name == 'schedule_free_adamw')
  loop = LoopSettings(
      num_train_steps=int(config.num_train_steps), stop_at_step=int(config.stop_at_step),
      log_every=int(config.log_every), eval_every=int(config.eval_every),
      checkpoint_every=int(config.checkpoint_every), max_checkpoints=int(config.max_checkpoints),
      stop_on_nan=bool(config.stop_on_nan), progress_bar=bool(config.progress_bar), plots=bool(config.plots),
      tensorboard=bool(config.get('tensorboard', True)), windows=windows, common_batch=common,
      rolls_back=guard['rollback'], lr_unit=lr_unit(config), hyperparam_names=names,
      controller=h.controller if auto_lr is not None else None)
  mesh = MeshSettings(num_replicas=int(h.num_replicas), devices=int(m.get('devices', 0)),
                      replicas=int(m.get('replicas', 0)), fsdp=int(m.get('fsdp', 1)), tensor=int(m.get('tensor', 1)),
                      batch_size=int(config.data.batch_size))
  return RunSettings(config=config, task=task, seed=int(config.seed), init_from=config.init_from or None,
                     warm_init_nu=config.warm_init.nu, mesh=mesh, optimizer=optimizer, programs=programs, loop=loop)


def optimizer_settings(config: Any, guard: dict[str, Any] | None = None) -> OptimizerSettings:
  """``optim.*`` and ``hdet.*`` as :func:`optimizer.make_optimizer` takes them (``guard``: as for
  :func:`auto_lr_settings`)."""
  o, h = config.optim, config.hdet
  explore = explored(config)
  if explore.get('weight_decay') is not None and o.name != 'adamw':
    raise ValueError(f'hdet.explore.weight_decay needs optim.name=adamw, got {o.name!r}.')
  return OptimizerSettings(
      name=o.name, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, grad_clip_norm=o.grad_clip_norm,
      runtime_lr_scale=bool(o.get('runtime_lr_scale', False)), schedule=schedule(config, o.max_lr / lr_unit(config)),
      spread=h.spread, windows=sync_windows(config),
      auto_lr=auto_lr_settings(config, guard), seed=config.seed,
      param_groups=param_groups(config), explore=explore or None,
      average_opt_state=bool(h.get('average_opt_state', False)))


def sync_windows(config: Any) -> tuple[int, ...]:
  """The core's ``sync_every``, one window length T: ``hdet.sync_every`` when it is > 0, else with ``hdet.num_syncs
  = K > 0`` ``round(num_train_steps / K)`` (windows counted per run), at most ``hdet.longest_window`` steps
  (:func:`hdet_jax.windows.default_period`). Both 0 means never sync (plain data parallel): T past the last step."""
  h = config.hdet
  every = int(h.sync_every)
  if every == 0 and h.get('num_syncs', 0) > 0:
    every = window_lib.default_period(config.num_train_steps, h.num_syncs, h.get('longest_window', 0))
  return (every if every > 0 else int(config.num_train_steps) + 1,)


def schedule(config: Any, max_lr: float | None = None) -> optax.Schedule:
  """The base schedule: torch's one-cycle (cosine up over pct_start of the run, then down), a linear warmup over
  pct_start of the run then a cosine decay (the usual LM schedule; both from max_lr / div_factor to max_lr, ending
  at max_lr / (div_factor * final_div_factor) on the last step), or max_lr throughout. ``max_lr``: another peak
  than ``optim.max_lr`` (the programs' own under ``optim.runtime_lr_scale``: :func:`lr_unit`)."""
  o = config.optim
  peak = o.max_lr if max_lr is None else max_lr
  name = o.get('schedule', 'one_cycle')
  if name == 'constant':
    return optax.constant_schedule(peak)
  if name == 'warmup_cosine':
    initial = peak / o.div_factor
    return optax.warmup_cosine_decay_schedule(
        init_value=initial, peak_value=peak, warmup_steps=int(round(o.pct_start * config.num_train_steps)),
        decay_steps=config.num_train_steps - 1, end_value=initial / o.final_div_factor)
  return H.one_cycle(max_lr=peak, total_steps=config.num_train_steps, pct_start=o.pct_start,
                     div_factor=o.div_factor, final_div_factor=o.final_div_factor)


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
  """The task's parameter groups (regexes on parameter paths) where ``hdet.param_groups`` is on, else None."""
  return dict(tasks_lib.get(config).param_groups) if config.hdet.param_groups else None


def hyperparam_names(config: Any) -> tuple[str, ...]:
  """The order of the optimizer state's [G] fields (and of the logged ``values``/``bases``)."""
  return H.hyperparam_names(param_groups=param_groups(config), explore=explored(config))


def auto_lr_settings(config: Any, guard: dict[str, Any] | None = None) -> H.AutoLR | None:
  """The auto-LR controller's settings from ``config.hdet``, or None when it is off: ``hdet.controller='fit'`` at
  the config's defaults is ``hdet_jax.AutoLR(total_steps=num_train_steps)``, the guarded climb; ``'paper'`` is
  ``hdet_jax.AutoLR.paper(...)`` (the 'fit' fields then do not apply). ``guard``: ``config_lib.guard``'s
  resolution of the back-off's fields, where the caller has it."""
  h = config.hdet
  if not h.auto_lr:
    return None
  stop = h.get('stop_fraction', 1.0)
  stop_steps = None if stop >= 1 else int(stop * config.num_train_steps)
  if h.get('controller', 'paper') == 'paper':
    return H.AutoLR.paper(total_steps=config.num_train_steps, warmup_steps=h.warmup_steps, temperature=h.temperature,
                          lr_of_lr=h.lr_of_lr, momentum=h.momentum, smooth_decay=h.smooth_decay, stop_steps=stop_steps)
  guard = config_lib.guard(h) if guard is None else guard  # the back-off's fields, those left at None resolved
  return H.AutoLR(
      total_steps=config.num_train_steps, controller='fit', warmup_steps=h.warmup_steps,
      initial_scale=h.initial_scale, trust=h.trust, memory=h.memory, step_growth=h.step_growth,
      max_gain=h.max_gain, stop_steps=stop_steps, after_stop=h.after_stop, backoff=guard['backoff'],
      backoff_stderrs=guard['backoff_stderrs'], backoff_fraction=guard['backoff_fraction'],
      settle=config_lib.settles(h), temperature=h.temperature, lr_of_lr=h.lr_of_lr, momentum=h.momentum,
      smooth_decay=h.smooth_decay)
