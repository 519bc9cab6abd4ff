"""Does the gradient noise scale, measured in the run, carry a learning rate found at batch B/N to batch B?

The defaults issue's thirteenth pass compared replicas trained apart (each on its own eighth of the batch) and
found their winner at 0.28-0.36x the sweep's best on the LM and fine-tuning but 0.45-0.71x on mnist1d: the factor
from B/N to B is the workload's. The noise-scale theory says which factor: with ``B_noise`` the batch at which the
gradient's noise equals its signal (``hdet_jax.noise_scale``), SGD's best LR goes as ``1 / (1 + B_noise / B)``
(McCandlish et al., 2018) and an Adam-style one's as ``1 / (sqrt(B_noise / B) + sqrt(B / B_noise))`` (Li et al.,
2024). This measures ``B_noise`` on every workload and run length of ``experiments.workloads`` along plain data
parallel runs (the sweep's own run at its anchor, ``log_noise_scale`` on: they train the same) and reads the
thirteenth pass's own-gradient winners carried by the predicted factor instead of sqrt(N) / N.

    python -m experiments.noise_scale                    # every cell, 3 seeds (cached, resumable; ~30 min on 2 cores)
    python -m experiments.noise_scale --workload lm --steps 750 --seeds 0
    python -m experiments.noise_scale --report-only      # redraw results/noise_scale.{md,json}
    python -m experiments.noise_scale --quick            # a smoke run (the tiny LM, 16 steps)
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

from experiments import autolr
from experiments import autolr_report
from experiments import climb_and_price
from experiments import records
from experiments import workloads
from hdet_jax import noise_scale as noise_lib

REPO = autolr.REPO
# The in-run bracket compares at 0.3 of the run (open_first30_wide_lowcomm), so that is all of the run a rule
# applied there could have measured; the whole run is reported beside it.
WINDOWS = (('first 0.3', 0.3), ('whole run', 1.0))
BLOCK = 25  # steps per stored block of the two sums (their means: any window of whole blocks can be re-read)
# The logged sums: plain, and (Adam) preconditioned by the second moment, each the replicas' mean |g_r|^2 and |g_B|^2.
KINDS = {'plain': '', 'pre': 'pre_'}
STAGES = {'noise', 'small', 'ladder'}
# The fifteenth pass's ladder: the plain sweep again at batch B/4 and B/2 (divisors of the global batch), so that the
# best LR is known at B/8, B/4, B/2 and B, and a factor measured between two small batches can be extrapolated.
LADDER = (4, 2)
LADDER_BASE = 8  # the B/N sweep's divisor (the replicas)


def run_name(optim: str, seed: int) -> str:
  return f'{optim}/noise_best_s{seed}'


def make_record(name: str, config, summary: dict, workdir: str, wall_s: float) -> dict:
  """workloads.py's record with the per-step noise sums' means over blocks of ``BLOCK`` steps."""
  from hdet_jax.trainer import metrics as metrics_lib
  rec = workloads.make_record(name, config, summary, workdir, wall_s)
  train = metrics_lib.read_metrics(os.path.join(workdir, 'metrics.jsonl')).get('train', [])
  by_step = {r['step']: r for r in train if 'grad_sq' in r}
  steps = sorted(by_step)
  blocks = []
  for start in range(0, len(steps), BLOCK):
    chunk = [by_step[s] for s in steps[start:start + BLOCK]]
    blocks.append({'end': chunk[-1]['step'] + 1, 'steps': len(chunk),
                   **{k: records.finite_or_none(np.mean([r[k] for r in chunk])) for k in metrics_lib.NOISE_SUMS
                      if k in chunk[0]}})
  if blocks:
    rec['noise'] = {'local_batch': int(config.data.batch_size), 'global_batch': int(config.data.batch_size) * int(
        config.hdet.num_replicas or 8), 'blocks': blocks}
  return rec


def measure_noise(rec: dict, fraction: float, kind: str = 'plain') -> float | None:
  """``B_noise`` of a record over its blocks ending by ``fraction`` of the run, from its plain or (``kind='pre'``)
  its Adam-preconditioned sums (None: none there, or not finite). The preconditioned sums are read from the first
  block that starts after Adam's second moment has averaged over its horizon, ``1 / (1 - b2)`` steps: before, it
  holds a few gradients, and a replica's own gradient divided by it is heavy-tailed (the first steps' sums are
  10^3-10^5 times the later ones')."""
  n = rec['noise']
  steps = rec['config']['num_train_steps']
  local_key, mean_key = KINDS[kind] + 'grad_sq', KINDS[kind] + 'mean_grad_sq'
  after = 1.0 / (1.0 - float(rec['config']['optim']['b2'])) if kind == 'pre' else 0.0
  blocks = [b for b in n['blocks'] if b['end'] <= fraction * steps + 1e-9 and b['end'] - b['steps'] >= after]
  if not blocks or any(b.get(local_key) is None or b.get(mean_key) is None for b in blocks):
    return None
  w = np.asarray([b['steps'] for b in blocks], float)
  local = float(np.sum(w * [b[local_key] for b in blocks]) / w.sum())
  mean = float(np.sum(w * [b[mean_key] for b in blocks]) / w.sum())
  return noise_lib.noise_scale(local, mean, n['local_batch'], n['global_batch'])


