"""Classifier sizes, data and run lengths no default was chosen on: mnist1d's CNN, wider, narrower, on other data.

The defaults (the HDET controller's, the LR bracket's rungs, '0.1:5,0.3:1' since the twenty-third pass) were chosen
on the 120k-parameter LM, mnist1d's 25-channel CNN (5.2k parameters) on MNIST-1D's dataset seed 42, and the
fine-tuning task (``results/workloads.md``, ``results/wider_rung.md``). Each check here changes the CNN's width,
the data's draw and the run's length at once (:data:`CHECKS`): ``wide``, 64 channels (28k parameters) on dataset
seed 7 for 1000 steps; ``narrow``, 16 channels on dataset seed 11 for 500 steps; ``digits`` (added after the
twenty-sixth pass, when every default had been chosen), the default CNN on another dataset, scikit-learn's
handwritten digits read as 64-sample signals (``research/archive/digits_npz.py``; 1,437 training examples, 360 test), at
8 examples per replica a step for 600 steps (about 27 epochs); ``mlp`` (added after the twenty-eighth pass), another
model family, an MLP of two ReLU layers of 128 units (``model.kind='mlp'``, 23k parameters) on dataset seed 13 for 750
steps. AdamW, 3 seeds. The plain one-cycle
sweep (8 peak LRs a factor 2 apart, as mnist1d's), then from 10x below, at and 10x above its first seed's best (as
every other check's starts) the default HDET run (``configs/mnist1d.py``) and the default LR bracket
(``configs/default.py``'s ``bracket.*``). The bracket that kept 4 at 0.1 of the run is read from the same brackets
(its runs are the same: the 4 best at 0.1, ranked again at 0.3), its kept run trained to the end where it differs.

Each run is one record (``results/heldout_task/runs/<check>/<name>.json``: cached; a rerun trains only what is
missing).

    python -m research.archive.heldout_task                  # train what is missing (about 20 min here), then report
    python -m research.archive.heldout_task --checks narrow  # one check
    python -m research.archive.heldout_task --report-only
    python -m research.archive.heldout_task --fresh-seeds 3,4,5,6,7  # the sweep, bracket on 5 more seeds
    python -m research.archive.heldout_task --checks digits --rung-trace   # do the rungs' rankings hold to the end?
                                                                     # (and an annealed copy's?)
    python -m research.archive.heldout_task --quick          # a smoke run: the tiny CNN, 2 grid points, the best start
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
from typing import NamedTuple

import numpy as np

from research import autolr
from research import bracket_mode
from research import records
from research import workloads
from research import wider_rung

REPO = autolr.REPO
# name: (overrides of configs/mnist1d.py, steps). Each changes the model, the data and the length at once.
CHECKS = {
  'wide': ({'model.channels': 64, 'data.dataset_seed': 7}, 1000),
  'narrow': ({'model.channels': 16, 'data.dataset_seed': 11}, 500),
  # Other data: handwritten digits (research/archive/digits_npz.py), 64-sample signals, an eighth of the batch.
  'digits': ({'data.path': 'research/data/digits.npz', 'data.batch_size': 8}, 600),
  # Another model family (added after the twenty-eighth pass): an MLP, two ReLU layers of 128 units (23k
  # parameters), on dataset seed 13, for 750 steps, a length no mnist1d default was measured at.
  'mlp': ({'model.kind': 'mlp', 'model.hidden': 128, 'data.dataset_seed': 13}, 750),
}
OPTIM, SEEDS = 'adamw', (0, 1, 2)
STARTS = bracket_mode.STARTS
# configs/default.py's bracket, pinned so that the records stay this bracket's (research/tests/test_heldout_task.py
# checks that it is the default).
BRACKET = {'bracket.points': 8, 'bracket.factor': 2.0, 'bracket.rungs': '0.1:5,0.3:1', 'bracket.compare_steps': 10}
# The brackets' kinds of record: the default. (The records ``annealed_<start>_s<seed>``, the same bracket with its last
# rung ranking copies annealed over 0.1 of the run, bracket.anneal, were the annealed_rung study's, retired in 1.0 with
# that field: they stay as data; ``git checkout 98c94c2`` trains them.)
BRACKETS = ('bracket',)


class Site(NamedTuple):
  """Where one check's runs live: the check, a quick smoke run or the full one, the workdir root."""

  check: str
  quick: bool
  work_root: str


