"""An LR bracket: plain runs apart at the full batch, the worse ones stopped early (successive halving).

``python train.py --config configs/bracket.py --workdir W`` trains ``bracket.points`` runs of the config at peak
LRs a factor ``bracket.factor`` apart, centred (geometrically) on ``optim.max_lr``:

    lr_k = max_lr * factor ** (k - (points - 1) / 2),    k = 0 .. points - 1.

Every run has the same seed, so the same initial parameters and the same batches. At each rung ``(fraction, kept)``
of ``bracket.rungs`` the runs still going stop at ``s = floor(fraction * num_train_steps)`` and are ranked by their
mean training loss over the steps ``s - compare_steps .. s - 1`` (mean over replicas; every run saw those batches);
the ``kept`` lowest go on (ties to the lower LR; a run that diverged, or whose loss there is not finite, loses), each
resumed bit for bit from its own checkpoint, and the last rung's one goes on to the end. Its schedule is its own from
step 0, so the bracket's result is that of a plain run at the kept LR. Compute, in runs of the config:

    points * f_1 + kept_1 * (f_2 - f_1) + ... + 1 * (1 - f_last)      (8 points, '0.1:5,0.3:1': 2.5 runs).

Why: one HDET run's comparisons, on the shared gradient, rank points of one line and follow the start, not the
sweep's best; runs apart at the full batch, compared at a fifth to a third of the run, rank whole runs, so the
bracket keeps one near the sweep's best (how often: results/bracket_mode.md, results/wider_rung.md).

Every run is built with ``optim.runtime_lr_scale``: its programs are those of the LR's mantissa, its power of two
applied at run time, so the runs of a bracket whose factor is a power of two (2 by default) share one set of compiled
programs through the persistent compilation cache, with the numbers of runs built apart bit for bit
(``optimizer.lr_unit``; ``results/bracket_compiles.md``).

Each run lives in ``W/bracket/point<k>_lr<lr>/`` (a workdir of its own, resumable); ``W/bracket.json`` records the
LRs, every rung's losses and decisions, the winner and the compute, and is rewritten after each rung. Rerunning
the same command resumes; a rung already decided is not trained again.

With several processes (``jax.distributed``) every process runs this same loop: each run is a multi-process run,
process 0 writes the metrics and ``bracket.json``, and after each run every process reads that run's metrics file
(a barrier first), so all rank the same float64 losses and keep the same runs. The workdir must be one directory
that every process sees, as a multi-process run's checkpoints already need.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

from hdet_jax.trainer import compat
from hdet_jax.trainer import config_lib
from hdet_jax.trainer import mesh as mesh_lib
from hdet_jax.trainer import metrics as metrics_lib
from hdet_jax.trainer import process
from hdet_jax.trainer import run_settings
from hdet_jax.trainer import schema
from hdet_jax.trainer import trainer as trainer_lib
from hdet_jax.trainer.config_lib import ConfigError

STATE_FILE = 'bracket.json'


def point_lrs(max_lr: float, points: int, factor: float) -> list[float]:
  """The bracket's peak LRs, lowest first: ``max_lr * factor ** (k - (points - 1) / 2)``."""
  return [float(max_lr * factor ** (k - (points - 1) / 2)) for k in range(points)]


def compute_runs(points: int, rungs: list[tuple[float, int]], total: int) -> float:
  """The steps the bracket trains, in runs of ``total`` steps (each rung's survivors from the rung before on)."""
  steps = schema.rung_steps(rungs, total) + [total]
  alive = [points] + [k for _, k in rungs]
  return sum(n * (b - a) for n, a, b in zip(alive, [0] + steps[:-1], steps)) / total


def survivors(losses: dict[float, float], kept: int) -> list[float]:
  """The ``kept`` LRs with the lowest loss (NaN counts as inf; ties go to the lower LR), lowest LR first."""
  key = lambda lr: (math.inf if not np.isfinite(losses[lr]) else losses[lr], lr)
  return sorted(sorted(losses, key=key)[:kept])


