"""``train_and_evaluate(config, workdir)``: HDET on the task ``config.task`` names (``tasks/``).

The loop knows a task only through :class:`tasks.Task` (its data, model, loss and metric); the device
layout is ``mesh.py``, the optimizer ``optimizer.py``, the compiled programs ``programs.py``, the process-level setup
``process.py``. The config is checked and resolved once, at the start (``run_settings.resolve``); each part then
gets its own settings.

Everything that can be wrong with the config, the task's data, the workdir, the devices or
``init_from`` is checked first and reported as one :class:`ConfigError` line, before any
training starts and before anything is written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from hdet_jax.trainer import checkpoints
from hdet_jax.trainer import compat
from hdet_jax.trainer import config_lib
from hdet_jax.trainer import metrics as metrics_lib
from hdet_jax.trainer import process
from hdet_jax.trainer import program_cache
from hdet_jax.trainer import run_settings
from hdet_jax.trainer import schema
from hdet_jax.trainer import tasks as tasks_lib
from hdet_jax.trainer import mesh as mesh_lib, optimizer as optimizer_lib, programs as programs_lib
from hdet_jax.trainer import warm_init
from hdet_jax.trainer.config_lib import ConfigError

_INIT_TAG, _WARM_TAG = 1, 2  # fold_in tags of the run key: model init, warm-init noise.


def _resolve_replicas(run: run_settings.RunSettings) -> tuple[int, int]:
  """(N, D): the replicas (device groups of ``mesh.fsdp`` x ``mesh.tensor`` devices each on a grouped mesh)
  and the devices of the replica axis (N / D replicas on each; one per group on a grouped mesh)."""
  m, visible = run.mesh, jax.device_count()
  if m.fsdp * m.tensor > 1:
    n = _resolve_groups(run, visible)
    return n, n
  wanted = m.devices
  if wanted > visible:
    raise ConfigError(
      f'mesh.devices={wanted} but only {visible} devices are visible; set --config.mesh.devices=0 '
      f'(all of them) or run on {wanted} devices (on CPU: JAX_NUM_CPU_DEVICES={wanted}).'
    )
  n = m.num_replicas or wanted or visible
  devices = wanted or min(n, visible)
  if jax.process_count() > 1 and devices != visible:
    raise ConfigError(
      f'hdet.num_replicas={n} on mesh.devices={devices} but {jax.process_count()} processes hold {visible} devices; '
      f'with several processes every device trains replicas: set --config.mesh.devices=0 and hdet.num_replicas '
      f'to a multiple of {visible}.'
    )
  if n % devices:
    lower = max(d for d in range(1, devices + 1) if n % d == 0)
    raise ConfigError(
      f'hdet.num_replicas={n} is not a multiple of the {devices} devices it would run on: set '
      f'--config.hdet.num_replicas to a multiple of {devices} (e.g. {(n // devices + 1) * devices}) or '
      f'--config.mesh.devices to a divisor of {n} (e.g. {lower}).'
    )
  return n, devices


def _resolve_groups(run: run_settings.RunSettings, devices: int) -> int:
  """N on a grouped mesh: ``mesh.replicas`` (0: every device in some group), checked against the devices."""
  m = run.mesh
  fsdp, tensor, size = m.fsdp, m.tensor, m.fsdp * m.tensor
  # One replica per group: mesh.replicas groups, or as many as the devices hold (at most hdet.num_replicas).
  n = m.replicas or min(m.num_replicas or devices, devices // size) or 1
  shape = f'mesh.replicas={n} x mesh.fsdp={fsdp}' + (f' x mesh.tensor={tensor}' if tensor > 1 else '')
  if n * size > devices or (jax.process_count() > 1 and n * size != devices):
    raise ConfigError(
      f'{shape} needs {n * size} devices, {devices} are visible'
      f'{" (with several processes it must use them all)" if jax.process_count() > 1 else ""}: '
      f'set mesh.replicas=0 (all devices) or run on {n * size} devices (on CPU: JAX_NUM_CPU_DEVICES).'
    )
  if m.num_replicas not in (0, n, schema.BY_NAME['hdet.num_replicas'].default):  # (the default: as many as fit)
    raise ConfigError(
      f'hdet.num_replicas={m.num_replicas} but {shape} trains {n} replicas (one per group of {size} devices; '
      f'hdet.num_replicas only caps the groups): set --config.mesh.replicas to the groups you want and '
      f'hdet.num_replicas=0, or run on {m.num_replicas * size} devices.'
    )
  if m.batch_size % fsdp:
    raise ConfigError(
      f'data.batch_size={m.batch_size} (windows per replica group) must be divisible by '
      f"mesh.fsdp={fsdp}, which splits them over the group's devices."
    )
  try:
    run.task.check_tensor_parallel(run.task_settings, tensor)
  except ValueError as e:
    raise ConfigError(f'mesh.tensor={tensor}: {e}') from None
  return n


# What marks a folder as a project's (its sources, its build files): a run writes nothing into one.
_PROJECT_MARKERS = ('pyproject.toml', 'setup.py', 'setup.cfg', '.git', 'train.py', 'hdet_jax')
_SOURCE_SUFFIXES = ('.py', '.toml', '.cfg', '.md', '.rst', '.ipynb')
_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))  # (above hdet_jax/)


def output_path_error(path: str, what: str, example: str = 'workdirs/NAME') -> str | None:
  """Why ``path`` (where ``what``, a flag or field, writes) must not be written into, or None: it resolves to the
  current folder, to a folder above it or above this project, or to a folder that holds a project's files
  (pyproject.toml, .git, train.py, hdet_jax/, sources such as .py or .md files), where a run's files would land
  among them."""
  full = os.path.realpath(os.path.abspath(os.path.expanduser(path)))
  fix = f'pass a folder of its own, e.g. {what}={example} (nothing was written)'
  cwd = os.path.realpath(os.getcwd())
  if full == cwd:
    return f"{what} {path!r} is the current folder ({full}): the run's files would land among the files there; {fix}."
  for inner, name in ((cwd, 'the current folder'), (_PROJECT_ROOT, "this project's folder")):
    if inner.startswith(full.rstrip(os.sep) + os.sep):
      return f"{what} {path!r} ({full}) holds {name} ({inner}): the run's files would land beside it; {fix}."
  if not os.path.isdir(full):
    return None
  try:
    names = sorted(os.listdir(full))
  except OSError:
    return None
  found = [n for n in names if n in _PROJECT_MARKERS] or [n for n in names if n.endswith(_SOURCE_SUFFIXES)]
  if found:
    held = ', '.join(found[:3])
    return f"{what} {path!r} ({full}) holds a project's files ({held}): the run's files would land among them; {fix}."
  return None


def check_output_paths(config: Any, workdir: str) -> None:
  """The folders a run writes into, refused (one ConfigError line naming the flag or field) where they resolve to
  the current folder or to a project's folder (:func:`output_path_error`): ``--workdir``, and ``compilation_cache``
  (JAX's persistent cache). Nothing is read or written; train.py calls it before JAX is set up."""
  error = output_path_error(workdir, '--workdir')
  cache = dict(config_lib.flatten(config)).get('compilation_cache') or ''
  if not error and cache:
    error = output_path_error(cache, '--config.compilation_cache', schema.BY_NAME['compilation_cache'].default)
  if error:
    raise ConfigError(error)


def _check_workdir(workdir: str, fields: dict) -> bool:
  """Whether the workdir holds checkpoints to resume from; raises if it holds another config's run.

  The config is compared with the newest checkpoint whose meta record reads back (a corrupt newer
  one is set aside when the state is restored).
  """
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError(f'--workdir {workdir} exists and is not a directory; pick another --workdir.')
  step, meta, _ = checkpoints.latest_readable_meta(workdir)
  saved, what = None, None
  if meta is not None:
    saved, what = meta['config'], f'a checkpoint (step {step})'
    fmt = meta.get('state_format', 1)
    if fmt != checkpoints.STATE_FORMAT:
      raise ConfigError(
        f'workdir {workdir} holds checkpoints of state format {fmt} (step {step}), written by another version '
        f'of hdet-jax whose saved state has other fields; this version reads format {checkpoints.STATE_FORMAT}. '
        'Pass a new --workdir (nothing in this one was changed), or resume it with the version that wrote it.'
      )
  elif os.path.exists(os.path.join(workdir, 'config.json')):
    try:
      with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
        saved, what = json.load(f).get('training_fields'), 'a run'
    except (OSError, ValueError, AttributeError):
      saved = None  # unreadable (cut short by a kill in an older version): the checkpoints decide
  if saved is not None:  # (a version before bracket.* left a run's identity wrote them where not at their defaults)
    saved = schema.run_identity(saved)
    gone = [k for k in saved if k in compat.REMOVED]
    if gone:
      raise ConfigError(
        f'workdir {workdir} holds {what} that set {gone[0]}={saved[gone[0]]!r}: '
        f'{compat.removed_message(gone[0])} Resume it with the version that wrote it, or pass a '
        'new --workdir (nothing in this one was changed).'
      )
  if saved is not None and saved != fields:
    raise ConfigError(
      f'workdir {workdir} holds {what} of a different config ({schema.differences(saved, fields)}); '
      'rerun with the same config to resume it, or pass a new --workdir.'
    )
  return bool(checkpoints.all_steps(workdir))


def _check_init_from(init_from: str | None, abstract_params: Any) -> str | None:
  if not init_from:
    return None
  src = os.path.abspath(os.path.expanduser(init_from))
  step = checkpoints.latest_step(src) if os.path.isdir(src) else None
  if step is None:
    raise ConfigError(
      f'init_from={init_from!r} holds no checkpoint; point --config.init_from at the workdir of an '
      'earlier run (e.g. run `python train.py --workdir workdirs/default` first), or unset it for a random init.'
    )
  try:
    meta = checkpoints.read_meta(src, step)
  except checkpoints.CorruptCheckpoint as e:
    raise ConfigError(f'init_from={init_from!r}: its latest checkpoint is corrupt ({e}).') from None
  want = jax.tree.map(lambda s: list(s.shape), abstract_params)
  if meta.get('param_shapes') != json.loads(json.dumps(want)):
    raise ConfigError(
      f'init_from={init_from!r} (step {step}) holds a model of another shape than model.* and '
      'data.seq_len describe; use the same model settings as that run or another init_from.'
    )
  return src


class _Inputs(NamedTuple):
  """What the checks produced: the run's settings, the task's data, the optimizer, the model's shapes and where the
  state comes from."""

  run: run_settings.RunSettings  # the config, resolved: each part's settings
  workdir: str  # absolute
  n: int  # replicas
  devices: int  # D, the devices of the replica axis (N / D replicas on each)
  data: tasks_lib.TaskData  # .batches (by step), .eval_batch [N, k, ...], .probe(sync index)
  tx: Any  # the HDET optimizer
  fields: dict  # the config's training fields (what resuming must match)
  resume: bool  # the workdir holds checkpoints to resume from
  graphdef: Any
  abstract_params: Any  # the model's parameter shapes (one replica)
  init_src: str | None  # the workdir a warm start reads its averaged model from
  tokens_per_step: int  # predictions (the task's unit) per step, over all replicas


class _Records(NamedTuple):
  """Where a run writes, and the mesh it runs on."""

  mesh: Any
  writer: metrics_lib.MetricsWriter
  ckpt: checkpoints.Checkpointer
  log: Callable[[str], None]  # a line on process 0's stdout
  lead: bool  # process 0: it writes metrics, plots and the summary
  programs_key: str  # under which the run's programs are kept for the next run (program_cache)


class _Programs(NamedTuple):
  """The compiled programs of the loop (nothing compiles after step 0) and what they read."""

  step: Any  # (params, opt_state, chunk) -> (params, opt_state, packed metrics)
  window_end: Any  # (params, opt_state, *_probe's data, ...) -> ...: after the step on sync steps
  evaluate: Any  # (params, val windows) -> [N] losses of the averaged model
  average: Any  # params -> the averaged model, replicated
  any_finite: Any  # params -> whether some replica's parameters are all finite
  to_eval: Callable | None  # (params, opt_state) -> the parameters to evaluate (schedule-free)
  packers: dict  # sync -> programs_lib.MetricsPacker of the step's (False) or window end's (True) metrics
  val: Any  # the validation windows on the devices
  distance: Any  # params -> each replica's distance from the mean: runs that never average
  saved_anchor: Any = None  # the loop's anchor -> the one copy a checkpoint holds (hdet.rollback)
  lr_unit: float = 1.0  # optim.runtime_lr_scale's factor: the state's LRs are the run's / lr_unit
  lr_rows: tuple[int, ...] = ()  # ... the rows of the logged [G] values that are learning rates


@dataclasses.dataclass
class _Loop:
  """The state the training loop rebinds at every step, and the run's bookkeeping."""

  params: Any  # [N, ...] every replica's parameters
  opt_state: Any  # [N, ...] every replica's optimizer state
  rng: Any  # the run's key data, replicated (checkpointed with the state)
  start: int  # the step this call starts or resumes at
  step: int  # steps done
  data: Any = None  # the chunk of chunk_steps steps' batches holding this step's, on the devices
  anchor: Any = None  # the state the last sync left, one copy per device (hdet.rollback; programs.make_anchor)
  pending: list = dataclasses.field(default_factory=list)  # (step, sync, metrics) fetched at the next log
  t_mark: float = 0.0  # when the current log interval started
  train_time: float = 0.0
  train_steps: int = 0
  last_losses: list = dataclasses.field(default_factory=list)  # each replica's loss at the last interval's steps
  diverged_at: int | None = None
  rolled_back_at: int | None = None  # the last sync whose rollback undid a divergence
  preempted_at: int | None = None
  val: dict = dataclasses.field(default_factory=lambda: {'val_loss': math.nan})  # the last 'eval' record's fields
  # Wait for each step's programs before dispatching the next (see one_program_in_flight).
  wait_each_step: bool = False


class _Run(NamedTuple):
  """What a run built before its loop, fixed from then on: the loop's functions take it whole."""

  inputs: _Inputs
  records: _Records
  programs: _Programs

  @property
  def settings(self) -> run_settings.LoopSettings:
    return self.inputs.run.loop


def check(config: Any, workdir: str, *, optimizer: optimizer_lib.Base | None = None) -> None:
  """Every check ``train_and_evaluate`` makes before it writes anything (the config, the task's data, the devices,
  the workdir, init_from); raises ConfigError, writes nothing. For callers that write first (the LR bracket)."""
  check_output_paths(config, workdir)
  _check(run_settings.resolve(config, optimizer), os.path.abspath(os.path.expanduser(workdir)))


def train_and_evaluate(config: Any, workdir: str, *, optimizer: optimizer_lib.Base | None = None) -> dict:
  """Trains (or resumes) the run described by ``config`` in ``workdir``; returns the summary. ``optimizer``: a base
  optimizer given in Python in place of ``optim.name``'s (research's LR-free baselines: ``optimizer.Base``).

  SIGTERM or SIGINT during training (a preemption, Ctrl-C) finishes the current step, writes a
  checkpoint and returns with ``summary['preempted']`` set; rerunning resumes from it.
  """
  with process.StopSignals() as stop:
    t0 = time.time()
    # ---- Checks: nothing is written before all of them pass. ----
    check_output_paths(config, workdir)
    run = run_settings.resolve(config, optimizer)
    inputs = _check(run, os.path.abspath(os.path.expanduser(workdir)))
    # ---- Build: the records, the initial state, and every program compiled once, up front. ----
    records = _open_records(inputs)
    loop = _initial_state(inputs, records)
    programs = _compile(inputs, records, loop)
    setup_s = time.time() - t0
    size = run.mesh.fsdp * run.mesh.tensor
    group = f' (groups of {size}, mesh {dict(records.mesh.shape)})' if size > 1 else ''
    per = f' ({inputs.n // inputs.devices} per device)' if inputs.n > inputs.devices else ''
    records.log(
      f'{inputs.n} replicas{group} on {records.mesh.devices.size} {jax.devices()[0].platform} devices{per} '
      f'({jax.process_count()} process(es)); task {inputs.run.task.name}, model '
      f'{metrics_lib.num_params(inputs.abstract_params):,} parameters; {inputs.data.description}; '
      f'setup {setup_s:.1f}s.'
    )
    # ---- Train. ----
    built = _Run(inputs, records, programs)
    _train(built, loop, stop)
    # ---- The end: evaluate, checkpoint, plot, summarise. ----
    return _finish(built, loop, t0, setup_s)


# ---------------------------------------------------------------------------------------------
# Checks and build
# ---------------------------------------------------------------------------------------------


def _check(run: run_settings.RunSettings, workdir: str) -> _Inputs:
  """Every check of the task's data, devices, workdir and init_from (the config's are ``run_settings.resolve``'s);
  reads, never writes."""
  task, settings = run.task, run.task_settings
  run_settings.check_controller_acts(schema.complete(run.given, task.name))
  n, devices = _resolve_replicas(run)
  try:
    data = task.load(settings, n)
  except tasks_lib.TaskError as e:
    raise ConfigError(str(e)) from None
  try:
    tx = optimizer_lib.make_optimizer(run.optimizer, n, rollback=run.loop.rolls_back)
  except ValueError as e:
    raise ConfigError(f'config: {e}') from None
  fields = run.training_fields(n)
  resume = _check_workdir(workdir, fields)
  graphdef, abstract_params = task.abstract_model(settings)
  init_src = _check_init_from(run.init_from, abstract_params) if not resume else None
  # Every process has read the workdir before process 0 creates checkpoints/ in it: a process that got
  # here late would otherwise see that directory, open it, and run orbax's collectives out of step.
  mesh_lib.barrier('hdet_workdir_checked')
  return _Inputs(
    run,
    workdir,
    n,
    devices,
    data,
    tx,
    fields,
    resume,
    graphdef,
    abstract_params,
    init_src,
    n * run.mesh.batch_size * task.predictions_per_example(settings),
  )


def _open_records(inputs: _Inputs) -> _Records:
  """The workdir, its config.json, the checkpointer and the metrics writer; the mesh."""
  run = inputs.run
  os.makedirs(inputs.workdir, exist_ok=True)
  lead = jax.process_index() == 0
  config_path = os.path.join(inputs.workdir, 'config.json')
  if lead and not os.path.exists(config_path):
    process.write_json_atomic(
      config_path, {'training_fields': inputs.fields, 'config': config_lib.unflatten(run.given)}, indent=1
    )
  mesh = mesh_lib.make_mesh(inputs.n, run.mesh.fsdp, run.mesh.tensor, devices=inputs.devices)
  ckpt = checkpoints.Checkpointer(inputs.workdir, run.loop.max_checkpoints)
  # TensorBoard event files beside metrics.jsonl, on unless the config sets tensorboard=False.
  writer = metrics_lib.MetricsWriter(
    os.path.join(inputs.workdir, 'metrics.jsonl'), enabled=lead, tensorboard=run.loop.tensorboard
  )
  log = (lambda msg: print(msg, flush=True)) if lead else (lambda msg: None)
  key = program_cache.programs_key(run.given, run.loop.lr_unit, inputs.n, mesh, inputs.data.description)
  return _Records(mesh, writer, ckpt, log, lead, key)


def _initial_state(inputs: _Inputs, records: _Records) -> _Loop:
  """The state to start from: the workdir's latest checkpoint, a warm start, or a random init."""
  run, settings = inputs.run, inputs.run.loop
  root = jax.random.key(run.seed)
  key = records.programs_key
  init = program_cache.get(
    key, 'init', lambda: programs_lib.make_init(run.task, run.task_settings, inputs.tx, records.mesh, inputs.n)
  )
  restored = _restore(inputs, records, init, root) if inputs.resume else None
  anchor = None
  if restored is not None:
    params, opt_state, start, anchor = restored
  elif inputs.init_src is not None:
    params, opt_state, start = *_warm_start(run, inputs, records, root), 0
  else:
    params, opt_state, start = *init(jax.random.fold_in(root, _INIT_TAG)), 0
    records.writer.write('event', step=0, event='start', init_from=None)
  if restored is None and settings.lr_unit != 1.0:  # (a checkpoint holds its own)
    opt_state = _set_lr_scale(key, opt_state, settings.lr_unit)
  records.writer.write('hyperparams', step=start, names=list(settings.hyperparam_names), controller=settings.controller)
  records.writer.flush()  # the start/resume is on record even if this start is killed before its first log interval
  rng = jax.device_put(np.asarray(jax.random.key_data(root)), mesh_lib.replicated(records.mesh))
  # The step reads its batch from a chunk of chunk_steps steps' batches at the optimizer's step count,
  # so the count must be the step number.
  count = int(
    mesh_lib.fetch(
      program_cache.get(key, 'step_count', lambda: programs_lib.make_step_count(inputs.tx))(params, opt_state)
    )[0]
  )
  if count != start:
    raise RuntimeError(f'the optimizer state counts {count} steps but training resumes at step {start}.')
  if anchor is not None:  # the checkpoint's copy, to one per device
    layout = mesh_lib.stacked_anchor_layout(
      records.mesh, _abstract_anchor(inputs.tx, records.mesh, params, opt_state), run.task
    )
    anchor = program_cache.get(key, 'restored_anchor', lambda: programs_lib.make_restored_anchor(records.mesh, layout))(
      anchor
    )
  elif settings.rolls_back:  # before the first sync: the start
    layout = mesh_lib.stacked_anchor_layout(
      records.mesh, _abstract_anchor(inputs.tx, records.mesh, params, opt_state), run.task
    )
    anchor = program_cache.get(key, 'anchor', lambda: programs_lib.make_anchor(records.mesh, inputs.tx, layout))(
      params, opt_state
    )
  return _Loop(
    params, opt_state, rng, start=start, step=start, anchor=anchor, wait_each_step=one_program_in_flight(records.mesh)
  )


def _set_lr_scale(key: str, opt_state: Any, unit: float) -> Any:
  """``opt_state`` with ``optim.runtime_lr_scale``'s factor set (a jit argument: one program for every unit)."""
  shardings = jax.tree.map(lambda x: x.sharding, opt_state)
  scale = program_cache.get(
    key,
    ('lr_scale', program_cache.signature(opt_state)),
    lambda: jax.jit(optimizer_lib.set_runtime_lr_scale, donate_argnums=0, out_shardings=shardings),
  )
  return scale(opt_state, np.float32(unit))


def one_program_in_flight(mesh: Any) -> bool:
  """Whether the loop waits for each step before dispatching the next: on CPU devices, where more than one take part.

  XLA:CPU runs an in-process collective's participants on a shared pool of threads; with several multi-device
  programs queued (the loop dispatches ahead), its all-reduce can wait for a participant that never comes and
  abort the process ("Termination timeout ... only 7 of them arrived"; CONTRIBUTING.md, "Known XLA:CPU limit").
  One program in flight leaves every device's thread to that program; the host's work that waiting no longer
  overlaps is small against a step on CPU.
  """
  return mesh.devices.size > 1 and all(d.platform == 'cpu' for d in mesh.devices.flat)


def _restore(inputs: _Inputs, records: _Records, init: Callable, root: Any) -> tuple | None:
  """(params, opt_state, step) of the latest readable checkpoint (a corrupt newer one is set aside)."""

  def corrupt(step, why):
    records.writer.write('event', step=step, event='corrupt_checkpoint', reason=why)
    records.log(f'warning: checkpoint {why}; falling back to the previous one.')

  abstract = jax.eval_shape(lambda k: dict(zip(('params', 'opt_state'), init(k))), root)
  abstract = mesh_lib.with_layout(records.mesh, abstract, inputs.run.task)  # restored straight into the run's layout
  abstract['rng'] = jax.ShapeDtypeStruct((2,), np.uint32, sharding=mesh_lib.replicated(records.mesh))
  if inputs.run.loop.rolls_back:  # the state the last sync left, which the next one may return to
    abstract['anchor'] = mesh_lib.anchor_shapes(records.mesh, abstract, inputs.run.task)
  t_restore = time.time()
  try:
    restored = records.ckpt.restore_latest(abstract, on_corrupt=corrupt)
  except checkpoints.CorruptCheckpoint as e:
    records.writer.close()
    raise ConfigError(str(e)) from None
  if restored is None:
    return None
  state, meta = restored
  start = meta['step']
  if meta['data_position'] != inputs.data.batches.position(start):
    raise ConfigError(
      f'checkpoint step {start} has data position {meta["data_position"]}, '
      f'this data gives {inputs.data.batches.position(start)}: was data.path changed?'
    )
  records.writer.write('event', step=start, event='resume', restore_s=time.time() - t_restore)
  records.log(
    f'Resuming {inputs.workdir} from step {start}.'
    if start < inputs.run.loop.num_train_steps
    else f'{inputs.workdir} already holds the finished run ({start} steps): evaluating and plotting only.'
  )
  return state['params'], state['opt_state'], start, state.get('anchor')


def _warm_start(run: run_settings.RunSettings, inputs: _Inputs, records: _Records, root: Any) -> tuple[Any, Any]:
  """(params, opt_state): the averaged model of ``init_from`` plus each replica's eq. 10 noise."""
  rep, rs = (
    mesh_lib.replicated(records.mesh),
    mesh_lib.param_layout(records.mesh, inputs.abstract_params, inputs.n, inputs.run.task),
  )
  try:
    avg = checkpoints.restore_avg_params(
      inputs.init_src,
      jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), inputs.abstract_params),
    )
  except checkpoints.CorruptCheckpoint as e:
    records.writer.close()
    raise ConfigError(f'init_from={run.init_from!r}: its latest checkpoint is corrupt ({e}).') from None
  nu = run.warm_init_nu
  params = jax.jit(lambda p, k: warm_init.warm_noisy_init(p, inputs.n, nu, k), out_shardings=rs)(
    avg, jax.random.fold_in(root, _WARM_TAG)
  )
  opt_state = programs_lib.make_opt_init(inputs.tx, records.mesh, inputs.run.task)(params)
  records.writer.write('event', step=0, event='start', init_from=inputs.init_src, nu=nu)
  records.log(f'Warm noisy start from {inputs.init_src} (nu={nu}).')
  return params, opt_state