def plan(site: Site) -> dict:
  """What the check trains: the grid, seeds, starts, bracket and steps (quick: a smoke run's)."""
  if site.quick:
    return {
      'grid': autolr.QUICK_GRIDS[OPTIM],
      'seeds': (0,),
      'starts': ('best',),
      'bracket': wider_rung.QUICK_BRACKET,
      'steps': 16,
    }
  return {
    'grid': autolr.GRIDS[OPTIM],
    'seeds': SEEDS,
    'starts': tuple(STARTS),
    'bracket': BRACKET,
    'steps': CHECKS[site.check][1],
  }


def record_path(name: str, site: Site) -> str:
  root = (
    os.path.join(site.work_root, 'records') if site.quick else os.path.join(REPO, 'results', 'heldout_task', 'runs')
  )
  return os.path.join(root, site.check, name + '.json')


def load(name: str, site: Site) -> dict | None:
  path = record_path(name, site)
  if not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def base_config(site: Site):
  """configs/mnist1d.py with the check's overrides (quick: the tiny CNN, on the check's data)."""
  from hdet_jax.trainer import config_lib

  c = workloads.base_config('mnist1d', plan(site)['steps'], site.quick)
  overrides = CHECKS[site.check][0]
  return config_lib.with_overrides(
    c, {k: v for k, v in overrides.items() if k.startswith('data.')} if site.quick else overrides
  )


def grid_name(lr: float, seed: int) -> str:
  return f'grid_lr{records.lr_tag(lr, 4)}_s{seed}'


def anchor_lr(site: Site) -> float | None:
  """The first seed's sweep best (None: its sweep is incomplete): the starts' reference, as in bracket_mode."""
  recs = [load(grid_name(lr, plan(site)['seeds'][0]), site) for lr in plan(site)['grid']]
  if any(r is None for r in recs):
    return None
  return min((r['final_metric'] if r['final_metric'] is not None else float('inf'), r['lr']) for r in recs)[1]


def config_for(name: str, site: Site, lr: float | None = None):
  """A run's config: ``grid_lr<lr>_s<seed>``, ``hdet_<start>_s<seed>``, ``bracket_<start>_s<seed>`` (the default
  bracket), or the narrower bracket's kept run ``end_lr<lr>_at_<start>_s<seed>`` (``lr`` given, exactly: that point of
  the bracket, trained to the end)."""
  from hdet_jax.trainer import bracket, config_lib

  kind, rest = name.split('_', 1)
  tag, seed = rest.rsplit('_s', 1)
  seed, p, c = int(seed), plan(site), base_config(site)
  if kind == 'grid':
    lr = {records.lr_tag(x, 4): x for x in p['grid']}[tag[2:]]  # (the grid's own LR, not its name's digits)
    return config_lib.with_overrides(c, autolr.run_overrides('grid', OPTIM, lr, seed, p['steps']))
  if kind == 'hdet':  # configs/mnist1d.py's HDET as it stands: only the peak LR and the seed set here
    return config_lib.with_overrides(c, {'seed': seed, 'optim.max_lr': anchor_lr(site) * STARTS[tag]})
  start = tag if kind in BRACKETS else tag.split('_at_')[1]
  centre = anchor_lr(site) * STARTS[start]
  b = config_lib.with_overrides(c, {**autolr.run_overrides('grid', OPTIM, centre, seed, p['steps']), **p['bracket']})
  return b if kind in BRACKETS else bracket.point_config(b, lr, 0)


def train(name: str, site: Site, lr: float | None = None) -> dict:
  """One run or bracket, in this process (cached); its record."""
  rec = load(name, site)
  if rec is not None:
    return rec
  workdir = os.path.join(site.work_root, 'runs', site.check, name)
  with contextlib.chdir(REPO):  # (a check's data.path is relative to the repository: records hold no machine's paths)
    rec = records.train_run(name, config_for(name, site, lr), workdir)
  records.write_record(record_path(name, site), rec, indent=1)
  shutil.rmtree(workdir, ignore_errors=True)
  return rec


