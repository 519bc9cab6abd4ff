"""A model size and a corpus the defaults were never chosen on: the LM at about 15x the parameters, 3 seeds.

Every default (the HDET controller's, the LR bracket's rungs) was chosen on the 120k-parameter LM, mnist1d's 5k CNN
and the fine-tuning task (``results/workloads.md``). This checks both on a wider and deeper LM (d_model 192, 4
layers, 1.8M parameters; the same batch and 1500 steps) trained on the held-out corpus of Python source
(``research.heldout_corpus``, where the small LM's sweep, default HDET and bracket are measured:
``results/heldout/autolr.md``, ``results/bracket_mode.md``): the plain one-cycle sweep (8 peak LRs a factor 2
apart), then from 10x below, at and 10x above the sweep's best the default HDET run (``configs/default.py``) and the
LR bracket (``bracket_mode.BRACKET``: 8 plain runs a factor 2 apart, 4 kept at 0.1 of the run and 1 at 0.3, the
default then) and the default bracket since (``bracket851``: ``configs/bracket.py``'s, 5 kept at 0.1).
Seeds 1 and 2 (``--seeds``) rerun the sweep's best grid point and its two neighbours, and the default HDET and the
default bracket from the starts ``--seed-starts`` names; over seeds 0-2 the report pairs each start's runs by seed
with the sweep's best LR (its 3-seed mean, among the grid points every seed has). The defaults, seeds 1,2 from every
start, are what ``results/`` holds: ``--report-only`` with no other flag redraws the committed page.

Each run is one record (``results/model_size/runs/<name>.json``: cached; a rerun trains only what is missing).
``--jobs N`` trains N runs at once, each in its own process (a GPU's host loop, not its compute, bounds these
small models, so runs side by side fill it).

    python -m research.archive.model_size --jobs 8        # train what is missing, then report (results/model_size.md)
    python -m research.archive.model_size --jobs 3 --seeds ''   # seed 0 alone
    python -m research.archive.model_size --report-only   # redraw results/model_size.{md,json} (--out DIR: into DIR)
    python -m research.archive.model_size --quick         # a smoke run: the tiny LM, 2 grid points, the best start
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from research import autolr
from research import bracket_mode
from research.archive import finer_grid
from research.archive import heldout_task
from research import records
from research import workloads

REPO = autolr.REPO
MODEL = {'model.d_model': 192, 'model.num_layers': 4, 'model.num_heads': 4}  # ~15x the default's parameters
STEPS, SEED, OPTIM = 1500, 0, 'adamw'
STARTS = bracket_mode.STARTS
# The brackets trained from each start: the one this experiment first ran (8-4-1, the default then), the default
# since (8-5-1, ``configs/bracket.py``; both rank the same 8 runs at the first rung) and the finer grid of
# ``research.finer_grid`` (15 points a factor 2^0.5 apart, 9 kept at 0.1; opt-in).
BRACKETS = {'bracket': bracket_mode.BRACKET, 'bracket851': heldout_task.BRACKET, 'bracket1591': finer_grid.FINE}
DEFAULT_BRACKET = 'bracket851'


# The sweep: autolr's 8 AdamW points (3.75e-3 ... 0.48) and two below them, since at this size the lowest of the
# 8 was the best (a sweep whose best sits at its edge has not found it).
GRID = tuple(0.03 * 2.0**k for k in range(-5, 5))


def grid_lrs(quick: bool) -> tuple:
  return autolr.QUICK_GRIDS[OPTIM] if quick else GRID


def job_names(quick: bool) -> tuple[list[str], list[str]]:
  """The sweep's runs, then those that start from its best (HDET and the bracket, from each start)."""
  starts = ['best'] if quick else list(STARTS)
  kinds = ('hdet', 'bracket') if quick else ('hdet', *BRACKETS)  # (quick: one quick bracket stands for both)
  return (
    [f'grid_lr{records.lr_tag(lr, 4)}' for lr in grid_lrs(quick)],
    [f'{kind}_{start}' for kind in kinds for start in starts],
  )


def seed_names(seed: int, quick: bool, work_root: str, starts=('best',)) -> list[str]:
  """Another seed's runs: the sweep's best grid point and its two neighbours (seed 0's best), the default HDET and
  the brackets from that best, and from the other ``starts`` the default HDET and the default bracket (none before
  seed 0's sweep is complete)."""
  best = sweep_best(quick, work_root)
  if best is None:
    return []
  grid = [lr for lr in grid_lrs(quick) if best[0] / 2.01 < lr < best[0] * 2.01]
  brackets = ['bracket'] if quick else list(BRACKETS)
  others = [s for s in STARTS if s in starts and s != 'best']
  return (
    [f'grid_lr{records.lr_tag(lr, 4)}_s{seed}' for lr in grid]
    + [f'hdet_best_s{seed}']
    + [f'{kind}_best_s{seed}' for kind in brackets]
    + [f'{kind}_{s}_s{seed}' for kind in ('hdet', 'bracket' if quick else DEFAULT_BRACKET) for s in others]
  )