def rule(optim: str) -> str:
  return 'sgd' if optim == 'sgd' else 'adam'


def cell_report(noise_recs: list[dict], folder: str, optim: str) -> dict | None:
  """One workload, length and optimizer: ``B_noise`` per window (geometric mean over seeds, and the range), the
  factor the own-gradient winners imply (the sweep's best over the winner, from 10x low and the best), the factor
  each rule predicts, and the winners carried by sqrt(N) / N and by the predicted factor with the sweep's final
  there (climb_and_price.sweep_at: each grid point's seed mean, interpolated in log LR; mean over runs)."""
  if not noise_recs:
    return None
  n = noise_recs[0]['noise']
  big, small = n['global_batch'], n['local_batch']
  replicas = big // small
  out = {'global_batch': big, 'local_batch': small, 'seeds': len(noise_recs), 'windows': {}}
  for kind in KINDS:
    for label, fraction in WINDOWS:
      b = [measure_noise(r, fraction, kind) for r in noise_recs]
      b = [x for x in b if x is not None and math.isfinite(x) and x > 0]
      if b:
        geo = float(np.exp(np.mean(np.log(b))))
        out['windows'][label if kind == 'plain' else f'{label}, preconditioned'] = {
            'b_noise': geo, 'range': [min(b), max(b)], 'factor': noise_lib.batch_factor(geo, big, replicas, rule(optim))}
  found = own_winners(folder, optim)
  if found is None:
    return out
  out['winner_x'] = float(np.exp(np.mean(np.log([w['best_x'] for w in found[3]]))))
  out['runs'] = len(found[3])
  out['implied_factor'] = 1.0 / out['winner_x']
  out['batch_rule'] = {'factor': climb_and_price.batch_rule(optim, replicas),
                       'sweep_pct': carried(found, climb_and_price.batch_rule(optim, replicas))}
  for w in out['windows'].values():
    w['sweep_pct'] = carried(found, w['factor'])
  return out


def own_winners(folder: str, optim: str):
  """The sweep's grid, its best (peak LR, value) and the own-gradient winners at 0.3 of the run (from 10x low and
  the best) as ``(grid, lr, value, winners)``; None where there are none."""
  found = climb_and_price._first_syncs(folder, optim, climb_and_price.OPEN_WIDE)  # pylint: disable=protected-access
  if found is None:
    return None
  grid, runs = found
  lr, best_val = autolr_report.grid_best(grid)
  own = [climb_and_price._wide_run(c, float(r['config']['optim']['max_lr']) / lr)  # pylint: disable=protected-access
         for m, r, c in runs if m.group(1) and m.group(2) in ('low', 'best')]
  return (grid, lr, best_val, own) if own else None


def carried(found, factor: float) -> float | None:
  """The sweep's final at each own-gradient winner times ``factor``, against its best (climb_and_price.sweep_at:
  each grid point's seed mean, interpolated in log LR; mean over the winners, in %)."""
  grid, lr, best_val, own = found
  pct = [climb_and_price.sweep_at(grid, lr * w['best_x'] * factor) for w in own]
  return None if None in pct else float(np.mean([100.0 * (p / best_val - 1.0) for p in pct]))