def narrower_kept(rec: dict) -> float:
  """The kept LR of the same bracket with its first rung keeping one fewer: the best ``kept - 1`` at the first rung,
  ranked again by their losses at the last (``bracket.survivors``, as the bracket ranks)."""
  from hdet_jax.trainer import bracket

  first, last = rec['rungs'][0], rec['rungs'][-1]
  # (the rungs' keys are the LRs to 6 digits: the points' own LRs are the record's, exactly)
  fewer = bracket.survivors({lr: first['losses'][f'{lr:.6g}'] for lr in rec['lrs']}, len(first['kept']) - 1)
  (kept,) = bracket.survivors({lr: last['losses'][f'{lr:.6g}'] for lr in fewer}, 1)
  return kept


def narrower_final(start: str, seed: int, site: Site, train_missing: bool) -> float | None:
  """The narrower bracket's final metric: the bracket's own where it keeps the same run, else its kept run's end."""
  rec = load(f'bracket_{start}_s{seed}', site)
  if rec is None:
    return None
  lr = narrower_kept(rec)
  if lr == rec['kept_lr']:
    return rec['final_metric']
  name = f'end_lr{records.lr_tag(lr, 6)}_at_{start}_s{seed}'
  end = train(name, site, lr) if train_missing else load(name, site)
  return None if end is None else end['final_metric']


def train_all(site: Site) -> None:
  p = plan(site)
  for seed in p['seeds']:
    for lr in p['grid']:
      print(f'  {site.check} {grid_name(lr, seed)}: {train(grid_name(lr, seed), site)["final_metric"]}', flush=True)
  for seed in p['seeds']:
    for start in p['starts']:
      for kind in ('hdet', 'bracket'):
        print(
          f'  {site.check} {kind}_{start}_s{seed}: {train(f"{kind}_{start}_s{seed}", site)["final_metric"]}', flush=True
        )
      narrower_final(start, seed, site, train_missing=True)


def train_fresh(site: Site, seeds: list[int]) -> None:
  """The sweep and the default bracket on more seeds (cached): ``research.finer_grid``'s 8-seed table reads
  seeds 3-7; this check's own report reads seeds 0-2 only."""
  p = plan(site)
  names = [grid_name(lr, seed) for seed in seeds for lr in p['grid']]
  names += [f'bracket_{start}_s{seed}' for seed in seeds for start in p['starts']]
  for name in names:
    print(f'  {site.check} {name}: {train(name, site)["final_metric"]}', flush=True)


def rung_steps(site: Site) -> list[int]:
  """The steps the default bracket's rungs compare at, in this check's runs."""
  from hdet_jax.trainer import schema

  return schema.rung_steps(schema.parse_rungs(BRACKET['bracket.rungs']), plan(site)['steps'])


def rung_trace(lr: float, seed: int, site: Site) -> dict:
  """The sweep's run at ``lr`` again, evaluated at the bracket's rungs too: the training loss each rung ranks (the
  mean over its ``bracket.compare_steps`` steps before it, as ``bracket.window_loss`` reads it), the test metric
  there, and the final metric (cached as ``trace_lr<lr>_s<seed>``). Evaluating changes no training step, so the final
  is the grid record's, bit for bit (tested)."""
  from hdet_jax.trainer import config_lib

  name = f'trace_lr{records.lr_tag(lr, 4)}_s{seed}'
  rec = load(name, site)
  if rec is not None:
    return rec
  rungs = rung_steps(site)
  every = int(np.gcd.reduce(rungs + [plan(site)['steps']]))
  config = config_lib.with_overrides(config_for(grid_name(lr, seed), site), {'eval_every': every})
  rec = _traced_run(name, config, site, rungs)
  records.write_record(record_path(name, site), rec, indent=1)
  return rec


ANNEAL_FRACTION = 0.1  # annealed_rung: the copy's anneal, as a fraction of the run


def annealed_rung(lr: float, seed: int, site: Site) -> dict:
  """The sweep's run at ``lr`` to its last rung, then annealed to the schedule's end LR over
  :data:`ANNEAL_FRACTION` of the run instead of the rest of it: what a rung that ranked annealed copies would see.

  One-cycle's warmup ends at ``pct_start * num_train_steps - 1``: with ``num_train_steps = rung + k`` and
  ``pct_start = rung / (rung + k)`` it ends at the same step, with the same peak and start, and the batches depend on
  the step only, so the run to the rung is the sweep's (tested on the schedule). Cached as
  ``anneal_lr<lr>_s<seed>``: its test metric and the training loss over its last ``bracket.compare_steps`` steps."""
  name = f'anneal_lr{records.lr_tag(lr, 4)}_s{seed}'
  rec = load(name, site)
  if rec is not None:
    return rec
  config = annealed_config(lr, seed, site)
  rec = _traced_run(name, config, site, [config.num_train_steps])
  rec['train_loss'] = rec.pop('rungs')[str(config.num_train_steps)]['train_loss']
  records.write_record(record_path(name, site), rec, indent=1)
  return rec