def split_name(name: str) -> tuple[str, str, int]:
  """'grid_lr0.03' -> ('grid', 'lr0.03', 0); 'bracket_best_s1' -> ('bracket', 'best', 1)."""
  kind, _, rest = name.partition('_')
  tag, _, seed = rest.partition('_s')
  return kind, tag, int(seed or SEED)


def record_dir(quick: bool, work_root: str) -> str:
  return os.path.join(work_root, 'records') if quick else os.path.join(REPO, 'results', 'model_size', 'runs')


def load(name: str, quick: bool, work_root: str) -> dict | None:
  """The run's record (None: not trained, or a start's run trained from another sweep best than the sweep's now)."""
  path = os.path.join(record_dir(quick, work_root), name + '.json')
  if not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as f:
    rec = json.load(f)
  kind, tag, _ = split_name(name)
  if kind != 'grid':
    best = sweep_best(quick, work_root)
    if best is None or not math.isclose(rec['lr'], best[0] * STARTS[tag], rel_tol=1e-9):
      return None
  return rec


def sweep_best(quick: bool, work_root: str) -> tuple[float, float] | None:
  """The sweep's best peak LR and its final metric (None: a grid run is missing)."""
  recs = [load(n, quick, work_root) for n in job_names(quick)[0]]
  if any(r is None for r in recs):
    return None
  finals = [(r['final_metric'] if r['final_metric'] is not None else float('inf'), r['lr']) for r in recs]
  value, lr = min(finals)
  return lr, value


def config_for(name: str, quick: bool, work_root: str):
  """The run's config: the LM (quick: the tiny one) at the larger size, with the grid's or the start's peak LR."""
  from hdet_jax.trainer import config_lib

  base = workloads.base_config('lm', 16 if quick else STEPS, quick)
  if not quick:
    config_lib.with_overrides(base, {**MODEL, 'data.path': bracket_mode.heldout_corpus('pystdlib')})
  kind, tag, seed = split_name(name)
  if kind == 'grid':
    lr = {records.lr_tag(lr, 4): lr for lr in grid_lrs(quick)}[tag[2:]]
  else:
    lr = sweep_best(quick, work_root)[0] * STARTS[tag]
  if kind == 'hdet':  # configs/default.py's HDET as it stands: only the peak LR and the seed set here
    o = {'seed': seed, 'optim.max_lr': lr}
  else:
    o = autolr.run_overrides('grid', OPTIM, lr, seed, base.num_train_steps)
    if kind in BRACKETS:
      o.update(bracket_mode.QUICK_BRACKET if quick else BRACKETS[kind])
  if quick:
    o = {k: v for k, v in o.items() if k != 'hdet.sync_every'}
  return config_lib.with_overrides(base, o)


def train_job(name: str, quick: bool, work_root: str) -> dict:
  """One run (or one bracket), in this process; its record."""
  import jax

  path = os.path.join(record_dir(quick, work_root), name + '.json')
  if os.path.exists(path):
    return load(name, quick, work_root)
  workdir = os.path.join(work_root, 'runs', name)
  rec = records.train_run(name, config_for(name, quick, work_root), workdir)
  rec['device'] = f'{jax.devices()[0].device_kind} x{jax.device_count()}'
  records.write_record(path, rec, indent=1)
  shutil.rmtree(workdir, ignore_errors=True)
  return rec


def run_jobs(names: list[str], quick: bool, work_root: str, jobs: int) -> None:
  """Trains the missing ``names``, ``jobs`` at a time, each in a process of its own."""
  todo = [n for n in names if load(n, quick, work_root) is None]
  cmd = [sys.executable, '-m', 'research.archive.model_size', '--workdir', work_root] + (['--quick'] if quick else [])

  def one(name):
    t0 = time.time()
    if jobs == 1:  # in this process
      train_job(name, quick, work_root)
    else:
      done = subprocess.run(cmd + ['--job', name], cwd=REPO, capture_output=True, text=True)
      if done.returncode:
        raise RuntimeError(f'{name} failed ({done.returncode}):\n{done.stderr[-3000:]}')
    print(f'  {name}: {load(name, quick, work_root)["final_metric"]} ({time.time() - t0:.0f} s)', flush=True)

  with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
    list(pool.map(one, todo))


