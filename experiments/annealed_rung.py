"""The LR bracket whose last rung ranks annealed copies (``bracket.anneal=0.1``, hdet_jax/trainer/bracket.py) against
the default bracket (the same 8 points, 5 kept at 0.1 of the run, 1 at 0.3, ranked on the runs' own training loss)
and the one-cycle sweep, on the workloads of ``results/workloads.md`` and the held-out checks of
``experiments.heldout_task``.

The twenty-seventh pass of the defaults issue found, by picking among a sweep's runs, that at the last rung (0.3 of a
one-cycle run, the end of its warmup) the training loss ranks a neighbour of the sweep's best first, and that a copy
annealed from there over 0.1 of the run ranks the best first on 15 of 16 MNIST-1D seeds. Here the bracket itself does
it: each run still going at the last rung is forked and annealed, the copies are ranked, and the kept run goes on
unannealed (3.0 runs of compute, against the default's 2.5).

    python -m experiments.annealed_rung                        # train what is missing (cached, resumable), report
    python -m experiments.annealed_rung --cells mnist1d:1000:sgd --seeds 0
    python -m experiments.annealed_rung --report-only
    python -m experiments.annealed_rung --quick                # a smoke run: the tiny LM, one start and seed
    python -m experiments.heldout_task --annealed 0,1,2,3,4,5,6,7   # the held-out checks' annealed brackets

Each workload row pairs the annealed bracket seed by seed with the default bracket (``results/wider_rung.json``'s
8-5-1 brackets, the same points and batches) and gives both 3-seed means against the sweep's best 3-seed mean. The
held-out checks pair both brackets with the sweep's run at its best LR on 8 seeds (``heldout_task.paired``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import numpy as np

from experiments import autolr
from experiments import bracket_mode
from experiments import heldout_task
from experiments import records

REPO = autolr.REPO
# The workload cells trained here: MNIST-1D at 1000 steps, where the default bracket misses (results/wider_rung.md),
# and the LM and fine-tuning at their shortest lengths, where it is within 1% and the anneal must not cost that.
CELLS = ('mnist1d:1000:adamw', 'mnist1d:1000:sgd', 'lm:750:adamw', 'finetune:300:adamw')
SEEDS = (0, 1, 2)
ANNEAL = heldout_task.BRACKETS['annealed']
BRACKET = {**heldout_task.BRACKET, 'bracket.anneal': ANNEAL}
QUICK_BRACKET = {**bracket_mode.QUICK_BRACKET, 'bracket.anneal': 0.25}
HELDOUT_SEEDS = heldout_task.SEEDS + heldout_task.FRESH_SEEDS


def record_path(cell: str, start: str, seed: int, quick: bool, work_root: str) -> str:
  workload, steps, optim = bracket_mode.parse_cell(cell)
  root = os.path.join(work_root, 'annealed_rung_quick') if quick else os.path.join(REPO, 'results', 'annealed_rung', 'runs')
  return os.path.join(root, workload, f'steps{steps}', optim, f'{start}_s{seed}.json')


def train_one(cell: str, start: str, seed: int, quick: bool, work_root: str) -> dict:
  """One annealed bracket (cached: its record; resumable: its workdir until the record is written)."""
  path = record_path(cell, start, seed, quick, work_root)
  if os.path.exists(path):
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  config = bracket_mode.config_for(cell, start, seed, quick, work_root, QUICK_BRACKET if quick else BRACKET)
  workdir = os.path.join(work_root, 'annealed_rung', cell.replace(':', '_'), f'{start}_s{seed}')
  rec = records.train_run(f'{cell} {start} s{seed}', config, workdir)
  rec.update(cell=cell, start=start, seed=seed, anchor_lr=bracket_mode.anchor_lr(cell, quick))
  records.write_json(path, rec, indent=1)
  shutil.rmtree(workdir, ignore_errors=True)
  print(f'  {cell} {start} s{seed}: kept {rec["kept_lr"] / rec["anchor_lr"]:.3g}x, final {rec["final_metric"]}, '
        f'{rec["wall_s"]:.0f}s', flush=True)
  return rec


def default_brackets(cell: str) -> dict:
  """The default bracket's (8-5-1) records per (start, seed): its kept LR and final metric (results/wider_rung.json)."""
  with open(os.path.join(REPO, 'results', 'wider_rung.json'), encoding='utf-8') as f:
    rows = json.load(f)['rows'].get(cell, {})
  return {(start, s['seed']): s['wider']['1'] for start, row in rows.items() for s in row['seeds']}