def window_loss(metrics_path: str, step: int, compare_steps: int, diverged_at: int | None) -> float:
  """A run's mean training loss over the steps ``step - compare_steps .. step - 1`` (inf: it diverged by then, or a
  loss there is not finite); each step's loss is the mean over the replicas, as last logged."""
  if diverged_at is not None and diverged_at < step:
    return math.inf
  logged = {r['step']: float(np.mean(r['loss'])) for r in metrics_lib.read_metrics(metrics_path).get('train', [])}
  steps = range(max(0, step - compare_steps), step)
  if any(s not in logged for s in steps):
    raise RuntimeError(f'{metrics_path} lacks the training loss of steps before {step}: the run did not reach them.')
  window = [logged[s] for s in steps]
  return float(np.mean(window)) if all(np.isfinite(window)) else math.inf


def _fields(run: run_settings.RunSettings) -> dict:
  """What defines the bracket: its runs' training fields (at the centre LR) and the bracket's own."""
  return {
    'training': run.training_fields(run.mesh.num_replicas),
    'bracket': {k[len('bracket.') :]: v for k, v in sorted(run.given.items()) if k.startswith('bracket.')},
  }


def point_config(config: Any, lr: float, stop_at_step: int) -> Any:
  """The config of the bracket's run at peak LR ``lr``, stopped at ``stop_at_step`` (0: trained to the end); its
  tuning is :func:`point_tuning`'s."""
  # (plots only for the run that ends: a rung's stop would draw every run's; the LR's power of two applied at run
  # time, so that points a power of two apart share their compiled programs: optimizer.lr_unit)
  return config_lib.with_overrides(
    config.copy_and_resolve_references(),
    {'optim.max_lr': lr, 'bracket.points': 0, 'plots': bool(config.plots and stop_at_step == 0)},
  )


def point_tuning(tuning: dict | None, stop_at_step: int) -> dict:
  """The tuning of the bracket's run stopped at ``stop_at_step``: the bracket's, the run stopped there, and the LR's
  power of two applied at run time."""
  return {**(tuning or {}), 'stop_at_step': stop_at_step, 'optim.runtime_lr_scale': True}


def _point_dir(workdir: str, k: int, lr: float) -> str:
  return os.path.join(workdir, 'bracket', f'point{k}_lr{lr:.6g}')


def _load_state(workdir: str, fields: dict) -> dict | None:
  """The bracket recorded in ``workdir`` (None: none); raises if the workdir holds anything else."""
  path = os.path.join(workdir, STATE_FILE)
  if os.path.exists(path):
    with open(path, encoding='utf-8') as f:
      state = json.load(f)
    state['fields']['training'] = schema.run_identity(state['fields']['training'])  # (see trainer._check_workdir)
    if state['fields']['bracket'].pop('anneal', 0.0):  # (0: as a bracket of 1.0 reads)
      raise ConfigError(
        f'workdir {workdir} holds an LR bracket with bracket.anneal: '
        f'{compat.removed_message("bracket.anneal")} Pass a new --workdir (nothing in this one '
        'was changed).'
      )
    if state['fields'] != fields:
      diff = schema.differences(config_lib.flatten(state['fields']), config_lib.flatten(fields))
      raise ConfigError(
        f'workdir {workdir} holds an LR bracket of a different config ({diff}); rerun with the same '
        'config to resume it, or pass a new --workdir.'
      )
    return state
  for name in ('checkpoints', 'metrics.jsonl', 'summary.json', 'bracket'):
    if os.path.exists(os.path.join(workdir, name)):
      raise ConfigError(
        f"workdir {workdir} holds {name!r} but no {STATE_FILE}: it is not an LR bracket's (a single "
        "run's, or another tool's). Pass a new --workdir; nothing in this one was changed."
      )
  return None