def _upload(inputs: _Inputs, mesh: Any, step: int) -> Any:
  """The chunk of batches holding step ``step``'s, on the devices."""
  k = inputs.run.loop.chunk_steps
  return mesh_lib.put_stacked(inputs.data.batches.chunk(step - step % k, k), mesh, batch_dim=2)  # [N, K, B, ...]


def _probe(inputs: _Inputs, mesh: Any, step: int) -> list:
  """The window end's data for the sync after step ``step``: none, or the common batch (every replica gets the same
  windows)."""
  settings = inputs.run.loop
  if not settings.common_batch:
    return []
  w = inputs.data.probe(settings.sync_index(step))
  return [mesh_lib.put_stacked(jax.tree.map(lambda a: np.broadcast_to(a, (inputs.n,) + a.shape), w), mesh, batch_dim=1)]


def _compile(inputs: _Inputs, records: _Records, loop: _Loop) -> _Programs:
  """Compiles the programs once, up front: the step (every step runs it), the end of a sync window
  (averaging and controller, run after the step on sync steps), the evaluation and the checkpoint's."""
  mesh, params = records.mesh, loop.params
  loop.data = _upload(inputs, mesh, loop.start)
  settings = inputs.run.loop
  probe = _probe(inputs, mesh, 0)
  val = mesh_lib.put_stacked(inputs.data.eval_batch, mesh, batch_dim=1)
  # A run that builds the same programs as the last one takes that run's (an LR bracket's points, a resumed run).
  args = (params, loop.opt_state, loop.data, probe, loop.anchor, val)
  built = program_cache.get(
    records.programs_key, ('loop', program_cache.signature(*args)), lambda: _build(inputs, mesh, *args)
  )
  # Compile the checkpoint fingerprints now too, so the loop runs only compiled code.
  checkpoints.fingerprint(_checkpoint_state(loop, built['saved_anchor']))
  checkpoints.fingerprint(built['average'](params))
  lr_rows = tuple(g for g, name in enumerate(settings.hyperparam_names) if name.startswith('learning_rate'))
  return _Programs(**built, val=val, lr_unit=settings.lr_unit, lr_rows=lr_rows)


