"""A bracket apart at the full batch, decided early: what the route the fourteenth pass left would cost and give.

The defaults issue's thirteenth and fourteenth passes left one way to find the best LR inside a run that does not
follow the start: replicas trained apart at the full batch, compared once, the winner kept (an early-stopped sweep,
successive halving's first rung). It needs no new run to be measured: the sweep's own runs are such a bracket's
replicas. At one seed every grid run draws the same batches, so at step ``f * steps`` their training losses compare
on common batches; the bracket keeps the lowest, and that run goes on to the end unchanged (the schedule is its own
from step 0), so the bracket's final is the sweep's run's own. Its compute: 8 runs to ``f``, one on, ``1 + 7 f``
runs (the sweep: 8; HDET: 1).

Each cell is read on the seeds whose grid is complete: a bracket over fewer points would be told the answer. The
sweep trains its whole grid on seed 0 (the LM at 750 / 1500 steps on seeds 0-2) and the other seeds near its best
only; ``--train`` trains the rest of the grid for the seeds asked (records in ``results/early_bracket/runs/``, the
sweep's own runs where it has them). The gap is paired: the kept run's final against the same seed's run at the
sweep's best grid point (its 3-seed mean's).

    python -m research.archive.early_bracket                      # reads the records (results/early_bracket.{md,json})
    python -m research.archive.early_bracket --report-only        # the same, and refuses --train
    python -m research.archive.early_bracket --train --workload finetune,mnist1d  # complete seeds 0-2 (cached)
    python -m research.archive.early_bracket --quick --train       # a smoke run over the quick sweep's records
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
from research.archive import climb_and_price
from research import records
from research import workloads

REPO = autolr.REPO
FRACTIONS = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0)  # when a single comparison is made, as fractions of the run
# Successive halving (rungs of (fraction, runs kept)), each ending at 0.3 of the run: the end of the one-cycle warmup
# (optim.pct_start), where every run reaches its peak LR.
WARMUP_END = 0.3  # the trainer's one-cycle schedule peaks there (optim.pct_start)
# A fan as wide as the sweep (8 replicas a factor 2 apart: 128x) centred on a start 10x below, at or 10x above the
# sweep's best: the bracket then holds the sweep's points within its span (points of the fan outside the sweep's
# grid are not trained; at the warmup's end no kept LR lies below a quarter of the best, so they would not win).
FAN_SPAN = 128.0
STARTS = {'10x low': 0.1, 'best': 1.0, '10x high': 10.0}
HALVING = {
  '8-4-1 at 0.1 / 0.3': ((0.1, 4), (0.3, 1)),
  '8-2-1 at 0.1 / 0.3': ((0.1, 2), (0.3, 1)),
  '8-4-2-1 at 0.1 / 0.2 / 0.3': ((0.1, 4), (0.2, 2), (0.3, 1)),
  '8-4-1 at 0.2 / 0.3': ((0.2, 4), (0.3, 1)),
}
# Every bracket the report reads, by table: single comparisons (named by their fraction) and the halving schedules.
SCHEDULES = {'fractions': {f'{f:g}': ((f, 1),) for f in FRACTIONS}, 'halving': HALVING}
_GRID = re.compile(r'grid_lr[^/]*_s(\d+)\.json$')


def loss_at(rec: dict, fraction: float) -> float | None:
  """The run's training loss at its last recorded step by ``fraction`` of the run (None: none is recorded by then;
  inf: the loss is not finite or the run had diverged by then, so it cannot win). A record keeps the loss of every
  ``log_every``-th step (25 in the sweep): one step's global batch, the same batch across the grid at one seed."""
  steps = rec['config']['num_train_steps']
  blocks = [b for b in rec['trajectory'] if b['step'] + 1 <= fraction * steps + 1e-9]
  if not blocks:
    return None
  b = blocks[-1]
  if rec.get('diverged_at') is not None and rec['diverged_at'] <= b['step'] + 1:
    return math.inf
  loss = records.finite_or_none(b['loss'])
  return math.inf if loss is None else loss


def final(rec: dict) -> float:
  return autolr_report.mean_bpb([rec])


