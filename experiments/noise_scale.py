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
import json
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
                   'grad_sq': records.finite_or_none(np.mean([r['grad_sq'] for r in chunk])),
                   'mean_grad_sq': records.finite_or_none(np.mean([r['mean_grad_sq'] for r in chunk]))})
  rec['noise'] = {'local_batch': int(config.data.batch_size), 'global_batch': int(config.data.batch_size) * int(
      config.hdet.num_replicas or 8), 'blocks': blocks}
  return rec


def measure_noise(rec: dict, fraction: float) -> float | None:
  """``B_noise`` of a record over its blocks ending by ``fraction`` of the run (None: none there, or not finite)."""
  n = rec['noise']
  steps = rec['config']['num_train_steps']
  blocks = [b for b in n['blocks'] if b['end'] <= fraction * steps + 1e-9]
  if not blocks or any(b['grad_sq'] is None or b['mean_grad_sq'] is None for b in blocks):
    return None
  w = np.asarray([b['steps'] for b in blocks], float)
  local = float(np.sum(w * [b['grad_sq'] for b in blocks]) / w.sum())
  mean = float(np.sum(w * [b['mean_grad_sq'] for b in blocks]) / w.sum())
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
  for label, fraction in WINDOWS:
    b = [measure_noise(r, fraction) for r in noise_recs]
    b = [x for x in b if x is not None and math.isfinite(x) and x > 0]
    if b:
      geo = float(np.exp(np.mean(np.log(b))))
      out['windows'][label] = {'b_noise': geo, 'range': [min(b), max(b)],
                               'factor': noise_lib.batch_factor(geo, big, replicas, rule(optim))}
  found = climb_and_price._first_syncs(folder, optim, climb_and_price.OPEN_WIDE)  # pylint: disable=protected-access
  if found is None:
    return out
  grid, runs = found
  lr, best_val = autolr_report.grid_best(grid)
  own = [climb_and_price._wide_run(c, float(r['config']['optim']['max_lr']) / lr)  # pylint: disable=protected-access
         for m, r, c in runs if m.group(1) and m.group(2) in ('low', 'best')]
  if not own:
    return out

  def carried(factor):
    pct = [climb_and_price.sweep_at(grid, lr * w['best_x'] * factor) for w in own]
    return None if None in pct else float(np.mean([100.0 * (p / best_val - 1.0) for p in pct]))
  out['winner_x'] = float(np.exp(np.mean(np.log([w['best_x'] for w in own]))))
  out['runs'] = len(own)
  out['implied_factor'] = 1.0 / out['winner_x']
  out['batch_rule'] = {'factor': climb_and_price.batch_rule(optim, replicas),
                       'sweep_pct': carried(climb_and_price.batch_rule(optim, replicas))}
  for w in out['windows'].values():
    w['sweep_pct'] = carried(w['factor'])
  return out


def noise_cache(workload: str, steps: int, quick: bool, work_root: str) -> records.RunCache:
  folder = (os.path.join(work_root, workload, 'noise_records') if quick else
            os.path.join(REPO, 'results', 'noise_scale', 'runs', workload, f'steps{steps}'))
  return records.RunCache(folder, os.path.join(work_root, workload, f'noise_steps{steps}'), make_record,
                          autolr.describe)


def run_cell(workload: str, steps: int, optim: str, seeds, quick: bool, work_root: str, train: bool) -> list[dict]:
  """The plain runs at the workload's anchor with ``log_noise_scale`` on (trained unless cached and ``train``)."""
  from hdet_jax.trainer import config_lib
  sweep = records.RunCache(workloads.records_dir(workload, steps, quick, work_root),
                           os.path.join(work_root, workload, f'steps{steps}'), workloads.make_record, autolr.describe)
  lr = autolr.read_anchor(sweep, optim) or (autolr.QUICK_GRIDS[optim][-1] if quick else None)
  if lr is None:  # (quick: no sweep needed, the smoke run trains at the quick grid's top)
    return []
  cache = noise_cache(workload, steps, quick, work_root)
  init_from = workloads.pretrained(work_root, quick) if workload == 'finetune' and train else None
  plain_extra = {'warm_init.nu': 0.0} if workload == 'finetune' else {}
  out = []
  for seed in seeds:
    o = {**autolr.run_overrides('grid', optim, lr, seed, steps), **plain_extra, 'log_noise_scale': True}
    if quick:
      o.pop('hdet.sync_every', None)
    name = run_name(optim, seed)
    rec = cache.get(name) if not train else cache.run(
        name, config_lib.with_overrides(workloads.base_config(workload, steps, quick, init_from), o), skip_busy=True)
    if rec is not None:
      twin = sweep.get(autolr.grid_name(optim, lr, seed))  # the sweep's run of the same config, without the logging
      rec = {**rec, 'same_as_sweep': None if twin is None else rec['val_bpb'] == twin['val_bpb']}
      out.append(rec)
  return out


def measure(args, work_root: str) -> dict:
  results = {}
  for w in args.workload:
    for steps in (args.steps or workloads.lengths(w, args.quick)):
      for optim in workloads.WORKLOADS[w][2]:
        recs = run_cell(w, steps, optim, args.seeds, args.quick, work_root, train=not args.report_only)
        folder = workloads.records_dir(w, steps, args.quick, work_root)
        cell = cell_report(recs, folder, optim)
        if cell:
          cell['same_as_sweep'] = [r['same_as_sweep'] for r in recs]
          results.setdefault(w, {}).setdefault(str(steps), {})[optim] = cell
  return results


