"""``train_and_evaluate(config, workdir)``: HDET on a byte-level transformer LM.

Everything that can be wrong with the config, the corpus, the workdir, the devices or
``init_from`` is checked first and reported as one :class:`ConfigError` line, before any
training starts and before anything is written.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import signal
import threading
import time
from typing import Any

import jax
import numpy as np

from hdet_jax.trainer import checkpoints
from hdet_jax.trainer import config_lib
from hdet_jax.trainer import input_pipeline
from hdet_jax.trainer import metrics as metrics_lib
from hdet_jax.trainer import model as model_lib
from hdet_jax.trainer import train_step as ts
from hdet_jax.trainer import warm_init
from hdet_jax.trainer.config_lib import ConfigError

_INIT_TAG, _WARM_TAG = 1, 2  # fold_in tags of the run key: model init, warm-init noise.


def setup_jax(config: Any, *, coordinator_address: str | None = None, num_processes: int | None = None,
              process_id: int | None = None, heartbeat_timeout_s: int = 20) -> None:
  """Process-level JAX setup; call before any other JAX call (train.py does).

  Starts ``jax.distributed`` when a coordinator is given, or under a SLURM job step with
  several tasks (JAX reads the rest from SLURM's environment); sets the number of simulated CPU
  devices (``config.num_cpu_devices`` split over the processes, unless JAX_NUM_CPU_DEVICES or
  XLA_FLAGS already say); turns on the persistent compilation cache.
  """
  slurm = int(os.environ.get('SLURM_NTASKS', '1') or 1) > 1 and 'SLURM_JOB_ID' in os.environ
  procs = num_processes or (int(os.environ['SLURM_NTASKS']) if slurm else 1)
  if ('JAX_NUM_CPU_DEVICES' not in os.environ
      and 'xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', '')
      and config.num_cpu_devices > 0):
    try:
      jax.config.update('jax_num_cpu_devices', max(1, config.num_cpu_devices // procs))
    except RuntimeError:
      pass  # the backend is already up (e.g. in a test); keep its device count.
  if coordinator_address:
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, heartbeat_timeout_seconds=heartbeat_timeout_s)
  elif slurm:
    jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout_s)
  if config.compilation_cache:
    jax.config.update('jax_compilation_cache_dir', os.path.expanduser(config.compilation_cache))
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)


def _resolve_replicas(config: Any) -> int:
  devices = jax.device_count()
  n = config.hdet.num_replicas or devices
  if n > devices:
    raise ConfigError(
        f'hdet.num_replicas={n} but only {devices} devices are visible; set --config.hdet.num_replicas=0 '
        f'(one replica per device) or run on {n} devices (on CPU: JAX_NUM_CPU_DEVICES={n}).')
  if jax.process_count() > 1 and n != devices:
    raise ConfigError(
        f'hdet.num_replicas={n} but {jax.process_count()} processes hold {devices} devices; with several '
        'processes every device holds one replica: set --config.hdet.num_replicas=0.')
  return n


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
          'Pass a new --workdir (nothing in this one was changed), or resume it with the version that wrote it.')
  elif os.path.exists(os.path.join(workdir, 'config.json')):
    try:
      with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
        saved, what = json.load(f).get('training_fields'), 'a run'
    except (OSError, ValueError, AttributeError):
      saved = None  # unreadable (cut short by a kill in an older version): the checkpoints decide
  if saved is not None and saved != fields:
    raise ConfigError(
        f'workdir {workdir} holds {what} of a different config ({config_lib.differences(saved, fields)}); '
        'rerun with the same config to resume it, or pass a new --workdir.')
  return bool(checkpoints.all_steps(workdir))


def _check_init_from(config: Any, abstract_params: Any) -> str | None:
  if not config.init_from:
    return None
  src = os.path.abspath(os.path.expanduser(config.init_from))
  step = checkpoints.latest_step(src) if os.path.isdir(src) else None
  if step is None:
    raise ConfigError(
        f'init_from={config.init_from!r} holds no checkpoint; point --config.init_from at the workdir of an '
        'earlier run (e.g. run `python train.py --workdir workdirs/default` first), or unset it for a random init.')
  try:
    meta = checkpoints.read_meta(src, step)
  except checkpoints.CorruptCheckpoint as e:
    raise ConfigError(f'init_from={config.init_from!r}: its latest checkpoint is corrupt ({e}).') from None
  want = jax.tree.map(lambda s: list(s.shape), abstract_params)
  if meta.get('param_shapes') != json.loads(json.dumps(want)):
    raise ConfigError(
        f'init_from={config.init_from!r} (step {step}) holds a model of another shape than model.* and '
        'data.seq_len describe; use the same model settings as that run or another init_from.')
  return src


class _Run:
  """The mutable bookkeeping of one call of train_and_evaluate."""

  def __init__(self):
    self.train_time = 0.0
    self.train_steps = 0
    self.last_losses: list[np.ndarray] = []
    self.diverged_at: int | None = None
    self.preempted_at: int | None = None
    self.val = (math.nan, math.nan)


class _StopSignals:
  """SIGTERM / SIGINT set a flag that the training loop checks; a second signal acts as usual.

  Installed only from the main thread (signal handlers cannot be set elsewhere), and undone on exit.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.received: str | None = None
    self._old = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in self.SIGNALS:
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    self.received = signal.Signals(signum).name
    # The next one of this signal does what it would have done without us: end the process now.
    signal.signal(signum, self._old.get(signum, signal.SIG_DFL))

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)
    return False


