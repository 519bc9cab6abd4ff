"""The paper's Table 1 ablation on the KJV byte-level LM, with an LR sweep and mechanism runs.

    python -m research.archive.table1                 # the full experiment: 46 runs (about an hour on 2 cores)
    python -m research.archive.table1 --quick         # a smoke run of every stage on a tiny model
    python -m research.archive.table1 --report-only   # redraw results/table1.{md,json} and its figures from the records

Stages:

1. **LR sweep.** Plain data parallel (no spread, no averaging, no controller) over a log grid of
   peak LRs, several seeds each. ``baseline_high`` is the lowest grid LR above the best one that
   is *bad*: some seed crashed, or the mean validation bits/byte is more than ``DEGRADE_BPB``
   above the best LR's. ``baseline_low`` is ``baseline_high / 9`` (two grid points lower).
2. **Warm checkpoint.** One Baseline-Low run (its own seed) whose averaged final model is the
   warm rows' starting point (eq. 10 noise is added per replica and seed).
3. **The paper's rows** at ``baseline_high``'s peak LR: Warm-Init, HDET w/o auto-LR, HDET w/o warm
   init, HDET (full); Baseline-Low and Baseline-High are the sweep's runs at those LRs.
4. **Mechanism runs** at the same LR: averaging without spread, spread without averaging, spread
   and averaging without the controller (cold), and a control: Baseline-Low from the warm checkpoint.

Every run is the trainer's own ``train_and_evaluate`` on ``research/configs/<row>.py`` with the experiment's
steps, peak LR and seed; warm rows set ``init_from`` to the pre-training run's workdir. A finished
run is one JSON record under ``results/table1/runs/`` (per-step losses and hyperparameters, the
final validation loss, and each replica's distance from the replicas' mean just before every sync,
or every ``LOG`` steps for runs that never average: the trainer's ``distance`` records), committed
with the project, so a rerun skips finished runs and only redraws the report, and ``--report-only``
redraws ``results/table1.md``, ``table1.json`` and the figures byte for byte from the records alone
(``--out DIR`` writes them into DIR instead). A warm row's record names its warm start ``pretrain``
(the run whose checkpoint it read), not the workdir's path on the machine that trained it. The
pre-training run's workdir (``workdirs/table1/pretrain``) is kept for its checkpoint, and retrained
only when a warm run is to train and the checkpoint is gone. The report goes to ``results/table1.md``,
``results/table1.json`` and ``results/figures/``; ``--quick`` keeps runs, records and report in
``workdirs/table1_quick``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np

from research import records
from research.archive import table1_report

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ---- The experiment's settings (the full run). ----
STEPS = 500  # Optimizer steps of every run (warm rows: after the pre-training run).
WARMUP = 250  # The auto-LR controller starts at the first sync at or after this step (half, as default.py).
GRID = tuple(1e-3 * 3.0**k for k in range(7))  # Peak LRs of the plain-DP sweep: 1e-3 ... 0.729, ratio 3.
SEEDS = (0, 1, 2)  # Seeds of every row and sweep point.
PRETRAIN_SEED = 100  # Seed of the Baseline-Low run that makes the warm checkpoint.
DEGRADE_BPB = 0.05  # "Clearly degrades": mean val bits/byte this much above the sweep's best LR.
BLOWUP_NATS = 0.5  # A crash: non-finite loss, or a final loss this far above the run's best (25-step means).
LOG = 25  # Steps per logged mean (the trainer's log_every) and the distance cadence of non-syncing runs.
LR_DIGITS = 3  # Significant digits of a peak LR in run names.

QUICK = dict(
  steps=40,
  warmup=20,
  grid=(3e-3, 3e-1),
  seeds=(0,),
  sync_every=10,
  model=dict(d_model=32, num_layers=1, num_heads=2, mlp_ratio=2),
  seq_len=32,
  batch_size=4,
  eval_windows=64,
  compilation_cache='',
)
# The trainer's fields that only steer a run: metrics every LOG steps, one evaluation and one checkpoint at the end.
RUN = {
  'log_every': LOG,
  'eval_every': 0,
  'checkpoint_every': 0,
  'max_checkpoints': 1,
  'progress_bar': False,
  'plots': False,
  'tensorboard': False,
}
WARM_ROWS = ('warm_init', 'hdet_no_auto_lr', 'hdet_full')
# A warm row's record names its warm start by the run whose checkpoint it read, not by that workdir's path on the
# machine that trained it (the run key leaves init_from out: see run_key).
WARM_START = 'pretrain'
MECHANISM = {  # name: (the row config it changes, the changes, warm start)
  'avg_no_spread': ('baseline_high', {'hdet.sync_every': 25}, False),
  'spread_no_avg': (
    'hdet_cold',
    {'hdet.spread': 0.25, 'hdet.sync_every': 0, 'hdet.num_syncs': 0, 'hdet.auto_lr': False},
    False,
  ),
  'hdet_cold_no_auto_lr': ('hdet_cold', {'hdet.auto_lr': False}, False),
  'baseline_low_warm': ('baseline_low', {}, True),
}


# ---------------------------------------------------------------------------------------------
# Configs and records
# ---------------------------------------------------------------------------------------------


def load_row_config(name: str):
  """A row's config as its records hold it (the trainer's tuning fields in it: records.load_config)."""
  from hdet_jax.trainer import config_lib, run_settings

  where = ('configs',) if name == 'default' else ('research', 'configs')  # (the product's default, or a row's)
  return run_settings.recorded_config(config_lib.load_config_file(os.path.join(REPO, *where, name + '.py')))


def experiment_config(base: str, settings: dict, *, lr: float, seed: int, init_from: str | None = None, **changes):
  """``research/configs/<base>.py`` with the experiment's steps, peak LR, seed and warm start (and ``changes``)."""
  from hdet_jax.trainer import config_lib

  c = load_row_config(base)
  config_lib.with_overrides(
    c,
    {
      'num_train_steps': settings['steps'],
      'hdet.warmup_steps': settings['warmup'],
      'optim.max_lr': float(lr),
      'seed': int(seed),
      'init_from': init_from,
      **RUN,
    },
  )
  c.eval_windows = settings.get('eval_windows', c.eval_windows)
  c.compilation_cache = settings.get('compilation_cache', c.compilation_cache)
  if settings.get('model'):
    config_lib.with_overrides(c, {f'model.{k}': v for k, v in settings['model'].items()})
    c.data.seq_len = settings['seq_len']
    c.data.batch_size = settings['batch_size']
  if settings.get('sync_every') and c.hdet.sync_every > 0:
    c.hdet.sync_every = settings['sync_every']
  return config_lib.with_overrides(c, changes)