def _build(
  inputs: _Inputs, mesh: Any, params: Any, opt_state: Any, data: Any, probe: list, anchor: Any, val: Any
) -> dict:
  """Traces, lowers and compiles the loop's programs for these arguments: :class:`_Programs`' fields but the data's."""
  packers = {s: programs_lib.MetricsPacker() for s in (False, True)}
  settings = inputs.run.programs
  layout = mesh_lib.layout(mesh, params, opt_state, inputs.run.task)  # None on a 1-D mesh
  if layout is not None and anchor is not None:  # the window end pins the anchor it returns too
    layout = (*layout, mesh_lib.stacked_anchor_layout(mesh, anchor, inputs.run.task))
  step = (
    programs_lib.make_train_step(
      inputs.graphdef,
      inputs.tx,
      mesh,
      sync=False,
      settings=settings,
      packer=packers[False],
      chunk_steps=inputs.run.loop.chunk_steps,
      shardings=layout,
    )
    .lower(params, opt_state, data)
    .compile()
  )
  extra = [anchor] if anchor is not None else []
  window_end = (
    programs_lib.make_window_end(
      inputs.tx, mesh, packer=packers[True], graphdef=inputs.graphdef, settings=settings, shardings=layout
    )
    .lower(params, opt_state, *probe, *extra)
    .compile()
  )
  saved_anchor = None
  if anchor is not None:
    saved = mesh_lib.anchor_layout(mesh, params, opt_state.inner_state, inputs.run.task)
    saved_anchor = programs_lib.make_saved_anchor(mesh, saved).lower(anchor).compile()
  evaluate = programs_lib.make_eval_step(inputs.graphdef, mesh, inputs.run.task).lower(params, val).compile()
  average = programs_lib.make_average(mesh, params, inputs.run.task).lower(params).compile()
  # Whether some replica's parameters are all finite (a checkpoint of only NaN/inf replicas is useless:
  # the loss that would reveal the last update's blow-up comes one step later).
  any_finite = (
    jax.jit(
      lambda p: jax.numpy.any(
        jax.numpy.stack(
          [jax.numpy.all(jax.numpy.isfinite(x.reshape(x.shape[0], -1)), axis=1) for x in jax.tree.leaves(p)]
        ).all(0)
      ),
      out_shardings=mesh_lib.replicated(mesh),
    )
    .lower(params)
    .compile()
  )
  # A run that never averages measures the replicas' distance from their mean at each log interval.
  distance = programs_lib.make_distance(mesh).lower(params).compile() if inputs.run.loop.never_syncs else None
  process.release_host_memory()
  return dict(
    step=step,
    window_end=window_end,
    evaluate=evaluate,
    average=average,
    any_finite=any_finite,
    to_eval=programs_lib.make_eval_params(settings, mesh),
    packers=packers,
    distance=distance,
    saved_anchor=saved_anchor,
  )


