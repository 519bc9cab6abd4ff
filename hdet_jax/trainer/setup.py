"""What ``train_and_evaluate`` builds before its loop, and the two bundles the loop reads.

:class:`Run` is what is fixed for the run: the checks' findings (``checks.check_run``), where the run writes and the
mesh (:func:`open_records`), and the compiled programs (:func:`compile_programs`). :class:`TrainState` is what the loop
rebinds at every step: the replicas' parameters and optimizer state, the rollback's anchor, the run's key and the
step. Nothing compiles after :func:`compile_programs`.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from hdet_jax.trainer import checkpoints
from hdet_jax.trainer import config_lib
from hdet_jax.trainer import metrics as metrics_lib
from hdet_jax.trainer import process
from hdet_jax.trainer import program_cache
from hdet_jax.trainer import run_settings
from hdet_jax.trainer import tasks as tasks_lib
from hdet_jax.trainer import mesh as mesh_lib, optimizer as optimizer_lib, programs as programs_lib
from hdet_jax.trainer import warm_init
from hdet_jax.trainer.config_lib import ConfigError

_INIT_TAG, _WARM_TAG = 1, 2  # fold_in tags of the run key: model init, warm-init noise.


class Run(NamedTuple):
  """What is fixed for the run, filled in three steps before the loop: the checks' fields (``checks.check_run``),
  the records' (:func:`open_records`) and the programs' (:func:`compile_programs`)."""

  # What the checks found (nothing is written yet).
  settings: run_settings.RunSettings  # the config, resolved: each part's settings (.loop: the loop's)
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
  # Where the run writes, and the mesh it runs on (open_records).
  mesh: Any = None
  writer: metrics_lib.MetricsWriter | None = None
  ckpt: checkpoints.Checkpointer | None = None
  log: Callable[[str], None] | None = None  # a line on process 0's stdout
  lead: bool = False  # process 0: it writes metrics, plots and the summary
  programs_key: str = ''  # under which the run's programs are kept for the next run (program_cache)
  wait_each_step: bool = False  # wait for each step's programs before dispatching the next (one_program_in_flight)
  # The compiled programs of the loop and what they read (compile_programs).
  train_step: Any = None  # (params, opt_state, chunk) -> (params, opt_state, packed metrics)
  window_end: Any = None  # (params, opt_state, *probe(...), [anchor]) -> (..., metrics, [anchor]): on sync steps
  eval_step: Any = None  # (params, val windows) -> [N] losses of the averaged model
  average: Any = None  # params -> the averaged model, replicated
  any_finite: Any = None  # params -> whether some replica's parameters are all finite
  eval_params: Callable | None = None  # (params, opt_state) -> the parameters to evaluate (schedule-free)
  packers: dict | None = None  # program name -> the programs_lib.MetricsPacker of its metrics
  val_windows: Any = None  # the validation windows on the devices
  distance: Any = None  # params -> each replica's distance from the mean: runs that never average
  saved_anchor: Any = None  # the loop's anchor -> the one copy a checkpoint holds (hdet.rollback)
  lr_unit: float = 1.0  # optim.runtime_lr_scale's factor: the state's LRs are the run's / lr_unit
  lr_rows: tuple[int, ...] = ()  # ... the rows of the logged [G] values that are learning rates


class TrainState(NamedTuple):
  """What the loop rebinds at every step (and a checkpoint holds)."""

  params: Any  # [N, ...] every replica's parameters
  opt_state: Any  # [N, ...] every replica's optimizer state
  anchor: Any  # the state the last sync left, one copy per device (hdet.rollback; programs.make_anchor), or None
  rng: Any  # the run's key data, replicated
  step: int  # steps done


def open_records(run: Run) -> Run:
  """The workdir, its config.json, the checkpointer and the metrics writer; the mesh."""
  settings = run.settings
  os.makedirs(run.workdir, exist_ok=True)
  lead = jax.process_index() == 0
  config_path = os.path.join(run.workdir, 'config.json')
  if lead and not os.path.exists(config_path):
    process.write_json_atomic(
      config_path, {'training_fields': run.fields, 'config': config_lib.unflatten(settings.given)}, indent=1
    )
  mesh = mesh_lib.make_mesh(run.n, settings.mesh.fsdp, settings.mesh.tensor, devices=run.devices)
  ckpt = checkpoints.Checkpointer(run.workdir, settings.loop.max_checkpoints)
  # TensorBoard event files beside metrics.jsonl, on unless the config sets tensorboard=False.
  writer = metrics_lib.MetricsWriter(
    os.path.join(run.workdir, 'metrics.jsonl'), enabled=lead, tensorboard=settings.loop.tensorboard
  )
  log = (lambda msg: print(msg, flush=True)) if lead else (lambda msg: None)
  key = program_cache.programs_key(settings.given, settings.loop.lr_unit, run.n, mesh, run.data.description)
  return run._replace(
    mesh=mesh,
    writer=writer,
    ckpt=ckpt,
    log=log,
    lead=lead,
    programs_key=key,
    wait_each_step=one_program_in_flight(mesh),
  )


def initial_state(run: Run) -> TrainState:
  """The state to start from: the workdir's latest checkpoint, a warm start, or a random init."""
  settings, loop = run.settings, run.settings.loop
  root = jax.random.key(settings.seed)
  key = run.programs_key
  init = program_cache.get(
    key, 'init', lambda: programs_lib.make_init(settings.task, settings.task_settings, run.tx, run.mesh, run.n)
  )
  restored = _restore(run, init, root) if run.resume else None
  anchor = None
  if restored is not None:
    params, opt_state, start, anchor = restored
  elif run.init_src is not None:
    params, opt_state, start = *_warm_start(run, root), 0
  else:
    params, opt_state, start = *init(jax.random.fold_in(root, _INIT_TAG)), 0
    run.writer.write('event', step=0, event='start', init_from=None)
  if restored is None and loop.lr_unit != 1.0:  # (a checkpoint holds its own)
    opt_state = set_lr_scale(key, opt_state, loop.lr_unit)
  run.writer.write(
    'hyperparams', step=start, names=list(settings.programs.hyperparam_names), controller=settings.controller
  )
  run.writer.flush()  # the start/resume is on record even if this start is killed before its first log interval
  rng = jax.device_put(np.asarray(jax.random.key_data(root)), mesh_lib.replicated(run.mesh))
  # The step reads its batch from a chunk of chunk_steps steps' batches at the optimizer's step count,
  # so the count must be the step number.
  count = int(
    mesh_lib.fetch(
      program_cache.get(key, 'step_count', lambda: programs_lib.make_step_count(run.tx))(params, opt_state)
    )[0]
  )
  if count != start:
    raise RuntimeError(f'the optimizer state counts {count} steps but training resumes at step {start}.')
  if anchor is not None:  # the checkpoint's copy, to one per device
    layout = mesh_lib.stacked_anchor_layout(run.mesh, _abstract_anchor(run, params, opt_state), settings.task)
    anchor = program_cache.get(key, 'restored_anchor', lambda: programs_lib.make_restored_anchor(run.mesh, layout))(
      anchor
    )
  elif settings.guard.rollback:  # before the first sync: the start
    layout = mesh_lib.stacked_anchor_layout(run.mesh, _abstract_anchor(run, params, opt_state), settings.task)
    anchor = program_cache.get(key, 'anchor', lambda: programs_lib.make_anchor(run.mesh, run.tx, layout))(
      params, opt_state
    )
  return TrainState(params, opt_state, anchor, rng, start)


