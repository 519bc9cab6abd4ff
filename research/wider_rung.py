"""A wider first rung: the LR bracket keeping 5 or 6 of its 8 points at 0.1 of the run instead of 4, on every cell.

Issue 26, twenty-second pass. The twenty-first (``results/bracket_straddle.md``) found the bracket's pick made at its
first rung: at 0.1 of a one-cycle run every point is still on its warmup and the higher peaks are further along it,
so the rung keeps the higher points, and the one just below the kept point, cut there, would often have won the last
rung. A rung that keeps more is the plain fix. It needs no new bracket: a bracket's runs are independent plain runs
(its test asserts the kept run equals a straight run bit for bit), so a bracket whose first rung keeps ``4 + k``
points is the committed bracket (``results/bracket_mode/runs``) plus the ``k`` points its first rung ranked next,
trained to the last rung (probes), and, where one of them then beats the kept point, trained to the end. Both
rungs rank as the bracket does (``bracket.survivors``: the mean training loss of the 10 steps before the rung).

Footing: the probes train on this CPU. Where a probe's first-rung loss is not the bracket record's bit for bit (a
record made on another CPU; fine-tuning, whose pretrained checkpoint was retrained here), the kept point is trained
to the last rung here too, and the probes are compared with that. ``--check`` trains one such bracket in full with
the wider rung and checks it against the composition.

    python -m research.wider_rung                 # train what is missing (cached, resumable), then report
    python -m research.wider_rung --report-only
    python -m research.wider_rung --check mnist1d:500:adamw:best:0   # one real bracket against the composition
    python -m research.wider_rung --quick         # a smoke run: the quick bracket of research.bracket_mode
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil

import numpy as np

from research import autolr
from research import bracket_mode
from research import bracket_straddle
from research import records

REPO = autolr.REPO
EXTRA = (1, 2)  # points the wider first rung keeps beyond the bracket's: 8-5-1 (2.5 runs) and 8-6-1 (2.7 runs)
QUICK_CELL = 'lm:16:adamw'
# The quick bracket has two rungs, as the real one (research.bracket_mode's quick bracket has one): 5 points, 2 kept
# at a quarter of the run, 1 at half; its wider rungs keep 3 and 4.
QUICK_BRACKET = {
  'bracket.points': 5,
  'bracket.factor': 2.0,
  'bracket.rungs': '0.25:2,0.5:1',
  'bracket.compare_steps': 3,
}


def bracket_fields(quick: bool) -> dict:
  return QUICK_BRACKET if quick else bracket_mode.BRACKET


def config_for(cell: str, start: str, seed: int, quick: bool, work_root: str):
  return bracket_mode.config_for(cell, start, seed, quick, work_root, bracket_fields(quick))


def runs_dir(cell: str, quick: bool, work_root: str) -> str:
  workload, steps, optim = bracket_mode.parse_cell(cell)
  root = os.path.join(work_root, 'wider_rung_quick') if quick else os.path.join(REPO, 'results', 'wider_rung', 'runs')
  return os.path.join(root, workload, f'steps{steps}', optim)


def _key(losses: dict, lr: float) -> tuple[float, float]:
  """The bracket's ranking (``bracket.survivors``): the loss, NaN as inf, ties to the lower LR."""
  v = losses[lr]
  return (math.inf if v is None or not np.isfinite(v) else v, lr)


def first_rung_order(rec: dict) -> list[float]:
  """The bracket's points as its first rung ranked them, best first."""
  losses = {lr: rec['rungs'][0]['losses'][f'{lr:.6g}'] for lr in rec['lrs']}
  return sorted(losses, key=lambda lr: _key(losses, lr))


def extra_points(rec: dict) -> list[float]:
  """The points a first rung keeping ``max(EXTRA)`` more would add, in its order."""
  kept = len(rec['rungs'][0]['kept'])
  return first_rung_order(rec)[kept : kept + max(EXTRA)]