def _abstract_anchor(tx: Any, mesh: Any, params: Any, opt_state: Any) -> Any:
  """The shapes of the anchor the loop holds (:func:`programs_lib.make_anchor`'s output)."""
  return jax.eval_shape(programs_lib.first_anchor(tx, mesh), params, opt_state)


# ---------------------------------------------------------------------------------------------
# The training loop
# ---------------------------------------------------------------------------------------------


def _train(r: _Run, loop: _Loop, stop: process.StopSignals) -> None:
  """Steps to the end (or ``stop_at_step``), logging, evaluating and checkpointing at their intervals."""
  settings, end = r.settings, r.settings.end
  bar = metrics_lib.ProgressBar(settings.num_train_steps, loop.start, enabled=r.records.lead and settings.progress_bar)
  loop.t_mark = time.time()
  while loop.step < end:
    _one_step(r, loop)
    step = loop.step
    eval_due = settings.eval_every > 0 and step % settings.eval_every == 0 and step < end
    ckpt_due = settings.checkpoint_every > 0 and step % settings.checkpoint_every == 0 and step < end
    # A stop signal is checked every step (with several processes, at each log interval, where the
    # processes agree on it: they must all stop after the same step).
    if step < end and (jax.process_count() == 1 or step % settings.log_every == 0):
      if process.any_process(stop.received is not None):
        loop.preempted_at = step
        ckpt_due = True
    if step % settings.log_every == 0 or step == end or eval_due or ckpt_due:
      if not _end_interval(r, loop, bar, stop, eval_due, ckpt_due):
        break
  bar.close()