def cell_rows(recs: dict, default: dict, best: float | None, seeds=SEEDS) -> dict:
  """Per start with all of ``seeds``: both brackets' 3-seed means and gaps to the sweep's best ``best``, and the
  annealed one's per-seed difference from the default (mean and standard error, ``records.paired_gap``)."""
  out = {}
  for start in bracket_mode.STARTS:
    if not all((start, s) in recs for s in seeds):
      continue
    mine = [records.finite_or_none(recs[(start, s)]['final_metric']) for s in seeds]
    row = {'annealed': mine, 'kept_x': [recs[(start, s)]['kept_lr'] / recs[(start, s)]['anchor_lr'] for s in seeds]}
    theirs = [default.get((start, s), {}).get('final_metric') for s in seeds]
    if best is not None and None not in mine:
      row['gap'] = float(np.mean(mine)) / best - 1
    if best is not None and None not in theirs:
      row['default'] = theirs
      row['default_gap'] = float(np.mean(theirs)) / best - 1
      row['vs_default'], row['vs_default_se'] = records.paired_gap(mine, theirs)
    out[start] = row
  return out


def workload_lines(results: dict) -> list[str]:
  lines = ['| cell | start | sweep best | default bracket (2.5 runs) | annealed last rung (3.0 runs) | annealed vs default, '
           'paired by seed | annealed\'s kept LR (x the start\'s reference), per seed |', '|---|---|---|---|---|---|---|']
  for cell, r in results.items():
    for start, row in r['starts'].items():
      vs = ('-' if row.get('vs_default') is None else
            f"{100 * row['vs_default']:+.1f} ± {100 * (row['vs_default_se'] or 0):.1f}%")
      kept = ' / '.join(f'{x:.3g}' for x in row['kept_x'])
      lines.append(f"| {cell} | {start} | {r['best']:.4g} | {records.pct(row.get('default_gap'))} | "
                   f"{records.pct(row.get('gap'))} | {vs} | {kept} |")
  return lines


def heldout_lines(quick: bool, work_root: str) -> tuple[list[str], dict]:
  """The held-out checks: both brackets paired by seed with the sweep's run at its best LR, on 8 seeds."""
  lines, out = [], {}
  text = lambda g: '-' if g['gap'] is None else f"{100 * g['gap']:+.1f} ± {100 * (g['se'] or 0):.1f}% ({records.verdict(g)})"
  for check in heldout_task.CHECKS:
    site = heldout_task.Site(check, quick, work_root)
    seeds = heldout_task.plan(site)['seeds'] + (() if quick else heldout_task.FRESH_SEEDS)
    if any(heldout_task.load(f'annealed_{start}_s{s}', site) is None for start in heldout_task.plan(site)['starts']
           for s in seeds):
      continue
    r = heldout_task.paired(site, seeds, ('bracket', 'annealed'))
    if r is None:
      continue
    out[check] = r
    for start, row in r['starts'].items():
      kept = [heldout_task.load(f'annealed_{start}_s{s}', site)['kept_lr'] / r['best_lr'] for s in seeds]
      lines.append(f"| {check} | {start} | {r['best']:.4g} at {r['best_lr']:g} | {text(row['bracket'])} | "
                   f"{text(row['annealed'])} | {' / '.join(f'{x:.2g}' for x in kept)} |")
  head = [f'| check | start | sweep best (mean of seeds {",".join(map(str, seeds))}) | default bracket, paired | '
          'annealed last rung, paired | annealed\'s kept LR (x the sweep\'s best), per seed |',
          '|---|---|---|---|---|---|'] if lines else []
  return head + lines, out