def noise_cache(workload: str, steps: int, quick: bool, work_root: str) -> records.RunCache:
  folder = (os.path.join(work_root, workload, 'noise_records') if quick else
            os.path.join(REPO, 'results', 'noise_scale', 'runs', workload, f'steps{steps}'))
  return records.RunCache(folder, os.path.join(work_root, workload, f'noise_steps{steps}'), make_record,
                          autolr.describe)


def _plain_runs(workload: str, steps: int, optim: str, quick: bool, work_root: str, train: bool):
  """``(name, lr, seed, extra) -> record``: the sweep's plain run from this experiment's cache (workloads.plain_runner)."""
  return workloads.plain_runner(noise_cache(workload, steps, quick, work_root), workload, steps, optim, quick,
                                work_root, train)


def run_cell(workload: str, steps: int, optim: str, seeds, quick: bool, work_root: str, train: bool) -> list[dict]:
  """The plain runs at the workload's anchor with ``log_noise_scale`` on (trained unless cached and ``train``)."""
  sweep = records.RunCache(workloads.records_dir(workload, steps, quick, work_root),
                           os.path.join(work_root, workload, f'steps{steps}'), workloads.make_record, autolr.describe)
  lr = autolr.read_anchor(sweep, optim) or (autolr.QUICK_GRIDS[optim][-1] if quick else None)
  if lr is None:  # (quick: no sweep needed, the smoke run trains at the quick grid's top)
    return []
  plain = _plain_runs(workload, steps, optim, quick, work_root, train)
  out = []
  for seed in seeds:
    rec = plain(run_name(optim, seed), lr, seed, {'log_noise_scale': True})
    if rec is not None:
      twin = sweep.get(autolr.grid_name(optim, lr, seed))  # the sweep's run of the same config, without the logging
      rec = {**rec, 'same_as_sweep': None if twin is None else rec['val_bpb'] == twin['val_bpb']}
      out.append(rec)
  return out


def small_name(optim: str, lr: float, seed: int, divisor: int | None = None) -> str:
  """The B/N sweep's runs keep their first names; other divisors (the ladder) carry theirs."""
  return f'{optim}/small{"" if divisor is None else f"_div{divisor}"}_lr{lr:g}_s{seed}'