def _one_step(r: _Run, loop: _Loop) -> None:
  """Runs step ``loop.step`` (and the window end after it on sync steps); its metrics stay on the devices."""
  step, programs = loop.step, r.programs
  sync = r.settings.is_sync_step(step)
  if step % r.settings.chunk_steps == 0 and step != loop.start:
    loop.data = _upload(r.inputs, r.records.mesh, step)
  loop.params, loop.opt_state, m = programs.step(loop.params, loop.opt_state, loop.data)
  if sync:
    common = _probe(r.inputs, r.records.mesh, step)
    anchor = [loop.anchor] if loop.anchor is not None else []  # hdet.rollback: where the back-off returns to
    loop.anchor = None  # (donated to the window end, which returns the next)
    loop.params, loop.opt_state, m_sync, *anchor = programs.window_end(loop.params, loop.opt_state, *common, *anchor)
    loop.anchor = anchor[0] if anchor else None
    m = (m, m_sync)
  loop.pending.append((step, sync, m))
  loop.step = step + 1
  if loop.wait_each_step:
    # The step's (and window end's) metrics are outputs of the programs that also return the state, so they are
    # ready when those programs have finished.
    jax.block_until_ready(m)


def _end_interval(
  r: _Run, loop: _Loop, bar: metrics_lib.ProgressBar, stop: process.StopSignals, eval_due: bool, ckpt_due: bool
) -> bool:
  """Logs the steps since the last interval, then evaluates and checkpoints where due; False: stop."""
  step, writer, programs, records = loop.step, r.records.writer, r.programs, r.records
  _flush(programs, writer, loop, bar)
  now = time.time()
  loop.train_time += now - loop.t_mark
  loop.train_steps += len(loop.pending)
  writer.write(
    'throughput',
    step=step - 1,
    steps_per_s=len(loop.pending) / (now - loop.t_mark),
    tokens_per_s=len(loop.pending) * r.inputs.tokens_per_step / (now - loop.t_mark),
  )
  loop.pending = []
  if programs.distance is not None:
    d = mesh_lib.fetch(programs.distance(loop.params))
    writer.write('distance', step=step - 1, distance=d['distance'], mean_norm=d['mean_norm'][0])
  if loop.diverged_at is not None and r.settings.stop_on_nan and not _rollback_ahead(r.settings, loop):
    bar.close()
    records.log(
      f"Training diverged: every replica's loss is NaN/inf at step {loop.diverged_at}. Stopping; the "
      'last good checkpoint is kept. Lower optim.max_lr, or set --config.stop_on_nan=False to keep going.'
    )
    return False
  if eval_due and loop.preempted_at is None:
    _evaluate(r, loop, step)
  if ckpt_due:
    _save(r, loop, step)
  writer.flush()
  if loop.preempted_at is not None:
    bar.close()
    records.ckpt.wait()
    writer.write('event', step=step, event='preempted', signal=stop.received)
    records.log(
      f'Stopped by {stop.received or "a signal to another process"} after step {step}: checkpoint '
      f'{step} is written; rerun the same command to resume.'
    )
    return False
  loop.t_mark = time.time()
  return True