def bracket(runs: dict[float, dict], rungs, loss=None) -> float | None:
  """Successive halving over ``runs`` (peak LR -> record): at each rung ``(fraction, keep)`` the ``keep`` runs with
  the lowest training loss at that fraction (``loss(record, fraction)``, :func:`loss_at` by default) go on; the peak
  LR of the last one left (None: a rung has no block to compare; ties go to the lower LR), kept by the trainer's own
  ``bracket.survivors``."""
  from hdet_jax.trainer import bracket as trainer_bracket

  alive, loss = dict(runs), loss or loss_at
  for fraction, keep in rungs:
    losses = {lr: loss(r, fraction) for lr, r in alive.items()}
    if any(v is None for v in losses.values()):
      return None
    alive = {lr: alive[lr] for lr in trainer_bracket.survivors(losses, keep)}  # (the product's rule: NaN as inf)
  return min(alive)


def pick(runs: dict[float, dict], fraction: float) -> float | None:
  """The peak LR whose run has the lowest training loss at ``fraction`` of the run: a single rung."""
  return bracket(runs, [(fraction, 1)])


def compute_runs(rungs, n: int = 8) -> float:
  """A bracket's compute in runs: each rung's survivors train to the next, the last one to the end."""
  total, alive, start = 0.0, n, 0.0
  for fraction, keep in rungs:
    total += alive * (fraction - start)
    alive, start = keep, fraction
  return total + alive * (1.0 - start)


def full_grids(folder: str, optim: str, lrs, extra: str | None = None) -> dict[int, dict[float, dict]]:
  """Per seed, the sweep's runs by peak LR (and this experiment's in ``extra``), for the seeds that have every
  point of ``lrs``."""
  by_seed = {}
  paths = glob.glob(os.path.join(folder, optim, 'grid_lr*_s*.json'))
  if extra:
    paths += glob.glob(os.path.join(extra, optim, 'grid_lr*_s*.json'))
  for path in sorted(paths):
    if _GRID.search(path):
      with open(path, encoding='utf-8') as f:
        rec = json.load(f)
      by_seed.setdefault(int(rec['config']['seed']), {})[float(rec['config']['optim']['max_lr'])] = rec
  return {s: g for s, g in sorted(by_seed.items()) if all(lr in g for lr in lrs)}


def extra_dir(workload: str, steps: int, quick: bool, work_root: str) -> str:
  """Where this experiment keeps the grid runs the sweep does not have."""
  if quick:
    return os.path.join(work_root, workload, 'bracket_records')
  return os.path.join(REPO, 'results', 'early_bracket', 'runs', workload, f'steps{steps}')


def complete_grids(workload: str, steps: int, optim: str, seeds, quick: bool, work_root: str) -> int:
  """Trains the sweep's grid points that ``seeds`` lack (the sweep's own config; cached, resumable; several
  processes share the list). Returns how many runs it trained or found cached here."""
  folder = workloads.records_dir(workload, steps, quick, work_root)
  cache = records.RunCache(
    extra_dir(workload, steps, quick, work_root),
    os.path.join(work_root, workload, f'bracket_steps{steps}'),
    workloads.make_record,
    autolr.describe,
  )
  run = workloads.plain_runner(cache, workload, steps, optim, quick, work_root, train=True)
  n = 0
  for seed in seeds:
    for lr in (autolr.QUICK_GRIDS if quick else autolr.GRIDS)[optim]:
      name = autolr.grid_name(optim, lr, seed)
      if not os.path.exists(os.path.join(folder, name + '.json')):
        n += run(name, lr, seed, {}) is not None
  return n


def cell_report(folder: str, optim: str, lrs, extra: str | None = None) -> dict | None:
  """One workload, length and optimizer: per decision fraction, each complete seed's kept LR (as a multiple of the
  sweep's best grid point) and the paired gap of its final to that seed's run at the best point."""
  grid = climb_and_price._grid(folder, optim)  # pylint: disable=protected-access
  seeds = full_grids(folder, optim, lrs, extra)
  if not grid or not seeds:
    return None
  best_lr, best = autolr_report.grid_best(grid)
  out = {'best_lr': best_lr, 'best': best, 'seeds': sorted(seeds), 'fractions': {}, 'halving': {}, 'starts': {}}
  for table, by_name in SCHEDULES.items():
    for name, rungs in by_name.items():
      got = kept_by_seed(seeds, rungs, best_lr)
      if got:
        out[table][name] = {'compute_runs': compute_runs(rungs), **got}
  for start, x in STARTS.items():  # one comparison at the warmup's end, over the points a fan around the start spans
    span = {
      s: {lr: r for lr, r in g.items() if abs(math.log(lr / (best_lr * x))) <= math.log(FAN_SPAN) / 2 + 1e-9}
      for s, g in seeds.items()
    }
    got = kept_by_seed(span, ((WARMUP_END, 1),), best_lr)
    if got:
      out['starts'][start] = {'points': [len(g) for g in span.values()], **got}
  return out