def annealed_config(lr: float, seed: int, site: Site):
  """:func:`annealed_rung`'s config (one-cycle runs only: another schedule's warmup would not end at the rung)."""
  from hdet_jax.trainer import config_lib

  config = config_for(grid_name(lr, seed), site)
  if config.optim.get('schedule', 'one_cycle') != 'one_cycle':
    raise ValueError(
      f'annealed_rung needs the one-cycle schedule (its warmup is moved to end at the rung); '
      f'{site.check} runs optim.schedule={config.optim.schedule!r}.'
    )
  rung, k = rung_steps(site)[-1], int(round(ANNEAL_FRACTION * plan(site)['steps']))
  return config_lib.with_overrides(
    config, {'num_train_steps': rung + k, 'optim.pct_start': rung / (rung + k), 'eval_every': 0}
  )


def _traced_run(name: str, config, site: Site, steps: list[int]) -> dict:
  """Trains ``config`` in this process; its final metric and, at each of ``steps``, the training loss a rung ranks
  (``bracket.window_loss``) and the test metric where it was evaluated."""
  from hdet_jax.trainer import bracket, metrics as metrics_lib

  workdir = os.path.join(site.work_root, 'runs', site.check, name)
  with contextlib.chdir(REPO):
    run = records.train_run(name, config, workdir)
  path = os.path.join(workdir, 'metrics.jsonl')
  evals = {r['step']: r['val_loss'] for r in metrics_lib.read_metrics(path).get('eval', [])}
  rec = {
    'name': name,
    'lr': run['lr'],
    'final_metric': run['final_metric'],
    'rungs': {
      str(step): {
        'train_loss': bracket.window_loss(path, step, BRACKET['bracket.compare_steps'], run['diverged_at']),
        'test_metric': records.finite_or_none(evals.get(step)),
      }
      for step in steps
    },
  }
  shutil.rmtree(workdir, ignore_errors=True)
  return rec


def selection_lines(site: Site, seeds: tuple[int, ...]) -> list[str]:
  """Which of the sweep's LRs each comparison picks, per seed, and where the sweep's run at that LR ends, paired by
  seed with its run at its best LR: the rungs' losses, the annealed copies', and the end's own (an oracle)."""
  grid = plan(site)['grid']
  tag = lambda lr: records.lr_tag(lr, 4)
  traces = {(lr, s): load(f'trace_lr{tag(lr)}_s{s}', site) for lr in grid for s in seeds}
  anneals = {(lr, s): load(f'anneal_lr{tag(lr)}_s{s}', site) for lr in grid for s in seeds}
  if any(r is None for r in list(traces.values()) + list(anneals.values())):
    return []
  steps = sorted(traces[grid[0], seeds[0]]['rungs'], key=int)
  criteria = [
    (f'training loss before step {st}', lambda lr, s, st=st: traces[lr, s]['rungs'][st]['train_loss']) for st in steps
  ]
  criteria += [
    (f'test metric at step {st}', lambda lr, s, st=st: traces[lr, s]['rungs'][st]['test_metric']) for st in steps
  ]
  criteria += [
    ('training loss after the anneal', lambda lr, s: anneals[lr, s]['train_loss']),
    ('test metric after the anneal', lambda lr, s: anneals[lr, s]['final_metric']),
    ("test metric at the end (the sweep's own, per seed)", lambda lr, s: final(grid_name(lr, s), site)),
  ]
  finals = {lr: [final(grid_name(lr, s), site) for s in seeds] for lr in grid}
  best = records.best_lr(finals)
  lines = [
    f"Which of the sweep's LRs each comparison picks, seeds {', '.join(map(str, seeds))}, and where the sweep's "
    f'run at the picked LR ends, paired by seed with its run at its best LR ({best:g}). The annealed copies '
    f'(`annealed_rung`) run to the last rung as the sweep does, then anneal to its end LR in '
    f'{round(ANNEAL_FRACTION * plan(site)["steps"])} steps:',
    '',
    "| ranked by | picked LR, per seed | its end against the best LR's, paired |",
    '|---|---|---|',
  ]
  for label, get in criteria:
    picks = [min(grid, key=lambda lr, s=s: (get(lr, s), lr)) for s in seeds]
    gap, se = records.paired_gap([final(grid_name(lr, s), site) for lr, s in zip(picks, seeds)], finals[best])
    text = '-' if gap is None else f'{100 * gap:+.1f} ± {100 * (se or 0):.1f}%'
    lines.append(f'| {label} | {" / ".join(f"{lr:g}" for lr in picks)} | {text} |')
  return lines + ['']