def set_lr_scale(key: str, opt_state: Any, unit: float) -> Any:
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


def _restore(run: Run, init: Callable, root: Any) -> tuple | None:
  """(params, opt_state, step, anchor) of the latest readable checkpoint (a corrupt newer one is set aside)."""

  def corrupt(step, why):
    run.writer.write('event', step=step, event='corrupt_checkpoint', reason=why)
    run.log(f'warning: checkpoint {why}; falling back to the previous one.')

  task = run.settings.task
  abstract = jax.eval_shape(lambda k: dict(zip(('params', 'opt_state'), init(k))), root)
  abstract = mesh_lib.with_layout(run.mesh, abstract, task)  # restored straight into the run's layout
  abstract['rng'] = jax.ShapeDtypeStruct((2,), np.uint32, sharding=mesh_lib.replicated(run.mesh))
  if run.settings.guard.rollback:  # the state the last sync left, which the next one may return to
    abstract['anchor'] = mesh_lib.anchor_shapes(run.mesh, abstract, task)
  t_restore = time.time()
  try:
    restored = run.ckpt.restore_latest(abstract, on_corrupt=corrupt)
  except checkpoints.CorruptCheckpoint as e:
    run.writer.close()
    raise ConfigError(str(e)) from None
  if restored is None:
    return None
  state, meta = restored
  start = meta['step']
  if meta['data_position'] != run.data.batches.position(start):
    raise ConfigError(
      f'checkpoint step {start} has data position {meta["data_position"]}, '
      f'this data gives {run.data.batches.position(start)}: was data.path changed?'
    )
  run.writer.write('event', step=start, event='resume', restore_s=time.time() - t_restore)
  run.log(
    f'Resuming {run.workdir} from step {start}.'
    if start < run.settings.loop.num_train_steps
    else f'{run.workdir} already holds the finished run ({start} steps): evaluating and plotting only.'
  )
  return state['params'], state['opt_state'], start, state.get('anchor')


