"""The config, checked and resolved once: each part of the trainer gets its own settings.

``resolve(config)`` is the last function that takes the ConfigDict. It flattens the config, completes it from
the schema (``schema.complete``: a field a config lacks reads as its row says), checks every field
(``schema.check_fields``) and the rules across fields (:func:`check`), and returns a :class:`RunSettings`: the
task's (:class:`tasks.TaskSettings`), the optimizer's (:class:`optimizer.OptimizerSettings`), the compiled
programs' (:class:`programs.ProgramSettings`), the loop's (:class:`LoopSettings`), the device layout's
(:class:`MeshSettings`), the start's, and the fields as given (what ``config.json``, the run's training fields and
the programs' cache key are made of). Defaults that depend on other fields (the sync window, the back-off guard,
``hdet.settle``, the LR's power of two) are resolved here and nowhere else, as ``hdet_jax.hdet()`` resolves its
``Plan``. The functions below :func:`resolve` read ``f``, the completed fields (a flat mapping of dotted names).

Example::

  run = resolve(config)
  tx = optimizer.make_optimizer(run.optimizer, num_replicas=8, seed=run.seed)
  run.optimizer.windows   # (100,): the sync window T
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import re
import typing
from typing import Any, Mapping, NamedTuple

import ml_collections
import optax

import hdet_jax as H
from hdet_jax import sync as sync_lib
from hdet_jax.trainer import compat
from hdet_jax.trainer import config_lib
from hdet_jax.trainer import schema
from hdet_jax.trainer import tasks as tasks_lib
from hdet_jax.trainer.config_lib import ConfigError
from hdet_jax.trainer import optimizer as optimizer_lib
from hdet_jax.trainer.optimizer import OptimizerSettings
from hdet_jax.trainer.programs import ProgramSettings

Fields = Mapping[str, Any]  # completed fields by dotted name (schema.complete)


class MeshSettings(NamedTuple):
  """The device layout asked for (``mesh.*``, ``hdet.num_replicas``); ``trainer`` resolves it against the devices."""

  num_replicas: int  # hdet.num_replicas (0: one per device, or per group)
  devices: int  # mesh.devices (0: every visible device)
  replicas: int  # mesh.replicas: groups on a grouped mesh (0: as many as the devices hold)
  fsdp: int  # mesh.fsdp: devices each replica's copy is sharded over
  tensor: int  # mesh.tensor: tensor-parallel devices inside a group
  batch_size: int  # data.batch_size: examples per replica (group) and step


class LoopSettings(NamedTuple):
  """What the training loop reads of its own: its length and intervals. What it shares with another part is that
  part's (:class:`RunSettings` says where: the sync windows, the guard's rollback, the programs' common batch)."""

  num_train_steps: int  # the run's length
  stop_at_step: int  # stop (as if preempted) at this step; 0: run to the end
  log_every: int  # steps between the metrics' fetches
  chunk_steps: int  # steps whose batches go to the devices in one transfer
  eval_every: int  # steps between evaluations (0: only at the end)
  checkpoint_every: int  # steps between checkpoints (0: only at the end)
  max_checkpoints: int  # checkpoints kept (0: all)
  stop_on_nan: bool  # stop where every replica's loss is NaN/inf
  progress_bar: bool
  plots: bool  # draw the workdir's plots at the end
  tensorboard: bool  # TensorBoard event files beside metrics.jsonl
  lr_unit: float  # optim.runtime_lr_scale's power of two (1.0: off)

  @property
  def end(self) -> int:
    """The step this call trains to: ``stop_at_step`` where it is set, else the run's end."""
    return self.num_train_steps if self.stop_at_step <= 0 else min(self.stop_at_step, self.num_train_steps)


class Guard(NamedTuple):
  """The back-off guard's fields, those left at None resolved (:func:`guard`)."""

  backoff: bool  # step the LR correction down on a window whose training loss rose
  rollback: bool  # ... and return the replicas to the sync before it
  backoff_stderrs: float  # the rise's margin in standard errors
  backoff_fraction: float  # ... and as a fraction of the loss


class BracketSettings(NamedTuple):
  """An LR bracket's fields (``bracket.*``; ``hdet_jax.trainer.bracket``)."""

  points: int  # runs at peak LRs a factor apart (0: no bracket, one run)
  factor: float  # the ratio of neighbouring points' peak LRs
  rungs: tuple[tuple[float, int], ...]  # (fraction of the run, runs kept) at each rung
  compare_steps: int  # a rung ranks runs by their mean training loss over this many steps
  max_lr: float  # optim.max_lr: the points' geometric centre


class RunSettings(NamedTuple):
  """Every part's settings of one run (:func:`resolve`)."""

  given: dict  # the config's fields as given, flattened (JSON values): config.json, identity
  task: tasks_lib.Task  # config.task's workload
  task_settings: tasks_lib.TaskSettings  # its own fields (data.*, model.*, ...), completed from the schema
  seed: int  # the run's (config.seed), said here only: init, warm-start noise, data order, permutations, dropout
  init_from: str | None  # a workdir whose averaged model a warm start reads (None: random init)
  warm_init_nu: float  # the warm start's noise scale (eq. 10)
  guard: Guard  # the back-off guard, resolved
  mesh: MeshSettings
  optimizer: OptimizerSettings
  programs: ProgramSettings
  loop: LoopSettings
  bracket: BracketSettings

  # Each fact two parts read is resolved once, in one part's settings: the sync windows the optimizer's (the core's
  # sync_every), the rollback the guard's, the [G] order and the common batch the programs'.

  @property
  def controller(self) -> str | None:
    """The auto-LR controller's name ('fit' or 'paper'), None without auto-LR."""
    return self.optimizer.auto_lr.controller if self.optimizer.auto_lr is not None else None

  @property
  def never_syncs(self) -> bool:
    """Whether no step of the run averages the replicas."""
    return self.optimizer.windows[0] > self.loop.num_train_steps

  def is_sync_step(self, step: int) -> bool:
    """Whether the update of step ``step`` (0-based) averages the replicas."""
    return H.is_sync_step(self.optimizer.windows, step)

  def sync_index(self, step: int) -> int:
    """How many syncs come before step ``step`` (0-based): 0 for the run's first sync, 1 for the second, ..."""
    return sync_lib.syncs_through(self.optimizer.windows, step)

  def training_fields(self, num_replicas: int) -> dict[str, Any]:
    """The fields that define the trajectory (what a resume compares), with N and the fields left at None
    resolved; those at their legacy value (``compat.QUIET_DEFAULTS``) are left out, as records before them lack
    them."""
    return identity(self.given, num_replicas)