def kept_by_seed(seeds: dict[int, dict[float, dict]], rungs, best_lr: float, loss=None) -> dict | None:
  """Each seed's bracket: the kept LR as a multiple of ``best_lr`` and the paired gap to that seed's run there."""
  kept = {s: bracket(g, rungs, loss) for s, g in seeds.items()}
  if any(lr is None for lr in kept.values()):
    return None
  gaps = [100.0 * (final(seeds[s][lr]) / final(seeds[s][best_lr]) - 1.0) for s, lr in kept.items()]
  return {
    'kept_x': [kept[s] / best_lr for s in sorted(kept)],
    'gaps_pct': [records.finite_or_none(g) for g in gaps],
    'kept_best': sum(1 for lr in kept.values() if lr == best_lr),
  }


def measure(args, work_root: str) -> dict:
  results = {}
  for w in workloads.WORKLOADS:
    for steps in workloads.lengths(w, args.quick):
      folder = workloads.records_dir(w, steps, args.quick, work_root)
      for optim in workloads.WORKLOADS[w][2]:
        if args.train and w in args.workload and (not args.steps or steps in args.steps):
          complete_grids(w, steps, optim, args.seeds, args.quick, work_root)
        c = cell_report(
          folder,
          optim,
          (autolr.QUICK_GRIDS if args.quick else autolr.GRIDS)[optim],
          extra_dir(w, steps, args.quick, work_root),
        )
        if c:
          results.setdefault(w, {}).setdefault(str(steps), {})[optim] = c
  return results


def fmt(x: dict | None) -> str:
  if x is None:
    return '-'
  gaps = [math.inf if g is None else g for g in x['gaps_pct']]
  mean = '+inf' if not math.isfinite(np.mean(gaps)) else f'{np.mean(gaps):+.1f}%'
  return f'{mean} ({x["kept_best"]}/{len(gaps)})'


def tally(cells, schedules=None) -> list[str]:
  """Over every complete seed of every cell: how many brackets ended within 1% of the seed's run at the best point."""
  rows = []
  for table, by_name in (schedules or SCHEDULES).items():
    for name, rungs in by_name.items():
      gaps = [math.inf if g is None else g for *_, c in cells if name in c[table] for g in c[table][name]['gaps_pct']]
      if gaps:
        label = f'one comparison at f = {name}' if table == 'fractions' else name
        rows.append(
          f'| {label} | {compute_runs(rungs):.2g} | '
          f'{sum(1 for g in gaps if g <= 1.0)} of {len(gaps)} | {np.median(gaps):+.2f}% | {max(gaps):+.1f}% |'
        )
  return [
    '',
    '## Over all cells',
    '',
    "Per seed and cell: within 1% of the same seed's run at the sweep's best "
    'grid point, the median and the largest gap.',
    '',
    '| bracket | compute (runs) | within 1% | median | largest |',
    '|---|---|---|---|---|',
  ] + rows