def run_bracket(config: Any, workdir: str, *, tuning: dict | None = None) -> dict:
  """Trains the LR bracket of ``config`` (``bracket.points > 0``) in ``workdir``; returns the kept run's summary with
  a ``'bracket'`` entry (the record written to ``workdir/bracket.json``). Resumes a bracket already there.
  ``tuning``: as ``train_and_evaluate``'s, for every run (``'bracket.compare_steps'``: the rungs' window)."""
  trainer_lib.check_output_paths(config, workdir)
  run = run_settings.resolve(config, tuning=tuning)
  if run.bracket.points == 0:
    raise ConfigError('run_bracket needs bracket.points > 0 (e.g. --config.bracket.points=8); 0 trains one run.')
  workdir = os.path.abspath(os.path.expanduser(workdir))
  b, total = run.bracket, run.loop.num_train_steps
  rungs = list(b.rungs)
  steps = schema.rung_steps(rungs, total)
  fields = _fields(run)
  state = _load_state(workdir, fields)
  mesh_lib.barrier('hdet_bracket_loaded')  # every process has read the workdir before process 0 writes to it
  if state is None:  # a new bracket: its record first, so that a bracket stopped before its first rung resumes
    state = {
      'fields': fields,
      'lrs': point_lrs(b.max_lr, b.points, b.factor),
      'compute_runs': compute_runs(b.points, rungs, total),
      'rungs': [],
      'winner': None,
    }
    lr0 = state['lrs'][0]  # every check a run makes (its data, devices, workdir) before anything is written
    trainer_lib.check(
      point_config(config, lr0, steps[0]), _point_dir(workdir, 0, lr0), tuning=point_tuning(tuning, steps[0])
    )
    _write_state(workdir, state)
  dirs = {lr: _point_dir(workdir, k, lr) for k, lr in enumerate(state['lrs'])}
  alive = state['rungs'][-1]['kept'] if state['rungs'] else list(state['lrs'])  # (a resumed bracket's last picks)
  for (fraction, kept), step in list(zip(rungs, steps))[len(state['rungs']) :]:
    losses = {}
    for lr in alive:
      summary = trainer_lib.train_and_evaluate(
        point_config(config, lr, step), dirs[lr], tuning=point_tuning(tuning, step)
      )
      if summary['preempted']:
        return {**summary, 'bracket': state}
      mesh_lib.barrier(f'hdet_bracket_{step}_{lr:.6g}')  # process 0 has written the run's metrics
      losses[lr] = window_loss(summary['metrics'], step, b.compare_steps, summary['diverged_at'])
    if not any(np.isfinite(list(losses.values()))):
      raise RuntimeError(f'every run of the LR bracket diverged by step {step} (LRs {alive}); lower optim.max_lr.')
    alive = survivors(losses, kept)
    state['rungs'].append(
      {'fraction': fraction, 'step': step, 'losses': {f'{lr:.6g}': v for lr, v in losses.items()}, 'kept': alive}
    )
    _write_state(workdir, state)
  (lr,) = alive
  summary = trainer_lib.train_and_evaluate(point_config(config, lr, 0), dirs[lr], tuning=point_tuning(tuning, 0))
  if not summary['preempted']:
    state['winner'] = {
      'lr': lr,
      'workdir': dirs[lr],
      'final_metric': summary['final_metric'],
      'diverged_at': summary['diverged_at'],
    }
    _write_state(workdir, state)
  return {**summary, 'bracket': state}


def _write_state(workdir: str, state: dict) -> None:
  """Process 0 writes the record (every process holds the same); the others go on at once."""
  import jax

  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    process.write_json_atomic(os.path.join(workdir, STATE_FILE), metrics_lib.to_json_safe(state), indent=1)


def format_bracket(state: dict) -> str:
  """The bracket's rungs and winner as a few human lines."""
  lrs = ', '.join(f'{lr:.4g}' for lr in state['lrs'])
  lines = [f'LR bracket over {len(state["lrs"])} peak LRs ({lrs}); compute {state["compute_runs"]:.2f} runs.']
  for r in state['rungs']:
    ranked = ', '.join(f'{lr} {v:.4f}' for lr, v in sorted(r['losses'].items(), key=lambda kv: float(kv[0])))
    lines.append(
      f'  step {r["step"]} ({r["fraction"]:g} of the run): training loss {ranked}; kept '
      f'{", ".join(f"{lr:.4g}" for lr in r["kept"])}'
    )
  if state.get('winner'):
    w = state['winner']
    lines.append(f'  kept run: peak LR {w["lr"]:.4g}, final metric {w["final_metric"]:.4f} ({w["workdir"]})')
  return '\n'.join(lines)
