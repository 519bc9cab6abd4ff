"""``train_and_evaluate(config, workdir)``: HDET on the task ``config.task`` names (``tasks/``), read top to bottom.

The checks come first (``checks.py``): everything that can be wrong with the config, the task's data, the workdir, the
devices or ``init_from`` is reported as one :class:`ConfigError` line, before any training starts and before anything
is written. Then the setup (``setup.py``): the records, the initial state and every program, compiled once. Then the
loop, in one place: the step, on sync steps the window end (the averaging, the controller and the rollback), and at
each log interval the records, the evaluation, the checkpoint and the stops. Then the end (``summary.py``).

The loop reads two bundles: :class:`setup.Run`, what is fixed for the run, and :class:`setup.TrainState`, what each
step rebinds. It knows a task only through :class:`tasks.Task` (its data, model, loss and metric); the device layout
is ``mesh.py``, the optimizer ``optimizer.py``, the compiled programs ``programs.py``, the process-level setup
``process.py``.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import jax
import numpy as np

from hdet_jax.trainer import checks
from hdet_jax.trainer import mesh as mesh_lib
from hdet_jax.trainer import metrics as metrics_lib
from hdet_jax.trainer import optimizer as optimizer_lib
from hdet_jax.trainer import process
from hdet_jax.trainer import run_settings
from hdet_jax.trainer import setup
from hdet_jax.trainer import summary as summary_lib
from hdet_jax.trainer import tasks as tasks_lib
from hdet_jax.trainer.checks import check, check_output_paths, output_path_error  # noqa: F401 (the trainer's API)
from hdet_jax.trainer.setup import Run, TrainState, one_program_in_flight  # noqa: F401 (the trainer's API)
from hdet_jax.trainer.summary import format_summary  # noqa: F401 (the trainer's API)


def train_and_evaluate(
  config: Any, workdir: str, *, optimizer: optimizer_lib.Base | None = None, tuning: dict | None = None
) -> dict:
  """Trains (or resumes) the run described by ``config`` in ``workdir``; returns the summary. ``optimizer``: a base
  optimizer given in Python in place of ``optim.name``'s (research's LR-free baselines: ``optimizer.Base``).
  ``tuning``: what research varies and a user does not set, given in Python by dotted name (``schema.tuning_fields``:
  the controller's tuning, e.g. ``{'hdet.trust': 0.25}``; ``'stop_at_step'``: stop as if preempted).

  SIGTERM or SIGINT during training (a preemption, Ctrl-C) finishes the current step, writes a
  checkpoint and returns with ``summary['preempted']`` set; rerunning resumes from it.
  """
  with process.StopSignals() as stop:
    t0 = time.time()
    # ---- Checks (checks.py): nothing is written before all of them pass. ----
    check_output_paths(config, workdir)
    settings = run_settings.resolve(config, optimizer, tuning)  # the config, checked and resolved: each part's settings
    run = checks.check_run(settings, os.path.abspath(os.path.expanduser(workdir)))
    # ---- Setup (setup.py): the records, the initial state, and every program compiled once, up front. ----
    run = setup.open_records(run)
    state = setup.initial_state(run)
    chunk = setup.upload(run, state.step)  # the chunk of chunk_steps steps' batches holding this step's
    run = setup.compile_programs(run, state, chunk)
    setup_s = time.time() - t0
    run.log(setup.describe(run, setup_s))

    # ---- Train. ----
    loop, writer = settings.loop, run.writer
    start, end = state.step, loop.end  # end: num_train_steps, or stop_at_step
    bar = metrics_lib.ProgressBar(loop.num_train_steps, start, enabled=run.lead and loop.progress_bar)
    pending = []  # (step, sync, its metrics on the devices) of the steps since the last log interval
    last_losses, val = [], {'val_loss': math.nan}  # each replica's loss at the last interval's steps; the last eval
    diverged_at = rolled_back_at = preempted_at = None  # rolled_back_at: the last sync whose rollback undid one
    train_s, train_steps, t_mark = 0.0, 0, time.time()
    for step in range(start, end):
      # The step; on sync steps the window end after it: the averaging, the controller and (hdet.rollback) the
      # back-off's return to the anchor, the state the last sync left. The window end takes the anchor (donated)
      # and returns the next. Metrics stay on the devices until the log interval.
      if step % loop.chunk_steps == 0 and step != start:
        chunk = setup.upload(run, step)
      params, opt_state, m = run.train_step(state.params, state.opt_state, chunk)
      sync, anchor = settings.is_sync_step(step), state.anchor
      if sync:
        held = [anchor] if anchor is not None else []
        params, opt_state, m_sync, *held = run.window_end(params, opt_state, *setup.probe(run, step), *held)
        anchor, m = (held[0] if held else None), (m, m_sync)
      state = TrainState(params, opt_state, anchor, state.rng, step + 1)
      pending.append((step, sync, m))
      if run.wait_each_step:  # (one_program_in_flight; the metrics are ready when the step's programs are done)
        jax.block_until_ready(m)
      done = step + 1
      eval_due = loop.eval_every > 0 and done % loop.eval_every == 0 and done < end
      ckpt_due = loop.checkpoint_every > 0 and done % loop.checkpoint_every == 0 and done < end
      # A stop signal is checked every step (with several processes, at each log interval, where the
      # processes agree on it: they must all stop after the same step).
      if done < end and (jax.process_count() == 1 or done % loop.log_every == 0):
        if process.any_process(stop.received is not None):
          preempted_at, ckpt_due = done, True
      if not (done % loop.log_every == 0 or done == end or eval_due or ckpt_due):
        continue

      # ---- The log interval: the steps' records (one transfer), then the evaluation and checkpoint where due. ----
      got = _fetch_metrics(run, pending)
      for (s, sync, _), m in zip(pending, got):
        metrics_lib.write_step(writer, s, sync, m)
        finite = np.isfinite(m['train']['loss'])
        if not finite.all() and diverged_at is None:  # the first non-finite loss: some replicas', or every one's
          if finite.any():
            writer.write('event', step=s, event='nonfinite', replicas=np.flatnonzero(~finite))
          else:
            diverged_at = s
            writer.write('event', step=s, event='diverged')
        if run.saved_anchor is not None and sync and m['controller']['backed_off'] and diverged_at is not None:
          # The rollback undid it: the back-off returned the replicas to the sync before.
          writer.write('event', step=s, event='rolled_back', diverged_at=diverged_at)
          diverged_at, rolled_back_at = None, s
      last_losses = [m['train']['loss'] for m in got]
      bar.update(len(pending), float(np.mean(last_losses[-1])), float(got[-1]['train']['base_lr']))
      now = time.time()
      train_s, train_steps = train_s + now - t_mark, train_steps + len(pending)
      writer.write(
        'throughput',
        step=step,
        steps_per_s=len(pending) / (now - t_mark),
        tokens_per_s=len(pending) * run.tokens_per_step / (now - t_mark),
      )
      pending = []
      if run.distance is not None:
        metrics_lib.write_step(
          writer, step, False, run.packers['distance'].unpack(mesh_lib.fetch(run.distance(state.params)))
        )
      if (
        diverged_at is not None
        and loop.stop_on_nan
        and not _rollback_ahead(settings, done, diverged_at, rolled_back_at)
      ):
        bar.close()
        run.log(
          f"Training diverged: every replica's loss is NaN/inf at step {diverged_at}. Stopping; the "
          'last good checkpoint is kept. Lower optim.max_lr, or set --config.stop_on_nan=False to keep going.'
        )
        break
      if eval_due and preempted_at is None:
        val = _evaluate(run, state)
      if ckpt_due:
        diverged_at = _save(run, state, diverged_at)
      writer.flush()
      if preempted_at is not None:
        bar.close()
        run.ckpt.wait()
        writer.write('event', step=done, event='preempted', signal=stop.received)
        run.log(
          f'Stopped by {stop.received or "a signal to another process"} after step {done}: checkpoint '
          f'{done} is written; rerun the same command to resume.'
        )
        break
      t_mark = time.time()
    bar.close()

    # ---- The end: the final evaluation and checkpoint, the summary (summary.py) and the plots. ----
    # A preempted run has little time left: the checkpoint is what matters. A run stopped at ``stop_at_step`` stops
    # as if preempted (an LR bracket's runs stop at its rungs, which rank training losses, not validation): it is
    # evaluated when it reaches its end.
    stopped = 0 < loop.stop_at_step <= state.step < loop.num_train_steps
    if preempted_at is None and not stopped:
      val = _evaluate(run, state)
    if diverged_at is None and state.step > start and run.ckpt.latest_step() != state.step:
      diverged_at = _save(run, state, diverged_at)
    run.ckpt.close()
    return summary_lib.finish(
      run,
      state.step,
      diverged_at=diverged_at,
      preempted=preempted_at is not None,
      last_losses=last_losses,
      val=val,
      train_s=train_s,
      train_steps=train_steps,
      setup_s=setup_s,
      t0=t0,
    )


# ---------------------------------------------------------------------------------------------
# The loop's helpers: each takes the run and what it reads of the state
# ---------------------------------------------------------------------------------------------


def _fetch_metrics(run: Run, pending: list) -> list[dict]:
  """The pending steps' records (``programs.py``'s ``{record: {key: value}}``), fetched in one transfer and
  unpacked: a step's 'train' record, and on a sync step the window end's (its 'controller' record is the one after
  the sync; the step's, before it, is left)."""

  def unpack(sync, rows):
    if not sync:
      return {'train': run.packers['train_step'].unpack(rows)['train']}
    return {'train': run.packers['train_step'].unpack(rows[0])['train'], **run.packers['window_end'].unpack(rows[1])}

  got = [unpack(sync, rows) for (_, sync, _), rows in zip(pending, mesh_lib.fetch([m for _, _, m in pending]))]
  if run.lr_unit != 1.0:
    got = [{**m, 'train': _in_run_lrs(m['train'], run.lr_unit, run.lr_rows)} for m in got]
  return got


def _in_run_lrs(train: dict, unit: float, rows: tuple[int, ...]) -> dict:
  """A step's 'train' record with the state's learning rates (``optim.runtime_lr_scale``: the run's / ``unit``) times
  ``unit``, the run's own: a power of two, so exactly the plain build's."""
  values, bases = np.array(train['values']), np.array(train['bases'])  # [G, N] and [G]
  values[list(rows)] *= unit
  bases[list(rows)] *= unit
  return {**train, 'lr': train['lr'] * unit, 'base_lr': train['base_lr'] * unit, 'values': values, 'bases': bases}


def _rollback_ahead(
  settings: run_settings.RunSettings, done: int, diverged_at: int, rolled_back_at: int | None
) -> bool:
  """Whether the rollback may still undo the divergence at step ``diverged_at``, ``done`` steps in: the run rolls
  back (``hdet.rollback``) and the sync that ends the diverged window has not run yet. Its back-off fires on the
  window's non-finite training loss and returns the replicas to the sync before (the loop then clears
  ``diverged_at``); a sync that passes without it (e.g. before the controller starts) leaves the divergence, and the
  run stops at the next interval."""
  if not settings.guard.rollback or rolled_back_at == diverged_at - 1:
    return False  # (diverged at the first step after a rollback: the state it returned to is itself lost)
  step, total = diverged_at, settings.loop.num_train_steps
  while step < total and not settings.is_sync_step(step):
    step += 1
  return step < total and done <= step


def _evaluate(run: Run, state: TrainState) -> dict:
  """The averaged model's held-out metrics (``val_loss`` and the task's others), recorded as an 'eval' record."""
  params = state.params if run.eval_params is None else run.eval_params(state.params, state.opt_state)
  means = {k: float(np.mean(v)) for k, v in mesh_lib.fetch(run.eval_step(params, run.val_windows)).items()}
  val = tasks_lib.eval_record(run.settings.task, means)
  run.writer.write('eval', step=state.step, **val)
  run.writer.flush()
  return val


def _save(run: Run, state: TrainState, diverged_at: int | None) -> int | None:
  """Checkpoints the state unless every replica's parameters are non-finite; returns the step the run diverged at:
  ``diverged_at``, or this step where its parameters are what reveals it (nothing is then written)."""
  step = state.step
  if not mesh_lib.fetch(run.any_finite(state.params)):
    if diverged_at is None:
      diverged_at = step
      run.writer.write('event', step=step, event='diverged', where='parameters')
    run.log(f"Not checkpointing step {step}: every replica's parameters are NaN/inf; the last good checkpoint is kept.")
    return diverged_at
  meta = {
    'step': step,
    'data_position': run.data.batches.position(step),
    'seed': run.settings.seed,
    'num_replicas': run.n,
    'config': run.fields,
    'param_shapes': setup.param_shapes(run.abstract_params),
  }
  run.ckpt.save(step, setup.checkpoint_state(state, run.saved_anchor), run.average(state.params), meta)
  return diverged_at