def _row(name: str, rec: dict | None, reference: float, best_lr: float) -> str:
  """A run's line: its final against ``reference``, a bracket's kept LR as a multiple of ``best_lr``."""
  if rec is None:
    return f'| {name} | | not trained | | | |'
  v = rec['final_metric']
  gap = 'diverged' if v is None else f'{100 * (v / reference - 1):+.1f}%'
  kept = f'{rec["kept_lr"] / best_lr:.3g}' if 'kept_lr' in rec else ''
  return f'| {name} | {rec["lr"]:.4g} | {"-" if v is None else f"{v:.4f}"} | {gap} | {kept} | {rec["wall_s"]:.0f} s |'


def report(quick: bool, work_root: str, seeds=(), starts=('best',), out: str | None = None) -> list[str]:
  """Writes ``model_size.{md,json}`` into ``out`` (default: the full run's under results/, a quick one's in
  ``work_root``); its lines."""
  best = sweep_best(quick, work_root)
  if best is None:
    raise SystemExit('error: the sweep is incomplete; train it first (without --report-only).')
  best_lr, best_value = best
  grid, after = job_names(quick)
  recs = {n: load(n, quick, work_root) for n in grid + after}
  anyrec = next(r for r in recs.values() if r)
  size = 'the quick tiny LM' if quick else 'd_model 192, 4 layers'
  lines = [
    '# A model size and a corpus the defaults were never chosen on: the LM at 15x the parameters',
    '',
    f'Made by `python -m research.model_size` (records in `results/model_size/runs/`): the LM task at {size} '
    f'({anyrec["num_params"]:,} parameters; the default 120,576) on the held-out corpus of Python source, {STEPS} '
    f'steps, AdamW, seed {SEED} (other seeds below), 8 replicas on {anyrec["device"]}. This table is one seed: '
    'gaps under about 0.5% are not resolved in it (the last table pairs 3 seeds).',
    '',
    "| run | peak LR (start) | final val bits/byte | vs the sweep's best | kept LR (x best) | wall |",
    '|---|---|---|---|---|---|',
  ]
  lines += [_row(n, recs[n], best_value, best_lr) for n in grid + after]
  lines += [
    '',
    f"The sweep's best: {best_value:.4f} at {best_lr:g}. HDET: one run of compute; the sweep 8. `bracket`: "
    f'8 points, `{bracket_mode.BRACKET["bracket.rungs"]}` (2.3 runs; the default when this experiment first '
    f'ran); `bracket851`: the default bracket since, `{heldout_task.BRACKET["bracket.rungs"]}` (2.5 runs); '
    f"`bracket1591`: `research.finer_grid`'s 15 points a factor 2^0.5 apart, "
    f'`{finer_grid.FINE["bracket.rungs"]}` (4.0 runs). '
    'Walls were taken with runs side by side (`--jobs`), so they are rough.',
  ]
  for seed in seeds:
    names = seed_names(seed, quick, work_root, starts)
    got = {n: load(n, quick, work_root) for n in names}
    recs.update(got)
    grid_got = [
      r['final_metric'] for n, r in got.items() if r and n.startswith('grid') and r['final_metric'] is not None
    ]
    if not grid_got:
      continue
    seed_best = min(grid_got)
    lines += [
      '',
      f'## Seed {seed}',
      '',
      f"The sweep's best grid point and its neighbours on seed {seed}, then the default "
      f"HDET and the bracket from the best (seed {SEED}'s); each against the best of those grid points on "
      f'seed {seed} ({seed_best:.4f}).',
      '',
      "| run | peak LR (start) | final val bits/byte | vs that seed's best | kept LR (x best) | wall |",
      '|---|---|---|---|---|---|',
    ]
    lines += [_row(n, r, seed_best, best_lr) for n, r in got.items()]
  summary = seed_summary(quick, work_root, seeds)
  if summary:
    lines += summary_lines(summary)
  results = {'best_lr': best_lr, 'best': best_value, 'runs': recs, 'seeds_summary': summary}
  out = out or (work_root if quick else os.path.join(REPO, 'results'))
  records.write_report(out, 'model_size', results, lines)
  return lines