def _load(path: str) -> dict | None:
  if not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def probe_path(cell: str, start: str, seed: int, lr: float, quick: bool, work_root: str) -> str:
  return os.path.join(runs_dir(cell, quick, work_root), f'rungs_{start}_s{seed}_lr{lr:.6g}.json')


def end_path(cell: str, start: str, seed: int, lr: float, quick: bool, work_root: str) -> str:
  return os.path.join(runs_dir(cell, quick, work_root), f'end_{start}_s{seed}_lr{lr:.6g}.json')


def _straddle_probe(cell: str, start: str, seed: int, lr: float, quick: bool, work_root: str) -> dict | None:
  """The twenty-first pass's probe of the same point (the same config, seed and stop), where it made one."""
  if start not in bracket_straddle.PROBE_STARTS:
    return None
  p = _load(bracket_straddle.probe_path(cell, seed, quick, work_root, start))
  return p if p is not None and p['lr'] == lr else None


def _scratch(cell: str, start: str, seed: int, lr: float, what: str, work_root: str) -> str:
  workload, steps, optim = bracket_mode.parse_cell(cell)
  return os.path.join(work_root, 'wider_rung', workload, f'steps{steps}', f'{optim}_{start}_s{seed}_{what}_lr{lr:.6g}')


def probe(cell: str, start: str, seed: int, lr: float, quick: bool, work_root: str, train: bool = True) -> dict | None:
  """The bracket's point at ``lr`` trained to its last rung, with its loss at every rung (cached; None where it is
  not recorded and ``train`` is off)."""
  from hdet_jax.trainer import bracket, schema

  path = probe_path(cell, start, seed, lr, quick, work_root)
  got = _load(path)
  if got is not None or not train:
    return got
  straddle = _straddle_probe(cell, start, seed, lr, quick, work_root)
  if straddle is not None:  # (its probe of the same point: reused, marked)
    steps, losses, source = straddle['rung_steps'], straddle['losses'], 'bracket_straddle'
  else:
    config = config_for(cell, start, seed, quick, work_root)
    steps = schema.rung_steps(schema.parse_rungs(config.bracket.rungs), config.num_train_steps)
    workdir = _scratch(cell, start, seed, lr, 'rungs', work_root)
    summary = bracket_straddle._train_point(config, lr, steps[-1], workdir)
    losses = [
      bracket.window_loss(summary['metrics'], s, config.bracket.compare_steps, summary['diverged_at']) for s in steps
    ]
    source = 'wider_rung'
    shutil.rmtree(workdir, ignore_errors=True)
  got = {'cell': cell, 'start': start, 'seed': seed, 'lr': lr, 'rung_steps': steps, 'losses': losses, 'source': source}
  records.write_record(path, got, indent=1)
  return got


def end(cell: str, start: str, seed: int, lr: float, quick: bool, work_root: str, train: bool = True) -> dict | None:
  """The bracket's point at ``lr`` trained to the end, as the bracket trains its winner: its record (cached; None
  where it is not recorded and ``train`` is off)."""
  path = end_path(cell, start, seed, lr, quick, work_root)
  got = _load(path)
  if got is None and train:
    config = config_for(cell, start, seed, quick, work_root)
    workdir = _scratch(cell, start, seed, lr, 'end', work_root)
    summary = bracket_straddle._train_point(config, lr, 0, workdir)
    got = {
      'cell': cell,
      'start': start,
      'seed': seed,
      'lr': lr,
      'final_metric': records.finite_or_none(summary['final_metric']),
    }
    records.write_record(path, got, indent=1)
    shutil.rmtree(workdir, ignore_errors=True)
  return got