def _any_process(flag: bool) -> bool:
  """True on every process iff ``flag`` on some process (a no-op with one process)."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils
  return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


def _write_json_atomic(path: str, obj: Any, **kwargs) -> None:
  """Writes ``path`` via a temporary file and a rename: a kill leaves the old file or the new one."""
  tmp = f'{path}.tmp-{os.getpid()}'
  with open(tmp, 'w', encoding='utf-8') as f:
    json.dump(obj, f, **kwargs)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def release_host_memory() -> None:
  """Returns the memory the compiler freed to the operating system (glibc only; else nothing).

  glibc keeps freed heap memory for reuse; after compiling, that is tens of MB per program that
  the process holds but no longer uses (on CPU the devices' buffers live on the same heap).
  """
  try:
    ctypes.CDLL('libc.so.6').malloc_trim(0)
  except (OSError, AttributeError):
    pass


# Steps whose batches go to the devices in one transfer (one per step cost about 1% of the loop).
_CHUNK = 25


def train_and_evaluate(config: Any, workdir: str) -> dict:
  """Trains (or resumes) the run described by ``config`` in ``workdir``; returns the summary.

  SIGTERM or SIGINT during training (a preemption, Ctrl-C) finishes the current step, writes a
  checkpoint and returns with ``summary['preempted']`` set; rerunning resumes from it.
  """
  with _StopSignals() as stop:
    return _train_and_evaluate(config, workdir, stop)


def _train_and_evaluate(config: Any, workdir: str, stop: _StopSignals) -> dict:
  t0 = time.time()
  workdir = os.path.abspath(os.path.expanduser(workdir))
  lead = jax.process_index() == 0

  # ---- Checks: nothing is written before all of them pass. ----
  config_lib.check_values(config)
  n = _resolve_replicas(config)
  try:
    corpus = input_pipeline.load_corpus(config.data.path)
    train_bytes, val_bytes = input_pipeline.split(corpus, config.data.val_fraction)
    batches = input_pipeline.TrainBatches(train_bytes, config.data.seq_len, config.data.batch_size, n, config.seed)
    val_windows = input_pipeline.validation_windows(val_bytes, config.data.seq_len, n, config.eval_windows)
  except input_pipeline.DataError as e:
    raise ConfigError(str(e)) from None
  try:
    tx = ts.make_optimizer(config, n)
  except ValueError as e:
    raise ConfigError(f'config: {e}') from None
  fields = config_lib.training_fields(config, n)
  resume = _check_workdir(workdir, fields)
  graphdef, abstract_params = model_lib.abstract_model(config.model, config.data.seq_len)
  init_src = _check_init_from(config, abstract_params) if not resume else None
  if jax.process_count() > 1:
    # Every process has read the workdir before process 0 creates checkpoints/ in it: a process that got
    # here late would otherwise see that directory, open it, and run orbax's collectives out of step.
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices('hdet_workdir_checked')

  # ---- Build. ----
  os.makedirs(workdir, exist_ok=True)
  config_path = os.path.join(workdir, 'config.json')
  if lead and not os.path.exists(config_path):
    _write_json_atomic(config_path, {'training_fields': fields, 'config': json.loads(config.to_json())}, indent=1)
  mesh = ts.make_mesh(n)
  rs, rep = ts.replica_sharding(mesh), ts.replicated(mesh)
  root = jax.random.key(config.seed)
  init = ts.make_init(config, tx, mesh, n)
  abstract_state = jax.eval_shape(lambda k: dict(zip(('params', 'opt_state'), init(k))), root)
  abstract_state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rs), abstract_state)
  abstract_state['rng'] = jax.ShapeDtypeStruct((2,), np.uint32, sharding=rep)
  ckpt = checkpoints.Checkpointer(workdir, config.max_checkpoints)
  # TensorBoard event files beside metrics.jsonl, on unless the config sets tensorboard=False.
  writer = metrics_lib.MetricsWriter(os.path.join(workdir, 'metrics.jsonl'), enabled=lead,
                                     tensorboard=bool(config.get('tensorboard', True)))
  log = (lambda msg: print(msg, flush=True)) if lead else (lambda msg: None)

  restored = None
  if resume:
    def corrupt(step, why):
      writer.write('event', step=step, event='corrupt_checkpoint', reason=why)
      log(f'warning: checkpoint {why}; falling back to the previous one.')
    t_restore = time.time()
    try:
      restored = ckpt.restore_latest(abstract_state, on_corrupt=corrupt)
    except checkpoints.CorruptCheckpoint as e:
      writer.close()
      raise ConfigError(str(e)) from None
  if restored is not None:
    state, meta = restored
    params, opt_state = state['params'], state['opt_state']
    resume_step = meta['step']
    if meta['data_position'] != batches.position(resume_step):
      raise ConfigError(f'checkpoint step {resume_step} has data position {meta["data_position"]}, '
                        f'this corpus gives {batches.position(resume_step)}: was data.path changed?')
    start = resume_step
    writer.write('event', step=start, event='resume', restore_s=time.time() - t_restore)
    log(f'Resuming {workdir} from step {start}.' if start < config.num_train_steps else
        f'{workdir} already holds the finished run ({start} steps): evaluating and plotting only.')
  elif init_src is not None:
    try:
      avg = checkpoints.restore_avg_params(
          init_src, jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), abstract_params))
    except checkpoints.CorruptCheckpoint as e:
      writer.close()
      raise ConfigError(f'init_from={config.init_from!r}: its latest checkpoint is corrupt ({e}).') from None
    params = jax.jit(lambda p, k: warm_init.warm_noisy_init(p, n, config.warm_init.nu, k), out_shardings=rs)(
        avg, jax.random.fold_in(root, _WARM_TAG))
    opt_state = ts.make_opt_init(tx, mesh)(params)
    start = 0
    writer.write('event', step=0, event='start', init_from=init_src, nu=config.warm_init.nu)
    log(f'Warm noisy start from {init_src} (nu={config.warm_init.nu}).')
  else:
    params, opt_state = init(jax.random.fold_in(root, _INIT_TAG))
    start = 0
    writer.write('event', step=0, event='start', init_from=None)
  writer.write('hyperparams', step=start, names=list(ts.hyperparam_names(config)))
  writer.flush()  # the start/resume is on record even if this start is killed before its first log interval
  rng = jax.device_put(np.asarray(jax.random.key_data(root)), rep)
  param_shapes = json.loads(json.dumps(jax.tree.map(lambda s: list(s.shape), abstract_params)))

  # The step reads its batch from a chunk of _CHUNK steps' batches at the optimizer's step count,
  # so the count must be the step number.
  count = int(ts.fetch(opt_state.count)[0])
  if count != start:
    raise RuntimeError(f'the optimizer state counts {count} steps but training resumes at step {start}.')

  def upload(step):
    """The chunk of batches holding step ``step``'s, on the devices."""
    first = step - step % _CHUNK
    return ts.put_stacked(batches.chunk(first, _CHUNK), mesh)

  # Compile the programs once, up front: the step (every step runs it), the end of a sync window
  # (averaging and controller, run after the step on sync steps) and the evaluation.
  data = upload(start)
  packers = {s: ts.MetricsPacker() for s in (False, True)}
  step_fn = ts.make_train_step(graphdef, tx, mesh, sync=False, config=config, packer=packers[False],
                               chunk_steps=_CHUNK).lower(params, opt_state, data).compile()
  common = ts.common_batch(config)

  def probe(step):
    """The common batch of the sync after step ``step`` (every replica gets the same windows)."""
    w = input_pipeline.probe_windows(train_bytes, config.data.seq_len, config.hdet.probe_windows, config.seed,
                                     step // ts.sync_every(config))
    return ts.put_stacked(np.broadcast_to(w, (n,) + w.shape), mesh)

  window_end = ts.make_window_end(tx, mesh, packer=packers[True], graphdef=graphdef, config=config).lower(
      params, opt_state, *([probe(0)] if common else [])).compile()
  to_eval = ts.make_eval_params(config, mesh)
  val_dev = ts.put_stacked(val_windows, mesh)
  evaluate_fn = ts.make_eval_step(graphdef, mesh).lower(params, val_dev).compile()
  average = ts.make_average(mesh).lower(params).compile()
  # Compile the checkpoint fingerprints now too, so the loop runs only compiled code.
  checkpoints.fingerprint({'params': params, 'opt_state': opt_state, 'rng': rng})
  checkpoints.fingerprint(average(params))
  # Whether some replica's parameters are all finite (a checkpoint of only NaN/inf replicas is useless:
  # the loss that would reveal the last update's blow-up comes one step later).
  any_finite = jax.jit(lambda p: jax.numpy.any(jax.numpy.stack(
      [jax.numpy.all(jax.numpy.isfinite(x.reshape(x.shape[0], -1)), axis=1) for x in jax.tree.leaves(p)]).all(0)),
      out_shardings=rep).lower(params).compile()
  release_host_memory()
  setup_s = time.time() - t0
  num_params = model_lib.num_params(abstract_params)
  tokens_per_step = n * config.data.batch_size * config.data.seq_len
  log(f'{n} replicas on {jax.device_count()} {jax.devices()[0].platform} devices '
      f'({jax.process_count()} process(es)); model {num_params:,} parameters; '
      f'{len(train_bytes):,} train / {len(val_bytes):,} validation bytes; setup {setup_s:.1f}s.')

  run = _Run()
  total = config.num_train_steps
  end = total if config.stop_at_step <= 0 else min(config.stop_at_step, total)
  bar = metrics_lib.ProgressBar(total, start, enabled=lead and config.progress_bar)

  def evaluate(step):
    losses = ts.fetch(evaluate_fn(params if to_eval is None else to_eval(params, opt_state), val_dev))
    val = float(np.mean(losses))
    run.val = (val, model_lib.bits_per_byte(val))
    writer.write('eval', step=step, val_loss=val, val_bits_per_byte=run.val[1])
    writer.flush()

  def save(step):
    """Checkpoints step ``step`` unless every replica's parameters are non-finite (then: diverged)."""
    if not ts.fetch(any_finite(params)):
      if run.diverged_at is None:
        run.diverged_at = step
        writer.write('event', step=step, event='diverged', where='parameters')
      log(f'Not checkpointing step {step}: every replica\'s parameters are NaN/inf; the last good checkpoint '
          'is kept.')
      return
    state = {'params': params, 'opt_state': opt_state, 'rng': rng}
    meta = {'step': step, 'data_position': batches.position(step), 'seed': config.seed, 'num_replicas': n,
            'config': fields, 'param_shapes': param_shapes}
    ckpt.save(step, state, average(params), meta)

  pending: list[tuple[int, bool, Any]] = []
  t_mark = time.time()

  def flush():
    def unpack(sync, rows):  # a sync step's metrics: the step's, then the window end's
      if not sync:
        return packers[False].unpack(rows)
      return {**packers[False].unpack(rows[0]), **packers[True].unpack(rows[1])}
    got = [unpack(sync, rows) for (_, sync, _), rows in zip(pending, ts.fetch([m for _, _, m in pending]))]
    for (step, sync, _), m in zip(pending, got):
      loss = m['loss']
      writer.write('train', step=step, loss=loss, lr=m['lrs'][0], base_lr=m['base_lr'][0], sync=sync,
                   values=m['values'][0], bases=m['bases'][0])
      if sync:
        writer.write('controller', step=step, weights=m['weights'][0], window_losses=m['window_losses'][0],
                     delta=m['delta'][0], velocity=m['velocity'][0], base_lr=m['base_lr'][0],
                     deltas=m['deltas'][0], velocities=m['velocities'][0])
      finite = np.isfinite(loss)
      if not finite.all() and run.diverged_at is None:
        if finite.any():
          writer.write('event', step=step, event='nonfinite', replicas=np.flatnonzero(~finite))
        else:
          run.diverged_at = step
          writer.write('event', step=step, event='diverged')
    run.last_losses = [m['loss'] for m in got]
    mean_loss = float(np.mean(run.last_losses[-1]))
    bar.update(len(pending), mean_loss, float(got[-1]['base_lr'][0]))
    return got

  step = start
  while step < end:
    sync = ts.is_sync_step(config, step)
    if step % _CHUNK == 0 and step != start:
      data = upload(step)
    params, opt_state, m = step_fn(params, opt_state, data)
    if sync:
      params, opt_state, m_sync = window_end(params, opt_state, *([probe(step)] if common else []))
      m = (m, m_sync)
    pending.append((step, sync, m))
    step += 1
    eval_due = config.eval_every > 0 and step % config.eval_every == 0 and step < end
    ckpt_due = config.checkpoint_every > 0 and step % config.checkpoint_every == 0 and step < end
    # A stop signal is checked every step (with several processes, at each log interval, where the
    # processes agree on it: they must all stop after the same step).
    if step < end and (jax.process_count() == 1 or step % config.log_every == 0):
      if _any_process(stop.received is not None):
        run.preempted_at = step
        ckpt_due = True
    if step % config.log_every == 0 or step == end or eval_due or ckpt_due:
      flush()
      now = time.time()
      run.train_time += now - t_mark
      run.train_steps += len(pending)
      writer.write('throughput', step=step - 1, steps_per_s=len(pending) / (now - t_mark),
                   tokens_per_s=len(pending) * tokens_per_step / (now - t_mark))
      pending = []
      if run.diverged_at is not None and config.stop_on_nan:
        bar.close()
        log(f'Training diverged: every replica\'s loss is NaN/inf at step {run.diverged_at}. Stopping; the '
            'last good checkpoint is kept. Lower optim.max_lr, or set --config.stop_on_nan=False to keep going.')
        break
      if eval_due and run.preempted_at is None:
        evaluate(step)
      if ckpt_due:
        save(step)
      writer.flush()
      if run.preempted_at is not None:
        bar.close()
        ckpt.wait()
        writer.write('event', step=step, event='preempted', signal=stop.received)
        log(f'Stopped by {stop.received or "a signal to another process"} after step {step}: checkpoint '
            f'{step} is written; rerun the same command to resume.')
        break
      t_mark = time.time()
  bar.close()

  # ---- The end: evaluate, checkpoint, plot, summarise. ----
  if run.preempted_at is None:  # a preempted run has little time left: the checkpoint is what matters
    evaluate(step)
  if run.diverged_at is None and step > start and ckpt.latest_step() != step:
    save(step)
  ckpt.close()
  tokens_per_s = run.train_steps * tokens_per_step / run.train_time if run.train_time > 0 else math.nan
  if run.last_losses:
    final_train = float(np.mean(run.last_losses))
  else:  # nothing trained in this call (the workdir's run was already complete): the last recorded steps.
    writer.flush()
    recorded = metrics_lib.read_metrics(writer.path).get('train', []) if lead else []
    final_train = float(np.mean([r['loss'] for r in recorded[-config.log_every:]])) if recorded else math.nan
  summary = {
      'step': step, 'num_train_steps': total, 'stopped_early': step < total, 'diverged_at': run.diverged_at,
      'preempted': run.preempted_at is not None,
      'final_train_loss': final_train, 'final_train_bits_per_byte': model_lib.bits_per_byte(final_train),
      'final_val_loss': run.val[0], 'final_val_bits_per_byte': run.val[1],
      'tokens_per_s': tokens_per_s, 'setup_s': setup_s, 'wall_s': time.time() - t0,
      'num_replicas': n, 'num_params': num_params, 'workdir': workdir,
      'metrics': os.path.join(workdir, 'metrics.jsonl'), 'checkpoints': checkpoints.checkpoint_dir(workdir),
      'plots': [],
  }
  writer.write('event', event='end', **{k: v for k, v in summary.items() if k != 'plots'})
  writer.close()
  if lead and config.plots and run.preempted_at is None:
    from hdet_jax.trainer import plots  # matplotlib: imported only when plotting
    summary['plots'] = plots.plot_workdir(workdir)
  summary['wall_s'] = time.time() - t0
  if lead:
    _write_json_atomic(os.path.join(workdir, 'summary.json'), metrics_lib._clean(summary), indent=1)
  return summary


def format_summary(s: dict) -> str:
  """The final summary as a few human lines."""
  status = (f'DIVERGED at step {s["diverged_at"]}' if s['diverged_at'] is not None
            else f'preempted after step {s["step"]} of {s["num_train_steps"]}, checkpoint written (rerun the same '
                 'command to resume)' if s.get('preempted')
            else f'stopped at step {s["step"]} of {s["num_train_steps"]} (rerun the same command to resume)'
            if s['stopped_early'] else f'finished {s["step"]} steps')
  lines = [
      f'Run {status}.',
      f'  final train loss {s["final_train_loss"]:.4f} nats ({s["final_train_bits_per_byte"]:.3f} bits/byte, '
      f'mean over replicas, last log interval)',
      f'  final validation loss of the averaged model {s["final_val_loss"]:.4f} nats '
      f'({s["final_val_bits_per_byte"]:.3f} bits/byte)',
      f'  {s["tokens_per_s"]:,.0f} tokens/s over {s["num_replicas"]} replicas; wall time {s["wall_s"]:.1f}s '
      f'(setup and compile {s["setup_s"]:.1f}s)',
      f'  metrics: {s["metrics"]}',
      f'  checkpoints: {s["checkpoints"]}',
  ]
  if s['plots']:
    lines.append(f'  plots: {", ".join(s["plots"])}')
  return '\n'.join(lines)
