"""What sets the 'fit' climb's end point, and what sets the ensemble's price: both read from cached records.

    python -m research.archive.climb_and_price            # results/climb_and_price.{md,json} from the committed records
    python -m research.archive.climb_and_price --report-only   # the same (nothing here trains)
    python -m research.archive.climb_and_price --quick    # the same over research.workloads --quick's records

Nothing trains here: the records are those of ``research.workloads`` (and ``research.autolr`` for the LM).

1. **The climb's end point.** At each sync the 'fit' controller asks for a step: up where the compared losses
   fall with the LR offset, down where they rise. With the default's rise-only rule the climb ends where the
   asks turn down. Per workload, run length and sync step, over every HDET record that compared the replicas
   on a common batch after T=100-step windows (all starts, seeds and variants: the asks depend on where a
   run is, not on how it got there), the LR that best splits the syncs asking up from those asking down,
   as a multiple of the sweep's best schedule at that step (``autolr_report.ask_thresholds``). A split below
   1 is a line search that turns short of the sweep's best LR: short-horizon bias, measured.
2. **The ensemble's price.** HDET without its controller (the ``ensemble_a<spread>_T<T>`` variants: the
   spread and the average only) at the sweep's best LR, against plain data parallel at that LR on the same
   seeds (same initialisation and data order: paired), with the replicas' distance from their mean at the
   syncs (RMS over replicas, relative to the mean's norm). The spread-0 variant (``ensemble_a0_T100``) is the
   control: its replicas differ by rounding only, so its "price" is the noise one ulp sets off, and each price is
   also given less the control's on the same seeds.
3. **Where the default's runs land.** Each of the default variant's runs by where its climb went: the peak base LR
   as a multiple of the sweep's best LR, and whether the guard fired (it fires on a blow-up, so a run it fired
   on climbed past the stability edge); per class, the runs' misses against the sweep's best.
4. **The sweep's best on seeds it never saw.** The sweep's best LR and its neighbours rerun on seeds outside
   ``autolr.SEEDS`` (``research.workloads --stage grid --seeds 3,4,5,6,7``): how far the reference itself moves
   (a 3-seed minimum is biased and noisy), and the default's runs on those seeds against that rerun.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys

import numpy as np

from research import autolr
from research import autolr_report
from research import records
from research import workloads
from hdet_jax.sync import CONFIDENT_STDERRS

ENSEMBLE = re.compile(r'hdet_(ensemble_a([0-9p]+)_T(\d+))_best_s(\d+)\.json$')
# A run's peak base LR over the sweep's best LR: the classes of the landing table (the guard's first).
BANDS = (('below 0.5x', 0.0, 0.5), ('0.5-2x', 0.5, 2.0), ('above 2x', 2.0, math.inf))


def _load(paths) -> list[dict]:
  out = []
  for p in sorted(paths):
    with open(p, encoding='utf-8') as f:
      out.append(json.load(f))
  return out


def _hdet_paths(folder: str, optim: str, pattern: re.Pattern) -> list[str]:
  """The HDET records of ``folder/optim`` whose file name ``pattern`` matches, sorted."""
  return sorted(p for p in glob.glob(os.path.join(folder, optim, 'hdet_*.json')) if pattern.search(p))


def _grid(folder: str, optim: str, seeds=autolr.SEEDS) -> dict[float, list[dict]]:
  """The sweep's records by peak LR: the seeds the sweep's best is taken over (``autolr.SEEDS``, as in
  ``results/workloads.md``), or every seed with ``seeds=None``."""
  grid = {}
  for r in _load(glob.glob(os.path.join(folder, optim, 'grid_*.json'))):
    if seeds is None or int(r['config']['seed']) in seeds:
      grid.setdefault(float(r['config']['optim']['max_lr']), []).append(r)
  return grid


def climb_end(folder: str, optim: str, min_runs: int) -> dict | None:
  """Where the line search turns, per sync step, as multiples of the sweep's best schedule; and the geometric
  mean of the split over the syncs from a fifth of the run on (the climb's part after the first syncs)."""
  grid = _grid(folder, optim)
  if not grid:
    return None
  lr, value = autolr_report.grid_best(grid)
  schedule = autolr_report._best_schedule(grid, {'lr': lr})  # pylint: disable=protected-access
  hdet = autolr_report.distinct_runs(
    [
      r
      for r in _load(glob.glob(os.path.join(folder, optim, 'hdet_*.json')))
      if r['config']['hdet'].get('auto_lr')
      and r['config']['hdet'].get('controller') == 'fit'
      and autolr_report.compares_after(r, 100)
    ]
  )
  splits = autolr_report.ask_thresholds(hdet, lambda step: schedule[step], window=100, min_runs=min_runs)
  steps = len(schedule)
  later = [math.sqrt(s['low'] * s['high']) for s in splits if s['step'] >= steps // 5 and s['low'] and s['high']]
  return {
    'sweep_best_lr': lr,
    'sweep_best': value,
    'runs': len(hdet),
    'splits': splits,
    'typical_split': float(np.exp(np.mean(np.log(later)))) if later else None,
  }


def price(folder: str, optim: str) -> dict:
  """Per ensemble variant: the paired difference to plain at the same LR and seed, in percent, and the
  replicas' relative distance at the syncs."""
  grid = _grid(folder, optim, seeds=None)  # paired by seed: any seed with a plain run at the LR
  out = {}
  for path in sorted(glob.glob(os.path.join(folder, optim, 'hdet_ensemble_*_best_s*.json'))):
    m = ENSEMBLE.search(path)
    rec = _load([path])[0]
    lr, seed = float(rec['config']['optim']['max_lr']), int(m.group(4))
    plain = next((g for g in grid.get(lr, []) if int(g['config']['seed']) == seed), None)
    if plain is None or rec['val_bpb'] is None or plain['val_bpb'] is None:
      continue
    v = out.setdefault(
      m.group(1),
      {
        'spread': float(m.group(2).replace('p', '.')),
        'T': int(m.group(3)),
        'lr': lr,
        'pct': [],
        'seeds': [],
        'distance_last': [],
        'distance_mean': [],
      },
    )
    v['pct'].append(100.0 * (rec['val_bpb'] / plain['val_bpb'] - 1.0))
    v['seeds'].append(seed)
    d = [x['relative'] for x in rec.get('distance', []) if x['relative'] is not None]
    if d:
      v['distance_last'].append(d[-1])
      v['distance_mean'].append(float(np.mean(d)))
  for v in out.values():
    pct = np.asarray(v['pct'])
    v['mean_pct'] = float(pct.mean())
    v['se_pct'] = float(pct.std(ddof=1) / math.sqrt(len(pct))) if len(pct) > 1 else None
    for k in ('distance_last', 'distance_mean'):
      v[k] = float(np.mean(v[k])) if v[k] else None
  return out


def fresh_seeds(folder: str, optim: str, variant: str = autolr.DEFAULT_VARIANT) -> dict | None:
  """The sweep's best LR (chosen on ``autolr.SEEDS``, the mean over them: the figure HDET is measured against)
  rerun on seeds the choice never saw, with its neighbours a factor 2 either side: per LR the mean over those
  seeds, and the sweep's best against it in percent. A positive difference is the reference's luck (the
  minimum of noisy means is biased low): the miss a rerun of the sweep's own best would show. And the variant's
  runs per start: those on the sweep's seeds against the sweep's best (``results/workloads.md``'s figure), and
  those on the rerun's seeds against the rerun (neither chosen on the seeds it is measured on)."""
  chosen = _grid(folder, optim)
  every = _grid(folder, optim, seeds=None)
  if not chosen:
    return None
  lr, value = autolr_report.grid_best(chosen)
  out = {}
  for x in (lr / 2, lr, lr * 2):
    fresh = [r for r in every.get(x, []) if int(r['config']['seed']) not in autolr.SEEDS]
    if fresh:
      out[f'{x:g}'] = {
        'n': len(fresh),
        'mean': autolr_report.mean_bpb(fresh),
        'seeds': sorted(int(r['config']['seed']) for r in fresh),
      }
  if f'{lr:g}' not in out:
    return None
  same = out[f'{lr:g}']
  hdet = {}
  for start in autolr.STARTS:  # the variant's runs on the sweep's seeds and on the rerun's
    pattern = re.compile(rf'hdet_{re.escape(variant)}_{start}_s\d+\.json$')
    runs = _load(_hdet_paths(folder, optim, pattern))
    own = [r for r in runs if int(r['config']['seed']) in autolr.SEEDS]
    new = [r for r in runs if int(r['config']['seed']) in same['seeds']]
    if own or new:
      hdet[start] = {
        'n': len(own),
        'vs_sweep_pct': 100.0 * (autolr_report.mean_bpb(own) / value - 1.0) if own else None,
        'n_fresh': len(new),
        'vs_rerun_pct': 100.0 * (autolr_report.mean_bpb(new) / same['mean'] - 1.0) if new else None,
      }
  return {
    'sweep_best_lr': lr,
    'sweep_best': value,
    'n_sweep': len(chosen[lr]),
    'fresh': out,
    'rerun_pct': 100.0 * (same['mean'] / value - 1.0),
    'fresh_best_lr': float(min(out, key=lambda k: out[k]['mean'])),
    'hdet': hdet,
  }


def above_control(v: dict, control: dict) -> list[float]:
  """Per seed that both ran: a price less the control's on that seed (paired: the control's noise on a seed is
  the same draw the price's plain run made)."""
  ctl = dict(zip(control['seeds'], control['pct']))
  return [p - ctl[s] for s, p in zip(v['seeds'], v['pct']) if s in ctl]


def _fmt_mean_se(diffs: list[float]) -> str:
  if not diffs:
    return '-'
  se = f' ± {np.std(diffs, ddof=1) / math.sqrt(len(diffs)):.2f}' if len(diffs) > 1 else ''
  return f'{np.mean(diffs):+.2f}%{se} (n={len(diffs)})'


def landings(folder: str, optim: str, variant: str = autolr.DEFAULT_VARIANT) -> dict | None:
  """The variant's runs (every start and seed) by where the climb went: 'guard fired' (a blow-up: the climb went
  past the stability edge), else by the peak base LR over the sweep's best LR (:data:`BANDS`). Per class the
  number of runs and their misses against the sweep's best (percent; a diverged run counts as +inf)."""
  grid = _grid(folder, optim)
  pattern = re.compile(rf'hdet_{re.escape(variant)}_(low|best|high)_s\d+\.json$')
  runs = [
    r for r in _load(_hdet_paths(folder, optim, pattern)) if int(r['config']['seed']) in autolr.SEEDS
  ]  # the seeds of the sweep's best (fresh ones: fresh_seeds)
  if not grid or not runs:
    return None
  lr, value = autolr_report.grid_best(grid)
  out = {name: [] for name in ('guard fired',) + tuple(b[0] for b in BANDS)}
  for r in runs:
    miss = math.inf if r['val_bpb'] is None else 100.0 * (r['val_bpb'] / value - 1.0)
    peak = max(t['bases'][0] for t in r['trajectory']) / lr
    fired = any(c.get('backed_off') for c in r.get('controller', []))
    name = 'guard fired' if fired else next(b[0] for b in BANDS if b[1] <= peak < b[2])
    out[name].append(miss)
  return {
    'sweep_best_lr': lr,
    'runs': len(runs),
    'classes': {
      k: {
        'n': len(v),
        'misses': sorted(v),
        'median_pct': float(np.median(v)) if v else None,
        'within_1pct': sum(m <= 1.0 for m in v),
      }
      for k, v in out.items()
    },
  }


# The default and the same controller with other windows (research.autolr: a fixed T, or 30 syncs of at most 50).
WINDOW_VARIANTS = re.compile(
  r'hdet_(' + re.escape(autolr.DEFAULT_VARIANT) + r'(?:_anneal\d+)?(?:_T\d+)?|'
  r'fit_K30_cap50_rollback_se2_f5_settle)'
  r'_(low|best|high)_s\d+\.json$'
)


def climb_turn(record: dict) -> dict | None:
  """Where one run's climb turned: T (the first window's length), the first sync whose line search asked for a
  smaller LR (its 1-based index, step and base LR), the sync that settled it, and the run's peak base LR; None
  for a run without the 'fit' controller's asks."""
  ctl = record.get('controller', [])
  if not ctl or 'asks' not in ctl[0]:
    return None
  turn = next((c for c in ctl if c['asks'][0] < 0), None)
  settle = next((c for c in ctl if c.get('settled') and c['settled'][0]), None)
  return {
    'T': ctl[0]['step'] + 1,
    'turn_sync': None if turn is None else ctl.index(turn) + 1,
    'turn_step': None if turn is None else turn['step'] + 1,
    'turn_lr': None if turn is None else float(turn['base_lr']),
    'settle_step': None if settle is None else settle['step'] + 1,
    'peak_lr': max(t['bases'][0] for t in record['trajectory']),
  }


def window_turns(folder: str, optim: str) -> dict | None:
  """Per scoring (``anneal``: the runs' ``hdet.score_anneal``, 0 for the last iterates), window length T and
  start, over the default's and its window and anneal variants' runs (:data:`WINDOW_VARIANTS`, each run once) on
  the sweep's seeds: the runs' sync of the turn (its range), the geometric means of the turn's and the peak's base
  LR over the sweep's best LR, and the mean miss against the sweep's best (percent; a diverged run +inf)."""
  grid = _grid(folder, optim)
  paths = _hdet_paths(folder, optim, WINDOW_VARIANTS)
  runs = autolr_report.distinct_runs(
    [
      {**r, 'start': WINDOW_VARIANTS.search(p).group(2)}
      for p, r in zip(paths, _load(paths))
      if int(r['config']['seed']) in autolr.SEEDS
    ]
  )
  if not grid or not runs:
    return None
  lr, value = autolr_report.grid_best(grid)
  cells = {}
  for r in runs:
    t = climb_turn(r)
    if t is None:
      continue
    miss = math.inf if r['val_bpb'] is None else 100.0 * (r['val_bpb'] / value - 1.0)
    anneal = float(r['config']['hdet'].get('score_anneal', 0.0))
    cells.setdefault((anneal, t['T'], r['start']), []).append({**t, 'miss_pct': miss})
  gm = lambda xs: float(np.exp(np.mean(np.log(xs)))) if xs else None
  out = []
  for (anneal, T, start), v in sorted(
    cells.items(), key=lambda kv: (kv[0][0], kv[0][1], list(autolr.STARTS).index(kv[0][2]))
  ):
    syncs = [c['turn_sync'] for c in v if c['turn_sync'] is not None]
    out.append(
      {
        'anneal': anneal,
        'T': T,
        'start': start,
        'n': len(v),
        'turned': len(syncs),
        'turn_sync': [min(syncs), max(syncs)] if syncs else None,
        'turn_lr_x': gm([c['turn_lr'] / lr for c in v if c['turn_lr']]),
        'peak_lr_x': gm([c['peak_lr'] / lr for c in v]),
        'miss_pct': float(np.mean([c['miss_pct'] for c in v])),
      }
    )
  return {'sweep_best_lr': lr, 'cells': out}


# The open-loop probe (research.autolr's open_T25 ... open_T200 and open_K15): the line search fits and records
# its slope at every sync but moves nothing, so every window length sees the same schedule.
OPEN_LOOP = re.compile(r'hdet_open_(T\d+|K15)_(low|best|high)_s\d+\.json$')


def open_turn(record: dict) -> dict | None:
  """Where one open-loop run's line search turned: the first of two syncs in a row whose slope asks confidently
  for a smaller LR (beyond :data:`hdet_jax.sync.CONFIDENT_STDERRS` standard errors, the settling rule's test), the
  step of the sync before it (the last that did not; 0 if none), and the base LR at both; None without a turn."""
  ctl = record.get('controller', [])
  down = [c['stderrs'][0] > 0 and c['velocities'][0] > CONFIDENT_STDERRS * c['stderrs'][0] for c in ctl]
  i = next((i for i in range(len(ctl) - 1) if down[i] and down[i + 1]), None)
  if i is None:
    return None
  before = ctl[i - 1] if i else None
  return {
    'T': ctl[0]['step'] + 1,
    'down_step': ctl[i]['step'] + 1,
    'down_lr': float(ctl[i]['base_lr']),
    'up_step': 0 if before is None else before['step'] + 1,
    'up_lr': None if before is None else float(before['base_lr']),
  }


def open_turns(folder: str, optim: str) -> dict | None:
  """Per window length T and start, over the open-loop probe's runs (:data:`OPEN_LOOP`): the runs, those whose
  line search turned (:func:`open_turn`), the range of the step of the turn and of its fraction of the run, and the
  geometric mean of the base LR there over the sweep's best LR."""
  grid = _grid(folder, optim)
  paths = _hdet_paths(folder, optim, OPEN_LOOP)
  if not grid or not paths:
    return None
  lr, _ = autolr_report.grid_best(grid)
  cells = {}
  runs = autolr_report.distinct_runs(
    [{**r, 'start': OPEN_LOOP.search(p).group(2)} for p, r in zip(paths, _load(paths))]
  )
  for r in runs:  # each run once: open_K15 at 1500 steps trains open_T100's windows
    t = open_turn(r)
    T = int(r['controller'][0]['step'] + 1) if r.get('controller') else None
    cells.setdefault((T, r['start']), []).append((t, int(r['config']['num_train_steps'])))
  out = []
  for (T, start), v in sorted(cells.items(), key=lambda kv: (kv[0][0], list(autolr.STARTS).index(kv[0][1]))):
    turned = [(t, steps) for t, steps in v if t is not None]
    steps_at = [t['down_step'] for t, _ in turned]
    frac = [t['down_step'] / steps for t, steps in turned]
    out.append(
      {
        'T': T,
        'start': start,
        'n': len(v),
        'turned': len(turned),
        'down_step': [min(steps_at), max(steps_at)] if steps_at else None,
        'down_fraction': [min(frac), max(frac)] if frac else None,
        'down_lr_x': float(np.exp(np.mean([np.log(t['down_lr'] / lr) for t, _ in turned]))) if turned else None,
      }
    )
  return {'sweep_best_lr': lr, 'cells': out}


# The probe's first window stretched to the end of the warmup (research.autolr's open_first30): only the first
# sync is read, the comparison of replicas that have trained apart since step 0.
OPEN_FIRST = re.compile(r'hdet_open_first30_(low|best|high)_s\d+\.json$')


def _first_syncs(folder: str, optim: str, pattern: re.Pattern):
  """(the sweep's records by peak LR, [(the file name's match, the record, its first sync's controller record)]) for
  the runs ``pattern`` names that reached a sync; None without a sweep or such runs."""
  grid = _grid(folder, optim)
  paths = _hdet_paths(folder, optim, pattern)
  if not grid or not paths:
    return None
  return grid, [(pattern.search(p), r, r['controller'][0]) for p, r in zip(paths, _load(paths)) if r.get('controller')]


def first_asks(folder: str, optim: str) -> dict | None:
  """Per start, over the open_first30 runs: the step of the first sync, the line search's fitted step there (its ask,
  a log-LR step; the mean over runs), the LR it asks for (the start's peak LR times e^ask) over the sweep's best LR
  (geometric mean), and the slope over its standard error (mean; negative: it wants a larger LR)."""
  found = _first_syncs(folder, optim, OPEN_FIRST)
  if found is None:
    return None
  grid, runs = found
  lr, _ = autolr_report.grid_best(grid)
  cells = {}
  for m, r, c in runs:
    t = c['velocities'][0] / c['stderrs'][0] if c['stderrs'][0] > 0 else 0.0
    cells.setdefault(m.group(1), []).append((c['step'] + 1, c['asks'][0], float(r['config']['optim']['max_lr']), t))
  out = [
    {
      'start': start,
      'n': len(v),
      'step': v[0][0],
      'ask': float(np.mean([a for _, a, _, _ in v])),
      'asked_lr_x': float(np.exp(np.mean([np.log(m / lr) + a for _, a, m, _ in v]))),
      't': float(np.mean([t for *_, t in v])),
    }
    for start, v in sorted(cells.items(), key=lambda kv: list(autolr.STARTS).index(kv[0]))
  ]
  return {'sweep_best_lr': lr, 'cells': out}


# The same on a fan as wide as the sweep (open_first30_wide: 8 replicas a factor 2 apart around the start).
OPEN_WIDE = re.compile(r'hdet_open_first30_wide(_lowcomm)?_(low|best|high)_s\d+\.json$')


def sweep_at(grid: dict[float, list[dict]], lr: float) -> float | None:
  """The sweep's final metric at peak LR ``lr``: each grid point's mean over its seeds, interpolated linearly in log LR
  between the two points around ``lr`` (inf where either is not finite); None outside the grid."""
  pts = sorted((k, autolr_report.mean_bpb(v)) for k, v in grid.items() if v)
  xs, x = np.log([k for k, _ in pts]), math.log(lr)
  if x < xs[0] - 1e-9 or x > xs[-1] + 1e-9:
    return None
  i = int(np.clip(np.searchsorted(xs, x), 1, len(xs) - 1))
  (x0, y0), (x1, y1) = (xs[i - 1], pts[i - 1][1]), (xs[i], pts[i][1])
  w = float(np.clip((x - x0) / (x1 - x0), 0.0, 1.0))
  if (w < 1 and not math.isfinite(y0)) or (w > 0 and not math.isfinite(y1)):
    return math.inf
  return (1 - w) * y0 + w * y1 if 0 < w < 1 else (y0 if w == 0 else y1)


def _wide_run(c: dict, start_x: float) -> dict:
  """One run's first sync (``c``; ``start_x``: its peak LR over the sweep's best): the best-scoring replica's peak LR
  over the sweep's best and its multiplier (its LR over the fan's geometric centre), how much worse (%) the replica
  nearest the sweep's best scored, and the non-finite scores."""
  values, scores = np.asarray(c['values'][0], float), np.asarray(c['window_losses'], float)
  rho = values / np.exp(np.mean(np.log(values)))
  peak_x = start_x * rho  # each replica's peak LR over the sweep's best
  finite = np.isfinite(scores)
  best = int(np.argmin(np.where(finite, scores, np.inf)))
  near = int(np.argmin(np.abs(np.log(peak_x))))
  return {
    'step': c['step'] + 1,
    'best_x': float(peak_x[best]),
    'rho': float(rho[best]),
    'gap': 100.0 * (scores[near] / scores[best] - 1.0) if finite[near] else math.inf,
    'nonfinite': int(np.sum(~finite)),
  }


def _wide_cell(runs: list[dict]) -> dict:
  """A start's runs (:func:`_wide_run`) summed up: geometric means of the LRs, means of the percentages."""
  geo = lambda xs: float(np.exp(np.mean(np.log(xs))))
  out = {
    'step': runs[0]['step'],
    'best_lr_x': geo([r['best_x'] for r in runs]),
    'best_lr_x_range': [min(r['best_x'] for r in runs), max(r['best_x'] for r in runs)],
    'best_rho': geo([r['rho'] for r in runs]),
    'gap_pct': float(np.mean([r['gap'] for r in runs])),
    'nonfinite': sum(r['nonfinite'] for r in runs),
  }
  if 'scaled' in runs[0]:
    pct = [r['pct'] for r in runs]
    out.update(
      scaled_lr_x=geo([r['scaled'] for r in runs]), sweep_at_scaled_pct=None if None in pct else float(np.mean(pct))
    )
  return out


# The batch rule that carries an LR from batch B/N to B: Adam's square root (Malladi et al., 2022), SGD's linear.
def batch_rule(optim: str, n: int) -> float:
  return float(n) if optim == 'sgd' else math.sqrt(n)


def wide_fan(folder: str, optim: str) -> dict | None:
  """Per gradient (``'shared'``; ``'own'``: the ``_lowcomm`` runs, each replica on its own eighth of the batch) and
  start, over the open_first30_wide runs (the replicas log-spaced over 128x around the start, parted at step 0, first
  compared on a common batch at 0.3 of the run): the best-scoring replica's LR over the
  sweep's best (the start's peak LR times its multiplier: geometric mean over runs, and the range), its multiplier
  (geometric mean), how much worse the replica nearest the sweep's best LR scored than the best one (mean %), and
  how many replicas' scores were not finite (all runs)."""
  found = _first_syncs(folder, optim, OPEN_WIDE)
  if found is None:
    return None
  grid, runs = found
  lr, best_val = autolr_report.grid_best(grid)
  cells = {}
  for m, r, c in runs:
    run = _wide_run(c, float(r['config']['optim']['max_lr']) / lr)
    if m.group(1):  # own gradients: the winner carried to the full batch, and the sweep's final there
      run['scaled'] = run['best_x'] * batch_rule(optim, len(c['values'][0]))
      at = sweep_at(grid, lr * run['scaled'])
      run['pct'] = None if at is None else 100.0 * (at / best_val - 1.0)
    cells.setdefault(('own' if m.group(1) else 'shared', m.group(2)), []).append(run)
  out = [
    {'gradients': grads, 'start': start, 'n': len(v), **_wide_cell(v)}
    for (grads, start), v in sorted(
      cells.items(), key=lambda kv: (kv[0][0] == 'own', list(autolr.STARTS).index(kv[0][1]))
    )
  ]
  return {'sweep_best_lr': lr, 'cells': out}


def sweep_leaders(folder: str, optim: str) -> dict | None:
  """The sweep's own leader over its runs: among the peak LRs trained on every seed of ``autolr.SEEDS``, the one
  with the lowest mean validation metric at each of the runs' evaluation steps (non-finite: last), and the sweep's
  best over those LRs at the end. Where the leader mid-run is not the final best, ranking whole plain runs at that
  point would have picked another LR."""
  full = {
    lr: rs
    for lr, rs in _grid(folder, optim).items()
    if len(rs) == len(autolr.SEEDS) and all(r.get('evals') for r in rs)
  }
  if len(full) < 2:
    return None
  steps = [e['step'] for e in next(iter(full.values()))[0]['evals']]

  def mean_at(rs, i):
    v = [r['evals'][i]['val_bpb'] if i < len(r['evals']) and r['evals'][i]['step'] == steps[i] else None for r in rs]
    return float(np.mean(v)) if all(x is not None and math.isfinite(x) for x in v) else math.inf

  final_lr, _ = autolr_report.grid_best(full)
  return {
    'lrs': sorted(full),
    'final_lr': final_lr,
    'leaders': [{'step': s, 'lr': min(sorted(full), key=lambda lr: mean_at(full[lr], i))} for i, s in enumerate(steps)],
  }


def folders(quick: bool, work_root: str):
  """(workload, steps, records folder) for every workload and run length of research.workloads."""
  for w in workloads.WORKLOADS:
    for steps in workloads.lengths(w, quick):
      folder = workloads.records_dir(w, steps, quick, work_root)
      if os.path.isdir(folder):
        yield w, steps, folder


def measure(quick: bool, work_root: str) -> dict:
  results = {}
  for w, steps, folder in folders(quick, work_root):
    for optim in workloads.WORKLOADS[w][2]:
      parts = {
        'climb': climb_end(folder, optim, min_runs=2 if quick else 6),
        'price': price(folder, optim),
        'landings': landings(folder, optim),
        'fresh': fresh_seeds(folder, optim),
        'turns': window_turns(folder, optim),
        'open': open_turns(folder, optim),
        'leaders': sweep_leaders(folder, optim),
        'first': first_asks(folder, optim),
        'wide': wide_fan(folder, optim),
      }
      if any(parts.values()):
        results.setdefault(w, {}).setdefault(str(steps), {})[optim] = parts
  return results


def _rows(results: dict, key: str, cells: bool = True) -> list[tuple]:
  """(workload, steps, optim, item) for every cell whose ``key`` part was measured: each of its 'cells', or the
  part itself (``cells=False``)."""
  return [
    (w, steps, optim, c)
    for w, by_steps in results.items()
    for steps, by_optim in by_steps.items()
    for optim, r in by_optim.items()
    if r.get(key)
    for c in (r[key]['cells'] if cells else [r[key]])
  ]


def _fmt_split(s: dict) -> str:
  lo, hi = s['low'], s['high']
  where = (
    'no split'
    if lo is None and hi is None
    else f'< {hi:.2g}'
    if lo is None
    else f'> {lo:.2g}'
    if hi is None
    else f'{lo:.2g}-{hi:.2g}'
  )  # no split: every split misplaces as many syncs (the asks carry no order)
  return where + (f' ({s["misplaced"]} of {s["n"]} misplaced)' if s['misplaced'] else f' (n={s["n"]})')


def write_report(out_dir: str, results: dict, quick: bool) -> list[str]:
  lines = [
    "# What sets the climb's end point, and the ensemble's price",
    '',
    f'Generated by `python -m research.climb_and_price{" --quick" if quick else ""}` from the cached records of '
    '`research.workloads`; nothing here trains. The reading is in `research/workloads_discussion.md`.',
    '',
    '## Where the line search turns',
    '',
    "Per sync step: the LR, as a multiple of the sweep's best schedule at that step, that splits the syncs "
    'whose line search asked for a larger LR (below it) from those that asked for a smaller one (above it), '
    'over every T=100 common-batch \'fit\' record of the cell (all starts, seeds and variants). "typical" is '
    'the geometric mean of the split over the syncs from a fifth of the run on. Below 1: the asks turn '
    "short of the sweep's best LR, so a climb that ends where they turn ends short of it.",
    '',
    '| workload | steps | optim | sweep best | runs | split per sync step | typical |',
    '|---|---|---|---|---|---|---|',
  ]
  for w, by_steps in results.items():
    for steps, by_optim in by_steps.items():
      for optim, r in by_optim.items():
        c = r['climb']
        if not c or not c['splits']:
          continue
        per = '; '.join(f'{s["step"] + 1}: {_fmt_split(s)}' for s in c['splits'])
        typical = '-' if c['typical_split'] is None else f'{c["typical_split"]:.2g}x'
        lines.append(f'| {w} | {steps} | {optim} | {c["sweep_best_lr"]:.3g} | {c["runs"]} | {per} | {typical} |')
  lines += [
    '',
    "## The ensemble's price",
    '',
    "HDET without its controller (spread and average only) at the sweep's best LR, against plain data "
    'parallel at that LR on the same seeds (paired: the same initialisation and data order). Distance: the '
    "replicas' RMS distance from their mean just before a sync, relative to the mean's norm (the last "
    'sync, and the mean over syncs). Spread 0 is the control: identical replicas, whose average differs from '
    'each by rounding only, so what it shows is the run-to-run noise a perturbation of one ulp sets off, not '
    'the ensemble; "above spread 0" is the price less that control\'s on the same seeds '
    '(mean ± se of the paired differences).',
    '',
    '| workload | steps | optim | spread | T | price (mean ± se over seeds) | per seed | distance last / mean '
    '| above spread 0 |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  for w, by_steps in results.items():
    for steps, by_optim in by_steps.items():
      for optim, r in by_optim.items():
        floor = next((v for v in r['price'].values() if v['spread'] == 0), None)
        for name, v in sorted(r['price'].items(), key=lambda kv: (kv[1]['T'], kv[1]['spread'])):
          se = '' if v['se_pct'] is None else f' ± {v["se_pct"]:.2f}'
          dist = '-' if v['distance_last'] is None else f'{v["distance_last"]:.3g} / {v["distance_mean"]:.3g}'
          per = ', '.join(f'{p:+.2f}' for p in v['pct'])
          above = '-' if floor is None or v is floor else _fmt_mean_se(above_control(v, floor))
          lines.append(
            f'| {w} | {steps} | {optim} | {v["spread"]:g} | {v["T"]} | {v["mean_pct"]:+.2f}%{se} (n={len(v["pct"])}) '
            f'| {per} | {dist} | {above} |'
          )
  lines += _landing_table(results)
  lines += _fresh_table(results)
  lines += _turns_table(results)
  lines += _open_table(results)
  lines += _leaders_table(results)
  lines += _first_table(results)
  lines += _wide_table(results)
  return records.write_report(out_dir, 'climb_and_price', results, lines)


def _landing_table(results: dict) -> list[str]:
  names = ('guard fired',) + tuple(b[0] for b in BANDS)
  lines = [
    '',
    "## Where the default's runs land",
    '',
    f'Each run of the default variant (`{autolr.DEFAULT_VARIANT}`; every start and seed) by where its climb '
    'went: the guard fired (a blow-up, so the climb went past the stability edge), or else its peak base LR '
    "as a multiple of the sweep's best LR. Per class: runs, the median miss against the sweep's best, and "
    'how many are within 1% of it.',
    '',
    '| workload | steps | optim | runs | ' + ' | '.join(names) + ' |',
    '|---|---|---|---|' + '---|' * len(names),
  ]
  cell = lambda c: '-' if not c['n'] else f'{c["n"]}: {c["median_pct"]:+.1f}%, {c["within_1pct"]} within 1%'
  for w, by_steps in results.items():
    for steps, by_optim in by_steps.items():
      for optim, r in by_optim.items():
        land = r.get('landings')
        if land:
          lines.append(
            f'| {w} | {steps} | {optim} | {land["runs"]} | '
            + ' | '.join(cell(land['classes'][k]) for k in names)
            + ' |'
          )
  return lines


def _fresh_table(results: dict) -> list[str]:
  rows = _rows(results, 'fresh', cells=False)
  if not rows:
    return []
  lines = [
    '',
    "## The sweep's best on seeds it never saw",
    '',
    "The sweep's best LR is chosen, and its value (the figure every miss above and in "
    '`results/workloads.md` is taken against) averaged, over the same seeds ('
    + ', '.join(map(str, autolr.SEEDS))
    + '). The same LR and its neighbours rerun on fresh seeds: their mean, '
    'and the sweep\'s best against it. A rerun of the sweep\'s own best would miss by "rerun", so a miss of '
    "that size is the reference's luck, not the method's.",
    '',
    "| workload | steps | optim | sweep best (n) | fresh seeds: LR: mean (n) | rerun | fresh seeds' best LR "
    "| default from 10x low / best / 10x high: on the sweep's seeds against the sweep | on the fresh seeds "
    'against the rerun |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  for w, steps, optim, f in rows:
    per = '; '.join(
      f'{k}: {v["mean"]:.4g} (n={v["n"]})' for k, v in sorted(f['fresh'].items(), key=lambda kv: float(kv[0]))
    )
    starts = [f['hdet'].get(s, {}) for s in autolr.STARTS]
    pct = lambda h, k, n: '-' if h.get(k) is None else f'{h[k]:+.1f}% (n={h[n]})'
    own = ' / '.join(pct(h, 'vs_sweep_pct', 'n') for h in starts)
    new = ' / '.join(pct(h, 'vs_rerun_pct', 'n_fresh') for h in starts)
    lines.append(
      f'| {w} | {steps} | {optim} | {f["sweep_best"]:.4g} at {f["sweep_best_lr"]:g} (n={f["n_sweep"]}) | '
      f'{per} | {f["rerun_pct"]:+.1f}% | {f["fresh_best_lr"]:g} | {own} | {new} |'
    )
  return lines


def _turns_table(results: dict) -> list[str]:
  rows = _rows(results, 'turns')
  if not rows:
    return []
  lines = [
    '',
    "## The climb's end point against the window length",
    '',
    f'The default (`{autolr.DEFAULT_VARIANT}`) and the same controller with other windows: a fixed T '
    '(`..._T25`, `_T50`, `_T200`) or 30 syncs of at most 50 steps (`fit_K30_cap50_rollback_se2_f5_settle`); '
    'and scoring each replica after an anneal of that fraction of a window (`..._anneal20`, `_anneal20_T50`, '
    '`_anneal20_T200`: `hdet.score_anneal`; "last": the last iterates, the default); '
    'each run once (a variant that trained the same windows trained the same run). Per scoring, T and start, on the '
    "sweep's seeds: the sync at which the line search first asked for a smaller LR (the turn; the range over "
    "runs), the base LR there and the run's peak base LR as multiples of the sweep's best LR (geometric "
    "means), and the mean miss against the sweep's best.",
    '',
    '| workload | steps | optim | scored | T | start | runs | turn at sync | turn LR / best | peak LR / best | miss |',
    '|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  fx = lambda x: '-' if x is None else f'{x:.2g}x'
  for w, steps, optim, c in rows:
    at = (
      '-'
      if c['turn_sync'] is None
      else (
        f'{c["turn_sync"][0]}' if c['turn_sync'][0] == c['turn_sync'][1] else f'{c["turn_sync"][0]}-{c["turn_sync"][1]}'
      )
    )
    turned = '' if c['turned'] == c['n'] else f' ({c["turned"]} turned)'
    scored = f'anneal {c["anneal"]:g}' if c.get('anneal') else 'last'
    lines.append(
      f'| {w} | {steps} | {optim} | {scored} | {c["T"]} | {c["start"]} | {c["n"]}{turned} | {at} | '
      f'{fx(c["turn_lr_x"])} | {fx(c["peak_lr_x"])} | {c["miss_pct"]:+.1f}% |'
    )
  return lines


def _open_table(results: dict) -> list[str]:
  rows = _rows(results, 'open')
  if not rows:
    return []
  lines = [
    '',
    '## The line search in open loop',
    '',
    "The open-loop probe (`research.autolr`'s `open_T25` ... `open_T200`, and `open_K15`: the default's "
    'windows, 15 per run of at most 100 steps): the line search fits and records its slope at every sync but '
    'moves nothing (a trust region of 1e-6, no cautious start, guard or settling, no memory across syncs), so '
    "the run trains the plain schedule at its start's peak LR. Per T and start: the sync step from which the "
    'line search asks for a smaller LR (the first of two syncs in a row beyond 2 standard errors; the range over '
    "runs), that step as a fraction of the run, and the base LR there over the sweep's best LR (geometric mean).",
    '',
    '| workload | steps | optim | T | start | runs | asks down from step | fraction of the run | LR there / best |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  rng = lambda r, f: '-' if r is None else (f.format(r[0]) if r[0] == r[1] else f.format(r[0]) + '-' + f.format(r[1]))
  for w, steps, optim, c in rows:
    turned = '' if c['turned'] == c['n'] else f' ({c["turned"]} turned)'
    lr = '-' if c['down_lr_x'] is None else f'{c["down_lr_x"]:.2g}x'
    lines.append(
      f'| {w} | {steps} | {optim} | {c["T"]} | {c["start"]} | {c["n"]}{turned} | '
      f'{rng(c["down_step"], "{}")} | {rng(c["down_fraction"], "{:.2f}")} | {lr} |'
    )
  return lines


def _leaders_table(results: dict) -> list[str]:
  rows = _rows(results, 'leaders', cells=False)
  if not rows:
    return []
  lines = [
    '',
    "## The sweep's own leader over the run",
    '',
    "Among the sweep's peak LRs trained on all of its seeds, the one with the lowest mean validation metric at "
    "each evaluation step of the plain runs, as a multiple of the sweep's best at the end (1x: the final best "
    'already leads there). A comparison of whole runs at that step would have picked the leader.',
    '',
    "| workload | steps | optim | LRs (all seeds) | sweep's best | leader at each evaluation step |",
    '|---|---|---|---|---|---|',
  ]
  for w, steps, optim, c in rows:
    per = ', '.join(f'{leader["step"]}: {leader["lr"] / c["final_lr"]:g}x' for leader in c['leaders'])
    lines.append(
      f'| {w} | {steps} | {optim} | {len(c["lrs"])} ({c["lrs"][0]:g}-{c["lrs"][-1]:g}) | {c["final_lr"]:g} | {per} |'
    )
  return lines


def _first_table(results: dict) -> list[str]:
  rows = _rows(results, 'first')
  if not rows:
    return []
  lines = [
    '',
    '## The line search over the whole history',
    '',
    "The open-loop probe with its first window stretched to 0.3 of the run (`research.autolr`'s "
    '`open_first30`: the replicas part at step 0 and are first compared at the end of the warmup; trust 5, so '
    'that the fitted step is not clipped short; only that first sync is read). Per start: the fitted step (its '
    "ask, in log LR), the LR it asks for (the start's peak LR times e^ask) over the sweep's best, and the "
    'slope over its standard error (negative: a larger LR wanted). A full trust region (+-5) is a fit without '
    'an interior minimum.',
    '',
    '| workload | steps | optim | start | runs | first sync at step | ask | asked LR / best | slope / se |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  for w, steps, optim, c in rows:
    lines.append(
      f'| {w} | {steps} | {optim} | {c["start"]} | {c["n"]} | {c["step"]} | {c["ask"]:+.2f} | '
      f'{c["asked_lr_x"]:.2g}x | {c["t"]:+.1f} |'
    )
  return lines


def _fmt_scaled(c: dict) -> str:
  if 'scaled_lr_x' not in c:
    return '- | -'
  pct = c['sweep_at_scaled_pct']
  return f'{c["scaled_lr_x"]:.2g}x | ' + ('off the grid' if pct is None else f'{pct:+.1f}%')


def _wide_table(results: dict) -> list[str]:
  rows = _rows(results, 'wide')
  if not rows:
    return []
  lines = [
    '',
    '## A fan as wide as the sweep, compared once',
    '',
    '`open_first30_wide`: `open_first30` with the replicas log-spaced over 128x around the start '
    "(`hdet.fan = 'geometric'`: 8 replicas a factor 2 apart, like the sweep's grid), parted at step 0 on the "
    'shared gradient and first compared on a common batch at 0.3 of the run; "own": `open_first30_wide_lowcomm`, '
    'each replica on its own gradient (an eighth of the batch, no all-reduce) until then. Per start: the best-scoring '
    "replica's LR over the sweep's best (geometric mean over runs, and the range), its multiplier of the start, "
    "how much worse the replica nearest the sweep's best scored, and the replicas whose score was not finite. "
    'A fan that brackets would put the best replica near 1x from every start; a best multiplier near 1 from '
    'every start means the line the replicas share has its best point where the run already is. Own gradients: '
    'the winner carried from batch B/N to B by the batch rule (Adam: x sqrt(N); SGD: x N; geometric mean over '
    "runs) and the sweep's final at that LR against its best (mean over runs; each grid point's seed mean, "
    'interpolated in log LR): an estimate of a plain run restarted there, not a run.',
    '',
    "| workload | steps | optim | gradients | start | runs | compared at step | best replica's LR / best (range) "
    '| its multiplier | replica nearest the best: worse by | not finite | own: winner x batch rule | the sweep there |',
    '|---|---|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for w, steps, optim, c in rows:
    lo, hi = c['best_lr_x_range']
    lines.append(
      f'| {w} | {steps} | {optim} | {c["gradients"]} | {c["start"]} | {c["n"]} | {c["step"]} | {c["best_lr_x"]:.2g}x '
      f'({lo:.2g}-{hi:.2g}) | {c["best_rho"]:.2g} | {c["gap_pct"]:+.1f}% | {c["nonfinite"]} | '
      f'{_fmt_scaled(c)} |'
    )
  return lines


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--quick', action='store_true', help="read research.workloads --quick's records")
  p.add_argument('--workdir', default=None, help='the workloads work root (default workdirs/workloads[_quick])')
  p.add_argument('--report-only', action='store_true', help='read the records (as always: nothing here trains)')
  p.add_argument('--out', default=None, help="the report's folder (default: results/; --quick: the workdir)")
  args = p.parse_args(sys.argv[1:] if argv is None else argv)
  work_root = args.workdir or os.path.join(autolr.REPO, 'workdirs', 'workloads_quick' if args.quick else 'workloads')
  out = args.out or (work_root if args.quick else os.path.join(autolr.REPO, 'results'))
  print('\n'.join(f'  {p}' for p in write_report(out, measure(args.quick, work_root), args.quick)))


if __name__ == '__main__':
  main()