def compose(cell: str, start: str, seed: int, quick: bool, work_root: str, train: bool) -> dict | None:
  """The committed bracket with its first rung keeping 1 and 2 more points: per ``EXTRA`` the point its last rung
  keeps and its final metric (None: a probe or an end is not trained yet and ``train`` is off)."""
  rec = _load(bracket_mode.record_path(cell, start, seed, quick, work_root))
  if rec is None:
    return None
  kept = rec['kept_lr']
  last = {kept: rec['rungs'][-1]['losses'][f'{kept:.6g}']}
  extras, reproduced = extra_points(rec), True
  for lr in extras:
    first = rec['rungs'][0]['losses'][f'{lr:.6g}']
    if _key({lr: first}, lr)[0] == math.inf:  # (it diverged by the first rung: inf at every later one, untrained)
      last[lr] = math.inf
      continue
    p = probe(cell, start, seed, lr, quick, work_root, train)
    if p is None:
      return None
    last[lr] = p['losses'][-1]
    reproduced &= p['losses'][0] == first
  if not reproduced:  # (the kept point's last rung on the probes' footing: this CPU)
    p = probe(cell, start, seed, kept, quick, work_root, train)
    if p is None:
      return None
    last[kept] = p['losses'][-1]
  out = {
    'cell': cell,
    'start': start,
    'seed': seed,
    'anchor_lr': rec['anchor_lr'],
    'kept_lr': kept,
    'final_metric': rec['final_metric'],
    'extras': extras,
    'last_rung': {f'{lr:.6g}': v for lr, v in last.items()},
    'reproduced': reproduced,
    'wider': {},
  }
  for k in EXTRA:
    pool = [kept] + extras[:k]
    winner = min(pool, key=lambda lr: _key(last, lr))
    e = (
      {'final_metric': rec['final_metric']}
      if winner == kept
      else end(cell, start, seed, winner, quick, work_root, train)
    )
    if e is None:
      return None
    out['wider'][str(k)] = {'kept_lr': winner, 'final_metric': e['final_metric']}
  if not reproduced and any(w['kept_lr'] != kept for w in out['wider'].values()):
    # (the kept point's end on the same footing as the new winner's: both trained here)
    e = end(cell, start, seed, kept, quick, work_root, train)
    if e is None:
      return None
    out['kept_end_here'] = e['final_metric']
  return out


def wider_rungs(k: int, quick: bool) -> list[tuple[float, int]]:
  """The bracket's rungs with the first keeping ``k`` more."""
  from hdet_jax.trainer import schema

  (fraction, kept), *rest = schema.parse_rungs(bracket_fields(quick)['bracket.rungs'])
  return [(fraction, kept + k)] + rest


def compute_runs(cell: str, k: int, quick: bool) -> float:
  from hdet_jax.trainer import bracket

  return bracket.compute_runs(
    bracket_fields(quick)['bracket.points'], wider_rungs(k, quick), bracket_mode.parse_cell(cell)[1]
  )


def rungs_text(k: int, quick: bool) -> str:
  """The wider bracket's ``bracket.rungs``."""
  return ','.join(f'{f:g}:{n}' for f, n in wider_rungs(k, quick))


def check(spec: str, quick: bool, work_root: str) -> dict:
  """Trains the bracket of ``cell:start:seed`` in full with the first rung keeping ``max(EXTRA)`` more, and returns
  its kept LR and final metric beside the composition's."""
  from hdet_jax.trainer import config_lib

  *cell, start, seed = spec.split(':')
  cell, seed, k = ':'.join(cell), int(seed), max(EXTRA)
  config = config_lib.with_overrides(
    config_for(cell, start, seed, quick, work_root), {'bracket.rungs': rungs_text(k, quick)}
  )
  workdir = _scratch(cell, start, seed, 0.0, 'check', work_root)
  shutil.rmtree(workdir, ignore_errors=True)
  summary = records.run_bracket(config, workdir)
  shutil.rmtree(workdir, ignore_errors=True)
  composed = compose(cell, start, seed, quick, work_root, train=True)['wider'][str(k)]
  got = {
    'cell': cell,
    'start': start,
    'seed': seed,
    'rungs': config.bracket.rungs,
    'bracket': {'kept_lr': summary['bracket']['winner']['lr'], 'final_metric': summary['final_metric']},
    'composed': composed,
    'equal': summary['bracket']['winner']['lr'] == composed['kept_lr']
    and summary['final_metric'] == composed['final_metric'],
  }
  records.write_record(check_path(cell, start, seed, quick, work_root), got, indent=1)
  return got