def rank_flip_lines(site: Site, seed: int) -> list[str]:
  """Per grid LR of ``seed``: the rungs' training losses and test metrics, and the end's test metric, with each
  column's rank (1: lowest)."""
  recs = [load(f'trace_lr{records.lr_tag(lr, 4)}_s{seed}', site) for lr in plan(site)['grid']]
  if any(r is None for r in recs):
    return []
  steps = list(recs[0]['rungs'])
  cols = [(f'training loss before step {s}', lambda r, s=s: r['rungs'][s]['train_loss']) for s in steps]
  cols += [(f'test metric at step {s}', lambda r, s=s: r['rungs'][s]['test_metric']) for s in steps]
  cols += [('test metric at the end', lambda r: r['final_metric'])]
  rank = lambda get: {r['lr']: 1 + sorted(get(x) for x in recs).index(get(r)) for r in recs}
  ranks = [rank(get) for _, get in cols]
  lines = [
    f"Do the rungs' rankings hold to the end? The sweep's seed-{seed} runs again, evaluated at the rungs too "
    f'(`rung_trace`; the same finals bit for bit); value (rank, 1 = lowest):',
    '',
    '| peak LR | ' + ' | '.join(c for c, _ in cols) + ' |',
    '|---' * (len(cols) + 1) + '|',
  ]
  for r in recs:
    lines.append(
      f'| {r["lr"]:g} | ' + ' | '.join(f'{get(r):.4f} ({rk[r["lr"]]})' for (_, get), rk in zip(cols, ranks)) + ' |'
    )
  return lines + ['']


def summarize(site: Site) -> dict:
  """The sweep's 3-seed means per LR, its best, and per start the default HDET's, the bracket's and the narrower
  bracket's 3-seed means and gaps to that best."""
  p = plan(site)
  grid = {}
  for lr in p['grid']:
    recs = [load(grid_name(lr, s), site) for s in p['seeds']]
    finals = [r['final_metric'] for r in recs if r is not None]
    grid[f'{lr:g}'] = {
      'mean': records.mean_or_none(finals) if len(finals) == len(recs) else None,
      'sd': float(np.std(finals, ddof=1)) if len(finals) > 1 else None,
      'n': len(finals),
    }
  done = {k: v['mean'] for k, v in grid.items() if v['mean'] is not None}
  best_lr = min(done, key=done.get) if done else None
  best = done.get(best_lr)
  gap = lambda v: None if v is None or best is None else v / best - 1
  starts = {}
  for start in p['starts']:
    row = {}
    for kind in ('hdet', 'bracket'):
      recs = [load(f'{kind}_{start}_s{s}', site) for s in p['seeds']]
      row[kind] = records.mean_or_none([None if r is None else r['final_metric'] for r in recs])
      if kind == 'bracket':
        anchor = anchor_lr(site)
        row['kept_x'] = [None if r is None else r['kept_lr'] / anchor for r in recs]
    row['narrower'] = records.mean_or_none([narrower_final(start, s, site, False) for s in p['seeds']])
    row.update({f'{k}_gap': gap(row[k]) for k in ('hdet', 'bracket', 'narrower')})
    starts[start] = row
  return {
    'grid': grid,
    'best_lr': best_lr,
    'best': best,
    'anchor_lr': anchor_lr(site),
    'starts': starts,
    'overrides': CHECKS[site.check][0],
    'steps': p['steps'],
    'bracket': p['bracket'],
    'paired3': paired(site, p['seeds']),
    'paired8': None if site.quick else paired(site, p['seeds'] + FRESH_SEEDS, ('bracket',)),
  }


