"""The two points a bracket centred on the sweep's best holds nearest it, trained to the end.

Issue 26, twentieth pass. Centred on the one-cycle sweep's best peak LR, the LR bracket (``results/bracket_mode.md``)
trains 8 points a factor 2 apart, so its two nearest the best are 0.71x and 1.41x: it cannot keep the best itself.
On mnist1d with AdamW it kept 1.41x on every seed at every length and missed by 5-28%. This trains both neighbours
as plain runs, as the sweep trains its grid (3 seeds), to tell apart the two readings: the rungs took the worse
neighbour, or both neighbours end as far from the best (the grid's offset on a sharp optimum). Then (twenty-first
pass) the lower one is trained as the bracket trains it, to its last rung: the bracket cut it at the first, and
its loss at the last says which of the two that rung would have kept.

    python -m research.bracket_straddle            # train what is missing (cached, resumable), then report
    python -m research.bracket_straddle --report-only
    python -m research.bracket_straddle --quick    # a smoke run: the tiny LM, 16 steps, one seed
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys

import numpy as np

from research import autolr
from research import bracket_mode
from research import records
from research import workloads

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
  root = (
    os.path.join(work_root, 'bracket_straddle_quick')
    if quick
    else os.path.join(REPO, 'results', 'bracket_straddle', 'runs')
  )
  return os.path.join(root, workload, f'steps{steps}', optim)


def train_cell(cell: str, seeds: list[int], quick: bool, work_root: str) -> None:
  """Both neighbours on every seed (cached records; a preempted run resumes)."""
  workload, steps, optim = bracket_mode.parse_cell(cell)
  cache = records.RunCache(
    records_dir(cell, quick, work_root),
    os.path.join(work_root, 'bracket_straddle', workload, f'steps{steps}', optim),
    autolr.make_record,
    autolr.describe,
  )
  run = workloads.plain_runner(cache, workload, steps, optim, quick, work_root, train=True)
  for side, lr in neighbour_lrs(bracket_mode.anchor_lr(cell, quick)).items():
    for seed in seeds:
      run(f'{side}_s{seed}', lr, seed, {})


PROBE_CELLS = bracket_mode.CELLS  # (the held-out corpus's cells are left out: kept held out)
PROBE_STARTS = ('best', 'high')  # (from 10x low the kept point is never the lowest survivor next to a cut)


def _tag(start: str, seed: int) -> str:
  return f's{seed}' if start == 'best' else f'{start}_s{seed}'


def probe_path(cell: str, seed: int, quick: bool, work_root: str, start: str = 'best') -> str:
  return os.path.join(records_dir(cell, quick, work_root), f'rungs_below_{_tag(start, seed)}.json')


def _bracket_record(cell: str, seed: int, quick: bool, work_root: str, start: str = 'best') -> dict | None:
  path = bracket_mode.record_path(cell, start, seed, quick, work_root)
  if not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def probe_lr(cell: str, seed: int, quick: bool, work_root: str, start: str = 'best') -> float | None:
  """The bracket's point just below the one its bracket from the best kept, where its first rung cut that point
  (None where the kept point is not the lowest survivor, or is the bracket's lowest); without a bracket record (quick
  mode) the point below the centre."""
  b = _bracket_record(cell, seed, quick, work_root, start)
  if b is None:
    return neighbour_lrs(bracket_mode.anchor_lr(cell, quick))['below'] if start == 'best' else None
  lrs, first, kept = sorted(b['lrs']), sorted(b['rungs'][0]['kept']), b['kept_lr']
  k = lrs.index(kept)
  return lrs[k - 1] if kept == first[0] and k > 0 else None


def _train_point(config, lr: float, stop_at_step: int, workdir: str) -> dict:
  """The bracket's run at ``lr`` (``bracket.point_config``) in a scratch workdir, removed afterwards; a preempted run
  exits 143 (rerun to resume)."""
  from hdet_jax.trainer import bracket, run_settings, trainer

  product, tuning = run_settings.split(config)
  summary = trainer.train_and_evaluate(
    bracket.point_config(product, lr, stop_at_step), workdir, tuning=bracket.point_tuning(tuning, stop_at_step)
  )
  if summary['preempted']:
    sys.exit(143)
  return summary


def train_probe(cell: str, seeds: list[int], quick: bool, work_root: str, start: str = 'best') -> None:
  """The point the bracket from the best cut just below its kept one (:func:`probe_lr`), trained as that bracket
  trains it (its config, its seed) to the bracket's last rung, with its loss at every rung (the bracket's own
  statistic). The bracket's records hold its loss at the first rung only; this says what the last rung would have
  seen (cached records)."""
  from hdet_jax.trainer import bracket, schema

  for seed in seeds:
    path, lr = probe_path(cell, seed, quick, work_root, start), probe_lr(cell, seed, quick, work_root, start)
    if lr is None or os.path.exists(path):
      continue
    config = bracket_mode.config_for(cell, start, seed, quick, work_root)
    steps = schema.rung_steps(schema.parse_rungs(config.bracket.rungs), config.num_train_steps)
    workload, total, optim = bracket_mode.parse_cell(cell)
    workdir = os.path.join(
      work_root, 'bracket_straddle_probe', workload, f'steps{total}', f'{optim}_below_{_tag(start, seed)}'
    )
    summary = _train_point(config, lr, steps[-1], workdir)
    losses = [
      bracket.window_loss(summary['metrics'], step, config.bracket.compare_steps, summary['diverged_at'])
      for step in steps
    ]
    records.write_record(
      path, {'cell': cell, 'start': start, 'seed': seed, 'lr': lr, 'rung_steps': steps, 'losses': losses}, indent=1
    )
    shutil.rmtree(workdir, ignore_errors=True)


def ends_path(cell: str, which: str, seed: int, quick: bool, work_root: str, start: str = 'best') -> str:
  return os.path.join(records_dir(cell, quick, work_root), f'ends_{which}_{_tag(start, seed)}.json')


def train_ends(cell: str, seeds: list[int], quick: bool, work_root: str, start: str = 'best') -> None:
  """Where the last rung would have kept the cut point, both it and the kept point trained to the end here, as the
  bracket trains its winner (cached records); the straddle's own cells have their plain runs already."""
  if cell in CELLS and start == 'best':
    return
  workload, total, optim = bracket_mode.parse_cell(cell)
  for row in probe_rows(cell, quick, work_root, start):
    if row['seed'] not in seeds or row.get('last_rung_keeps') != 'below':
      continue
    config = bracket_mode.config_for(cell, start, row['seed'], quick, work_root)
    for which, lr in (('cut', row['lr']), ('kept', row['bracket']['kept_lr'])):
      path = ends_path(cell, which, row['seed'], quick, work_root, start)
      if os.path.exists(path):
        continue
      workdir = os.path.join(
        work_root, 'bracket_straddle_ends', workload, f'steps{total}', f'{optim}_{which}_{_tag(start, row["seed"])}'
      )
      summary = _train_point(config, lr, 0, workdir)
      records.write_record(
        path, {'cell': cell, 'seed': row['seed'], 'lr': lr, 'final_metric': summary['final_metric']}, indent=1
      )
      shutil.rmtree(workdir, ignore_errors=True)