def identity(given: Fields, num_replicas: int) -> dict[str, Any]:
  """:meth:`RunSettings.training_fields` of the (flattened) fields ``given``."""
  flat = compat.quiet(schema.run_identity(resolved(given)))
  flat = {k: flat[k] for k in sorted(flat, key=lambda k: k.split('.'))}  # (the order config.json always had)
  flat['hdet.num_replicas'] = int(num_replicas)
  return json.loads(json.dumps(flat, default=str))


def resolve(config: Any, optimizer: optimizer_lib.Base | None = None, tuning: Fields | None = None) -> RunSettings:
  """``config`` checked (raises ConfigError naming the field and the fix) and resolved once. ``optimizer``: a base
  optimizer given in Python (research's LR-free baselines), recorded as ``optim.name`` in place of the config's.
  ``tuning``: research's fields given in Python (:func:`schema.tuning_fields`, by their dotted names), the rest at
  their defaults (``hdet.controller='paper'``: the paper's, ``schema.PAPER_TUNING``)."""
  given = config_lib.flatten(json.loads(config.to_json()))
  if optimizer is not None:
    given['optim.name'] = optimizer.name
  removed = compat.first_removed(given)
  if removed:
    raise ConfigError(compat.removed_message(removed))
  given = with_tuning(given, tuning)
  try:
    task = tasks_lib.get(schema.task_of(given))
  except tasks_lib.TaskError as e:
    raise ConfigError(str(e)) from None
  f = schema.complete(given, task.name)
  check(f, task, optimizer)
  try:
    return _resolve(given, f, task, optimizer)
  except ValueError as e:  # a combination no single field's rule sees (e.g. a model hyperparameter the task lacks)
    raise ConfigError(f'config: {e}') from None


def with_tuning(given: Fields, tuning: Fields | None) -> dict[str, Any]:
  """The config's (flattened) fields ``given`` with research's ``tuning`` and every other tuning field at its default,
  each at its row's place: the fields a run records (``config.json``), in the order records have them. A tuning field
  in the config, or a config field in ``tuning``, is a ConfigError naming it and where it belongs."""
  tuning = dict(tuning or {})
  names = schema.tuning_fields()
  for name in given:
    if name in names:
      raise ConfigError(
        f'{name} is no longer a config field (it was in 1.0): research gives it in Python, '
        f'train_and_evaluate(config, workdir, tuning={{{name!r}: {given[name]!r}}}); remove it from the config.'
      )
  for name in tuning:
    if name not in names:
      raise ConfigError(
        f'tuning: {name!r} is not a tuning field ({", ".join(names)}); set a config field in the config.'
      )
  values = {name: schema.BY_NAME[name].default for name in names}
  if given.get('hdet.controller', schema.BY_NAME['hdet.controller'].default) == 'paper':
    values.update(schema.PAPER_TUNING)  # the paper's method at its values, where research sets none of them
  values.update(tuning)
  out, rows = {}, [f.name for f in schema.FIELDS]
  for name, value in given.items():  # each tuning field right after the row before it
    out[name] = value
    at = rows.index(name) if name in rows else -1
    while at >= 0 and at + 1 < len(rows) and rows[at + 1] in values:
      out[rows[at + 1]] = values.pop(rows[at + 1])
      at += 1
  out.update(values)  # (a config without the fields before them)
  return out


def split(config: Any) -> tuple[Any, dict[str, Any]]:
  """A config as records hold it (research's, with its tuning fields) split into what ``train_and_evaluate`` takes:
  ``(config, tuning)``, the config without the tuning fields and those fields by dotted name (one it lacks at the
  value records made before the field have, as ``schema.complete`` reads them; a config without any: none).

  Example::

    config, tuning = split(recorded_config(product_config))
    train_and_evaluate(config, workdir, tuning=tuning)
  """
  flat, tuning = _split_fields(config)
  return ml_collections.ConfigDict(config_lib.unflatten(flat)), tuning