FRESH_SEEDS = (3, 4, 5, 6, 7)  # the sweep's and the default bracket's further seeds (--fresh-seeds)


def final(name: str, site: Site) -> float | None:
  """A record's final metric (None: not trained, or it diverged)."""
  rec = load(name, site)
  return None if rec is None else records.finite_or_none(rec['final_metric'])


def paired(site: Site, seeds: tuple[int, ...], kinds: tuple[str, ...] = ('bracket', 'hdet')) -> dict | None:
  """Seed by seed against the sweep's run at its best LR (the lowest mean over ``seeds``): per start and kind, the
  gap of the means and the standard error of the per-seed gaps (``records.paired_gap``). None: a grid record is
  missing."""
  grid = {lr: [final(grid_name(lr, s), site) for s in seeds] for lr in plan(site)['grid']}
  if any(load(grid_name(lr, s), site) is None for lr in grid for s in seeds):
    return None
  best = records.best_lr(grid)
  starts = {}
  for start in plan(site)['starts']:
    starts[start] = {}
    for kind in kinds:
      gap, se = records.paired_gap([final(f'{kind}_{start}_s{s}', site) for s in seeds], grid[best])
      starts[start][kind] = {'gap': gap, 'se': se}
  return {'seeds': list(seeds), 'best_lr': best, 'best': float(np.mean(grid[best])), 'starts': starts}


def paired_lines(r: dict) -> list[str]:
  """The paired table of one check: 3 seeds (bracket and HDET) and, where trained, 8 (the bracket)."""
  three, eight = r.get('paired3'), r.get('paired8')
  if three is None:
    return []
  text = lambda g: (
    '-' if g['gap'] is None else f'{100 * g["gap"]:+.1f} ± {100 * (g["se"] or 0):.1f}% ({records.verdict(g)})'
  )
  head = (
    f"Paired by seed with the sweep's run at its best LR (by the mean over the same seeds: {three['best_lr']:g} "
    f'on seeds 0-2'
  )
  head += f', {eight["best_lr"]:g} on seeds 0-7' if eight else ''
  lines = [
    head + '); ± the standard error of the per-seed gaps; "within" 1% of it or below, a "miss" beyond 1% by '
    'more than 2 of them (`records.verdict`), or "not resolved":',
    '',
    '| start | bracket (default), seeds 0-2 | bracket, seeds 0-7 | default HDET, seeds 0-2 |',
    '|---|---|---|---|',
  ]
  for start, row in three['starts'].items():
    e = text(eight['starts'][start]['bracket']) if eight else '-'
    lines.append(f'| {start} | {text(row["bracket"])} | {e} | {text(row["hdet"])} |')
  return lines + ['']


def check_lines(site: Site, r: dict) -> list[str]:
  """One check's section of the report."""
  rec = load(grid_name(plan(site)['grid'][0], 0), site)
  params = f'{rec["num_params"]:,} parameters' if rec else 'not trained'
  lines = [
    f'## {site.check}: {", ".join(f"{k}={v}" for k, v in CHECKS[site.check][0].items())}, {r["steps"]} steps',
    '',
    f'{params} (quick: the tiny CNN); the sweep (plain one-cycle runs):',
    '',
    '| peak LR | 3-seed mean | sd |',
    '|---|---|---|',
  ]
  for lr, g in r['grid'].items():
    mean = '-' if g['mean'] is None else f'{g["mean"]:.5f}'
    sd = '-' if g['sd'] is None else f'{g["sd"]:.5f}'
    lines.append(f'| {lr} | {mean} | {sd} |')
  best = '-' if r['best'] is None else f'{r["best"]:.5f} at {r["best_lr"]}'
  lines += [
    '',
    f"The sweep's best 3-seed mean: {best}; the starts are centred on its first seed's best, "
    f'{r["anchor_lr"]}. From 10x below, at and 10x above it:',
    '',
    '| start | default HDET (1 run) | bracket, 5 kept at 0.1 (default, 2.5 runs) | bracket, 4 kept at 0.1 (2.3 '
    "runs) | bracket's kept LR (x the start's reference), per seed |",
    '|---|---|---|---|---|',
  ]
  for start, row in r['starts'].items():
    kept = ' / '.join('-' if x is None else f'{x:.3g}' for x in row['kept_x'])
    gaps = ' | '.join(records.pct(row[f'{k}_gap']) for k in ('hdet', 'bracket', 'narrower'))
    lines.append(f'| {start} | {gaps} | {kept} |')
  eight = plan(site)['seeds'] + FRESH_SEEDS
  selection = selection_lines(site, eight) if not site.quick else []  # (on 8 seeds where they are all traced)
  return (
    lines
    + ['']
    + paired_lines(r)
    + rank_flip_lines(site, 0)
    + (selection or selection_lines(site, plan(site)['seeds']))
  )