def check_path(cell: str, start: str, seed: int, quick: bool, work_root: str) -> str:
  return os.path.join(runs_dir(cell, quick, work_root), f'check_{start}_s{seed}.json')


def checks(quick: bool, work_root: str) -> list[dict]:
  """Every ``--check`` recorded."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(runs_dir(QUICK_CELL, quick, work_root))))
  out = []
  for path in sorted(glob.glob(os.path.join(root, '*', '*', '*', 'check_*.json'))):
    with open(path, encoding='utf-8') as f:
      out.append(json.load(f))
  return out


def paired_final(seed: dict, k: int) -> float | None:
  """A wider bracket's final metric on the committed record's footing: its own where its kept point is the
  record's or its probes reproduce the record; else the record's plus the difference of the two points' ends, both
  trained here (one CPU, one checkpoint), so that another CPU's rounding (about as large as the seed's noise over a
  run) does not enter the gap."""
  w = seed['wider'][str(k)]
  if w['kept_lr'] == seed['kept_lr'] or seed['reproduced']:
    return w['final_metric']
  if None in (w['final_metric'], seed['final_metric'], seed['kept_end_here']):
    return None
  return seed['final_metric'] + w['final_metric'] - seed['kept_end_here']


def cell_rows(cell: str, quick: bool, work_root: str) -> dict:
  """Per start (3 seeds composed): the 3-seed mean final of the committed bracket and of each wider one, their
  gaps to the sweep's best, and per seed the kept points and whether the kept point changed."""
  best = None if quick else bracket_mode.sweep_cell(cell)['grid_best']['value']
  gap = lambda v: None if v is None or best is None else v / best - 1
  out = {}
  for start in ['best'] if quick else list(bracket_mode.STARTS):
    seeds = [compose(cell, start, s, quick, work_root, train=False) for s in ([0] if quick else bracket_mode.SEEDS)]
    if any(s is None for s in seeds):
      continue
    row = {'seeds': seeds, 'sweep_best': best, 'base': records.mean_or_none([s['final_metric'] for s in seeds])}
    row['base_gap'] = gap(row['base'])
    for k in EXTRA:
      finals = [paired_final(s, k) for s in seeds]
      row[f'wider{k}'] = records.mean_or_none(finals)
      row[f'wider{k}_gap'] = gap(row[f'wider{k}'])
      row[f'wider{k}_changed'] = sum(s['wider'][str(k)]['kept_lr'] != s['kept_lr'] for s in seeds)
    out[start] = row
  return out


def _row_line(cell: str, start: str, r: dict) -> str:
  """One cell-start's table row (``cell_rows``'s entry)."""
  k1, k2 = EXTRA
  seeds = r['seeds']
  kept = ' / '.join(f'{s["wider"][str(k2)]["kept_lr"] / s["anchor_lr"]:.3g}' for s in seeds)
  footing = (
    'record'
    if all(s['reproduced'] for s in seeds)
    else 'here (' + ', '.join(f's{s["seed"]}' for s in seeds if not s['reproduced']) + ')'
  )
  here = (
    ', '.join(f's{s["seed"]} {s["final_metric"]:.4g} / {s["kept_end_here"]:.4g}' for s in seeds if 'kept_end_here' in s)
    or '-'
  )
  best = '-' if r['sweep_best'] is None else f'{r["sweep_best"]:.4g}'
  return (
    f'| {cell} | {start} | {best} | {records.pct(r["base_gap"])} | {records.pct(r[f"wider{k1}_gap"])} '
    f'({r[f"wider{k1}_changed"]}) | {records.pct(r[f"wider{k2}_gap"])} ({r[f"wider{k2}_changed"]}) | {kept} | '
    f'{footing} | {here} |'
  )