def report(cells: list[str], quick: bool, work_root: str) -> list[str]:
  results = {}
  for cell in cells:
    recs = {(start, s): json.load(open(p, encoding='utf-8')) for start in bracket_mode.STARTS for s in SEEDS
            if os.path.exists(p := record_path(cell, start, s, quick, work_root))}
    if not recs:
      continue
    best = None if quick else bracket_mode.sweep_cell(cell)['grid_best']['value']
    results[cell] = {'best': best if best is not None else float('nan'),
                     'starts': cell_rows(recs, {} if quick else default_brackets(cell), best, (0,) if quick else SEEDS)}
  held, held_results = heldout_lines(quick, work_root)
  lines = ['# The LR bracket with an annealed last rung (bracket.anneal=0.1)', '',
           'Made by `python -m experiments.annealed_rung` (records in `results/annealed_rung/runs/`) and, for the held-out '
           'checks, `python -m experiments.heldout_task --annealed 0,...,7` (records `annealed_<start>_s<seed>` in '
           '`results/heldout_task/runs/<check>/`). The bracket: 8 plain runs a factor 2 apart centred 10x below, at or '
           '10x above the sweep\'s first-seed best, 5 kept at 0.1 of the run; at 0.3 each of the 5 is forked, its copy '
           'annealed to the schedule\'s end LR over 0.1 of the run, and the copy with the lowest training loss over its '
           'last 10 steps names the run that goes on (unannealed) to the end. The default bracket is the same but ranks '
           'the runs\' own loss at 0.3. Gaps: final metric (lower is better) against the sweep\'s best.', '',
           '## Workloads (3 seeds)', '',
           'The default bracket\'s records are `results/wider_rung.json`\'s 8-5-1 brackets: the same points, seeds and '
           'batches. "Annealed vs default": the mean of the per-seed relative differences of the two brackets\' finals, '
           '± their standard error.', '', *workload_lines(results), '',
           '## Held-out checks (8 seeds)', '',
           'Both brackets paired seed by seed with the sweep\'s run at its best LR (the lowest mean over the 8 seeds); '
           '± the standard error of the per-seed gaps; "within" 1% or below, a "miss" beyond 1% by more than 2 of them, '
           'or "not resolved" (`records.verdict`).', '', *(held or ['(not trained)'])]
  out = work_root if quick else os.path.join(REPO, 'results')
  records.write_report(out, 'annealed_rung', {'workloads': results, 'heldout': held_results}, lines)
  return lines


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--cells', default=','.join(CELLS), help='workload:steps:optim,... to train (the report reads all)')
  p.add_argument('--seeds', default=','.join(map(str, SEEDS)), help='seeds to train (the report reads 0, 1, 2)')
  p.add_argument('--starts', default=','.join(bracket_mode.STARTS), help='starts to train: low, best, high')
  p.add_argument('--report-only', action='store_true', help='read the records, train nothing')
  p.add_argument('--quick', action='store_true', help='a smoke run: the tiny LM, one start and seed')
  p.add_argument('--workdir', default=None, help='where the brackets train (default: workdirs/annealed_rung)')
  args = p.parse_args(argv)
  cells = args.cells.split(',')
  if not args.quick and set(cells) - set(CELLS):
    p.error(f'--cells must name some of {", ".join(CELLS)}, got {args.cells!r}')
  work_root = os.path.abspath(args.workdir or os.path.join(REPO, 'workdirs', 'annealed_rung_quick' if args.quick
                                                           else 'workloads'))
  if args.quick:
    cells, starts, seeds = ['lm:16:adamw'], ['best'], [0]
  else:
    starts, seeds = args.starts.split(','), [int(x) for x in args.seeds.split(',')]
  if not args.report_only:
    for cell in cells:
      for seed in seeds:
        for start in starts:
          train_one(cell, start, seed, args.quick, work_root)
  print('\n'.join(report(cells if args.quick else list(CELLS), args.quick, work_root)))


if __name__ == '__main__':
  main()