def run_key(config) -> dict:
  """The fields a cached record must match: the training fields, less the warm start's (machine's) path."""
  from hdet_jax.trainer import config_lib, run_settings, schema

  flat = run_settings.resolved(config_lib.flatten(json.loads(config.to_json())))
  return {k: v for k, v in flat.items() if schema.defines_a_run(k) and k != 'init_from'}


def portable_config(config: dict) -> dict:
  """A run's config (as JSON) with its warm start named :data:`WARM_START` instead of a workdir's path."""
  return {**config, 'init_from': WARM_START if config.get('init_from') else None}


def make_record(name: str, config, summary: dict, workdir: str, wall_s: float) -> dict:
  """The run's record from the trainer's summary and metrics: what the report and the LR choice read."""
  from hdet_jax.trainer import metrics as metrics_lib
  from hdet_jax.trainer.tasks import lm_model as model_lib

  m = metrics_lib.read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  loss = [np.asarray(r['loss'], np.float32) for r in m['train']]  # [N] each, as the trainer computed them
  values = [np.asarray(r['values']) for r in m['train']]  # [G, N] each
  diverged = [r['step'] for r, x in zip(m['train'], loss) if not np.isfinite(x).any()]
  val_loss = float(summary['final_val_loss'])
  rec = {
    'name': name,
    'config': portable_config(json.loads(config.to_json())),
    'hyperparam_names': next((r['names'] for r in m.get('hyperparams', [])), []),
    'steps_run': summary['step'],
    'diverged_at': diverged[0] if diverged else None,
    'loss_mean': [float(np.mean(x)) for x in loss],
    'loss_min': [float(np.min(x)) for x in loss],
    'loss_max': [float(np.max(x)) for x in loss],
    'bases': [[float(b) for b in r['bases']] for r in m['train']],
    'values_min': [[float(x) for x in v.min(1)] for v in values],
    'values_max': [[float(x) for x in v.max(1)] for v in values],
    'dists': [[d['step'], [float(x) for x in d['distance']], float(d['mean_norm'])] for d in m.get('distance', [])],
    'val_loss': val_loss,
    'val_bpb': model_lib.bits_per_byte(val_loss) if math.isfinite(val_loss) else None,
    'setup_s': summary['setup_s'],
    'wall_s': wall_s,
  }
  rec.update(summarize(rec))
  return rec


def describe(rec: dict) -> str:
  """A finished run in one line."""
  vb = rec['val_bpb']
  return (
    f'train {rec["final_train_loss"]} nats, val {"nan" if vb is None else f"{vb:.4f}"} bits/byte, '
    f'{"CRASHED" if rec["crashed"] else "ok"}, {rec["wall_s"]:.0f}s'
  )


