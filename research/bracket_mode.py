"""The LR bracket as a user runs it (``configs/bracket.py``, hdet_jax/trainer/bracket.py) against the sweep and the
default HDET controller, on the workloads of ``results/workloads.md``.

The fifteenth and sixteenth passes of the defaults issue read an early-stopped bracket from the sweep's own runs:
its points were the sweep's grid. Here the mode trains its own: 8 plain runs a factor 2 apart centred on a start
10x below, at, or 10x above the one-cycle sweep's best peak LR (the first seed's, as the default HDET's starts), so
its points are not the sweep's (from 10x low they reach 1.13x the best; from the best 0.088-11.3x; from 10x high
0.88-113x), halved at 0.1 (4 kept) and 0.3 (1 kept) of the run, ranked by the mean training loss of the 10 steps
before. 2.3 runs of compute. (``configs/bracket.py``'s rungs then; since the twenty-third pass it keeps 5 at 0.1,
whose brackets ``research.wider_rung`` composes from these.) Each bracket's final metric is compared, as 3-seed means,
with the sweep's best 3-seed mean and with the default HDET's from the same start (``results/workloads.json``).

    python -m research.bracket_mode                  # train what is missing (cached, resumable), then report
    python -m research.bracket_mode --cells lm:750:adamw --report-only
    python -m research.bracket_mode --cells pystdlib:1500:adamw,pystdlib:1500:sgd   # the held-out corpus
    python -m research.bracket_mode --quick          # a smoke run: the tiny LM, 3 points, one start and seed
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time

import numpy as np

from research import autolr
from research import heldout_corpus as heldout_corpus_lib
from research import records
from research import workloads

REPO = autolr.REPO
CELLS = (
  'lm:750:adamw',
  'finetune:300:adamw',
  'mnist1d:1000:adamw',
  'mnist1d:1000:sgd',
  'lm:1500:adamw',
  'finetune:150:adamw',
  'finetune:600:adamw',  # (these two: the eighteenth pass)
  'lm:3000:adamw',  # (the nineteenth pass: twice the main job's length, the rungs' steps 300 and 900)
  'mnist1d:500:adamw',
  'mnist1d:500:sgd',
  'mnist1d:2000:adamw',
  'mnist1d:2000:sgd',
)  # (nineteenth: seed 0)
# A corpus neither the defaults nor the bracket's rungs were chosen on: the LM task on Python's standard library source
# (research.heldout_corpus), whose sweep and default HDET are results/heldout/autolr.json's.
HELDOUT = {'pystdlib': os.path.join('workdirs', 'pystdlib.txt')}
HELDOUT_CELLS = ('pystdlib:1500:adamw', 'pystdlib:1500:sgd')
STARTS = {'low': 0.1, 'best': 1.0, 'high': 10.0}  # the bracket's centre, as a multiple of the sweep's best LR
SEEDS = (0, 1, 2)
BRACKET = {'bracket.points': 8, 'bracket.factor': 2.0, 'bracket.rungs': '0.1:4,0.3:1', 'bracket.compare_steps': 10}
QUICK_BRACKET = {
  **BRACKET,
  'bracket.points': 3,
  'bracket.factor': 4.0,
  'bracket.rungs': '0.5:1',
  'bracket.compare_steps': 3,
}


def parse_cell(text: str) -> tuple[str, int, str]:
  workload, steps, optim = text.split(':')
  return workload, int(steps), optim


def record_path(cell: str, start: str, seed: int, quick: bool, work_root: str) -> str:
  workload, steps, optim = parse_cell(cell)
  root = (
    os.path.join(work_root, 'bracket_mode_quick') if quick else os.path.join(REPO, 'results', 'bracket_mode', 'runs')
  )
  return os.path.join(root, workload, f'steps{steps}', optim, f'{start}_s{seed}.json')


def sweep_cell(cell: str) -> dict:
  """The cell's one-cycle sweep and default HDET, as ``results/workloads.json`` has them (a held-out corpus's:
  ``results/heldout/autolr.json``'s, in the same shape)."""
  workload, steps, optim = parse_cell(cell)
  if workload in HELDOUT:
    h = _heldout(optim)
    default = h['variants'][h['default_variant']]
    return {
      'grid_best': {'value': h['grid_best']['val_bpb'], 'lr': h['grid_best']['lr']},
      'hdet': {start: {'value': row['val_bpb']} for start, row in default.items()},
    }
  with open(os.path.join(REPO, 'results', 'workloads.json'), encoding='utf-8') as f:
    return json.load(f)[workload][str(steps)][optim]