def report(quick: bool, work_root: str, out: str | None = None) -> list[str]:
  """Writes ``heldout_task.{md,json}`` into ``out`` (default: the full run's under results/, a quick one's in
  ``work_root``) for every check with records; its lines."""
  sites = [Site(c, quick, work_root) for c in CHECKS]
  results = {s.check: summarize(s) for s in sites if load(grid_name(plan(s)['grid'][0], 0), s) is not None}
  lines = [
    "# Classifier sizes, data and run lengths no default was chosen on: mnist1d's CNN, an MLP, and other data",
    '',
    'Made by `python -m research.heldout_task` (records in `results/heldout_task/runs/<check>/`): the mnist1d '
    'task (the default CNN has 25 channels, about 5.2k parameters, and was tuned on dataset seed 42 at 500-2000 '
    "steps), AdamW, seeds 0, 1, 2 (quick: 0), 8 replicas on 8 CPU devices. The metric: the averaged model's test "
    "cross-entropy (nats, lower is better). Gaps: 3-seed means against the sweep's best 3-seed mean.",
    '',
  ]
  for s in sites:
    if s.check in results:
      lines += check_lines(s, results[s.check])
  out = out or (work_root if quick else os.path.join(REPO, 'results'))
  records.write_report(out, 'heldout_task', results, lines)
  return lines


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--checks', default=','.join(CHECKS), help=f'comma-separated, of {", ".join(CHECKS)}')
  p.add_argument('--report-only', action='store_true', help='read the records, train nothing')
  p.add_argument('--out', default=None, help="the report's folder (default: results/; --quick: the workdir)")
  p.add_argument(
    '--quick', action='store_true', help='a smoke run: the tiny CNN, 2 grid points, the best start, the first check'
  )
  p.add_argument('--workdir', default=None, help='where runs train (default: workdirs/heldout_task)')
  p.add_argument(
    '--rung-trace',
    action='store_true',
    help="the sweep's runs again, evaluated at the bracket's "
    "rungs, and copies annealed at its last rung (cached; the report's last two tables); with "
    '--fresh-seeds on those seeds too (the selection table then reads 8 seeds)',
  )
  p.add_argument(
    '--fresh-seeds',
    default='',
    help='more seeds for the sweep and the default bracket, e.g. 3,4,5,6,7 '
    "(read by research.finer_grid's 8-seed table, not by this report)",
  )
  args = p.parse_args(argv)
  fresh = [int(x) for x in args.fresh_seeds.split(',') if x.strip()] if args.fresh_seeds.strip() else []
  if set(fresh) & set(SEEDS) or (fresh and args.quick):
    p.error(
      f'--fresh-seeds must be seeds other than {",".join(map(str, SEEDS))}, without --quick; got {args.fresh_seeds!r}'
    )
  checks = [c for c in args.checks.split(',') if c]
  if not checks or set(checks) - set(CHECKS):
    p.error(f'--checks must name some of {", ".join(CHECKS)}, got {args.checks!r}')
  work_root = os.path.abspath(
    args.workdir or os.path.join(REPO, 'workdirs', 'heldout_task_quick' if args.quick else 'heldout_task')
  )
  if not args.report_only:
    for check in checks[:1] if args.quick else checks:
      train_all(Site(check, args.quick, work_root))
      if fresh:
        train_fresh(Site(check, args.quick, work_root), fresh)
      if args.rung_trace:
        site = Site(check, args.quick, work_root)
        for seed in list(plan(site)['seeds']) + fresh:
          for lr in plan(site)['grid']:
            print(
              f'  {check} trace {lr:g} s{seed}: {rung_trace(lr, seed, site)["rungs"]}; annealed: '
              f'{annealed_rung(lr, seed, site)["final_metric"]}',
              flush=True,
            )
  print('\n'.join(report(args.quick, work_root, args.out)))


if __name__ == '__main__':
  main()