def _rollback_ahead(settings: run_settings.LoopSettings, loop: _Loop) -> bool:
  """Whether the rollback may still undo the divergence: the run rolls back (``hdet.rollback``) and the sync that
  ends the diverged window has not run yet. Its back-off fires on the window's non-finite training loss and returns
  the replicas to the sync before (``_write_step`` then clears ``diverged_at``); a sync that passes without it
  (e.g. before the controller starts) leaves the divergence, and the run stops at the next interval."""
  if not settings.rolls_back or loop.rolled_back_at == loop.diverged_at - 1:
    return False  # (diverged at the first step after a rollback: the state it returned to is itself lost)
  step = loop.diverged_at
  while step < settings.num_train_steps and not settings.is_sync_step(step):
    step += 1
  return step < settings.num_train_steps and loop.step <= step


def _flush(programs: _Programs, writer: metrics_lib.MetricsWriter, loop: _Loop, bar: metrics_lib.ProgressBar) -> None:
  """Fetches the pending steps' metrics (one transfer) and writes them; notes non-finite losses."""
  packers = programs.packers

  def unpack(sync, rows):  # a sync step's metrics: the step's, then the window end's
    if not sync:
      return packers[False].unpack(rows)
    return {**packers[False].unpack(rows[0]), **packers[True].unpack(rows[1])}

  got = [
    unpack(sync, rows) for (_, sync, _), rows in zip(loop.pending, mesh_lib.fetch([m for _, _, m in loop.pending]))
  ]
  if programs.lr_unit != 1.0:
    got = [_in_run_lrs(m, programs.lr_unit, programs.lr_rows) for m in got]
  for (step, sync, _), m in zip(loop.pending, got):
    _write_step(writer, loop, step, sync, m, rolls_back=programs.saved_anchor is not None)
  loop.last_losses = [m['loss'] for m in got]
  bar.update(len(loop.pending), float(np.mean(loop.last_losses[-1])), float(got[-1]['base_lr'][0]))


