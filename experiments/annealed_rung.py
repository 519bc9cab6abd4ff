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

Each bracket records its runs' own losses at the last rung beside the copies' (``run_losses``), so the default
bracket is read from the same brackets, its pick trained to the end where it differs: both on one machine, paired
seed by seed. Workload rows give both against the sweep's best 3-seed mean, with ``results/wider_rung.json``'s
committed default brackets beside them; the held-out checks pair both with the sweep's run at its best LR.
"""

from __future__ import annotations

import argparse
import contextlib
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


def _records_root(quick: bool, work_root: str) -> str:
  return os.path.join(work_root, 'annealed_rung_quick') if quick else os.path.join(REPO, 'results', 'annealed_rung', 'runs')


def record_path(cell: str, start: str, seed: int, quick: bool, work_root: str) -> str:
  workload, steps, optim = bracket_mode.parse_cell(cell)
  return os.path.join(_records_root(quick, work_root), workload, f'steps{steps}', optim, f'{start}_s{seed}.json')


def train_one(cell: str, start: str, seed: int, quick: bool, work_root: str) -> dict:
  """One annealed bracket (cached: its record; resumable: its workdir until the record is written)."""
  path = record_path(cell, start, seed, quick, work_root)
  if (rec := _load(path)) is not None:
    return rec
  config = bracket_mode.config_for(cell, start, seed, quick, work_root, QUICK_BRACKET if quick else BRACKET)
  workdir = os.path.join(work_root, 'annealed_rung', cell.replace(':', '_'), f'{start}_s{seed}')
  rec = records.train_run(f'{cell} {start} s{seed}', config, workdir)
  rec.update(cell=cell, start=start, seed=seed, anchor_lr=bracket_mode.anchor_lr(cell, quick))
  records.write_record(path, rec, indent=1)
  shutil.rmtree(workdir, ignore_errors=True)
  print(f'  {cell} {start} s{seed}: kept {rec["kept_lr"] / rec["anchor_lr"]:.3g}x, final {rec["final_metric"]}, '
        f'{rec["wall_s"]:.0f}s', flush=True)
  return rec


def default_pick(rec: dict) -> float | None:
  """The point the default bracket keeps from the same brackets: the last rung's runs ranked by their own losses
  there (``run_losses``, recorded beside the annealed copies'; None: a record without them)."""
  from hdet_jax.trainer import bracket
  last = rec['rungs'][-1]
  if 'run_losses' not in last:
    return None
  by_key = {f'{lr:.6g}': lr for lr in rec['lrs']}  # (the rungs' keys are the LRs to 6 digits: the points' own LRs)
  (kept,) = bracket.survivors({by_key[k]: v for k, v in last['run_losses'].items()}, 1)
  return kept


def end_path(cell: str, start: str, seed: int, lr: float, quick: bool, work_root: str) -> str:
  """Where the default bracket's point ``lr`` trained to the end is recorded (a held-out check's ``cell``: its name)."""
  if cell in heldout_task.CHECKS:
    return os.path.join(_records_root(quick, work_root), 'heldout', cell,
                        f'{start}_s{seed}_end_lr{records.lr_tag(lr, 6)}.json')
  return record_path(cell, start, seed, quick, work_root).replace('.json', f'_end_lr{records.lr_tag(lr, 6)}.json')


def _end_config(cell: str, start: str, seed: int, lr: float, quick: bool, work_root: str):
  """The config of the bracket's point ``lr`` trained to the end, as a bracket trains its winner."""
  from hdet_jax.trainer import bracket
  if cell in heldout_task.CHECKS:
    return heldout_task.config_for(f'end_lr{records.lr_tag(lr, 6)}_at_{start}_s{seed}',
                                   heldout_task.Site(cell, quick, work_root), lr)
  base = bracket_mode.config_for(cell, start, seed, quick, work_root, QUICK_BRACKET if quick else BRACKET)
  return bracket.point_config(base, lr, 0)


def default_final(cell: str, rec: dict, start: str, seed: int, quick: bool, work_root: str,
                  train: bool) -> float | None:
  """The default bracket's final metric on this record's footing (``cell``: a workload cell or a held-out check): the
  annealed bracket's own where both keep the same point (the same run), else that point trained to the end as a
  bracket trains its winner (cached; None: not trained, or the record has no ``run_losses``)."""
  lr = default_pick(rec)
  if lr is None:
    return None
  if lr == rec['kept_lr']:
    return records.finite_or_none(rec['final_metric'])
  path = end_path(cell, start, seed, lr, quick, work_root)
  if not os.path.exists(path):
    if not train:
      return None
    workdir = os.path.join(work_root, 'annealed_rung', cell.replace(':', '_'), f'{start}_s{seed}_end')
    with contextlib.chdir(REPO):  # (a held-out check's data.path is relative to the repository)
      end = records.train_run(f'{cell} {start} s{seed} end {lr:.6g}', _end_config(cell, start, seed, lr, quick,
                                                                                   work_root), workdir)
    records.write_record(path, end, indent=1)
    shutil.rmtree(workdir, ignore_errors=True)
  return records.finite_or_none(_load(path)['final_metric'])


def recorded_defaults(cell: str) -> dict:
  """The default bracket's (8-5-1) final metric per (start, seed), as ``results/wider_rung.json`` recorded it (made on
  another footing for most cells: its first-rung losses are not these records' bit for bit)."""
  with open(os.path.join(REPO, 'results', 'wider_rung.json'), encoding='utf-8') as f:
    rows = json.load(f)['rows'].get(cell, {})
  return {(start, s['seed']): s['wider']['1']['final_metric'] for start, row in rows.items() for s in row['seeds']}


def start_row(annealed: list, default: list, reference: list, kept_x: list, picks_differ: int) -> dict:
  """One start: both brackets paired seed by seed with ``reference`` (the sweep's best, per seed or its mean repeated),
  and the annealed one with the default (``records.paired_gap``: gap of the means, standard error of per-seed gaps)."""
  gap = lambda v, r: dict(zip(('gap', 'se'), records.paired_gap(v, r)))
  return {'annealed': gap(annealed, reference), 'default': gap(default, reference),
          'vs_default': gap(annealed, default), 'kept_x': kept_x, 'picks_differ': picks_differ,
          'finals': annealed, 'default_finals': default}


def workload_rows(cell: str, quick: bool, work_root: str, train: bool, seeds=SEEDS) -> dict | None:
  """Per start, over the seeds of ``seeds`` with a record: the two brackets against the sweep's best 3-seed mean
  (results/workloads.json), and the default as recorded on the same seeds beside them. None: no records."""
  best = None if quick else bracket_mode.sweep_cell(cell)['grid_best']['value']
  recorded = {} if quick else recorded_defaults(cell)
  starts = {}
  for start in bracket_mode.STARTS:
    have = [s for s in seeds if os.path.exists(record_path(cell, start, s, quick, work_root))]
    if not have:
      continue
    recs = [_load(record_path(cell, start, s, quick, work_root)) for s in have]
    default = [default_final(cell, r, start, s, quick, work_root, train) for r, s in zip(recs, have)]
    ref = [best] * len(have) if best is not None else [r['final_metric'] for r in recs]
    row = start_row([records.finite_or_none(r['final_metric']) for r in recs], default, ref,
                    [r['kept_lr'] / r['anchor_lr'] for r in recs],
                    sum(default_pick(r) != r['kept_lr'] for r in recs))
    mine = [recorded.get((start, s)) for s in have]
    row['recorded_default'] = None if best is None or None in mine else float(np.mean(mine)) / best - 1
    row['seeds'] = have
    starts[start] = row
  return {'best': best, 'starts': starts} if starts else None


def heldout_rows(check: str, quick: bool, work_root: str, train: bool) -> dict | None:
  """One held-out check, on the seeds with every start's annealed record (at least 3): both brackets paired seed by
  seed with the sweep's run at its best LR (the lowest mean over those seeds), and the committed default bracket."""
  site = heldout_task.Site(check, quick, work_root)
  plan = heldout_task.plan(site)
  seeds = tuple(s for s in plan['seeds'] + (() if quick else heldout_task.FRESH_SEEDS)
                if all(heldout_task.load(f'annealed_{start}_s{s}', site) for start in plan['starts']))
  if len(seeds) < len(plan['seeds']):
    return None
  grid = {lr: [heldout_task.final(heldout_task.grid_name(lr, s), site) for s in seeds] for lr in plan['grid']}
  best = records.best_lr(grid)
  starts = {}
  for start in plan['starts']:
    recs = [heldout_task.load(f'annealed_{start}_s{s}', site) for s in seeds]
    default = [default_final(check, r, start, s, quick, work_root, train) for r, s in zip(recs, seeds)]
    row = start_row([records.finite_or_none(r['final_metric']) for r in recs], default, grid[best],
                    [r['kept_lr'] / best for r in recs], sum(default_pick(r) != r['kept_lr'] for r in recs))
    committed = [heldout_task.final(f'bracket_{start}_s{s}', site) for s in seeds]
    row['recorded_default'] = dict(zip(('gap', 'se'), records.paired_gap(committed, grid[best])))
    starts[start] = row
  return {'seeds': list(seeds), 'best_lr': best, 'best': float(np.mean(grid[best])), 'starts': starts}


def _load(path: str) -> dict | None:
  if not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def _gap(g: dict | None, verdict: bool = False) -> str:
  if not g or g.get('gap') is None:
    return '-'
  text = f"{100 * g['gap']:+.1f}" + (f" ± {100 * g['se']:.1f}%" if g.get('se') is not None else '%')
  return text + (f' ({records.verdict(g)})' if verdict else '')


def workload_lines(results: dict) -> list[str]:
  lines = ['| cell | start | seeds | sweep best (3 seeds) | default bracket, as recorded (2.5 runs) | default bracket, here | annealed last '
           'rung (3.0 runs) | annealed vs default here, paired | seeds whose pick differs | annealed\'s kept LR (x the '
           'start\'s reference), per seed |', '|---|---|---|---|---|---|---|---|---|---|']
  for cell, r in results.items():
    for start, row in r['starts'].items():
      kept = ' / '.join(f'{x:.3g}' for x in row['kept_x'])
      best = '-' if r['best'] is None else f"{r['best']:.4g}"
      lines.append(f"| {cell} | {start} | {len(row['seeds'])} | {best} | "
                   f"{records.pct(row['recorded_default'])} | {_gap(row['default'])} | {_gap(row['annealed'])} | "
                   f"{_gap(row['vs_default'])} | {row['picks_differ']} | {kept} |")
  return lines


def heldout_lines(results: dict) -> list[str]:
  lines = []
  for check, r in results.items():
    for start, row in r['starts'].items():
      kept = ' / '.join(f'{x:.2g}' for x in row['kept_x'])
      lines.append(f"| {check} | {start} | {len(r['seeds'])} | {r['best']:.4g} at {r['best_lr']:g} | "
                   f"{_gap(row['recorded_default'], True)} | {_gap(row['default'], True)} | {_gap(row['annealed'], True)} | "
                   f"{_gap(row['vs_default'])} | {row['picks_differ']} | {kept} |")
  head = ['| check | start | seeds | sweep best (mean over the seeds) | default bracket, as committed | default bracket, '
          'here | annealed last rung | annealed vs default here | seeds whose pick differs | annealed\'s kept LR (x the '
          'sweep\'s best), per seed |', '|---|---|---|---|---|---|---|---|---|---|']
  return head + lines if lines else ['(not trained)']


def report(cells: list[str], quick: bool, work_root: str, train: bool = False) -> list[str]:
  """Writes ``annealed_rung.{md,json}`` (results/, or a quick run's ``work_root``); trains the default's differing
  picks to the end first where ``train``. Its lines."""
  work = {c: r for c in cells if (r := workload_rows(c, quick, work_root, train, (0,) if quick else SEEDS))}
  held = {} if quick else {c: r for c in heldout_task.CHECKS if (r := heldout_rows(c, quick, work_root, train))}
  lines = ['# The LR bracket with an annealed last rung (bracket.anneal=0.1)', '',
           'Made by `python -m experiments.annealed_rung` (records in `results/annealed_rung/runs/`) and, for the '
           'held-out checks, `python -m experiments.heldout_task --annealed 0,...,7` (records `annealed_<start>_s<seed>` '
           'in `results/heldout_task/runs/<check>/`). The bracket: 8 plain runs a factor 2 apart centred 10x below, at '
           'or 10x above the sweep\'s first-seed best, 5 kept at 0.1 of the run; at 0.3 each of the 5 is forked, its '
           'copy annealed to the schedule\'s end LR over 0.1 of the run, and the copy with the lowest training loss '
           'over its last 10 steps names the run that goes on, unannealed, to the end (3.0 runs of compute). The '
           'default bracket ranks the runs\' own losses at 0.3 instead (2.5 runs). "Here": the default bracket read '
           'from the same brackets (each records the runs\' own losses at 0.3 beside the copies\'), its pick trained to '
           'the end where it differs, so both brackets share their points, batches and machine. "As recorded": the '
           'default bracket\'s committed records, made on another footing (their first-rung losses differ from these '
           'in the 8th digit and more), which moves a run\'s end by up to several percent. Gaps: final metric (lower is '
           'better) against the sweep\'s best; ± the standard error of the per-seed gaps.', '',
           '## Workloads (seeds 0-2 where trained, against the sweep\'s best 3-seed mean)', '', *workload_lines(work), '',
           '## Held-out checks (paired seed by seed with the sweep\'s run at its best LR)', '',
           '"within" 1% of it or below, a "miss" beyond 1% by more than 2 standard errors, or "not resolved" '
           '(`records.verdict`).', '', *heldout_lines(held)]
  out = work_root if quick else os.path.join(REPO, 'results')
  records.write_report(out, 'annealed_rung', {'workloads': work, 'heldout': held}, lines)
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
  print('\n'.join(report(cells if args.quick else list(CELLS), args.quick, work_root, train=not args.report_only)))


if __name__ == '__main__':
  main()