def write_report(out_dir: str, rows: dict, quick: bool) -> str:
  from hdet_jax.trainer import schema

  k1, k2 = EXTRA
  b = bracket_fields(quick)
  n, (first, last) = b['bracket.points'], schema.parse_rungs(b['bracket.rungs'])
  name = lambda k: f'{n}-{first[1] + k}-{last[1]}'
  c = {k: compute_runs(next(iter(rows), QUICK_CELL), k, quick) for k in (0,) + EXTRA}
  lines = [
    f'# A wider first rung: the bracket keeping {first[1] + k1} or {first[1] + k2} of its {n} points at {first[0]:g} '
    'of the run',
    '',
    f'Made by `python -m research.wider_rung{" --quick" if quick else ""}` (records in `results/wider_rung/runs/`). '
    f'Each bracket of `results/bracket_mode.md` ({n} points a factor {b["bracket.factor"]:g} apart; {first[1]} kept at '
    f'{first[0]:g} of the run, {last[1]} at {last[0]:g}) recomposed with its first rung keeping {first[1] + k1} '
    f'({c[k1]:.2g} runs) or {first[1] + k2} ({c[k2]:.2g} runs) instead of {first[1]} ({c[0]:.2g} runs): the '
    'committed records plus the points the first rung ranked next, trained to the last '
    "rung and, where one then beats the kept point, to the end. Gaps are 3-seed means against the sweep's best "
    '3-seed mean. "Changed": seeds whose kept point moved. "Footing": "here" where a probe\'s first-rung loss is '
    "not the record's bit for bit (a record made on another CPU; fine-tuning's pretrained checkpoint, retrained "
    'here): the kept point is then retrained to the last rung here, and where it is replaced, to the end too, '
    "and the new point's final enters as the record's plus the difference of the two ends trained here (the "
    "last column: the kept point's end as recorded and as trained here). The reading is in "
    '`research/workloads_discussion.md` (twenty-second pass).',
    '',
  ]
  header = [
    f'| cell | start | sweep best | {name(0)} gap | {name(k1)} gap (changed) | {name(k2)} gap (changed) | {name(k2)} '
    "kept (x the sweep's first-seed best), per seed | footing | kept point's end: record / here, where replaced |",
    '|---|---|---|---|---|---|---|---|---|',
  ]
  lines += header
  tallies = {}
  for cell, starts in rows.items():
    group = 'heldout' if bracket_mode.parse_cell(cell)[0] in bracket_mode.HELDOUT else 'cells'
    if group == 'heldout' and 'heldout' not in tallies:
      lines += [
        '',
        '## On the held-out corpus',
        '',
        "The LM on Python's standard library source (`research.heldout_corpus`), "
        "which neither the bracket's rungs nor this pass were chosen on; its sweep as in `results/bracket_mode.md`.",
        '',
        *header,
      ]
    t = tallies.setdefault(group, {'total': 0, **{name(k): 0 for k in (0,) + EXTRA}})
    for start, r in starts.items():
      lines.append(_row_line(cell, start, r))
      if r['base_gap'] is not None:
        t['total'] += 1
        for k, key in ((0, 'base_gap'), (k1, f'wider{k1}_gap'), (k2, f'wider{k2}_gap')):
          t[name(k)] += r[key] is not None and r[key] <= 0.01
  for group, t in tallies.items():
    where = ' on the held-out corpus' if group == 'heldout' else ''
    lines += [
      '',
      f"Within 1% of the sweep's best (3-seed means){where}, of {t['total']} cell-starts: "
      + ', '.join(f'{name(k)} {t[name(k)]}' for k in (0,) + EXTRA)
      + '.',
    ]
  done = checks(quick, out_dir)
  if done:
    lines += [
      '',
      f'Checked (`--check`): a real bracket with the widest rung trained in full equals its composition bit for bit '
      f'(kept LR and final metric) in {sum(c["equal"] for c in done)} of {len(done)}: '
      + '; '.join(
        f'{c["cell"]} from {c["start"]}, seed {c["seed"]} (rungs {c["rungs"]}): kept '
        f'{c["bracket"]["kept_lr"]:.4g}, final {c["bracket"]["final_metric"]:.6g}'
        for c in done
      )
      + '.',
    ]
  os.makedirs(out_dir, exist_ok=True)
  records.write_json(
    os.path.join(out_dir, 'wider_rung.json'),
    {'rows': rows, 'tally': tallies, 'compute_runs': {name(k): v for k, v in c.items()}},
    indent=1,
  )
  md = os.path.join(out_dir, 'wider_rung.md')
  with open(md, 'w', encoding='utf-8') as f:
    f.write('\n'.join(lines) + '\n')
  return md