def _in_run_lrs(m: dict, unit: float, rows: tuple[int, ...]) -> dict:
  """A step's metrics with the state's learning rates (``optim.runtime_lr_scale``: the run's / ``unit``) times
  ``unit``, the run's own: a power of two, so exactly the plain build's."""
  values, bases = np.array(m['values']), np.array(m['bases'])  # [N, G, N] and [N, G] (each replica's row)
  values[:, list(rows)] *= unit
  bases[:, list(rows)] *= unit
  return {**m, 'lrs': m['lrs'] * unit, 'base_lr': m['base_lr'] * unit, 'values': values, 'bases': bases}


def _write_step(
  writer: metrics_lib.MetricsWriter, loop: _Loop, step: int, sync: bool, m: dict, rolls_back: bool = False
) -> None:
  """One step's records: 'train', on sync steps 'controller' and 'distance', the first non-finite loss's event, and
  (``rolls_back``) a sync's rollback of a divergence."""
  loss = m['loss']
  writer.write(
    'train',
    step=step,
    loss=loss,
    lr=m['lrs'][0],
    base_lr=m['base_lr'][0],
    sync=sync,
    values=m['values'][0],
    bases=m['bases'][0],
  )
  if sync:
    writer.write(
      'controller',
      step=step,
      weights=m['weights'][0],
      window_losses=m['window_losses'][0],
      delta=m['delta'][0],
      velocity=m['velocity'][0],
      base_lr=m['base_lr'][0],
      deltas=m['deltas'][0],
      velocities=m['velocities'][0],
      corrections=m['corrections'][0],
      asks=m['asks'][0],
      stderrs=m['stderrs'][0],
      gains=m['gains'][0],
      # the window's mean training loss, kept by the back-off only (NaN without it: not written)
      **(
        {'train_loss': m['train_loss'][0], 'train_loss_se': m['train_loss_se'][0]}
        if np.isfinite(m['train_loss'][0])
        else {}
      ),
      # the back-off fired (with hdet.rollback the replicas returned to the sync before)
      **({'backed_off': True} if m['backed_off'][0] else {}),
      # hdet.settle: which hyperparameters have ended their climb (written once any has)
      **({'settled': [bool(v) for v in m['settled'][0]]} if np.any(m['settled'][0]) else {}),
    )
    writer.write('distance', step=step, distance=m['distance'], mean_norm=m['mean_norm'][0])
  finite = np.isfinite(loss)
  if not finite.all() and loop.diverged_at is None:
    if finite.any():
      writer.write('event', step=step, event='nonfinite', replicas=np.flatnonzero(~finite))
    else:
      loop.diverged_at = step
      writer.write('event', step=step, event='diverged')
  if rolls_back and sync and m['backed_off'][0] and loop.diverged_at is not None:  # the rollback undid it
    writer.write('event', step=step, event='rolled_back', diverged_at=loop.diverged_at)
    loop.diverged_at, loop.rolled_back_at = None, step


def _evaluate(r: _Run, loop: _Loop, step: int) -> None:
  """The averaged model's held-out metrics (``val_loss`` and the task's others), recorded as an 'eval' record."""
  programs, writer = r.programs, r.records.writer
  params = loop.params if programs.to_eval is None else programs.to_eval(loop.params, loop.opt_state)
  means = {k: float(np.mean(v)) for k, v in mesh_lib.fetch(programs.evaluate(params, programs.val)).items()}
  loop.val = tasks_lib.eval_record(r.inputs.run.task, means)
  writer.write('eval', step=step, **loop.val)
  writer.flush()


def _save(r: _Run, loop: _Loop, step: int) -> None:
  """Checkpoints step ``step`` unless every replica's parameters are non-finite (then: diverged)."""
  inputs, records, programs = r
  if not mesh_lib.fetch(programs.any_finite(loop.params)):
    if loop.diverged_at is None:
      loop.diverged_at = step
      records.writer.write('event', step=step, event='diverged', where='parameters')
    records.log(
      f"Not checkpointing step {step}: every replica's parameters are NaN/inf; the last good checkpoint is kept."
    )
    return
  state = _checkpoint_state(loop, programs.saved_anchor)
  meta = {
    'step': step,
    'data_position': inputs.data.batches.position(step),
    'seed': inputs.run.seed,
    'num_replicas': inputs.n,
    'config': inputs.fields,
    'param_shapes': _param_shapes(inputs.abstract_params),
  }
  records.ckpt.save(step, state, programs.average(loop.params), meta)