def anchor_lr(cell: str, quick: bool) -> float:
  """The start's reference: the sweep's best LR of its first seed (where the default HDET's starts are anchored)."""
  if quick:
    return 0.01
  workload, steps, optim = parse_cell(cell)
  if workload in HELDOUT:
    return float(_heldout(optim)['anchor_lr'])
  with open(
    os.path.join(workloads.records_dir(workload, steps, False, ''), optim, 'anchor.json'), encoding='utf-8'
  ) as f:
    return float(json.load(f)['lr'])


def _heldout(optim: str) -> dict:
  with open(os.path.join(REPO, 'results', 'heldout', 'autolr.json'), encoding='utf-8') as f:
    return json.load(f)[optim]


def heldout_corpus(workload: str) -> str:
  """The held-out corpus's path, checked to be the recorded sweep's file (another Python builds another one)."""
  path = os.path.join(REPO, HELDOUT[workload])
  if not os.path.exists(path):
    raise SystemExit(f'error: {path} is missing: build it with python -m research.heldout_corpus --out {path}')
  with open(path, 'rb') as f:
    sha = hashlib.sha256(f.read()).hexdigest()
  if sha != heldout_corpus_lib.RECORDED_SHA256:
    raise SystemExit(
      f'error: {path} is not the corpus the sweep was run on (sha256 {sha}); build it with CPython '
      '3.11.7 (research/heldout_corpus.py).'
    )
  return path


def config_for(cell: str, start: str, seed: int, quick: bool, work_root: str, bracket: dict | None = None):
  """The bracket's config (``bracket``: its ``bracket.*`` fields, default ``BRACKET``, or ``QUICK_BRACKET``)."""
  from hdet_jax.trainer import config_lib

  workload, steps, optim = parse_cell(cell)
  centre = anchor_lr(cell, quick) * STARTS[start]
  o = {**autolr.run_overrides('grid', optim, centre, seed, steps), **(bracket or (QUICK_BRACKET if quick else BRACKET))}
  if workload in HELDOUT:  # the LM task on the held-out corpus
    return config_lib.with_overrides(
      workloads.base_config('lm', steps, quick), {**o, 'data.path': heldout_corpus(workload)}
    )
  init_from = (
    workloads.pretrained(os.path.join(REPO, 'workdirs', 'workloads'), quick) if workload == 'finetune' else None
  )
  if workload == 'finetune':
    o['warm_init.nu'] = 0.0  # (the sweep's plain fine-tuning)
  if quick:
    o.pop('hdet.sync_every', None)
  return config_lib.with_overrides(workloads.base_config(workload, steps, quick, init_from), o)


def train_one(
  cell: str, start: str, seed: int, quick: bool, work_root: str, bracket_fields: dict | None = None
) -> dict:
  """One bracket (cached: its record; resumable: its workdir until the record is written); ``bracket_fields`` as
  :func:`config_for`'s ``bracket``."""

  path = record_path(cell, start, seed, quick, work_root)
  if os.path.exists(path):
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  workload, steps, optim = parse_cell(cell)
  workdir = os.path.join(work_root, 'bracket_mode', workload, f'steps{steps}', f'{optim}_{start}_s{seed}')
  config = config_for(cell, start, seed, quick, work_root, bracket_fields)
  t0 = time.time()
  summary = records.run_bracket(config, workdir)
  if summary['preempted']:
    sys.exit(143)
  state = summary['bracket']
  rec = {
    'cell': cell,
    'start': start,
    'seed': seed,
    'centre_lr': config.optim.max_lr,
    'anchor_lr': anchor_lr(cell, quick),
    'lrs': state['lrs'],
    'rungs': state['rungs'],
    'compute_runs': state['compute_runs'],
    'kept_lr': state['winner']['lr'],
    'final_metric': records.finite_or_none(summary['final_metric']),
    'diverged_at': summary['diverged_at'],
    'wall_s': time.time() - t0,
  }
  records.write_record(path, rec, indent=1)
  shutil.rmtree(workdir, ignore_errors=True)
  print(
    f'  {cell} {start} s{seed}: kept {rec["kept_lr"]:.4g} ({rec["kept_lr"] / rec["anchor_lr"]:.2f}x), '
    f'final {rec["final_metric"]}, {rec["wall_s"]:.0f}s',
    flush=True,
  )
  return rec