def _warm_start(run: Run, root: Any) -> tuple[Any, Any]:
  """(params, opt_state): the averaged model of ``init_from`` plus each replica's eq. 10 noise."""
  settings = run.settings
  rep, rs = (
    mesh_lib.replicated(run.mesh),
    mesh_lib.param_layout(run.mesh, run.abstract_params, run.n, settings.task),
  )
  try:
    avg = checkpoints.restore_avg_params(
      run.init_src,
      jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), run.abstract_params),
    )
  except checkpoints.CorruptCheckpoint as e:
    run.writer.close()
    raise ConfigError(f'init_from={settings.init_from!r}: its latest checkpoint is corrupt ({e}).') from None
  nu = settings.warm_init_nu
  params = jax.jit(lambda p, k: warm_init.warm_noisy_init(p, run.n, nu, k), out_shardings=rs)(
    avg, jax.random.fold_in(root, _WARM_TAG)
  )
  opt_state = programs_lib.make_opt_init(run.tx, run.mesh, settings.task)(params)
  run.writer.write('event', step=0, event='start', init_from=run.init_src, nu=nu)
  run.log(f'Warm noisy start from {run.init_src} (nu={nu}).')
  return params, opt_state


def upload(run: Run, step: int) -> Any:
  """The chunk of ``chunk_steps`` steps' batches holding step ``step``'s, on the devices."""
  k = run.settings.loop.chunk_steps
  return mesh_lib.put_stacked(run.data.batches.chunk(step - step % k, k), run.mesh, batch_dim=2)  # [N, K, B, ...]


def probe(run: Run, step: int) -> list:
  """The window end's data for the sync after step ``step``: none, or the common batch (every replica gets the same
  windows)."""
  if not run.settings.programs.common_batch:
    return []
  w = run.data.probe(run.settings.sync_index(step))
  return [
    mesh_lib.put_stacked(jax.tree.map(lambda a: np.broadcast_to(a, (run.n,) + a.shape), w), run.mesh, batch_dim=1)
  ]


def compile_programs(run: Run, state: TrainState, chunk: Any) -> Run:
  """Compiles the programs once, up front: the step (every step runs it), the end of a sync window
  (averaging and controller, run after the step on sync steps), the evaluation and the checkpoint's."""
  val = mesh_lib.put_stacked(run.data.eval_batch, run.mesh, batch_dim=1)
  # A run that builds the same programs as the last one takes that run's (an LR bracket's points, a resumed run).
  args = (state.params, state.opt_state, chunk, probe(run, 0), state.anchor, val)
  built = program_cache.get(
    run.programs_key, ('loop', program_cache.signature(*args)), lambda: build_programs(run, *args)
  )
  # Compile the checkpoint fingerprints now too, so the loop runs only compiled code.
  checkpoints.fingerprint(checkpoint_state(state, built['saved_anchor']))
  checkpoints.fingerprint(built['average'](state.params))
  names = run.settings.programs.hyperparam_names
  lr_rows = tuple(g for g, name in enumerate(names) if name.startswith('learning_rate'))
  return run._replace(**built, val_windows=val, lr_unit=run.settings.loop.lr_unit, lr_rows=lr_rows)