def _fmt_pct(p) -> str:
  return 'off the grid' if p is None else f'{p:+.1f}%'


def write_report(out_dir: str, results: dict, quick: bool) -> list[str]:
  os.makedirs(out_dir, exist_ok=True)
  jpath, mpath = os.path.join(out_dir, 'noise_scale.json'), os.path.join(out_dir, 'noise_scale.md')
  with open(jpath, 'w', encoding='utf-8') as f:
    json.dump(results, f, indent=1, sort_keys=True)
  lines = ['# The gradient noise scale and the batch factor', '',
           f'Generated by `python -m experiments.noise_scale{" --quick" if quick else ""}`; the reading is in '
           '`experiments/workloads_discussion.md` (fourteenth pass). B_noise: the simple noise scale (tr Sigma / |G|^2, '
           'from the replicas\' own and the all-reduced gradients: `hdet_jax.noise_scale`) along plain data-parallel '
           'runs at the sweep\'s anchor, in the batch\'s units (LM: windows; mnist1d: examples), over the first 0.3 '
           'of the run and over all of it (geometric mean over seeds, and the range). "implied": the sweep\'s best '
           'over the own-gradient winner at 0.3 of the run (`open_first30_wide_lowcomm`, from 10x low and the best; '
           'geometric mean over runs). "predicted": lr*(B) / lr*(B/N) from B_noise (Adam: Li et al. 2024; SGD: '
           'McCandlish et al. 2018). "sweep there": the sweep\'s final at the winner times the factor, against its '
           'best (each grid point\'s seed mean interpolated in log LR; mean over runs): an estimate of a plain run '
           'restarted there, not a run. "same as the sweep": the logging runs ended bit for bit as the sweep\'s runs '
           'of the same config.', '',
           '| workload | steps | optim | B | B_noise, first 0.3 (range) | B_noise, whole run | implied factor | '
           'x sqrt(N) or N: sweep there | predicted factor (first 0.3): sweep there | predicted (whole run): sweep there '
           '| same as the sweep |',
           '|---|---|---|---|---|---|---|---|---|---|---|']
  for w, by_steps in results.items():
    for steps, by_optim in sorted(by_steps.items(), key=lambda kv: int(kv[0])):
      for optim, c in by_optim.items():
        ws = c['windows']
        first, whole = ws.get('first 0.3'), ws.get('whole run')
        fmt_b = lambda x: '-' if x is None else f'{x["b_noise"]:.3g} ({x["range"][0]:.3g}-{x["range"][1]:.3g})'
        fmt_p = lambda x: '-' if x is None or 'sweep_pct' not in x else f'{x["factor"]:.2f}: {_fmt_pct(x["sweep_pct"])}'
        rule_cell = ('-' if 'batch_rule' not in c else
                     f'{c["batch_rule"]["factor"]:.2f}: {_fmt_pct(c["batch_rule"]["sweep_pct"])}')
        same = c.get('same_as_sweep', [])
        lines.append(f'| {w} | {steps} | {optim} | {c["global_batch"]} | {fmt_b(first)} | {fmt_b(whole)} | '
                     f'{c.get("implied_factor", float("nan")):.2f} | {rule_cell} | {fmt_p(first)} | {fmt_p(whole)} | '
                     f'{sum(1 for s in same if s)} of {len(same)} |')
  with open(mpath, 'w', encoding='utf-8') as f:
    f.write('\n'.join(lines) + '\n')
  return [jpath, mpath]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--workload', default=','.join(workloads.WORKLOADS), help='comma-separated workloads')
  p.add_argument('--steps', default='', help='comma-separated run lengths (default: each workload\'s three)')
  p.add_argument('--seeds', default='0,1,2', help='comma-separated seeds')
  p.add_argument('--quick', action='store_true', help='a smoke run: the tiny configs, 16 steps')
  p.add_argument('--report-only', action='store_true', help='train nothing; redraw the report from the records')
  p.add_argument('--workdir', default=None, help='the workloads work root (default workdirs/workloads[_quick])')
  args = p.parse_args(sys.argv[1:] if argv is None else argv)
  args.workload = [w for w in args.workload.split(',') if w]
  bad = [w for w in args.workload if w not in workloads.WORKLOADS]
  if bad:
    p.error(f'--workload: {bad} not among {list(workloads.WORKLOADS)}')
  args.steps = [int(s) for s in args.steps.split(',') if s]
  args.seeds = [int(s) for s in args.seeds.split(',') if s]
  work_root = args.workdir or os.path.join(REPO, 'workdirs', 'workloads_quick' if args.quick else 'workloads')
  from hdet_jax.trainer import trainer
  trainer.setup_jax(workloads.base_config('lm', 16, args.quick))  # 8 CPU devices, as the sweep's runs had
  out = work_root if args.quick else os.path.join(REPO, 'results')
  print('\n'.join(f'  {p}' for p in write_report(out, measure(args, work_root), args.quick)))


if __name__ == '__main__':
  main()