def cell_rows(cell: str, recs: dict, quick: bool) -> dict:
  """Per start: the bracket's 3-seed mean, its gap to the sweep's best, the default HDET's gap, the kept LRs."""
  sweep = None if quick else sweep_cell(cell)
  out = {}
  for start in STARTS:
    got = [recs[(start, s)] for s in SEEDS if (start, s) in recs]
    if not got:
      continue
    finals = [r['final_metric'] if r['final_metric'] is not None else float('inf') for r in got]
    unit = sweep['grid_best']['lr'] if sweep else None  # kept LRs as multiples of the sweep's 3-seed best
    row = {
      'n': len(got),
      'value': float(np.mean(finals)),
      'finals': finals,
      'kept_x': [r['kept_lr'] / (unit or r['anchor_lr']) for r in got],
      'wall_s': float(np.mean([r['wall_s'] for r in got])),
    }
    if sweep is not None:
      best = sweep['grid_best']['value']
      row['sweep_best'], row['sweep_lr'] = best, sweep['grid_best']['lr']
      row['gap'] = row['value'] / best - 1
      hdet = sweep['hdet'].get(start)
      row['hdet_gap'] = None if hdet is None else hdet['value'] / best - 1
    out[start] = row
  return out


def _pct(x) -> str:
  return 'n/a' if x is None else f'{100 * x:+.1f}%'


_TABLE_HEADER = (
  '| cell | sweep best | start | bracket (3-seed mean) | gap | default HDET gap | kept LR (x best), per seed | '
  'wall per bracket |',
  '|---|---|---|---|---|---|---|---|',
)


def write_report(out_dir: str, results: dict, quick: bool) -> list[str]:
  lines = [
    '# The LR bracket as a mode: 8 plain runs, halved at 0.1 and 0.3 of the run (2.3 runs)',
    '',
    'Made by `python -m research.bracket_mode` (records in `results/bracket_mode/runs/`). Each row: the '
    "bracket centred 10x below, at or 10x above the one-cycle sweep's best peak LR (its first seed's), "
    "3 seeds; the gap is its 3-seed mean final metric against the sweep's best 3-seed mean "
    "(`results/workloads.json`); the default HDET's gap from the same start beside it. Kept: the peak LR "
    "the bracket kept, per seed, as a multiple of the sweep's best.",
    '',
    *_TABLE_HEADER,
  ]
  main = {c: r for c, r in results.items() if parse_cell(c)[0] not in HELDOUT}
  heldout = {c: r for c, r in results.items() if parse_cell(c)[0] in HELDOUT}
  table, (within, hdet_within, total) = _rows(main)
  lines += table
  lines += [
    '',
    "Compute: 8 runs to 0.1 of the run, 4 from there to 0.3, 1 to the end: 2.3 runs of the cell's steps "
    "(the sweep: 8; HDET: 1). Wall: each of a bracket's 13 trainer calls sets up and compiles (about 4-10 s on "
    'this 2-core CPU, with the persistent compilation cache), so short runs pay more than 2.3x; the walls '
    'above were taken with two brackets sharing the CPU (the LM at 1500 steps from seed 2 alone; at 3000 steps one '
    'bracket at a time, beside test runs at times).',
    '',
    f"Within 1% of the sweep's best (3-seed means): the bracket in {within} of {total} cell-starts, the "
    f'default HDET in {hdet_within} of the same {total}.',
  ]
  tally = {'within': within, 'hdet_within': hdet_within, 'total': total}
  if heldout:
    table, (h_within, h_hdet, h_total) = _rows(heldout)
    lines += [
      '',
      '## On a corpus none of this was chosen on',
      '',
      "The LM on Python's standard library source (`research.heldout_corpus`; neither the default HDET nor "
      "the bracket's rungs were chosen on it), 1500 steps, centred as above on its own sweep's first-seed best, "
      "which is half its 3-seed best there (AdamW 0.015 against 0.03, SGD 0.5 against 1), as the default HDET's "
      "starts are (`results/heldout/autolr.json`, whose sweep and default HDET rows these are; that sweep's "
      '3-seed sd is 0.4-1.8% near its best).',
      '',
      *_TABLE_HEADER,
    ] + table
    lines += [
      '',
      f'Within 1% there: the bracket in {h_within} of {h_total} cell-starts, the default HDET in {h_hdet} '
      f'of the same {h_total}.',
    ]
    tally['heldout'] = {'within': h_within, 'hdet_within': h_hdet, 'total': h_total}
  return records.write_report(out_dir, 'bracket_mode', results | {'_tally': tally} if not quick else results, lines)