def _checkpoint_state(loop: _Loop, saved_anchor: Any) -> dict:
  """What a checkpoint holds of the loop (and what setup compiles its fingerprint for): the same tree; the anchor
  as one copy (``saved_anchor``: :func:`programs_lib.make_saved_anchor`), as the state format has it."""
  return {
    'params': loop.params,
    'opt_state': loop.opt_state,
    'rng': loop.rng,
    **({'anchor': saved_anchor(loop.anchor)} if loop.anchor is not None else {}),
  }


def _param_shapes(abstract_params: Any) -> Any:
  """The parameters' shapes as JSON reads them back (what a checkpoint's meta records)."""
  return json.loads(json.dumps(jax.tree.map(lambda s: list(s.shape), abstract_params)))


# ---------------------------------------------------------------------------------------------
# The end
# ---------------------------------------------------------------------------------------------


def _finish(r: _Run, loop: _Loop, t0: float, setup_s: float) -> dict:
  """The final evaluation and checkpoint, the summary (also summary.json) and the plots."""
  (inputs, records, _), settings, task = r, r.settings, r.inputs.run.task
  step, writer = loop.step, records.writer
  # A preempted run has little time left: the checkpoint is what matters. A run stopped at ``stop_at_step`` stops
  # as if preempted (an LR bracket's runs stop at its rungs, which rank training losses, not validation): it is
  # evaluated when it reaches its end.
  stopped = 0 < settings.stop_at_step <= step < settings.num_train_steps
  if loop.preempted_at is None and not stopped:
    _evaluate(r, loop, step)
  if loop.diverged_at is None and step > loop.start and records.ckpt.latest_step() != step:
    _save(r, loop, step)
  records.ckpt.close()
  final_train = _final_train_loss(r, loop)
  summary = {
    'step': step,
    'num_train_steps': settings.num_train_steps,
    'stopped_early': step < settings.num_train_steps,
    'diverged_at': loop.diverged_at,
    'preempted': loop.preempted_at is not None,
    'final_train_loss': final_train,
    **{f'final_train_{k}': v for k, v in task.loss_units(final_train).items()},
    **{f'final_{k}': v for k, v in loop.val.items()},
    # The task's primary metric (lower is better): what "within 1% of the sweep" is measured on.
    'task': task.name,
    'unit': task.unit,
    'metric': task.metric,
    'final_metric': loop.val.get(task.metric, math.nan),
    'tokens_per_s': (loop.train_steps * inputs.tokens_per_step / loop.train_time if loop.train_time > 0 else math.nan),
    'setup_s': setup_s,
    'wall_s': time.time() - t0,
    'num_replicas': inputs.n,
    'num_devices': int(records.mesh.devices.size),
    'replicas_per_device': inputs.n // inputs.devices,
    'num_params': metrics_lib.num_params(inputs.abstract_params),
    'workdir': inputs.workdir,
    'metrics': os.path.join(inputs.workdir, 'metrics.jsonl'),
    'checkpoints': checkpoints.checkpoint_dir(inputs.workdir),
    'plots': [],
    'machine': process.machine(),
  }
  writer.write('event', event='end', **{k: v for k, v in summary.items() if k != 'plots'})
  writer.close()
  if records.lead and settings.plots and loop.preempted_at is None:
    from hdet_jax.trainer import plots  # matplotlib: imported only when plotting

    summary['plots'] = plots.plot_workdir(inputs.workdir)
  summary['wall_s'] = time.time() - t0
  if records.lead:
    process.write_json_atomic(os.path.join(inputs.workdir, 'summary.json'), metrics_lib.to_json_safe(summary), indent=1)
  return summary


def _final_train_loss(r: _Run, loop: _Loop) -> float:
  """The mean over replicas and the last log interval's steps of the training loss."""
  records = r.records
  if loop.last_losses:
    return float(np.mean(loop.last_losses))
  # Nothing trained in this call (the workdir's run was already complete): the last recorded steps.
  records.writer.flush()
  recorded = metrics_lib.read_metrics(records.writer.path).get('train', []) if records.lead else []
  return float(np.mean([rec['loss'] for rec in recorded[-r.settings.log_every :]])) if recorded else math.nan


def format_summary(s: dict) -> str:
  """The final summary as a few human lines."""
  status = (
    f'DIVERGED at step {s["diverged_at"]}'
    if s['diverged_at'] is not None
    else f'preempted after step {s["step"]} of {s["num_train_steps"]}, checkpoint written (rerun the same '
    'command to resume)'
    if s.get('preempted')
    else f'stopped at step {s["step"]} of {s["num_train_steps"]} (rerun the same command to resume)'
    if s['stopped_early']
    else f'finished {s["step"]} steps'
  )

  def more(prefix):  # the task's other figures beside a loss: '1.234 bits/byte', 'accuracy 0.941'
    extra = [(k[len(prefix) :], v) for k, v in s.items() if k.startswith(prefix) and k != prefix + 'loss']
    return ''.join(f', {v:.3f} bits/byte' if k == 'bits_per_byte' else f', {k} {v:.4f}' for k, v in extra)

  stopped = s['diverged_at'] is None and (s.get('preempted') or s['stopped_early'])
  # A stopped run is not evaluated at the stop (as a preempted one): its figure is the last interval evaluation's.
  val = (
    '  validation: none before the stop (the run is evaluated at its end)'
    if stopped and math.isnan(s['final_val_loss'])
    else f'  {"last" if stopped else "final"} validation loss of the averaged model {s["final_val_loss"]:.4f} '
    f'nats{more("final_val_")}'
  )
  lines = [
    f'Run {status}.',
    f'  final train loss {s["final_train_loss"]:.4f} nats{more("final_train_")} '
    '(mean over replicas, last log interval)',
    val,
    f'  {s["tokens_per_s"]:,.0f} {s.get("unit", "tokens")}/s over {s["num_replicas"]} replicas; '
    f'wall time {s["wall_s"]:.1f}s (setup and compile {s["setup_s"]:.1f}s)',
    f'  metrics: {s["metrics"]}',
    f'  checkpoints: {s["checkpoints"]}',
  ]
  if s['plots']:
    lines.append(f'  plots: {", ".join(s["plots"])}')
  return '\n'.join(lines)