def _split_fields(config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
  """:func:`split` on the flattened fields: (the config's other fields, its tuning fields)."""
  flat = config_lib.flatten(json.loads(config.to_json()))
  names = schema.tuning_fields()
  tuning = {name: flat.pop(name) for name in names if name in flat}
  if tuning:  # a record's config: a tuning field it lacks, added after it was written, reads as such records trained
    tuning = {name: tuning[name] if name in tuning else schema.BY_NAME[name].absent for name in names}
  return flat, tuning


def recorded_config(config: Any, tuning: Fields | None = None) -> Any:
  """``config`` with the tuning fields (``tuning``'s, the rest at their defaults) in their places: a config as records
  hold it, whose tuning fields research sets like any other (:func:`split` takes them back out)."""
  flat, held = _split_fields(config)
  return ml_collections.ConfigDict(config_lib.unflatten(with_tuning(flat, {**held, **(tuning or {})})))


def resolve_recorded(config: Any, optimizer: optimizer_lib.Base | None = None) -> RunSettings:
  """:func:`resolve` of a config as records hold it: its tuning fields (:func:`split`) given as ``tuning``."""
  config, tuning = split(config)
  return resolve(config, optimizer, tuning)


def _resolve(given: dict, f: Fields, task: tasks_lib.Task, base: optimizer_lib.Base | None) -> RunSettings:
  g, unit = guard(f), lr_unit(f)
  optimizer = optimizer_settings(f, task, g, unit)._replace(base=base)
  programs = ProgramSettings(
    task=task,
    hyperparam_names=H.hyperparam_names(param_groups=optimizer.param_groups, explore=optimizer.explore or {}),
    dropout=f['model.dropout'],
    attn_temperature=f['model.attn_temperature'],
    label_smoothing=f['optim.label_smoothing'],
    shares_gradient=not f['hdet.low_communication'],
    common_batch=bool(f['hdet.auto_lr']) and f['hdet.score'] == 'common',
    rolls_back=g.rollback,
    plateau=bool(base and base.plateau),
    schedule_free=bool(base and base.schedule_free),
  )
  loop = _read(LoopSettings, f, lr_unit=unit)
  mesh = MeshSettings(
    num_replicas=int(f['hdet.num_replicas']),
    devices=int(f['mesh.devices']),
    replicas=int(f['mesh.replicas']),
    fsdp=int(f['mesh.fsdp']),
    tensor=int(f['mesh.tensor']),
    batch_size=int(f['data.batch_size']),
  )
  return RunSettings(
    given=given,
    task=task,
    task_settings=task_settings(f, task),
    seed=int(f['seed']),
    init_from=f['init_from'] or None,
    warm_init_nu=f['warm_init.nu'],
    guard=g,
    mesh=mesh,
    optimizer=optimizer,
    programs=programs,
    loop=loop,
    bracket=BracketSettings(
      points=int(f['bracket.points']),
      factor=float(f['bracket.factor']),
      rungs=tuple(schema.parse_rungs(f['bracket.rungs'])) if f['bracket.points'] else (),
      compare_steps=int(f['bracket.compare_steps']),
      max_lr=float(f['optim.max_lr']),
    ),
  )


def _read(cls: type, f: Fields, **resolved: Any) -> Any:
  """A part's settings ``cls`` (a NamedTuple): each field ``resolved`` leaves out read off ``f`` by its name, as its
  type (a loop field is its line in fields.py and its line in LoopSettings)."""
  kinds = typing.get_type_hints(cls)
  return cls(**{k: kinds[k](f[k]) for k in cls._fields if k not in resolved}, **resolved)


def task_settings(f: Fields, task: tasks_lib.Task) -> tasks_lib.TaskSettings:
  """The task's own fields: ``data.*`` and ``model.*``, and what its data reads of the loop's."""

  def section(prefix):
    return tasks_lib.Section({k[len(prefix) :]: v for k, v in f.items() if k.startswith(prefix)})

  return tasks_lib.TaskSettings(
    name=task.name,
    data=section('data.'),
    model=section('model.'),
    eval_windows=int(f['eval_windows']),
    probe_windows=int(f['hdet.probe_windows']),
  )


def optimizer_settings(f: Fields, task: tasks_lib.Task, guard_: Guard, unit: float) -> OptimizerSettings:
  """``optim.*`` and ``hdet.*`` as :func:`optimizer.make_optimizer` takes them. ``guard_``: :func:`guard`'s;
  ``unit``: :func:`lr_unit`'s."""
  explore = explored(f, task)
  if explore.get('weight_decay') is not None and f['optim.name'] != 'adamw':
    raise ValueError(f'hdet.explore.weight_decay needs optim.name=adamw, got {f["optim.name"]!r}.')
  return OptimizerSettings(
    name=f['optim.name'],
    b1=f['optim.b1'],
    b2=f['optim.b2'],
    weight_decay=f['optim.weight_decay'],
    grad_clip_norm=f['optim.grad_clip_norm'],
    runtime_lr_scale=bool(f['optim.runtime_lr_scale']),
    schedule=schedule(f, f['optim.max_lr'] / unit),
    spread=f['hdet.spread'],
    windows=sync_windows(f),
    auto_lr=auto_lr_settings(f, guard_),
    param_groups=param_groups(f, task),
    explore=explore or None,
    average_opt_state=bool(f['hdet.average_opt_state']),
  )


def sync_windows(f: Fields) -> tuple[int, ...]:
  """The core's ``sync_every``, one window length T: ``hdet.sync_every`` when it is > 0, else with ``hdet.num_syncs
  = K > 0`` ``round(num_train_steps / K)`` (windows counted per run), at most ``hdet.longest_window`` steps
  (:func:`hdet_jax.sync.default_period`). Both 0 means never sync (plain data parallel): T past the last step."""
  every = int(f['hdet.sync_every'])
  if every == 0 and f['hdet.num_syncs'] > 0:
    every = sync_lib.default_period(f['num_train_steps'], f['hdet.num_syncs'], f['hdet.longest_window'])
  return (every if every > 0 else int(f['num_train_steps']) + 1,)


def schedule(f: Fields, max_lr: float | None = None) -> optax.Schedule:
  """The base schedule: torch's one-cycle (cosine up over pct_start of the run, then down), a linear warmup over
  pct_start of the run then a cosine decay (the usual LM schedule; both from max_lr / div_factor to max_lr, ending
  at max_lr / (div_factor * final_div_factor) on the last step), or max_lr throughout. ``max_lr``: another peak
  than ``optim.max_lr`` (the programs' own under ``optim.runtime_lr_scale``: :func:`lr_unit`)."""
  peak = f['optim.max_lr'] if max_lr is None else max_lr
  name, total, div = f['optim.schedule'], f['num_train_steps'], f['optim.div_factor']
  if name == 'constant':
    return optax.constant_schedule(peak)
  if name == 'warmup_cosine':
    initial = peak / div
    return optax.warmup_cosine_decay_schedule(
      init_value=initial,
      peak_value=peak,
      warmup_steps=int(round(f['optim.pct_start'] * total)),
      decay_steps=total - 1,
      end_value=initial / f['optim.final_div_factor'],
    )
  return H.one_cycle(
    max_lr=peak,
    total_steps=total,
    pct_start=f['optim.pct_start'],
    div_factor=div,
    final_div_factor=f['optim.final_div_factor'],
  )


def lr_unit(f: Fields) -> float:
  """The power of two ``2**e`` that ``optim.runtime_lr_scale`` applies at run time (1.0 when it is off).

  ``optim.max_lr = m * 2**e`` with ``m`` in [0.5, 1) (``math.frexp``, exact): the programs are built for the peak
  ``m`` and every learning rate is multiplied by ``2**e`` when the optimizer uses it. A product with a power of two
  is exact in floating point (away from overflow and subnormals), and every schedule here is linear in its peak, so
  the run's learning rates, and so its numbers, are the plain build's bit for bit; runs whose ``max_lr`` differ by
  a power of two (an LR bracket or sweep a factor 2 apart) build identical programs, and the persistent compilation
  cache compiles them once.
  """
  if not f['optim.runtime_lr_scale']:
    return 1.0
  return math.ldexp(1.0, math.frexp(f['optim.max_lr'])[1])


def explored(f: Fields, task: tasks_lib.Task) -> dict[str, H.Explore]:
  """The hyperparameters besides the learning rate(s) that the config explores, in order."""
  out = {}
  for name in ('dropout', 'attn_temperature'):
    if f[f'hdet.explore.{name}'] > 0 and name not in task.explorable:
      raise ValueError(f"hdet.explore.{name}: the {task.name} task's model has no {name}; set it to 0.")
  if f['hdet.explore.weight_decay'] > 0:
    out['weight_decay'] = H.Explore(f['optim.weight_decay'], f['hdet.explore.weight_decay'], low=0.0)
  if f['hdet.explore.dropout'] > 0:  # additive: a base rate of 0 must still be explorable
    out['dropout'] = H.Explore(
      f['model.dropout'], f['hdet.explore.dropout'], additive=True, low=0.0, high=0.9, to_optimizer=False
    )
  if f['hdet.explore.label_smoothing'] > 0:
    out['label_smoothing'] = H.Explore(
      f['optim.label_smoothing'],
      f['hdet.explore.label_smoothing'],
      additive=True,
      low=0.0,
      high=0.5,
      to_optimizer=False,
    )
  if f['hdet.explore.attn_temperature'] > 0:
    out['attn_temperature'] = H.Explore(
      f['model.attn_temperature'], f['hdet.explore.attn_temperature'], low=0.05, to_optimizer=False
    )
  return out


def param_groups(f: Fields, task: tasks_lib.Task) -> dict[str, str] | None:
  """The task's parameter groups (regexes on parameter paths) where ``hdet.param_groups`` is on, else None."""
  return dict(task.param_groups) if f['hdet.param_groups'] else None


def auto_lr_settings(f: Fields, guard_: Guard) -> H.AutoLR | None:
  """The auto-LR controller's settings from ``hdet.*``, or None when it is off: ``hdet.controller='fit'`` at
  the config's defaults is ``hdet_jax.AutoLR(total_steps=num_train_steps)``, the guarded climb; ``'paper'`` is
  ``hdet_jax.AutoLR.paper(...)`` (the 'fit' fields then do not apply). ``guard_``: :func:`guard`'s."""
  if not f['hdet.auto_lr']:
    return None
  total, stop = f['num_train_steps'], f['hdet.stop_fraction']
  stop_steps = None if stop >= 1 else int(stop * total)
  common = dict(
    total_steps=total,
    warmup_steps=f['hdet.warmup_steps'],
    temperature=f['hdet.temperature'],
    lr_of_lr=f['hdet.lr_of_lr'],
    momentum=f['hdet.momentum'],
    smooth_decay=f['hdet.smooth_decay'],
    stop_steps=stop_steps,
  )
  if f['hdet.controller'] == 'paper':
    return H.AutoLR.paper(**common)
  return H.AutoLR(
    controller='fit',
    initial_scale=f['hdet.initial_scale'],
    trust=f['hdet.trust'],
    memory=f['hdet.memory'],
    step_growth=f['hdet.step_growth'],
    max_gain=f['hdet.max_gain'],
    after_stop=f['hdet.after_stop'],
    backoff=guard_.backoff,
    backoff_stderrs=guard_.backoff_stderrs,
    backoff_fraction=guard_.backoff_fraction,
    settle=settles(f),
    anneal_fraction=anneals(f),
    **common,
  )


# ---- Defaults that depend on other fields: each resolved here only. ----


def settles(f: Fields) -> bool:
  """Whether ``hdet.settle`` is on: as set, or where it is left at None (the default), wherever it applies (the
  'fit' controller's rise-only climb: ``auto_lr``, ``controller='fit'``, ``after_stop='rise'``)."""
  if f['hdet.settle'] is not None:
    return bool(f['hdet.settle'])
  return _settle_applies(f)


def anneals(f: Fields) -> float:
  """``hdet.anneal_fraction`` as the controller takes it (``hdet_jax.AutoLR.anneal_fraction``): as set, or where
  left at None (the default) the core's default wherever it applies (the 'fit' controller with ``auto_lr``), else 0.
  None stays None in the run's training fields, as records and workdirs made before the field read."""
  if f['hdet.anneal_fraction'] is not None:
    return float(f['hdet.anneal_fraction'])
  applies = bool(f['hdet.auto_lr']) and f['hdet.controller'] == 'fit'
  return float(schema.AUTO_LR_DEFAULTS['anneal_fraction']) if applies else 0.0


def _settle_applies(f: Fields) -> bool:
  return bool(f['hdet.auto_lr']) and f['hdet.controller'] == 'fit' and f['hdet.after_stop'] == 'rise'


# The back-off guard where its fields are left at None (configs/default.py): wherever the back-off applies, it
# fires on a rise of the window's training loss beyond hdet_jax.AutoLR's margins (2 standard errors and 5%) and rolls
# back; elsewhere it is off.
GUARD_ON = Guard(
  backoff=True,
  rollback=True,
  backoff_stderrs=schema.AUTO_LR_DEFAULTS['backoff_stderrs'],
  backoff_fraction=schema.AUTO_LR_DEFAULTS['backoff_fraction'],
)
GUARD_OFF = Guard(backoff=False, rollback=False, backoff_stderrs=0.0, backoff_fraction=0.0)


def guard(f: Fields) -> Guard:
  """The back-off's fields with those left at None resolved: the back-off on wherever it applies (the 'fit'
  controller with ``auto_lr``), and the other three at :data:`GUARD_ON` where it is on, at :data:`GUARD_OFF` where
  not; the rollback only where the replicas share their optimizer state (:func:`shared_opt_state`). Example:
  ``guard(schema.complete({}))`` is ``GUARD_ON``."""
  backoff = f['hdet.backoff']
  backoff = _backoff_applies(f) if backoff is None else bool(backoff)
  fallback = GUARD_ON if backoff else GUARD_OFF
  if backoff and not shared_opt_state(f):  # no one copy of the optimizer state to return to
    fallback = GUARD_ON._replace(rollback=False)
  resolved_ = {
    name: getattr(fallback, name) if f[f'hdet.{name}'] is None else type(getattr(GUARD_OFF, name))(f[f'hdet.{name}'])
    for name in ('rollback', 'backoff_stderrs', 'backoff_fraction')
  }
  return Guard(backoff=backoff, **resolved_)


def _backoff_applies(f: Fields) -> bool:
  return bool(f['hdet.auto_lr']) and f['hdet.controller'] == 'fit'


# The optimizers whose state is a function of the gradients alone: optim.name's (optimizer.FACTORIES). A base given
# in Python (an LR-free one) may keep LR-dependent estimates (Prodigy's d, schedule-free's z), which the replicas'
# own LRs set apart.
SHARED_STATE_OPTIMIZERS = optimizer_lib.OPTIMIZERS


def shared_opt_state(f: Fields) -> bool:
  """Whether every replica holds the same wrapped optimizer state after a sync, so that the rollback's one copy
  of it (its anchor) is every replica's: an optimizer of :data:`SHARED_STATE_OPTIMIZERS` on the shared gradient,
  or in the low-communication mode averaging the state."""
  if f['optim.name'] not in SHARED_STATE_OPTIMIZERS:
    return False
  return not f['hdet.low_communication'] or bool(f['hdet.average_opt_state'])


def resolved(flat: Fields) -> dict[str, Any]:
  """A flattened config or record with the fields left at None ("wherever it applies") written as what they
  resolve to, so a run, a resumed run and a cached record compare what trains (``hdet.settle``: :func:`settles`;
  the back-off's fields: :func:`guard`). Fields ``flat`` lacks stay absent."""
  f = schema.complete(flat)
  out = dict(flat)
  if 'hdet.settle' in flat and flat['hdet.settle'] is None:
    out['hdet.settle'] = settles(f)
  if any(f'hdet.{name}' in flat and flat[f'hdet.{name}'] is None for name in Guard._fields):
    out.update({f'hdet.{k}': v for k, v in guard(f)._asdict().items() if f'hdet.{k}' in flat})
  return out


# ---- Fields set where the run cannot use them: one warning line per cause. ----


def _only(names: Any) -> tuple[str, ...]:
  """The trainer's fields (``hdet.<name>``) of those of ``hdet_jax.AutoLR``'s fields ``names``, in its order."""
  return tuple(
    f'hdet.{f.name}' for f in dataclasses.fields(H.AutoLR) if f.name in names and f'hdet.{f.name}' in schema.BY_NAME
  )


# Each controller's own fields, read off the core: AutoLR.paper takes every field the paper's controller reads, the
# 'fit' controller's are the rest; the paper's own are its arguments from temperature on (AutoLR's layout: the fields
# every controller reads come before).
_PAPER_ARGUMENTS = tuple(inspect.signature(H.AutoLR.paper).parameters)
_FIT_FIELDS = _only({f.name for f in dataclasses.fields(H.AutoLR)} - {*_PAPER_ARGUMENTS, 'controller'})
_PAPER_FIELDS = _only(_PAPER_ARGUMENTS[_PAPER_ARGUMENTS.index('temperature') :])
_CONTROLLER_FIELDS = (
  'hdet.controller',
  'hdet.score',
  'hdet.probe_windows',
  'hdet.warmup_steps',
  'hdet.stop_fraction',
  *_FIT_FIELDS,
  *_PAPER_FIELDS,
)
# What each optimizer of optimizer.OPTIMIZERS leaves out of optim.b1, optim.b2 and optim.weight_decay (optimizer.py).
_OPTIMIZER_IGNORES = {
  'adamw': (),
  'adam': ('optim.weight_decay',),
  'sgd': ('optim.b2', 'optim.weight_decay'),
}


def _moved(f: Fields, name: str) -> bool:
  """Whether ``f[name]`` is away from its default and from its legacy value (a value records made before the field
  trained with: configs set it to keep those runs' identity, not to ask for it)."""
  row, value = schema.BY_NAME[name], f[name]
  return value != row.default and not (row.has_legacy and value == row.legacy)


def _ignored(f: Fields, task: tasks_lib.Task) -> list[tuple[str, tuple[str, ...]]]:
  """(why, fields) for each cause that leaves fields set away from their default unread (:func:`ignored`)."""
  out = []

  def add(why, names):
    names = tuple(n for n in names if n in f and _moved(f, n))
    if names:
      out.append((why, names))

  if not f['hdet.auto_lr']:
    add(
      'hdet.auto_lr=False, so no controller moves the learning rate (hdet.auto_lr=True uses them)',
      _CONTROLLER_FIELDS,
    )
  else:
    if f['hdet.controller'] == 'paper':
      add("hdet.controller='paper' (eqs. 4-9) reads none of the 'fit' controller's settings", _FIT_FIELDS)
    else:
      add(f"hdet.controller={f['hdet.controller']!r} reads none of the 'paper' controller's settings", _PAPER_FIELDS)
    if f['hdet.score'] == 'window':
      add("hdet.score='window' compares the replicas' window losses; no common batch is drawn", ('hdet.probe_windows',))
  if f['hdet.sync_every'] > 0:
    add(
      f'hdet.sync_every={f["hdet.sync_every"]} sets the window; these count windows only with hdet.sync_every=0',
      ('hdet.num_syncs', 'hdet.longest_window'),
    )
  elif f['hdet.num_syncs'] == 0:
    add('hdet.sync_every=0 and hdet.num_syncs=0, so the replicas never average', ('hdet.longest_window',))
  if f['optim.schedule'] == 'constant':
    add(
      "optim.schedule='constant' holds optim.max_lr throughout",
      ('optim.pct_start', 'optim.div_factor', 'optim.final_div_factor'),
    )
  name = f['optim.name']
  unread = _OPTIMIZER_IGNORES.get(name, ('optim.b1', 'optim.b2', 'optim.weight_decay'))
  if f['optim.weight_decay'] == 0:  # (no decay asked, none applied)
    unread = tuple(n for n in unread if n != 'optim.weight_decay')
  why = {
    'adam': "optim.name='adam' has no weight decay (optim.name='adamw' has)",
    'sgd': "optim.name='sgd' takes optim.b1 as its momentum and has no b2 or weight decay",
  }.get(name, f'optim.name={name!r} runs at its documented defaults')
  add(why, unread)
  if f['bracket.points'] == 0:
    add(
      'bracket.points=0 trains one run, not an LR bracket', ('bracket.factor', 'bracket.rungs', 'bracket.compare_steps')
    )
  if not f['init_from']:
    add("init_from is None: the run starts from a random init, without a warm start's noise", ('warm_init.nu',))
  for why, names in task.unread(f):  # the task's own fields (tasks/<task>.py)
    add(why, names)
  return out


def ignored(config: Any, base: Any = None, tuning: Fields | None = None) -> list[str]:
  """One line per cause for the fields ``config`` sets (away from their default and legacy value) where the run
  cannot use them: ``"hdet.trust=0.5 is ignored: hdet.auto_lr=False: ..."`` (train.py prints each once, at the
  start, as a warning). ``base``: the config the user started from (a shipped config file, as loaded): its own
  unread fields are that file's choices, and are left out unless ``config`` gives them another value. ``config``
  is checked first (:func:`resolve`'s ConfigError). ``tuning``: research's, given in Python (``base`` is read
  without it)."""
  run = resolve(config, tuning=tuning)
  f = schema.complete(run.given, run.task.name)
  skip = set()
  if base is not None:
    b = schema.complete(with_tuning(config_lib.flatten(json.loads(base.to_json())), None), run.task.name)
    skip = {(n, json.dumps(b[n])) for _, names in _ignored(b, run.task) for n in names}
  lines = []
  for why, names in _ignored(f, run.task):
    names = [n for n in names if (n, json.dumps(f[n])) not in skip]
    if names:
      values = ', '.join(f'{n}={f[n]!r}' for n in names)
      lines.append(f'{values} {"is" if len(names) == 1 else "are"} ignored: {why}.')
  return lines


# ---- The rules across fields (each field's own: schema.check_fields). ----


def check(f: Fields, task: tasks_lib.Task, base: optimizer_lib.Base | None = None) -> None:
  """Every field's type and range, then the rules across fields, then the task's own; raises ConfigError naming the
  field and the fix. Runs before anything touches JAX, so a bad value never surfaces from inside it. ``base``: a base
  optimizer given in Python, whose name ``optim.name`` holds."""
  try:
    schema.check_fields({k: v for k, v in f.items() if not (base and k == 'optim.name')})
    task.check(task_settings(f, task))
  except ValueError as e:  # (a TaskError is one)
    raise ConfigError(str(e)) from None
  _check_schedule(f)
  _check_bracket(f)
  _check_runtime_lr_scale(f)
  if f['hdet.auto_lr'] and f['hdet.spread'] > 0 and f['hdet.warmup_steps'] >= f['num_train_steps']:
    raise ConfigError(
      f'hdet.warmup_steps={f["hdet.warmup_steps"]} must be < num_train_steps={f["num_train_steps"]} '
      '(the controller would never start); lower it or set hdet.auto_lr=False.'
    )
  _check_num_syncs(f)
  _check_guard(f)
  _check_mesh(f)
  _check_task_fields(f, task)
  if f['hdet.explore.weight_decay'] > 0 and f['optim.weight_decay'] == 0:
    raise ConfigError(
      f'hdet.explore.weight_decay={f["hdet.explore.weight_decay"]} spreads optim.weight_decay multiplicatively, '
      'and optim.weight_decay=0 spreads to 0 on every replica: set optim.weight_decay > 0 (e.g. 0.1), or '
      'hdet.explore.weight_decay=0.'
    )
  if f['hdet.settle'] and not _settle_applies(f):
    raise ConfigError(
      "hdet.settle=True ends the 'fit' controller's rise-only climb: it needs hdet.auto_lr=True, "
      f"hdet.controller='fit' and hdet.after_stop='rise' (got {f['hdet.controller']!r}, "
      f'{f["hdet.after_stop"]!r}), or set hdet.settle=False.'
    )
  _check_controller(f)


# The trainer's name of each hdet_jax.AutoLR field the core's check may name (the rest are hdet.<field>).
_AUTO_LR_FIELD = {'total_steps': 'num_train_steps', 'stop_steps': 'hdet.stop_fraction'}


def _check_controller(f: Fields) -> None:
  """The controller's ranges and the guard's rules: the core's own checks (``hdet_jax.settings.check_auto_lr`` and
  ``check_rollback``) of the controller and rollback this config builds, the error naming the config or tuning
  field. A controller that is off is not built, nor its ranges checked."""
  g = guard(f)
  auto_lr = auto_lr_settings(f, g)
  try:
    if auto_lr is not None and f['hdet.spread'] != 0:  # (auto-LR without a spread: check_controller_acts says so)
      H.settings.check_auto_lr(auto_lr, f['hdet.spread'])
    H.settings.check_rollback(g.rollback, auto_lr)
  except ValueError as e:
    named = re.sub(r'\bauto_lr\.(\w+)', lambda m: _AUTO_LR_FIELD.get(m.group(1), f'hdet.{m.group(1)}'), str(e))
    raise ConfigError(re.sub(r'(?<![.\w])(rollback|backoff)=', r'hdet.\1=', named)) from None


def _check_guard(f: Fields) -> None:
  """The back-off's fields set where it cannot act (a field left at None resolves where it can: :func:`guard`). The
  rules the core states (the margins need the back-off, the rollback the guard) are its: :func:`_check_controller`."""
  if f['hdet.backoff'] and not _backoff_applies(f):
    raise ConfigError(
      f"hdet.backoff=True steps the 'fit' controller's LR correction down: it needs hdet.auto_lr=True "
      f"and hdet.controller='fit' (got {f['hdet.controller']!r}), or set hdet.backoff=False."
    )
  rollback, optimizer = f['hdet.rollback'], f['optim.name']
  if rollback and optimizer not in SHARED_STATE_OPTIMIZERS:
    raise ConfigError(
      f'hdet.rollback=True keeps one copy of the optimizer state for every replica to return to, but '
      f'optim.name={optimizer!r} keeps LR-dependent state that differs between the replicas: use one of '
      f'{", ".join(SHARED_STATE_OPTIMIZERS)}, or set hdet.rollback=False.'
    )
  if rollback and not shared_opt_state(f):
    raise ConfigError(
      'hdet.rollback=True keeps one copy of the optimizer state for every replica to return to, but '
      "with hdet.low_communication=True each replica's state is its own: set "
      'hdet.average_opt_state=True (the replicas then share it after each sync), or hdet.rollback=False.'
    )


def _check_schedule(f: Fields) -> None:
  """The warmup must leave a decay: one-cycle's phases each at least a step, warmup_cosine's warmup ending before
  the last step."""
  name, pct, total = f['optim.schedule'], f['optim.pct_start'], f['num_train_steps']
  if name == 'warmup_cosine' and not round(pct * total) < total - 1:
    raise ConfigError(
      f"optim.pct_start={pct} with num_train_steps={total} leaves optim.schedule='warmup_cosine' no "
      f'step to decay over (its warmup is round(pct_start * num_train_steps) = {round(pct * total)} '
      'steps, which must end before the last step); lower optim.pct_start or raise num_train_steps.'
    )
  if name == 'one_cycle' and not (pct * total - 1 > 0 and total - 1 > pct * total - 1):
    raise ConfigError(
      f"optim.pct_start={pct} with num_train_steps={total} leaves optim.schedule='one_cycle' an empty "
      'phase (its warmup ends at step pct_start * num_train_steps - 1, which must lie inside the run); '
      'move optim.pct_start away from 0 and 1 or raise num_train_steps.'
    )


def _check_runtime_lr_scale(f: Fields) -> None:
  """``optim.runtime_lr_scale`` is for runs whose learning rates no controller sets."""
  if f['optim.runtime_lr_scale'] and f['hdet.auto_lr']:
    raise ConfigError(
      "optim.runtime_lr_scale=True applies the learning rate's power of two outside the programs, "
      'where the auto-LR controller would not see it: set hdet.auto_lr=False, or '
      'optim.runtime_lr_scale=False.'
    )


def _check_bracket(f: Fields) -> None:
  """An LR bracket's rungs must fit the run and narrow it down to one run; its runs must train at a fixed LR."""
  points, rungs_text, total = f['bracket.points'], f['bracket.rungs'], f['num_train_steps']
  if points == 0:
    return
  try:
    rungs = schema.parse_rungs(rungs_text)
  except ValueError as e:
    raise ConfigError(f"bracket.rungs={rungs_text!r} must be 'fraction:kept,...' (e.g. '0.1:4,0.3:1'): {e}.") from None
  steps, kept = schema.rung_steps(rungs, total), [k for _, k in rungs]
  alive = [points] + kept
  if not (
    0 < steps[0]
    and all(a < c for a, c in zip(steps, steps[1:]))
    and steps[-1] < total
    and all(a > c >= 1 for a, c in zip(alive, alive[1:]))
    and kept[-1] == 1
  ):
    raise ConfigError(
      f'bracket.rungs={rungs_text!r} with bracket.points={points} and num_train_steps={total} '
      f'(rung steps {steps}) must compare at increasing steps inside the run (0 < fraction * num_train_steps < '
      'num_train_steps) and keep fewer runs at each rung, the last keeping 1; e.g. '
      f"'0.1:{max(1, points // 2)},0.3:1'."
    )
  if f['hdet.auto_lr']:
    raise ConfigError(
      'bracket.points > 0 looks for the LR by comparing runs trained apart at fixed LRs, but '
      "hdet.auto_lr=True would move each run's LR too: set hdet.auto_lr=False (configs/bracket.py "
      'trains plain data parallel), or bracket.points=0 for one HDET run.'
    )
  if f['stop_at_step'] > 0:
    raise ConfigError(
      f'stop_at_step={f["stop_at_step"]} cannot stop an LR bracket, which stops its runs at its '
      'rungs itself: set stop_at_step=0 (a preempted bracket resumes where it stopped).'
    )


def check_controller_acts(f: Fields) -> None:
  """The auto-LR controller needs a spread to compare and a sync before the last step to act at: the trainer's check
  before it builds the optimizer, whose ``hdet()`` refuses both in its own terms (its arguments), not the config's
  fields. (Not :func:`check`'s: a config that cannot train may still be resolved, to read its settings.)"""
  if not f['hdet.auto_lr']:
    return
  if f['hdet.spread'] == 0:
    raise ConfigError(
      'hdet.auto_lr=True compares replicas trained at spread LRs, but hdet.spread=0 trains every replica at one '
      'LR, so the controller gets no signal: set hdet.spread > 0 (e.g. 0.25), or hdet.auto_lr=False.'
    )
  windows, total, warmup = sync_windows(f), int(f['num_train_steps']), int(f['hdet.warmup_steps'])
  start = sync_lib.first_sync_at_or_after(windows, warmup)
  if start >= total - 1:  # (as hdet_jax.settings refuses it)
    if windows[0] > total:
      why = (
        f'with hdet.sync_every={f["hdet.sync_every"]} and hdet.num_syncs={f["hdet.num_syncs"]} the replicas '
        'never average'
        if f['hdet.sync_every'] == 0
        else f'hdet.sync_every={f["hdet.sync_every"]} leaves no sync inside num_train_steps={total}'
      )
    else:
      why = (
        f'its first sync at or after hdet.warmup_steps={warmup} is step {start}, not before the last '
        f'(num_train_steps={total}, windows of {windows[0]} steps)'
      )
    raise ConfigError(
      f'hdet.auto_lr=True moves the LR at syncs, but {why}: lower hdet.sync_every (or set it to 0 and use '
      'hdet.num_syncs) or hdet.warmup_steps, or set hdet.auto_lr=False.'
    )


def _check_mesh(f: Fields) -> None:
  """``mesh.replicas`` is read on a grouped mesh only (mesh.fsdp x mesh.tensor > 1), ``mesh.devices`` on a 1-D one
  only: each set where the other layout is built would be dropped."""
  replicas, devices, fsdp, tensor = f['mesh.replicas'], f['mesh.devices'], f['mesh.fsdp'], f['mesh.tensor']
  if replicas > 0 and fsdp * tensor == 1:
    raise ConfigError(
      f'mesh.replicas={replicas} counts replica groups of mesh.fsdp x mesh.tensor devices, but both are 1 (a 1-D '
      f'mesh, which does not read it): set hdet.num_replicas={replicas} (mesh.devices={replicas} for one per '
      'device) and mesh.replicas=0, or mesh.fsdp or mesh.tensor > 1.'
    )
  if devices > 0 and fsdp * tensor > 1:
    raise ConfigError(
      f'mesh.devices={devices} picks the devices of a 1-D mesh, but mesh.fsdp={fsdp} x mesh.tensor={tensor} '
      'builds a grouped mesh of mesh.replicas x mesh.fsdp x mesh.tensor devices, which does not read it: set '
      f'mesh.replicas={max(1, devices // (fsdp * tensor))} instead, and mesh.devices=0.'
    )


def _check_task_fields(f: Fields, task: tasks_lib.Task) -> None:
  """A field another task's config declares (``schema.Field.task``) is read by that task only."""
  for field in schema.FIELDS:
    if field.task not in (None, task.name) and field.name in f:
      raise ConfigError(
        f"{field.name} is a field of the {field.task} task's config (configs/{field.task}.py), which task="
        f'{task.name!r} does not read: remove it, or set task={field.task!r}.'
      )


def _check_num_syncs(f: Fields) -> None:
  k, total = f['hdet.num_syncs'], f['num_train_steps']
  if f['hdet.sync_every'] == 0 and k > total:  # (a sync_every > 0 sets T instead)
    raise ConfigError(
      f'hdet.num_syncs={k} windows do not fit in num_train_steps={total} '
      '(each window is at least one step): lower hdet.num_syncs, or set it to 0 and use hdet.sync_every.'
    )
