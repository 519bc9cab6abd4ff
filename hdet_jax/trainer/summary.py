"""The end of a run: its summary (``summary.json``, the 'end' event), its plots, and the summary's human lines."""

from __future__ import annotations

import math
import os
import time

import numpy as np

from hdet_jax.trainer import checkpoints
from hdet_jax.trainer import metrics as metrics_lib
from hdet_jax.trainer import process
from hdet_jax.trainer.setup import Run


def finish(
  run: Run,
  step: int,
  *,
  diverged_at: int | None,
  preempted: bool,
  last_losses: list,
  val: dict,
  train_s: float,
  train_steps: int,
  setup_s: float,
  t0: float,
) -> dict:
  """The summary (also summary.json and the 'end' event) of a run that stopped after step ``step``, and its plots.

  ``last_losses``: each replica's loss at the last log interval's steps; ``val``: the last 'eval' record's fields;
  ``train_s``, ``train_steps``: the loop's time and steps (its throughput); ``t0``: when the run started."""
  settings, task, writer = run.settings.loop, run.settings.task, run.writer
  final_train = _final_train_loss(run, last_losses)
  summary = {
    'step': step,
    'num_train_steps': settings.num_train_steps,
    'stopped_early': step < settings.num_train_steps,
    'diverged_at': diverged_at,
    'preempted': preempted,
    'final_train_loss': final_train,
    **{f'final_train_{k}': v for k, v in task.loss_units(final_train).items()},
    **{f'final_{k}': v for k, v in val.items()},
    # The task's primary metric (lower is better): what "within 1% of the sweep" is measured on.
    'task': task.name,
    'unit': task.unit,
    'metric': task.metric,
    'final_metric': val.get(task.metric, math.nan),
    'tokens_per_s': (train_steps * run.tokens_per_step / train_s if train_s > 0 else math.nan),
    'setup_s': setup_s,
    'wall_s': time.time() - t0,
    'num_replicas': run.n,
    'num_devices': int(run.mesh.devices.size),
    'replicas_per_device': run.n // run.devices,
    'num_params': metrics_lib.num_params(run.abstract_params),
    'workdir': run.workdir,
    'metrics': os.path.join(run.workdir, 'metrics.jsonl'),
    'checkpoints': checkpoints.checkpoint_dir(run.workdir),
    'plots': [],
    'machine': process.machine(),
  }
  writer.write('event', event='end', **{k: v for k, v in summary.items() if k != 'plots'})
  writer.close()
  if run.lead and settings.plots and not preempted:
    from hdet_jax.trainer import plots  # matplotlib: imported only when plotting

    summary['plots'] = plots.plot_workdir(run.workdir)
  summary['wall_s'] = time.time() - t0
  if run.lead:
    process.write_json_atomic(os.path.join(run.workdir, 'summary.json'), metrics_lib.to_json_safe(summary), indent=1)
  return summary


def _final_train_loss(run: Run, last_losses: list) -> float:
  """The mean over replicas and the last log interval's steps of the training loss."""
  if last_losses:
    return float(np.mean(last_losses))
  # Nothing trained in this call (the workdir's run was already complete): the last recorded steps.
  run.writer.flush()
  recorded = metrics_lib.read_metrics(run.writer.path).get('train', []) if run.lead else []
  return float(np.mean([rec['loss'] for rec in recorded[-run.settings.loop.log_every :]])) if recorded else math.nan


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