def build_programs(run: Run, params: Any, opt_state: Any, chunk: Any, probe: list, anchor: Any, val: Any) -> dict:
  """Traces, lowers and compiles the loop's programs for these arguments: :class:`Run`'s program fields but the
  data's."""
  mesh, task, settings = run.mesh, run.settings.task, run.settings.programs
  packers = {p: programs_lib.MetricsPacker() for p in ('train_step', 'window_end', 'distance')}
  layout = mesh_lib.layout(mesh, params, opt_state, task)  # None on a 1-D mesh
  if layout is not None and anchor is not None:  # the window end pins the anchor it returns too
    layout = (*layout, mesh_lib.stacked_anchor_layout(mesh, anchor, task))
  train_step = (
    programs_lib.make_train_step(
      run.graphdef,
      run.tx,
      mesh,
      sync=False,
      seed=run.settings.seed,
      settings=settings,
      packer=packers['train_step'],
      chunk_steps=run.settings.loop.chunk_steps,
      shardings=layout,
    )
    .lower(params, opt_state, chunk)
    .compile()
  )
  extra = [anchor] if anchor is not None else []
  window_end = (
    programs_lib.make_window_end(
      run.tx,
      mesh,
      seed=run.settings.seed,
      packer=packers['window_end'],
      graphdef=run.graphdef,
      settings=settings,
      shardings=layout,
    )
    .lower(params, opt_state, *probe, *extra)
    .compile()
  )
  saved_anchor = None
  if anchor is not None:
    saved = mesh_lib.anchor_layout(mesh, params, opt_state.inner_state, task)
    saved_anchor = programs_lib.make_saved_anchor(mesh, saved).lower(anchor).compile()
  eval_step = programs_lib.make_eval_step(run.graphdef, mesh, task).lower(params, val).compile()
  average = programs_lib.make_average(mesh, params, task).lower(params).compile()
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
  distance = (
    programs_lib.make_distance(mesh, packers['distance']).lower(params).compile() if run.settings.never_syncs else None
  )
  process.release_host_memory()
  return dict(
    train_step=train_step,
    window_end=window_end,
    eval_step=eval_step,
    average=average,
    any_finite=any_finite,
    eval_params=programs_lib.make_eval_params(settings, mesh),
    packers=packers,
    distance=distance,
    saved_anchor=saved_anchor,
  )


def _abstract_anchor(run: Run, params: Any, opt_state: Any) -> Any:
  """The shapes of the anchor the loop holds (:func:`programs_lib.make_anchor`'s output)."""
  return jax.eval_shape(programs_lib.first_anchor(run.tx, run.mesh), params, opt_state)


def checkpoint_state(state: TrainState, saved_anchor: Any) -> dict:
  """What a checkpoint holds of the state (and what :func:`compile_programs` compiles its fingerprint for): the same
  tree; the anchor as one copy (``saved_anchor``: :func:`programs_lib.make_saved_anchor`): the state format's."""
  return {
    'params': state.params,
    'opt_state': state.opt_state,
    'rng': state.rng,
    **({'anchor': saved_anchor(state.anchor)} if state.anchor is not None else {}),
  }


def param_shapes(abstract_params: Any) -> Any:
  """The parameters' shapes as JSON reads them back (what a checkpoint's meta records)."""
  return json.loads(json.dumps(jax.tree.map(lambda s: list(s.shape), abstract_params)))


def describe(run: Run, setup_s: float) -> str:
  """The line a run starts with: its replicas on the devices, its task and model, its data, its setup's time."""
  size = run.settings.mesh.fsdp * run.settings.mesh.tensor
  group = f' (groups of {size}, mesh {dict(run.mesh.shape)})' if size > 1 else ''
  per = f' ({run.n // run.devices} per device)' if run.n > run.devices else ''
  return (
    f'{run.n} replicas{group} on {run.mesh.devices.size} {jax.devices()[0].platform} devices{per} '
    f'({jax.process_count()} process(es)); task {run.settings.task.name}, model '
    f'{metrics_lib.num_params(run.abstract_params):,} parameters; {run.data.description}; '
    f'setup {setup_s:.1f}s.'
  )