TRAIN_ORDER = ('best', 'high', 'low')  # (from 10x low the added points are the bracket's two lowest: trained last)


def train_start(cell: str, start: str, seeds: list[int], quick: bool, work_root: str) -> None:
  """Each seed's wider brackets (cached); in quick mode its bracket first."""
  for seed in seeds:
    if quick:
      bracket_mode.train_one(cell, start, seed, quick, work_root, QUICK_BRACKET)
    got = compose(cell, start, seed, quick, work_root, train=True)
    if got is not None:
      w = got['wider']
      print(
        f'  {cell} {start} s{seed}: kept x '
        + ' / '.join(f'{w[str(k)]["kept_lr"] / got["anchor_lr"]:.3g}' for k in EXTRA)
        + f' (was {got["kept_lr"] / got["anchor_lr"]:.3g}), final '
        + ' / '.join(str(w[str(k)]['final_metric']) for k in EXTRA)
        + f' (was {got["final_metric"]})',
        flush=True,
      )


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--cells', default=','.join(bracket_mode.CELLS), help='workload:steps:optim,... to train')
  p.add_argument(
    '--seeds', default=','.join(map(str, bracket_mode.SEEDS)), help='seeds to train (the report reads them all)'
  )
  p.add_argument('--report-only', action='store_true', help='read the records, train nothing')
  p.add_argument('--out', default=None, help="the report's folder (default: results/; --quick: the workdir)")
  p.add_argument(
    '--check', default=None, help='cell:start:seed: train that bracket in full with the widest rung and compare'
  )
  p.add_argument('--quick', action='store_true', help='a smoke run: the quick bracket of research.bracket_mode')
  p.add_argument('--workdir', default=None, help='where runs train (default: workdirs/workloads)')
  args = p.parse_args(argv)
  work_root = args.workdir or os.path.join(REPO, 'workdirs', 'wider_rung_quick' if args.quick else 'workloads')
  cells = [QUICK_CELL] if args.quick else args.cells.split(',')
  seeds = [0] if args.quick else [int(s) for s in args.seeds.split(',')]
  if not args.report_only:
    from hdet_jax import trainer
    from research import workloads

    trainer.setup_jax(workloads.base_config('lm', 16, True))
    if args.check:
      print(json.dumps(check(args.check, args.quick, work_root), indent=1))
      return
    for start in ['best'] if args.quick else TRAIN_ORDER:
      for cell in cells:
        train_start(cell, start, seeds, args.quick, work_root)
  rows = {
    c: cell_rows(c, args.quick, work_root)
    for c in ([QUICK_CELL] if args.quick else bracket_mode.CELLS + bracket_mode.HELDOUT_CELLS)
  }
  out = args.out or (work_root if args.quick else os.path.join(REPO, 'results'))
  md = write_report(out, {c: r for c, r in rows.items() if r}, args.quick)
  with open(md, encoding='utf-8') as f:
    print(f.read())


if __name__ == '__main__':
  main()