def probe_rows(cell: str, quick: bool, work_root: str, start: str = 'best') -> list[dict]:
  """Per seed: the probe's loss at each rung beside the bracket's recorded losses there (its own at the first rung,
  which it reproduces or not; the kept point's at the last), and which point the last rung would have kept."""
  out = []
  for seed in [0] if quick else SEEDS:
    path = probe_path(cell, seed, quick, work_root, start)
    if not os.path.exists(path):
      continue
    with open(path, encoding='utf-8') as f:
      probe = json.load(f)
    row = {'cell': cell, 'start': start, 'seed': seed, 'lr': probe['lr'], 'losses': probe['losses'], 'bracket': None}
    b = _bracket_record(cell, seed, quick, work_root, start)
    if b is not None:
      first, last = b['rungs'][0], b['rungs'][-1]
      (kept,) = last['kept']
      row['bracket'] = {
        'first_loss': first['losses'].get(f'{probe["lr"]:.6g}'),
        'first_kept_x': [x / b['anchor_lr'] for x in first['kept']],
        'probe_x': probe['lr'] / b['anchor_lr'],
        'kept_lr': kept,
        'kept_x': kept / b['anchor_lr'],
        'kept_last_loss': last['losses'][f'{kept:.6g}'],
      }
      row['first_reproduced'] = (
        probe['losses'][0] == row['bracket']['first_loss']
      )  # (bit for bit, or it is not the point)
      row['last_rung_keeps'] = 'below' if probe['losses'][-1] < row['bracket']['kept_last_loss'] else 'kept'
      ends = [ends_path(cell, w, seed, quick, work_root, start) for w in ('cut', 'kept')]
      if all(os.path.exists(e) for e in ends):  # (both trained here, on one CPU)
        row['ends'] = []
        for e in ends:
          with open(e, encoding='utf-8') as f:
            row['ends'].append(json.load(f)['final_metric'])
    out.append(row)
  return out


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
    row['neighbours'][side] = {
      'lr': lr,
      'x': lr / anchor,
      'values': got,
      'mean': float(np.mean(finite)) if finite and len(finite) == len(got) else None,
    }
  if not quick:
    sweep = bracket_mode.sweep_cell(cell)
    row['sweep_best'] = sweep['grid_best']['value']
    brackets = []
    for seed in SEEDS:
      p = bracket_mode.record_path(cell, 'best', seed, False, work_root)
      if os.path.exists(p):
        with open(p, encoding='utf-8') as f:
          brackets.append(json.load(f))
    row['bracket_best_start'] = {
      'kept_x': [r['kept_lr'] / r['anchor_lr'] for r in brackets],
      'mean': float(np.mean([r['final_metric'] for r in brackets])) if brackets else None,
    }
  return row