def write_report(out_dir: str, results: dict, quick: bool) -> list[str]:
  cells = [
    (w, s, o, c) for w, by_steps in results.items() for s, by_optim in by_steps.items() for o, c in by_optim.items()
  ]
  lines = [
    '# A bracket apart at the full batch, decided early',
    '',
    f"Generated by `python -m research.early_bracket{' --quick' if quick else ''}` from the sweep's records "
    '(nothing trained); the reading is in `research/workloads_discussion.md` (fifteenth pass).',
    '',
    "The sweep's 8 runs (peak LRs a factor 2 apart) compared once at a fraction f of the run by their training "
    "loss on the same batch (that of the last recorded step by then: records keep every 25th step's, one step's "
    'global batch), the lowest kept and run on: its final '
    "against the same seed's run at the sweep's best grid point (paired; mean over the seeds whose grid is "
    'complete), and in brackets how many of them kept the best point. Compute: 1 + 7 f runs (HDET 1, the '
    'sweep 8). Diverged runs lose.',
    '',
    '| workload | steps | optim | seeds | '
    + ' | '.join(f'f = {n} ({compute_runs(r):.2g} runs)' for n, r in SCHEDULES['fractions'].items())
    + ' |',
    '|---|---|---|---|' + '---|' * len(FRACTIONS),
  ]
  for w, steps, optim, c in cells:
    lines.append(
      f'| {w} | {steps} | {optim} | {",".join(map(str, c["seeds"]))} | '
      + ' | '.join(fmt(c['fractions'].get(f'{f:g}')) for f in FRACTIONS)
      + ' |'
    )
  lines += [
    '',
    "## Successive halving, ending at the warmup's end",
    '',
    'Rungs: at each fraction the runs with the lowest training loss go on (8 -> 4 -> 1: the best 4 at 0.1 of '
    'the run, the best of those at 0.3); compute in runs. The schedules shown are all that were computed.',
    '',
    '| workload | steps | optim | '
    + ' | '.join(f'{n} ({compute_runs(r):.2g} runs)' for n, r in HALVING.items())
    + ' |',
    '|---|---|---|' + '---|' * len(HALVING),
  ]
  for w, steps, optim, c in cells:
    lines.append(f'| {w} | {steps} | {optim} | ' + ' | '.join(fmt(c['halving'].get(n)) for n in HALVING) + ' |')
  lines += [
    '',
    "## From each start: one comparison at the warmup's end over a 128x fan around it",
    '',
    "The sweep's points within a factor sqrt(128) of the start (10x below, at or 10x above the sweep's best; "
    'a fan of 8 a factor 2 apart spans 128x), compared at 0.3 of the run; in brackets the seeds that kept the '
    'best point and the points per seed.',
    '',
    '| workload | steps | optim | ' + ' | '.join(STARTS) + ' |',
    '|---|---|---|' + '---|' * len(STARTS),
  ]
  for w, steps, optim, c in cells:
    lines.append(
      f'| {w} | {steps} | {optim} | '
      + ' | '.join(
        fmt(c['starts'].get(k)) + ('' if k not in c['starts'] else f', {min(c["starts"][k]["points"])} points')
        for k in STARTS
      )
      + ' |'
    )
  lines += tally(cells) + kept_table(cells, FRACTIONS)
  return records.write_report(out_dir, 'early_bracket', results, lines)


def kept_table(cells, fractions, label=lambda workload, cell: workload) -> list[str]:
  """The report's last table: the LR each single comparison kept per seed, as multiples of the sweep's best."""
  lines = [
    '',
    "The LR kept, as multiples of the sweep's best grid point (per seed):",
    '',
    '| workload | steps | optim | ' + ' | '.join(f'f = {f:g}' for f in fractions) + ' |',
    '|---|---|---|' + '---|' * len(fractions),
  ]
  for w, steps, optim, c in cells:
    lines.append(
      f'| {label(w, c)} | {steps} | {optim} | '
      + ' | '.join(
        '-' if f'{f:g}' not in c['fractions'] else ' '.join(f'{x:g}' for x in c['fractions'][f'{f:g}']['kept_x'])
        for f in fractions
      )
      + ' |'
    )
  return lines


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--quick', action='store_true', help="the quick sweep's records (run research.workloads --quick)")
  p.add_argument('--workdir', default=None, help='the workloads work root (default workdirs/workloads[_quick])')
  p.add_argument('--train', action='store_true', help='train the grid points the seeds lack (else read records only)')
  p.add_argument('--workload', default=','.join(workloads.WORKLOADS), help='comma-separated workloads to train')
  p.add_argument('--steps', default='', help='comma-separated run lengths to train (default: every length)')
  p.add_argument('--seeds', default='0,1,2', help='comma-separated seeds whose grids --train completes')
  p.add_argument('--report-only', action='store_true', help='read the records, train nothing (the default)')
  p.add_argument('--out', default=None, help="the report's folder (default: results/; --quick: the workdir)")
  args = p.parse_args(sys.argv[1:] if argv is None else argv)
  if args.report_only and args.train:
    p.error('--train trains the grid and --report-only trains nothing; drop one of them')
  workloads.parse_cells(p, args)
  work_root = args.workdir or os.path.join(REPO, 'workdirs', 'workloads_quick' if args.quick else 'workloads')
  if args.train:
    from hdet_jax.trainer import process

    process.setup_jax(workloads.base_config('lm', 16, args.quick))  # 8 CPU devices, as the sweep's runs had
  out = args.out or (work_root if args.quick else os.path.join(REPO, 'results'))
  print('\n'.join(f'  {path}' for path in write_report(out, measure(args, work_root), args.quick)))


if __name__ == '__main__':
  main()