def run_small(workload: str, steps: int, optim: str, seeds, quick: bool, work_root: str,
              train: bool, divisor: int | None = None) -> dict[float, list[dict]]:
  """The plain sweep at batch B/m (``data.batch_size`` divided by ``divisor`` m, by default the N replicas;
  everything else the sweep's): the grid on the first seed, extended by one point (a factor 2) past an end where its
  best lies there, and the other seeds on its best and the two points either side. Returns the records by peak LR."""
  lrs = (autolr.QUICK_GRIDS if quick else autolr.GRIDS)[optim]
  base = workloads.base_config(workload, steps, quick)
  replicas = int(base.hdet.num_replicas or 8)
  m = replicas if divisor is None else divisor
  if base.data.batch_size % m and not quick:  # (quick: the tiny batch's floor, at least one)
    raise ValueError(f'data.batch_size={base.data.batch_size} does not divide by {m}.')
  plain = _plain_runs(workload, steps, optim, quick, work_root, train)
  tag = None if m == replicas else m
  get = lambda lr, seed: plain(small_name(optim, lr, seed, tag), lr, seed,
                               {'data.batch_size': max(1, base.data.batch_size // m)})
  grid = {}

  def train_seed(seed, todo):
    for lr in todo:
      rec = get(lr, seed)
      if rec is not None:
        grid.setdefault(lr, []).append(rec)
  for i, seed in enumerate(seeds):
    todo = list(lrs)
    if i > 0:
      first = {lr: [grid[lr][0]] for lr in grid}
      if any(lr not in first for lr in lrs):
        break  # (the first seed's grid is not complete: another worker has it)
      ext = sorted(first)
      k = ext.index(autolr_report.grid_best(first)[0])
      todo = ext[max(0, k - 2):k + 3]
    train_seed(seed, todo)
    if i == 0 and all(lr in grid for lr in lrs):  # the best at an end: one more point past it
      best = autolr_report.grid_best({lr: grid[lr] for lr in lrs})[0]
      edge = {lrs[0]: lrs[0] / 2, lrs[-1]: lrs[-1] * 2}.get(best)
      if edge is not None:
        train_seed(seed, [edge])
  return grid


def optimum(grid: dict[float, list[dict]]) -> dict | None:
  """The sweep's best peak LR: the grid point with the lowest seed mean, and the vertex of the parabola in log LR
  through its and its two neighbours' means over the seeds all three have (kept between the outer two; the grid
  point where a neighbour is missing, no seed is common or a mean is not finite, or the parabola opens downward)."""
  if not grid:
    return None
  lrs = sorted(grid)
  means = {lr: autolr_report.mean_bpb(grid[lr]) for lr in lrs}
  k = lrs.index(min(lrs, key=lambda lr: means[lr]))
  out = {'grid_lr': lrs[k], 'lr': lrs[k], 'value': means[lrs[k]], 'seeds': len(grid[lrs[k]])}
  if 0 < k < len(lrs) - 1:
    three = lrs[k - 1:k + 2]
    common = set.intersection(*({int(r['config']['seed']) for r in grid[lr]} for lr in three))
    x = np.log(three)
    y = np.asarray([autolr_report.mean_bpb([r for r in grid[lr] if int(r['config']['seed']) in common]) if common
                    else math.nan for lr in three])
    out['parabola_seeds'] = len(common)
    if np.all(np.isfinite(y)):
      a, b, _ = np.polyfit(x, y, 2)
      if a > 0:
        out['lr'] = float(np.exp(np.clip(-b / (2 * a), x[0], x[2])))
  return out


def small_report(small: dict[float, list[dict]], folder: str, optim: str, cell: dict) -> dict | None:
  """The whole-run factor lr*(B) / lr*(B/N) (each sweep's :func:`optimum`, the parabola's vertex), against the
  batch rule, the noise rules' predictions and the own-gradient winners' implied factor."""
  big, little = optimum(climb_and_price._grid(folder, optim)), optimum(small)  # pylint: disable=protected-access
  if big is None or little is None:
    return None
  return {'b': big, 'b_over_n': little, 'factor': big['lr'] / little['lr'],
          'grid_factor': big['grid_lr'] / little['grid_lr'], 'runs': sum(len(v) for v in small.values()),
          'grid': {f'{lr:g}': autolr_report.mean_bpb(rs) for lr, rs in sorted(small.items())}}


def surge_fit(batches, lrs) -> tuple[float, float] | None:
  """Adam's law ``lr*(B) = c / (sqrt(B_noise / B) + sqrt(B / B_noise))`` (Li et al., 2024) fitted by least squares
  in log LR to the points: ``(c, B_noise)``, B_noise searched over a log grid 1/64 to 64 times the batches' range
  (c in closed form for each); None with fewer than two points."""
  if len(lrs) < 2:
    return None
  b, y = np.asarray(batches, float), np.log(np.asarray(lrs, float))
  best = None
  for bn in np.geomspace(b.min() / 64, b.max() * 64, 2001):
    shape = -np.log(np.sqrt(bn / b) + np.sqrt(b / bn))
    log_c = float(np.mean(y - shape))
    sse = float(np.sum((y - shape - log_c) ** 2))
    if best is None or sse < best[0] - 1e-15:
      best = (sse, math.exp(log_c), float(bn))
  return best[1], best[2]


def surge_lr(c: float, b_noise: float, batch: float) -> float:
  return c / (math.sqrt(b_noise / batch) + math.sqrt(batch / b_noise))


def ladder_report(small, rungs, folder, optim) -> dict | None:
  """The best LR at B/8, B/4, B/2 and B (each sweep's :func:`optimum`) and the factor B/8 -> B that each law read
  from the small batches alone would predict: the power law through B/8 and B/4 (its factor cubed), through B/8 and
  B/2 (to the power 3/2), and Adam's surge law fitted to the three;
  each with the own-gradient winners carried by it (:func:`carried`)."""
  sweeps = {1: climb_and_price._grid(folder, optim), **rungs, LADDER_BASE: small}  # pylint: disable=protected-access
  opt = {m: optimum(g) for m, g in sweeps.items()}
  if any(o is None for o in opt.values()):
    return None
  lr = {m: opt[m]['lr'] for m in opt}
  small_ms = sorted((m for m in lr if m > 1), reverse=True)  # B/8, B/4, B/2
  # (A power law fitted to all three in log-log has the outer two's slope: the points are equally spaced in log B.)
  fit = surge_fit([1.0 / m for m in small_ms], [lr[m] for m in small_ms])
  base = LADDER_BASE
  predicted = {'power law through B/8, B/4': (lr[4] / lr[base]) ** 3,
               'power law through B/8, B/2': (lr[2] / lr[base]) ** 1.5,
               'Adam surge law through B/8, B/4, B/2': surge_lr(*fit, 1.0) / surge_lr(*fit, 1.0 / base)}
  found = own_winners(folder, optim)
  out = {'optima': {str(m): opt[m] for m in sorted(opt)}, 'lr': {str(m): lr[m] for m in sorted(lr)},
         'doubling': [lr[m // 2] / lr[m] for m in (8, 4, 2)], 'factor': lr[1] / lr[base],
         'surge_b_noise': fit[1], 'runs': {str(m): sum(len(v) for v in sweeps[m].values()) for m in small_ms},
         'predicted': {k: {'factor': float(v), 'sweep_pct': None if found is None else carried(found, v)}
                       for k, v in predicted.items()}}
  if found is not None:
    out['measured_sweep_pct'] = carried(found, out['factor'])
  return out


def measure(args, work_root: str) -> dict:
  results = {}
  for w in args.workload:
    for steps in (args.steps or workloads.lengths(w, args.quick)):
      for optim in workloads.WORKLOADS[w][2]:
        recs = run_cell(w, steps, optim, args.seeds, args.quick, work_root,
                        train='noise' in args.stages and not args.report_only)
        folder = workloads.records_dir(w, steps, args.quick, work_root)
        cell = cell_report(recs, folder, optim)
        if cell:
          cell['same_as_sweep'] = [r['same_as_sweep'] for r in recs]
          default_length = steps == (workloads.lengths(w, True)[0] if args.quick else workloads.WORKLOADS[w][1])
          if default_length and args.stages & {'small', 'ladder'}:
            small = run_small(w, steps, optim, args.seeds, args.quick, work_root,
                              train='small' in args.stages and not args.report_only)
            cell['small_batch'] = small_report(small, folder, optim, cell)
          if default_length and 'ladder' in args.stages:
            rungs = {m: run_small(w, steps, optim, args.seeds, args.quick, work_root, train=not args.report_only,
                                  divisor=m) for m in LADDER}
            cell['ladder'] = ladder_report(small, rungs, folder, optim)
          results.setdefault(w, {}).setdefault(str(steps), {})[optim] = cell
  return results


def _fmt_pct(p) -> str:
  return 'off the grid' if p is None else f'{p:+.1f}%'


_LABELS = ('first 0.3', 'whole run', 'first 0.3, preconditioned', 'whole run, preconditioned')


def _cells(results: dict):
  return [(w, steps, optim, c) for w, by_steps in results.items()
          for steps, by_optim in sorted(by_steps.items(), key=lambda kv: int(kv[0])) for optim, c in by_optim.items()]


def write_report(out_dir: str, results: dict, quick: bool) -> list[str]:
  lines = ['# The gradient noise scale and the batch factor', '',
           f'Generated by `python -m experiments.noise_scale{" --quick" if quick else ""}`; the reading is in '
           '`experiments/workloads_discussion.md` (fourteenth pass).', '',
           '## The noise scale along the sweep\'s runs', '',
           'B_noise: the simple noise scale (tr Sigma / |G|^2, from the replicas\' own and the all-reduced gradients: '
           '`hdet_jax.noise_scale`), in the batch\'s units (LM and fine-tuning: windows; mnist1d: examples), along '
           'plain data-parallel runs at the sweep\'s anchor (`log_noise_scale` on), over the first 0.3 of the run and '
           'over all of it; "preconditioned": the same of the gradients divided as Adam\'s update divides them '
           '(`g / (sqrt(nu) + 1e-8)`). Geometric mean over seeds (range). "same as the sweep": the logging runs '
           'ended bit for bit as the sweep\'s runs of the same config.', '',
           '| workload | steps | optim | B | B_noise, first 0.3 | whole run | preconditioned, first 0.3 | whole run '
           '| same as the sweep |', '|---|---|---|---|---|---|---|---|---|']
  fmt_b = lambda x: '-' if x is None else f'{x["b_noise"]:.3g} ({x["range"][0]:.3g}-{x["range"][1]:.3g})'
  for w, steps, optim, c in _cells(results):
    same = c.get('same_as_sweep', [])
    lines.append(f'| {w} | {steps} | {optim} | {c["global_batch"]} | '
                 + ' | '.join(fmt_b(c['windows'].get(k)) for k in _LABELS) + f' | {sum(1 for s in same if s)} of {len(same)} |')
  lines += ['', '## The factor from B/N to B, and where it carries the winners', '',
            '"implied": the sweep\'s best over the own-gradient winner at 0.3 of the run (`open_first30_wide_lowcomm`, '
            'from 10x low and the best; geometric mean over runs). Each rule\'s factor lr*(B) / lr*(B/N): the batch '
            'rule (Adam sqrt(N), SGD N); from B_noise (Adam-style: Li et al. 2024, lr* ~ 1 / (sqrt(B_noise / B) + '
            'sqrt(B / B_noise)); SGD: McCandlish et al. 2018, lr* ~ 1 / (1 + B_noise / B)). After the colon: the '
            'sweep\'s final at the winner times that factor, against its best (each grid point\'s seed mean '
            'interpolated in log LR; mean over runs): an estimate of a plain run restarted there, not a run.', '',
            '| workload | steps | optim | implied | batch rule | B_noise, first 0.3 | whole run | preconditioned, '
            'first 0.3 | whole run |', '|---|---|---|---|---|---|---|---|---|']
  fmt_p = lambda x: '-' if x is None else f'{x["factor"]:.2f}' + (
      f': {_fmt_pct(x["sweep_pct"])}' if 'sweep_pct' in x else '')
  for w, steps, optim, c in _cells(results):
    implied = f'{c["implied_factor"]:.2f}' if 'implied_factor' in c else '-'
    lines.append(f'| {w} | {steps} | {optim} | {implied} | {fmt_p(c.get("batch_rule"))} | '
                 + ' | '.join(fmt_p(c['windows'].get(k)) for k in _LABELS) + ' |')
  lines += _small_table(results) + _ladder_table(results)
  return records.write_report(out_dir, 'noise_scale', results, lines)


def _small_table(results: dict) -> list[str]:
  rows = [r for r in _cells(results) if r[3].get('small_batch')]
  if not rows:
    return []
  lines = ['', '## The factor from whole runs at B/N', '',
           'The plain sweep again at batch B/N (each replica on an Nth of its batch: `data.batch_size / N`; the same '
           'grid, steps and schedule; the first seed on every point, the others on its best and the two neighbours), '
           'at each workload\'s default length. Each sweep\'s best peak LR is the vertex of the parabola in log LR '
           'through its best seed mean and the two neighbours (in brackets the grid point). "whole runs": the '
           'factor between the two sweeps\' bests, free of the comparison\'s horizon; beside it the batch rule, the '
           'noise rules from B_noise (first 0.3 / whole run) and the own-gradient winners\' implied factor.', '',
           '| workload | steps | optim | best at B (grid point) | best at B/N (grid point), runs | factor, whole runs | '
           'batch rule | noise rule: first 0.3 / whole run / preconditioned first 0.3 / whole run | implied by the '
           'winners at 0.3 |',
           '|---|---|---|---|---|---|---|---|---|']
  for w, steps, optim, c in rows:
    sb, ws = c['small_batch'], c['windows']
    noise = ' / '.join('-' if k not in ws else f'{ws[k]["factor"]:.2f}' for k in _LABELS)
    implied = f'{c["implied_factor"]:.2f}' if 'implied_factor' in c else '-'
    lines.append(f'| {w} | {steps} | {optim} | {sb["b"]["lr"]:.3g} ({sb["b"]["grid_lr"]:g}) | {sb["b_over_n"]["lr"]:.3g} '
                 f'({sb["b_over_n"]["grid_lr"]:g}), {sb["runs"]} | {sb["factor"]:.2f} | '
                 f'{c.get("batch_rule", {}).get("factor", float("nan")):.2f} | {noise} | {implied} |')
  return lines


def _ladder_table(results: dict) -> list[str]:
  rows = [r for r in _cells(results) if r[3].get('ladder')]
  if not rows:
    return []
  names = list(rows[0][3]['ladder']['predicted'])
  lines = ['', '## The batch ladder: is the factor one power law? (fifteenth pass)', '',
           'The plain sweep again at B/4 and B/2 (`--stages ladder`; the same grid, seeds and parabola as at B/N = B/8). '
           'The best peak LR at each batch (the parabola\'s vertex), the factor per doubling of the batch, the '
           'factor from B/8 to B measured, and what each law read from the small batches alone predicts for it: a '
           'power law through two of them (B/8 and B/4: their factor cubed; B/8 and B/2: to the power 3/2; fitted to '
           'all three in log-log it is the latter, the points being equally spaced), Adam\'s surge law fitted to the '
           'three. After the colon: the '
           'own-gradient winners at 0.3 of the run carried by that factor, the sweep\'s final there against its best '
           '(interpolated: an estimate, not a run; "measured": carried by the measured factor itself).', '',
           '| workload | steps | optim | best LR at B/8, B/4, B/2, B | per doubling | measured B/8 -> B | '
           + ' | '.join(names) + ' | runs at B/4, B/2 |', '|---|---|---|---|---|---|' + '---|' * (len(names) + 1)]
  pct = lambda x: '' if x is None else f': {_fmt_pct(x)}'
  for w, steps, optim, c in rows:
    lad = c['ladder']
    lines.append(f'| {w} | {steps} | {optim} | ' + ', '.join(f'{lad["lr"][m]:.3g}' for m in ('8', '4', '2', '1'))
                 + ' | ' + ' / '.join(f'{x:.2f}' for x in lad['doubling'])
                 + f' | {lad["factor"]:.2f}{pct(lad.get("measured_sweep_pct"))} | '
                 + ' | '.join(f'{lad["predicted"][n]["factor"]:.2f}{pct(lad["predicted"][n]["sweep_pct"])}'
                              for n in names)
                 + f' | {lad["runs"]["4"]}, {lad["runs"]["2"]} |')
  return lines


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--workload', default=','.join(workloads.WORKLOADS), help='comma-separated workloads')
  p.add_argument('--steps', default='', help='comma-separated run lengths (default: each workload\'s three)')
  p.add_argument('--seeds', default='0,1,2', help='comma-separated seeds')
  p.add_argument('--quick', action='store_true', help='a smoke run: the tiny configs, 16 steps')
  p.add_argument('--stages', default='noise,small', help='noise: the sweep\'s runs at its anchor with the sums '
                 'logged (every length); small: the plain sweep at batch B/N (each workload\'s default length); '
                 'ladder: the same at B/4 and B/2 (not in the default)')
  p.add_argument('--report-only', action='store_true', help='train nothing; redraw the report from the records')
  p.add_argument('--workdir', default=None, help='the workloads work root (default workdirs/workloads[_quick])')
  args = p.parse_args(sys.argv[1:] if argv is None else argv)
  workloads.parse_cells(p, args)
  args.stages = {x for x in args.stages.split(',') if x}
  if args.stages - STAGES:
    p.error(f'--stages: {sorted(args.stages - STAGES)} not among {", ".join(sorted(STAGES))}')
  work_root = args.workdir or os.path.join(REPO, 'workdirs', 'workloads_quick' if args.quick else 'workloads')
  from hdet_jax.trainer import trainer
  trainer.setup_jax(workloads.base_config('lm', 16, args.quick))  # 8 CPU devices, as the sweep's runs had
  out = work_root if args.quick else os.path.join(REPO, 'results')
  print('\n'.join(f'  {p}' for p in write_report(out, measure(args, work_root), args.quick)))


if __name__ == '__main__':
  main()