def summarize(r: dict) -> dict:
  """Final train loss (mean of the last LOG steps), crash flags and the loss's largest rise."""
  loss = np.asarray(r['loss_mean'], dtype=np.float64)
  k = len(loss) // LOG
  windows = loss[: k * LOG].reshape(k, LOG).mean(1) if k else loss[None].mean(1)
  final = float(np.mean(loss[-LOG:])) if len(loss) else math.nan
  finite = np.isfinite(windows)
  best = float(np.min(windows[finite])) if finite.any() else math.nan
  rise = 0.0
  if finite.any():
    running = np.minimum.accumulate(np.where(finite, windows, np.inf))
    rise = float(np.max(np.where(finite, windows - running, np.inf)))
  nonfinite = r['diverged_at'] is not None or not np.all(np.isfinite(loss))
  blowup = (not nonfinite) and final > best + BLOWUP_NATS
  return {
    'final_train_loss': final if math.isfinite(final) else None,
    'best_window_loss': best,
    'max_rise': rise if math.isfinite(rise) else None,
    'nonfinite': bool(nonfinite),
    'crashed': bool(nonfinite or blowup),
  }


def choose_lrs(sweep: dict[float, list[dict]]) -> dict:
  """baseline_high: the lowest grid LR above the best whose seeds crashed or clearly degraded."""
  lrs = sorted(sweep)

  def mean_bpb(lr):
    v = [r['val_bpb'] for r in sweep[lr] if r['val_bpb'] is not None and not r['crashed']]
    return float(np.mean(v)) if len(v) == len(sweep[lr]) else math.inf

  bpb = {lr: mean_bpb(lr) for lr in lrs}
  best = min(lrs, key=lambda lr: bpb[lr])
  reasons = {}
  for lr in lrs:
    crashes = sum(r['crashed'] for r in sweep[lr])
    if crashes:
      reasons[lr] = f'{crashes}/{len(sweep[lr])} seeds crashed'
    elif bpb[lr] > bpb[best] + DEGRADE_BPB:
      reasons[lr] = f'mean val {bpb[lr]:.3f} bits/byte, {bpb[lr] - bpb[best]:+.3f} vs the best LR'
  bad = [lr for lr in lrs if lr > best and lr in reasons]
  found = bool(bad)
  high = bad[0] if found else lrs[-1]
  return {'best': best, 'high': high, 'low': high / 9, 'found_edge': found, 'reasons': reasons, 'mean_bpb': bpb}


# ---------------------------------------------------------------------------------------------
# The experiment
# ---------------------------------------------------------------------------------------------


class Experiment:
  """The runs of one invocation: each one's record, cached, or (``report_only``) only read back."""

  def __init__(self, cache: records.RunCache, settings: dict, report_only: bool):
    self.cache, self.settings, self.report_only = cache, settings, report_only
    self.done: dict[str, dict] = {}

  def config(self, base: str, lr: float, seed: int, warm: bool = False, **changes):
    init_from = self.cache.workdir(WARM_START) if warm else None
    return experiment_config(base, self.settings, lr=lr, seed=seed, init_from=init_from, **changes)

  def run(self, name: str, config, keep_workdir: bool = False) -> dict:
    if self.report_only:
      rec = self.cache.get(name)
      if rec is None:
        raise SystemExit(f'error: --report-only: no record of run {name!r} in {self.cache.dir}.')
    else:
      key = run_key(config)
      if config.init_from and self.cache.get(name, key) is None:
        self.ensure_warm_checkpoint()
      rec = self.cache.run(name, config, key, keep_workdir=keep_workdir)
    self.done[name] = rec
    return rec

  def warm_checkpoint(self, config) -> None:
    """The pre-training run (its record; its workdir kept for the checkpoint the warm runs read)."""
    self.pretrain_config = config
    self.run(WARM_START, config, keep_workdir=True)

  def ensure_warm_checkpoint(self) -> None:
    """Retrains the pre-training run's final checkpoint where its workdir lost it (a warm run is about to train)."""
    from hdet_jax.trainer import checkpoints, trainer

    workdir = self.cache.workdir(WARM_START)
    if checkpoints.latest_step(workdir) is None:
      print(f'   the warm checkpoint is gone: retraining {workdir}', flush=True)
      product, kwargs = records.trainer_arguments(self.pretrain_config)
      trainer.train_and_evaluate(product, workdir, **kwargs)