def _rows(results: dict) -> tuple[list[str], tuple[int, int, int]]:
  """The table's rows, and how many complete cell-starts the bracket and the default HDET end within 1% in."""
  lines, within, hdet_within, total = [], 0, 0, 0
  for cell, rows in results.items():
    for start, row in rows.items():
      kept = ' / '.join(f'{x:.3g}' for x in row['kept_x'])
      n = f' (n={row["n"]})' if row['n'] < len(SEEDS) else ''
      sweep = f'{row["sweep_best"]:.4g} at {row["sweep_lr"]:g}' if 'sweep_best' in row else ''
      lines.append(
        f'| {cell} | {sweep} | {start} | {row["value"]:.4g} | {_pct(row.get("gap"))}{n} | '
        f'{_pct(row.get("hdet_gap"))} | {kept} | {row["wall_s"]:.0f} s |'
      )
      if row.get('gap') is not None and row['n'] == len(SEEDS):
        total += 1
        within += row['gap'] <= 0.01
        hdet_within += row['hdet_gap'] is not None and row['hdet_gap'] <= 0.01
  return lines, (within, hdet_within, total)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument(
    '--cells',
    default=','.join(CELLS),
    help='workload:steps:optim,... to train (default: every cell; the report reads every cell)',
  )
  p.add_argument('--seeds', default=','.join(map(str, SEEDS)), help='seeds to train (the report reads them all)')
  p.add_argument('--report-only', action='store_true', help='read the records, train nothing')
  p.add_argument('--out', default=None, help="the report's folder (default: results/; --quick: the workdir)")
  p.add_argument('--quick', action='store_true', help='a smoke run: the tiny LM, 3 points, one start and seed')
  p.add_argument('--workdir', default=None, help='where the brackets train (default: workdirs/bracket_mode)')
  args = p.parse_args(argv)
  work_root = args.workdir or os.path.join(REPO, 'workdirs', 'bracket_mode_quick' if args.quick else 'workloads')
  cells = ['lm:16:adamw'] if args.quick else args.cells.split(',')
  starts, seeds = (['best'], [0]) if args.quick else (list(STARTS), list(SEEDS))
  train_seeds = [int(x) for x in args.seeds.split(',')]
  if not args.report_only:
    from hdet_jax import trainer

    trainer.setup_jax(workloads.base_config('lm', 16, True))
  if not args.report_only:  # train the selection (cached)
    for cell in cells:
      for seed in seeds if args.quick else train_seeds:
        for start in starts:
          train_one(cell, start, seed, args.quick, work_root)
  results = {}  # the report reads every cell's records, whatever was selected
  for cell in cells if args.quick else CELLS + HELDOUT_CELLS:
    recs = {}
    for seed in seeds:
      for start in starts:
        path = record_path(cell, start, seed, args.quick, work_root)
        if os.path.exists(path):
          with open(path, encoding='utf-8') as f:
            recs[(start, seed)] = json.load(f)
    if recs:
      results[cell] = cell_rows(cell, recs, args.quick)
  out = args.out or (work_root if args.quick else os.path.join(REPO, 'results'))
  _, md = write_report(out, results, args.quick)
  with open(md, encoding='utf-8') as f:
    print(f.read())


if __name__ == '__main__':
  main()