def _gap(value, best) -> str:
  return '-' if value is None or best is None else f'{100 * (value / best - 1):+.1f}%'


EDGES = ('bracket_low', 'cut_below', 'inner', 'cut_above', 'bracket_high')


def edge_counts() -> dict:
  """Over every committed bracket record (``results/bracket_mode/runs``): per start, where the kept point sits among
  the first rung's survivors: the bracket's own lowest point, the lowest survivor with a cut point below it, an inner
  survivor, the highest with a cut point above it, or the bracket's own highest point."""
  counts = {}
  for path in sorted(glob.glob(os.path.join(REPO, 'results', 'bracket_mode', 'runs', '*', '*', '*', '*.json'))):
    with open(path, encoding='utf-8') as f:
      r = json.load(f)
    first, lrs, kept = sorted(r['rungs'][0]['kept']), sorted(r['lrs']), r['kept_lr']
    if kept == first[0]:
      where = 'bracket_low' if kept == lrs[0] else 'cut_below'
    elif kept == first[-1]:
      where = 'bracket_high' if kept == lrs[-1] else 'cut_above'
    else:
      where = 'inner'
    by_start = counts.setdefault(r['start'], dict.fromkeys(EDGES, 0))
    by_start[where] += 1
  return counts


def mark_ends(probes: list[dict], rows: list[dict]) -> None:
  """Sets each probe's ``cut_ends_lower`` where both points' ends are known: trained here (``ends``), or, in the
  straddle's own cells from the best, its plain runs (the cut point is 0.71x there, the kept one 1.41x)."""
  neighbours = {r['cell']: r['neighbours'] for r in rows}
  for p in probes:
    if p['bracket'] is None:
      continue
    if 'ends' in p:
      p['cut_ends_lower'] = p['ends'][0] < p['ends'][1]
    elif p['cell'] in neighbours and p['start'] == 'best':
      i, values = SEEDS.index(p['seed']), neighbours[p['cell']]
      below, above = (values[side]['values'] for side in NEIGHBOURS)
      if len(below) > i and len(above) > i and below[i] is not None and above[i] is not None:
        p['cut_ends_lower'] = below[i] < above[i]