def seed_summary(quick: bool, work_root: str, seeds=()) -> dict | None:
  """Over seed 0 and ``seeds`` (None: fewer than 3 seeds, or a grid point missing on one): the sweep's best LR by
  its mean over those seeds (among the grid points every seed has), and per start the default HDET's and each
  bracket's paired gap (± the standard error of the per-seed gaps) against it, where every seed has that run."""
  all_seeds = [SEED] + [s for s in seeds if s != SEED]
  if len(all_seeds) < 3:
    return None
  name = lambda base, seed: base if seed == SEED else f'{base}_s{seed}'
  grid = {}
  for lr in grid_lrs(quick):
    finals = [
      (load(name(f'grid_lr{records.lr_tag(lr, 4)}', s), quick, work_root) or {}).get('final_metric') for s in all_seeds
    ]
    if None not in finals:
      grid[lr] = finals
  if not grid:
    return None
  best_lr = records.best_lr(grid)
  out = {'seeds': all_seeds, 'best_lr': best_lr, 'sweep': grid[best_lr], 'runs': {}}
  for kind in ('hdet', 'bracket') if quick else ('hdet', *BRACKETS):
    for start in STARTS:
      got = [load(name(f'{kind}_{start}', s), quick, work_root) for s in all_seeds]
      if None in got:
        continue
      finals = [r['final_metric'] for r in got]
      gap, se = records.paired_gap(finals, grid[best_lr])
      out['runs'][f'{kind}_{start}'] = {
        'finals': finals,
        'gap': gap,
        'se': se,
        'kept_x': [r['kept_lr'] / best_lr for r in got] if 'kept_lr' in got[0] else None,
      }
  return out


def summary_lines(summary: dict) -> list[str]:
  """The seeds' summary as a table: per run, its per-seed finals and its paired gap against the sweep's best."""
  seeds = ', '.join(map(str, summary['seeds']))
  lines = [
    '',
    f"## Seeds {seeds}: against the sweep's best LR",
    '',
    f"The sweep's best LR by its mean over seeds {seeds} (among the grid points every seed has): "
    f'{summary["best_lr"]:g}, mean {np.mean(summary["sweep"]):.4f} (per seed '
    + ' / '.join(f'{v:.4f}' for v in summary['sweep'])
    + '). Each run against it, paired by seed: the gap of '
    'the means, ± the standard error of the per-seed gaps.',
    '',
    "| run | per seed | mean | vs the sweep's best LR | kept LR (x best), per seed |",
    '|---|---|---|---|---|',
  ]
  for run, r in summary['runs'].items():
    gap = 'diverged' if r['gap'] is None else f'{100 * r["gap"]:+.2f} ± {100 * r["se"]:.2f}%'
    kept = '' if r['kept_x'] is None else ' / '.join(f'{k:.3g}' for k in r['kept_x'])
    finals = ' / '.join('-' if v is None else f'{v:.4f}' for v in r['finals'])
    mean = '-' if None in r['finals'] else f'{np.mean(r["finals"]):.4f}'
    lines.append(f'| {run} | {finals} | {mean} | {gap} | {kept} |')
  return lines


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--jobs', type=int, default=1, help='runs trained at once, each in its own process')
  p.add_argument('--report-only', action='store_true', help='read the records, train nothing')
  p.add_argument('--quick', action='store_true', help='a smoke run: the tiny LM, 2 grid points, the best start')
  p.add_argument('--workdir', default=None, help='where runs train (default: workdirs/model_size)')
  p.add_argument(
    '--seeds',
    default=None,
    help='seeds besides 0 that rerun the best, its neighbours, HDET and the '
    'bracket from the best (default: 1,2, what results/ holds; with --quick none; empty: none)',
  )
  p.add_argument(
    '--seed-starts',
    default=None,
    help='starts those seeds run the default HDET and the default '
    'bracket from (default: low,best,high, what results/ holds; with --quick best)',
  )
  p.add_argument('--out', default=None, help="the report's folder (default: results/; --quick: the workdir)")
  p.add_argument('--job', default=None, help=argparse.SUPPRESS)  # one run, in this process (run_jobs' workers)
  args = p.parse_args(argv)
  if args.jobs < 1:
    p.error(f'--jobs must be >= 1, got {args.jobs}')
  work_root = os.path.abspath(
    args.workdir or os.path.join(REPO, 'workdirs', 'model_size_quick' if args.quick else 'model_size')
  )
  if args.job:
    train_job(args.job, args.quick, work_root)
    return
  seeds = [int(x) for x in (args.seeds if args.seeds is not None else '' if args.quick else '1,2').split(',') if x]
  starts = tuple(x for x in (args.seed_starts or ('best' if args.quick else ','.join(STARTS))).split(',') if x)
  if not set(starts) <= set(STARTS):
    p.error(f'--seed-starts: unknown {sorted(set(starts) - set(STARTS))}; choose from {",".join(STARTS)}')
  if not args.report_only:
    grid, after = job_names(args.quick)
    run_jobs(grid, args.quick, work_root, args.jobs)
    run_jobs(
      after + [n for seed in seeds for n in seed_names(seed, args.quick, work_root, starts)],
      args.quick,
      work_root,
      args.jobs,
    )
  print('\n'.join(report(args.quick, work_root, seeds, starts, out=args.out)))


if __name__ == '__main__':
  main()
