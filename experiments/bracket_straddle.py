"""The two points a bracket centred on the sweep's best holds nearest it, trained to the end.

Issue 26, twentieth pass. Centred on the one-cycle sweep's best peak LR, the LR bracket (``results/bracket_mode.md``)
trains 8 points a factor 2 apart, so its two nearest the best are 0.71x and 1.41x: it cannot keep the best itself.
On mnist1d with AdamW it kept 1.41x on every seed at every length and missed by 5-28%. This trains both neighbours
as plain runs, as the sweep trains its grid (3 seeds), to tell apart the two readings: the rungs took the worse
neighbour, or both neighbours end as far from the best (the grid's offset on a sharp optimum).

    python -m experiments.bracket_straddle            # train what is missing (cached, resumable), then report
    python -m experiments.bracket_straddle --report-only
    python -m experiments.bracket_straddle --quick    # a smoke run: the tiny LM, 16 steps, one seed
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from experiments import autolr
from experiments import bracket_mode
from experiments import records
from experiments import workloads

REPO = autolr.REPO
CELLS = ('mnist1d:500:adamw', 'mnist1d:1000:adamw', 'mnist1d:2000:adamw')
SEEDS = (0, 1, 2)
NEIGHBOURS = ('below', 'above')  # the bracket's points just below and just above its centre


def neighbour_lrs(anchor: float) -> dict[str, float]:
  """The two points of a bracket centred on ``anchor`` nearest it (its own grid: the same floats it trains)."""
  from hdet_jax.trainer import bracket
  b = bracket_mode.BRACKET
  lrs = sorted(bracket.point_lrs(anchor, b['bracket.points'], b['bracket.factor']))
  below = max(lr for lr in lrs if lr < anchor)
  return {'below': below, 'above': min(lr for lr in lrs if lr > anchor)}


def records_dir(cell: str, quick: bool, work_root: str) -> str:
  workload, steps, optim = bracket_mode.parse_cell(cell)
  root = os.path.join(work_root, 'bracket_straddle_quick') if quick else os.path.join(REPO, 'results', 'bracket_straddle', 'runs')
  return os.path.join(root, workload, f'steps{steps}', optim)


def train_cell(cell: str, seeds: list[int], quick: bool, work_root: str) -> None:
  """Both neighbours on every seed (cached records; a preempted run resumes)."""
  workload, steps, optim = bracket_mode.parse_cell(cell)
  cache = records.RunCache(records_dir(cell, quick, work_root),
                           os.path.join(work_root, 'bracket_straddle', workload, f'steps{steps}', optim),
                           autolr.make_record, autolr.describe)
  run = workloads.plain_runner(cache, workload, steps, optim, quick, work_root, train=True)
  for side, lr in neighbour_lrs(bracket_mode.anchor_lr(cell, quick)).items():
    for seed in seeds:
      run(f'{side}_s{seed}', lr, seed, {})


def cell_row(cell: str, seeds: list[int], quick: bool, work_root: str) -> dict:
  """Per neighbour its LR (x the anchor), per-seed final metrics and mean; the sweep's best and the bracket's
  from-the-best mean beside them (not in quick mode)."""
  anchor = bracket_mode.anchor_lr(cell, quick)
  row = {'cell': cell, 'anchor_lr': anchor, 'neighbours': {}}
  for side, lr in neighbour_lrs(anchor).items():
    got = []
    for seed in seeds:
      p = os.path.join(records_dir(cell, quick, work_root), f'{side}_s{seed}.json')
      if os.path.exists(p):
        with open(p, encoding='utf-8') as f:
          got.append(json.load(f)['val_bpb'])
    finite = [v for v in got if v is not None]
    row['neighbours'][side] = {'lr': lr, 'x': lr / anchor, 'values': got,
                               'mean': float(np.mean(finite)) if finite and len(finite) == len(got) else None}
  if not quick:
    sweep = bracket_mode.sweep_cell(cell)
    row['sweep_best'] = sweep['grid_best']['value']
    brackets = []
    for seed in SEEDS:
      p = bracket_mode.record_path(cell, 'best', seed, False, work_root)
      if os.path.exists(p):
        with open(p, encoding='utf-8') as f:
          brackets.append(json.load(f))
    row['bracket_best_start'] = {'kept_x': [r['kept_lr'] / r['anchor_lr'] for r in brackets],
                                 'mean': float(np.mean([r['final_metric'] for r in brackets])) if brackets else None}
  return row


def _gap(value, best) -> str:
  return '-' if value is None or best is None else f'{100 * (value / best - 1):+.1f}%'


def write_report(out_dir: str, rows: list[dict], quick: bool) -> str:
  lines = ['# The bracket\'s two points nearest the sweep\'s best, trained to the end', '',
           f'Made by `python -m experiments.bracket_straddle{" --quick" if quick else ""}` (records in '
           '`results/bracket_straddle/runs/`). A bracket centred on the sweep\'s best (its first seed\'s) holds 8 '
           'points a factor 2 apart, so its two nearest the best are 0.71x and 1.41x. Each is trained here as a plain '
           'one-cycle run, as the sweep trains its grid; gaps are 3-seed means against the sweep\'s best 3-seed mean. '
           'The reading is in `experiments/workloads_discussion.md` (twentieth pass).', '',
           '| cell | sweep best | 0.71x per seed | 0.71x gap | 1.41x per seed | 1.41x gap | bracket from the best: kept, gap |',
           '|---|---|---|---|---|---|---|']
  for r in rows:
    best = r.get('sweep_best')
    below, above = r['neighbours']['below'], r['neighbours']['above']
    per_seed = lambda n: ' / '.join('-' if v is None else f'{v:.4g}' for v in n['values']) or '-'
    b = r.get('bracket_best_start') or {}
    kept = ' / '.join(f'{x:.2f}x' for x in b.get('kept_x', [])) or '-'
    lines.append(f'| {r["cell"]} | {"-" if best is None else f"{best:.4g}"} | {per_seed(below)} | '
                 f'{_gap(below["mean"], best)} | {per_seed(above)} | {_gap(above["mean"], best)} | '
                 f'{kept}, {_gap(b.get("mean"), best)} |')
  os.makedirs(out_dir, exist_ok=True)
  records.write_json(os.path.join(out_dir, 'bracket_straddle.json'), rows, indent=1)
  md = os.path.join(out_dir, 'bracket_straddle.md')
  with open(md, 'w', encoding='utf-8') as f:
    f.write('\n'.join(lines) + '\n')
  return md


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--cells', default=','.join(CELLS), help='workload:steps:optim,... to train')
  p.add_argument('--seeds', default=','.join(map(str, SEEDS)), help='seeds to train (the report reads them all)')
  p.add_argument('--report-only', action='store_true', help='read the records, train nothing')
  p.add_argument('--quick', action='store_true', help='a smoke run: the tiny LM, 16 steps, one seed')
  p.add_argument('--workdir', default=None, help='where runs train (default: workdirs/workloads)')
  args = p.parse_args(argv)
  work_root = args.workdir or os.path.join(REPO, 'workdirs', 'bracket_mode_quick' if args.quick else 'workloads')
  cells = ['lm:16:adamw'] if args.quick else args.cells.split(',')
  seeds = [0] if args.quick else [int(s) for s in args.seeds.split(',')]
  if not args.report_only:
    from hdet_jax import trainer
    trainer.setup_jax(workloads.base_config('lm', 16, True))
    for cell in cells:
      train_cell(cell, seeds, args.quick, work_root)
  rows = [cell_row(c, [0] if args.quick else list(SEEDS), args.quick, work_root) for c in (cells if args.quick else CELLS)]
  md = write_report(work_root if args.quick else os.path.join(REPO, 'results'), rows, args.quick)
  with open(md, encoding='utf-8') as f:
    print(f.read())


if __name__ == '__main__':
  main()