def sweep_and_choose(ex: Experiment) -> tuple[dict, dict, dict]:
  """Stage 1: the plain data-parallel sweep, the LRs it picks and the baseline rows at them."""
  s = ex.settings
  tag = lambda lr: records.lr_tag(lr, LR_DIGITS)
  print(
    f'1. LR sweep, plain data parallel: {len(s["grid"])} peak LRs x {len(s["seeds"])} seeds, {s["steps"]} steps.',
    flush=True,
  )
  sweep = {
    lr: [ex.run(f'sweep_lr{tag(lr)}_s{seed}', ex.config('baseline_high', lr, seed)) for seed in s['seeds']]
    for lr in s['grid']
  }
  choice = choose_lrs(sweep)
  high, low = choice['high'], choice['low']
  print(
    f'   best LR {tag(choice["best"])}; baseline_high {tag(high)} '
    f'({choice["reasons"].get(high, "no LR in the grid was bad: the largest")}); baseline_low {tag(low)}.',
    flush=True,
  )
  named = {'baseline_high': sweep[high]}
  if any(math.isclose(low, g, rel_tol=1e-6) for g in sweep):
    named['baseline_low'] = sweep[min(sweep, key=lambda g: abs(g - low))]
  else:
    named['baseline_low'] = [
      ex.run(f'baseline_low_lr{tag(low)}_s{seed}', ex.config('baseline_low', low, seed)) for seed in s['seeds']
    ]
  return sweep, choice, named


def rows_and_mechanism(ex: Experiment, choice: dict, named: dict) -> None:
  """Stages 2-4: the warm checkpoint, the paper's rows and the mechanism runs (into ``named``)."""
  s, high, low = ex.settings, choice['high'], choice['low']
  print('2. Warm checkpoint: Baseline-Low, seed', PRETRAIN_SEED, flush=True)
  ex.warm_checkpoint(ex.config('baseline_low', low, PRETRAIN_SEED))
  print(f"3. The paper's rows at peak LR {records.lr_tag(high, LR_DIGITS)}.", flush=True)
  for row in ('warm_init', 'hdet_no_auto_lr', 'hdet_cold', 'hdet_full'):
    named[row] = [ex.run(f'{row}_s{seed}', ex.config(row, high, seed, warm=row in WARM_ROWS)) for seed in s['seeds']]
  print('4. Mechanism runs.', flush=True)
  for name, (base, changes, warm) in MECHANISM.items():
    if s.get('sync_every') and changes.get('hdet.sync_every'):
      changes = dict(changes, **{'hdet.sync_every': s['sync_every']})
    lr = low if name == 'baseline_low_warm' else high
    named[name] = [ex.run(f'{name}_s{seed}', ex.config(base, lr, seed, warm=warm, **changes)) for seed in s['seeds']]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--quick', action='store_true', help='a smoke run of every stage on a tiny model')
  parser.add_argument(
    '--workdir',
    default=None,
    help='where runs train (default workdirs/table1; --quick: workdirs/table1_quick, records too)',
  )
  parser.add_argument('--report-only', action='store_true', help='redraw the report from the records, train nothing')
  parser.add_argument(
    '--out', default=None, help="the report's folder (default: results/; --quick: the workdir), figures/ in it"
  )
  args = parser.parse_args(argv)
  work_root = args.workdir or os.path.join(REPO, 'workdirs', 'table1_quick' if args.quick else 'table1')
  records_dir = os.path.join(work_root, 'records') if args.quick else os.path.join(REPO, 'results', 'table1', 'runs')
  out_dir = args.out or (work_root if args.quick else os.path.join(REPO, 'results'))
  kept = os.path.isdir(records_dir) and any(f.endswith('.json') for f in os.listdir(records_dir))
  if args.report_only and not kept:
    shown = records_dir if args.quick else 'results/table1/runs/'
    raise SystemExit(f'error: --report-only: no records in {shown}; python -m research.archive.table1 trains the runs.')

  from absl import logging
  from hdet_jax.trainer import process

  logging.set_verbosity(logging.ERROR)  # orbax warns at every read-only open of the warm checkpoint
  settings = dict(steps=STEPS, warmup=WARMUP, grid=GRID, seeds=SEEDS)
  if args.quick:
    settings.update(QUICK)
  process.setup_jax(experiment_config('default', settings, lr=1.0, seed=0))
  t0 = time.time()
  ex = Experiment(records.RunCache(records_dir, work_root, make_record, describe), settings, args.report_only)
  sweep, choice, named = sweep_and_choose(ex)
  rows_and_mechanism(ex, choice, named)
  print(f'Runs done in {time.time() - t0:.0f}s; writing the report.', flush=True)
  report_settings = dict(
    settings,
    log=LOG,
    pretrain_seed=PRETRAIN_SEED,
    blowup_nats=BLOWUP_NATS,
    degrade_bpb=DEGRADE_BPB,
    lr_digits=LR_DIGITS,
  )
  paths = table1_report.write(out_dir, report_settings, sweep, choice, named, ex.done, quick=args.quick)
  print('\n'.join(f'  {p}' for p in paths))


if __name__ == '__main__':
  main()