def _probe_lines(probes: list[dict]) -> list[str]:
  lines = [
    '',
    '## What the first rung cut: the point just below the kept one, trained as the bracket trains it',
    '',
    "Where a bracket from the best or from 10x high kept the lowest of its first rung's survivors, the point just "
    'below it was cut there. Here that point is trained as the bracket trains it '
    '(its config and seed, stopped at the last '
    "rung; the statistic is the bracket's: the mean training loss of the 10 steps before the rung) and its loss "
    "at each rung set beside the bracket's records: at the first rung the bracket's own for that point (bit "
    'for bit, else marked "differs": a record made on another CPU rounds differently), at the last the kept '
    'point\'s. "Ends lower": of the cut and the kept point trained to the end, '
    "the straddle's plain runs above or, where "
    'the last rung would have kept the cut point, both trained here as the bracket trains its winner (cut / kept).',
    '',
    '| cell, start, seed | first rung kept (x the best) | cut point | its first-rung loss: here / bracket | '
    'its last-rung loss | kept point there | the last rung would keep | ends lower |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for p in probes:
    b, cell = p['bracket'], p['cell']
    if b is None:
      lines.append(
        f'| {cell}, {p["start"]}, {p["seed"]} | - | - | {p["losses"][0]:.4f} / - | {p["losses"][-1]:.4f} | - | - | - |'
      )
      continue
    lower = '-'
    if 'cut_ends_lower' in p:
      lower = f'{b["probe_x"]:.2f}x' if p['cut_ends_lower'] else f'{b["kept_x"]:.2f}x'
      if 'ends' in p:
        lower += f' ({p["ends"][0]:.4f} / {p["ends"][1]:.4f})'
    first = (
      f'{b["first_loss"]:.4f}{"" if p["first_reproduced"] else " (differs)"}' if b['first_loss'] is not None else '-'
    )
    keeps = f'{b["probe_x"]:.2f}x' if p['last_rung_keeps'] == 'below' else f'{b["kept_x"]:.2f}x'
    survivors = ', '.join(f'{x:.2f}' for x in b['first_kept_x'])
    lines.append(
      f'| {cell}, {p["start"]}, {p["seed"]} | {survivors} | {b["probe_x"]:.2f}x | {p["losses"][0]:.4f} / {first} | '
      f'{p["losses"][-1]:.4f} | {b["kept_x"]:.2f}x: {b["kept_last_loss"]:.4f} | {keeps} | {lower} |'
    )
  for start in ('best', 'high'):
    kept = [p for p in probes if p['bracket'] is not None and p['start'] == start]
    if kept:
      would = [p for p in kept if p['last_rung_keeps'] == 'below']
      known = [p for p in would if 'cut_ends_lower' in p]
      lines += [
        '',
        f'From {"the best" if start == "best" else "10x high"}: the last rung would have kept the cut point in '
        f'{len(would)} of {len(kept)}; of those the cut point ends lower in {sum(p["cut_ends_lower"] for p in known)} '
        f'of the {len(known)} with both ends trained. The first-rung loss is reproduced bit for bit in '
        f'{sum(p["first_reproduced"] for p in kept)} of {len(kept)}.',
      ]
  return lines


def _edge_lines(counts: dict) -> list[str]:
  lines = [
    '',
    "## Every bracket: where its kept point sits among the first rung's survivors",
    '',
    'All committed brackets (`results/bracket_mode/runs`: every cell, start and seed): the point the last rung '
    'kept, against the four the first rung kept. "Next to a cut" means a point the first rung cut lies just '
    'beyond it; "the bracket\'s end" that no point of the bracket does.',
    '',
    "| start | the bracket's lowest point | lowest survivor, next to a cut | an inner survivor | highest survivor, "
    "next to a cut | the bracket's highest point |",
    '|---|---|---|---|---|---|',
  ]
  for start in ('low', 'best', 'high'):
    c = counts.get(start)
    if c:
      lines.append(f'| {start} | ' + ' | '.join(str(c[e]) for e in EDGES) + ' |')
  return lines


def write_report(out_dir: str, rows: list[dict], quick: bool, probes: list[dict] = ()) -> str:
  lines = [
    "# The bracket's two points nearest the sweep's best, trained to the end",
    '',
    f'Made by `python -m research.bracket_straddle{" --quick" if quick else ""}` (records in '
    "`results/bracket_straddle/runs/`). A bracket centred on the sweep's best (its first seed's) holds 8 "
    'points a factor 2 apart, so its two nearest the best are 0.71x and 1.41x. Each is trained here as a plain '
    "one-cycle run, as the sweep trains its grid; gaps are 3-seed means against the sweep's best 3-seed mean. "
    'The reading is in `research/workloads_discussion.md` (twentieth and twenty-first passes).',
    '',
    '| cell | sweep best | 0.71x per seed | 0.71x gap | 1.41x per seed | 1.41x gap | '
    'bracket from the best: kept, gap |',
    '|---|---|---|---|---|---|---|',
  ]
  for r in rows:
    best = r.get('sweep_best')
    below, above = r['neighbours']['below'], r['neighbours']['above']
    per_seed = lambda n: ' / '.join('-' if v is None else f'{v:.4g}' for v in n['values']) or '-'
    b = r.get('bracket_best_start') or {}
    kept = ' / '.join(f'{x:.2f}x' for x in b.get('kept_x', [])) or '-'
    lines.append(
      f'| {r["cell"]} | {"-" if best is None else f"{best:.4g}"} | {per_seed(below)} | '
      f'{_gap(below["mean"], best)} | {per_seed(above)} | {_gap(above["mean"], best)} | '
      f'{kept}, {_gap(b.get("mean"), best)} |'
    )
  lines += _probe_lines(probes)
  if not quick:
    lines += _edge_lines(edge_counts())
  os.makedirs(out_dir, exist_ok=True)
  records.write_json(os.path.join(out_dir, 'bracket_straddle.json'), {'cells': rows, 'probes': list(probes)}, indent=1)
  md = os.path.join(out_dir, 'bracket_straddle.md')
  with open(md, 'w', encoding='utf-8') as f:
    f.write('\n'.join(lines) + '\n')
  return md


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--cells', default=','.join(CELLS), help='workload:steps:optim,... to train')
  p.add_argument('--seeds', default=','.join(map(str, SEEDS)), help='seeds to train (the report reads them all)')
  p.add_argument(
    '--probe-cells',
    default=','.join(PROBE_CELLS),
    help='cells whose brackets from the best get their cut point probed (default: every cell but the held-out)',
  )
  p.add_argument('--report-only', action='store_true', help='read the records, train nothing')
  p.add_argument('--out', default=None, help="the report's folder (default: results/; --quick: the workdir)")
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
    for cell in cells if args.quick else args.probe_cells.split(','):
      for start in PROBE_STARTS:
        train_probe(cell, seeds, args.quick, work_root, start)
        train_ends(cell, seeds, args.quick, work_root, start)
  rows = [
    cell_row(c, [0] if args.quick else list(SEEDS), args.quick, work_root) for c in (cells if args.quick else CELLS)
  ]
  probes = [
    p
    for start in PROBE_STARTS
    for c in (cells if args.quick else PROBE_CELLS)
    for p in probe_rows(c, args.quick, work_root, start)
  ]
  mark_ends(probes, rows)
  md = write_report(args.out or (work_root if args.quick else os.path.join(REPO, 'results')), rows, args.quick, probes)
  with open(md, encoding='utf-8') as f:
    print(f.read())


if __name__ == '__main__':
  main()
