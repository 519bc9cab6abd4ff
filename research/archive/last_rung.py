"""The default LR bracket's last rung, checked: its runner-up trained to the end, and what 3 seeds resolve.

Issue 26, twenty-fourth pass. The default bracket (``bracket.rungs = '0.1:5,0.3:1'``; its 36 cell-starts are
``research.wider_rung``'s 8-5-1 compositions) misses the sweep's best by more than 1% in 11 cell-starts, all on
mnist1d. Three questions, answered from records plus plain runs and brackets trained here:

* **Which misses can 3 seeds resolve?** Every bracket seed is paired with the sweep's run at its best LR on the same
  seed (the same initialisation and data order). The gap is the ratio of the 3-seed means, as everywhere; its
  standard error is that of the 3 per-seed gaps. A miss is resolved where ``gap - 2 se > 1%``; a gap at or below 1%
  is within; the rest is not resolved by 3 seeds (2 degrees of freedom: a rough screen, not a test). Where the sweep
  has fresh seeds at the same LR (the ninth pass trained seeds 3-7 near mnist1d's best), the last column says how
  far its best moves on them: the reference's own uncertainty.
* **What does the last rung's choice cost?** At 0.3 of the run, the one-cycle peak, the last rung keeps one of its 5
  survivors by training loss. Its runner-up (the second lowest loss there) is trained to the end as the bracket
  trains its winner (``wider_rung.end``: a plain run). "Better of the two at the end" is an oracle bound, picked by
  the final metric itself (a last rung that could see the end: 3.2 runs of compute), not a method.
* **Do mnist1d's misses hold on 8 seeds?** On every mnist1d cell (500, 1000 and 2000 steps, AdamW and SGD) the
  sweep has fresh seeds 3-7 at its best LR and both neighbours, and the default HDET has them too. The default
  bracket is trained on them, from every start, and both are compared, paired, with the sweep's best over the same
  8 seeds.

Footing as in ``wider_rung``: where a bracket's record was made on another CPU (the LM, fine-tuning), every survivor
is retrained to the last rung here and both ends are trained here, and the runner-up's final enters as the record's
plus the difference of the two ends.

    python -m research.archive.last_rung                    # train what is missing (cached, resumable), then report
    python -m research.archive.last_rung --report-only
    python -m research.archive.last_rung --cells mnist1d:1000:adamw --eight-seeds ''   # one cell's runner-ups only
    python -m research.archive.last_rung --quick            # a smoke run: wider_rung's quick bracket
"""

from __future__ import annotations

import argparse
import math
import os
import shutil

import numpy as np

from research import autolr
from research import bracket_mode
from research.archive import heldout_task
from research import records
from research import wider_rung
from research import workloads

REPO = autolr.REPO
K = 1  # the default bracket is wider_rung's composition with one point more at the first rung (8-5-1)
# The runner-ups trained by default: mnist1d's, where every miss is (its records are this CPU's, so no survivor is
# retrained, and its runs are short). The LM and fine-tuning are within 1% from every start; --cells trains theirs.
TRAIN_CELLS = tuple(c for c in bracket_mode.CELLS if c.startswith('mnist1d'))
FRESH_SEEDS = range(3, 8)  # (the sweep's fresh seeds, where the ninth pass trained them)
RESOLVE_SE = records.RESOLVE_SE  # a miss is resolved where gap - RESOLVE_SE * se > 1%
# The default bracket trained on the sweep's fresh seeds, where the sweep has them at its best LR and both
# neighbours, and the default HDET too: mnist1d's six cells (8 seeds each, against the 3 of every other figure).
DEFAULT_BRACKET = heldout_task.BRACKET  # (the default, pinned: research/tests/test_heldout_task.py checks it)
EIGHT_SEED_CELLS = (
  'mnist1d:1000:adamw',
  'mnist1d:1000:sgd',
  'mnist1d:500:adamw',
  'mnist1d:500:sgd',
  'mnist1d:2000:adamw',
  'mnist1d:2000:sgd',
)


def recorded_finals(cell: str, names: list[str]) -> list[float | None]:
  """The final metric of each of the cell's recorded runs ``names`` (``results/workloads/runs``' or autolr's
  records; None: not recorded, or not finite)."""
  workload, steps, _ = bracket_mode.parse_cell(cell)
  cache = records.RunCache(workloads.records_dir(workload, steps, False, ''), '', None, None)
  return [None if r is None else records.finite_or_none(r['val_bpb']) for r in map(cache.get, names)]


def sweep_finals(cell: str, seeds) -> list[float | None]:
  """The sweep's final metric at its best LR (``results/workloads.json``'s), per seed (None: not recorded)."""
  optim = bracket_mode.parse_cell(cell)[2]
  lr = bracket_mode.sweep_cell(cell)['grid_best']['lr']
  return recorded_finals(cell, [autolr.grid_name(optim, lr, s) for s in seeds])


def last_rung_losses(
  comp: dict, cell: str, start: str, seed: int, quick: bool, work_root: str, train: bool
) -> dict | None:
  """The default bracket's survivors at its last rung (``comp``: its ``wider_rung.compose``), each with its loss
  there, on one footing: the record's where its probes reproduce it, else all retrained here (None: not trained and
  ``train`` is off)."""
  rec = wider_rung._load(bracket_mode.record_path(cell, start, seed, quick, work_root))
  losses = {}
  for lr in rec['rungs'][0]['kept'] + comp['extras'][:K]:
    key = f'{lr:.6g}'
    if comp['reproduced'] and key in comp['last_rung']:
      losses[lr] = comp['last_rung'][key]
    elif comp['reproduced'] and key in rec['rungs'][-1]['losses']:
      losses[lr] = rec['rungs'][-1]['losses'][key]
    elif wider_rung._key({lr: rec['rungs'][0]['losses'][key]}, lr)[0] == math.inf:
      losses[lr] = math.inf  # (it diverged by the first rung)
    else:  # (another CPU's record: retrained here)
      p = wider_rung.probe(cell, start, seed, lr, quick, work_root, train)
      if p is None:
        return None
      losses[lr] = p['losses'][-1]
  return losses


def runner_up(cell: str, start: str, seed: int, quick: bool, work_root: str, train: bool) -> dict | None:
  """The default bracket's kept point and final (None: its composition is not recorded), and, where trained (or
  ``train``), its last rung's runner-up with its final, both on the record's footing (``runner_up_final`` None:
  not trained, or it diverged)."""
  comp = wider_rung.compose(cell, start, seed, quick, work_root, train)
  if comp is None:
    return None
  winner = comp['wider'][str(K)]['kept_lr']  # (the composition's, on the record's footing)
  out = {
    'seed': seed,
    'anchor_lr': comp['anchor_lr'],
    'kept_lr': winner,
    'final_metric': wider_rung.paired_final(comp, K),
    'runner_up_lr': None,
    'runner_up_final': None,
    'reproduced': comp['reproduced'],
  }
  losses = last_rung_losses(comp, cell, start, seed, quick, work_root, train)
  if losses is None:
    return out
  second = min((lr for lr in losses if lr != winner), key=lambda lr: wider_rung._key(losses, lr))
  out.update(runner_up_lr=second, last_rung={f'{lr:.6g}': v for lr, v in losses.items()})
  if losses[second] == math.inf:
    return out
  e = wider_rung.end(cell, start, seed, second, quick, work_root, train)
  if e is None:
    return out
  if comp['reproduced']:
    out['runner_up_final'] = e['final_metric']
    return out
  w = wider_rung.end(cell, start, seed, winner, quick, work_root, train)  # (both ends here, one footing)
  parts = (out['final_metric'], e['final_metric'], None if w is None else w['final_metric'])
  out['runner_up_final'] = None if None in parts else parts[0] + parts[1] - parts[2]
  return out


def cell_rows(cell: str, quick: bool, work_root: str, train: bool = False) -> dict:
  """Per start: each seed's ``runner_up`` and the paired gaps of the kept point, the runner-up and the better of the
  two against the sweep's best LR on the same seeds."""
  seeds = [0] if quick else list(bracket_mode.SEEDS)
  sweep = None if quick else sweep_finals(cell, seeds)
  fresh = None if quick else [v for v in sweep_finals(cell, FRESH_SEEDS) if v is not None]
  out = {}
  for start in ['best'] if quick else list(bracket_mode.STARTS):
    got = [runner_up(cell, start, s, quick, work_root, train) for s in seeds]
    if any(g is None for g in got):
      continue
    kept = [g['final_metric'] for g in got]
    second = [g['runner_up_final'] for g in got]
    better = [None if None in (a, b) else min(a, b) for a, b in zip(kept, second)]
    row = {'seeds': got, 'sweep': sweep}
    for name, values in (('kept', kept), ('runner_up', second), ('better', better)):
      row[name] = None if sweep is None else dict(zip(('gap', 'se'), records.paired_gap(values, sweep)))
    row['runner_up_ahead'] = None if None in kept + second else sum(b < a for a, b in zip(kept, second))
    if sweep is not None and len(fresh) >= 3 and None not in sweep:
      row['sweep_fresh'] = {'n': len(fresh), 'shift': float(np.mean(fresh) / np.mean(sweep) - 1)}
    out[start] = row
  return out


# ---- The default bracket on 8 seeds (the sweep's 3 and its 5 fresh ones) ----


def fresh_path(cell: str, start: str, seed: int) -> str:
  workload, steps, optim = bracket_mode.parse_cell(cell)
  return os.path.join(
    REPO, 'results', 'last_rung', 'runs', workload, f'steps{steps}', optim, f'bracket_{start}_s{seed}.json'
  )


def fresh_bracket(cell: str, start: str, seed: int, work_root: str, train: bool) -> dict | None:
  """The default bracket (``DEFAULT_BRACKET``) from ``start`` on a fresh seed: its record (cached; None where it
  is not recorded and ``train`` is off)."""
  path = fresh_path(cell, start, seed)
  got = wider_rung._load(path)
  if got is not None or not train:
    return got
  workload, steps, optim = bracket_mode.parse_cell(cell)
  workdir = os.path.join(work_root, 'last_rung', workload, f'steps{steps}', f'{optim}_{start}_s{seed}')
  config = bracket_mode.config_for(cell, start, seed, False, work_root, DEFAULT_BRACKET)
  got = {
    'cell': cell,
    'start': start,
    'seed': seed,
    'anchor_lr': bracket_mode.anchor_lr(cell, False),
    **records.train_run(f'bracket_{start}_s{seed}', config, workdir),
  }
  records.write_record(path, got, indent=1)
  shutil.rmtree(workdir, ignore_errors=True)
  print(
    f'  {cell} {start} s{seed}: kept {got["kept_lr"] / got["anchor_lr"]:.3g}x, final {got["final_metric"]}', flush=True
  )
  return got


def eight_seed_rows(cell: str, work_root: str, train: bool = False) -> dict:
  """The sweep's best over 8 seeds (among the LRs recorded on all 8) and, per start, the default bracket on the same
  8 seeds (seeds 0-2 its composition, 3-7 trained here): the paired gap and its standard error."""
  seeds = list(bracket_mode.SEEDS) + list(FRESH_SEEDS)
  optim = bracket_mode.parse_cell(cell)[2]
  grid = {}
  for lr in bracket_mode.sweep_cell(cell)['grid']:
    finals = recorded_finals(cell, [autolr.grid_name(optim, float(lr), s) for s in seeds])
    if None not in finals:
      grid[float(lr)] = finals
  best_lr = records.best_lr(grid)
  out = {
    'sweep_lr': best_lr,
    'sweep': grid[best_lr],
    'sweep_means': {f'{lr:g}': float(np.mean(v)) for lr, v in grid.items()},
    'starts': {},
  }
  for start in bracket_mode.STARTS:
    first = [runner_up(cell, start, s, False, work_root, False) for s in bracket_mode.SEEDS]
    fresh = [fresh_bracket(cell, start, s, work_root, train) for s in FRESH_SEEDS]
    if None in first or None in fresh:
      continue
    finals = [g['final_metric'] for g in first] + [r['final_metric'] for r in fresh]
    kept = [g['kept_lr'] / g['anchor_lr'] for g in first] + [r['kept_lr'] / r['anchor_lr'] for r in fresh]
    gap, se = records.paired_gap(finals, grid[best_lr])
    out['starts'][start] = {'finals': finals, 'kept_x': kept, 'gap': gap, 'se': se}
    h = recorded_finals(cell, [autolr.hdet_name(optim, autolr.DEFAULT_VARIANT, start, s) for s in seeds])
    if None not in h:  # (the default HDET from the same start, on the same 8 seeds: results/workloads.json's runs)
      out['starts'][start]['hdet'] = dict(zip(('gap', 'se'), records.paired_gap(h, grid[best_lr])), finals=h)
  return out


verdict = records.verdict  # 'within' 1%, a 'miss' beyond RESOLVE_SE se, or 'not resolved'


def _gap_text(g: dict | None) -> str:
  if g is None or g['gap'] is None:
    return '-'
  return records.pct(g['gap']) + ('' if g['se'] is None else f' ± {100 * g["se"]:.1f}')


def write_report(out_dir: str, rows: dict, eight: dict, quick: bool) -> list[str]:
  lines = [
    "# The default bracket's last rung, and what 3 seeds resolve",
    '',
    f'Made by `python -m research.last_rung{" --quick" if quick else ""}` (end runs in `results/wider_rung/runs/`). '
    "The default bracket (`bracket.rungs = '0.1:5,0.3:1'`, 2.5 runs; `research.wider_rung`'s 8-5-1 "
    'composition) against the sweep at its best LR on the same 3 seeds: the gap is the ratio of the 3-seed '
    'means, ± the standard error of the 3 per-seed gaps. Verdict: "within" at or below 1%, "miss" where the gap '
    f'less {RESOLVE_SE:g} se is above 1% (2 degrees of freedom: a rough screen), else "not resolved". The '
    "runner-up is the last rung's second lowest loss (0.3 of the run), trained to the end as the bracket trains "
    'its winner; "better of the two" picks by the final metric itself (an oracle bound at 3.2 runs, not a '
    'method); "ahead" counts seeds where the runner-up ends lower. "Fresh seeds": the sweep\'s best LR rerun on '
    "seeds 3-7 where recorded, its mean against seeds 0-2's. The reading is in "
    '`research/workloads_discussion.md` (twenty-fourth pass).',
    '',
    '| cell | start | default bracket gap ± se | verdict | kept (x best), per seed | runner-up (x best), per seed | '
    "runner-up gap ± se | ahead | better of the two ± se | sweep's best on fresh seeds |",
    '|---|---|---|---|---|---|---|---|---|---|',
  ]
  tally = {'within': 0, 'miss': 0, 'not resolved': 0, '-': 0}
  better_within = with_runner_up = 0
  for cell, starts in rows.items():
    for start, r in starts.items():
      v = verdict(r['kept'])
      tally[v] += 1
      with_runner_up += verdict(r['better']) != '-'
      better_within += verdict(r['better']) == 'within'
      ratio = lambda key: ' / '.join('-' if g[key] is None else f'{g[key] / g["anchor_lr"]:.3g}' for g in r['seeds'])
      ahead = '-' if r['runner_up_ahead'] is None else f'{r["runner_up_ahead"]} of {len(r["seeds"])}'
      fresh = f'{records.pct(r["sweep_fresh"]["shift"])} (n={r["sweep_fresh"]["n"]})' if 'sweep_fresh' in r else '-'
      lines.append(
        f'| {cell} | {start} | {_gap_text(r["kept"])} | {v} | {ratio("kept_lr")} | {ratio("runner_up_lr")} | '
        f'{_gap_text(r["runner_up"])} | {ahead} | '
        f'{_gap_text(r["better"])} | {fresh} |'
      )
  total = sum(tally.values()) - tally['-']
  lines += [
    '',
    f'Of {total} cell-starts, the default bracket is within 1% in {tally["within"]}, misses by more than 1% '
    f'beyond {RESOLVE_SE:g} se in {tally["miss"]}, and is not resolved by 3 seeds in {tally["not resolved"]}. '
    f'Where the runner-up was trained ({with_runner_up} cell-starts), the better of it and the kept point (an oracle '
    f'at 3.2 runs) would be within 1% in {better_within}.',
  ]
  lines += _eight_seed_lines(rows, eight)
  return records.write_report(
    out_dir, 'last_rung', {'rows': rows, 'tally': tally, 'better_within': better_within, 'eight_seeds': eight}, lines
  )


def _eight_seed_lines(rows: dict, eight: dict) -> list[str]:
  if not eight:
    return []
  tally = {'within': 0, 'miss': 0, 'not resolved': 0, '-': 0}
  lines = [
    '',
    '## Eight seeds',
    '',
    f"The default bracket (`{DEFAULT_BRACKET['bracket.rungs']}`) trained on the sweep's fresh seeds 3-7 too "
    '(records in '
    "`results/last_rung/runs/`), against the sweep's best over the same 8 seeds (among its LRs recorded on all 8), "
    "paired by seed; the 3-seed gap is the table's above. The last column: the default HDET from the same start on the "
    "same 8 seeds (`results/workloads/runs/`, the ninth pass's fresh seeds).",
    '',
    "| cell | start | sweep's best, 8 seeds | 3-seed gap | 8-seed gap ± se | verdict | kept (x the first-seed best), "
    'seeds 0-7 | default HDET, 8 seeds ± se |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for cell, e in eight.items():
    for start, r in e['starts'].items():
      g = {'gap': r['gap'], 'se': r['se']}
      lines.append(
        f'| {cell} | {start} | {np.mean(e["sweep"]):.4g} at {e["sweep_lr"]:g} | '
        f'{_gap_text(rows[cell][start]["kept"])} | '
        f'{_gap_text(g)} | {verdict(g)} | {" / ".join(f"{x:.3g}" for x in r["kept_x"])} | {_gap_text(r.get("hdet"))} |'
      )
      tally[verdict(g)] += 1
  lines += [
    '',
    f'Of {sum(tally.values())} cell-starts on 8 seeds, the default bracket is within 1% in {tally["within"]}, '
    f'misses beyond {RESOLVE_SE:g} se in {tally["miss"]}, and is not resolved in {tally["not resolved"]}.',
  ]
  return lines


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument(
    '--cells',
    default=','.join(TRAIN_CELLS),
    help='workload:steps:optim,... whose runner-ups to train (the report reads every cell)',
  )
  p.add_argument(
    '--eight-seeds',
    default=','.join(EIGHT_SEED_CELLS),
    help='cells whose default bracket to train on seeds 3-7 too ("" for none)',
  )
  p.add_argument('--report-only', action='store_true', help='read the records, train nothing')
  p.add_argument('--out', default=None, help="the report's folder (default: results/; --quick: the workdir)")
  p.add_argument('--quick', action='store_true', help="a smoke run: wider_rung's quick bracket")
  p.add_argument('--workdir', default=None, help='where runs train (default: workdirs/workloads)')
  args = p.parse_args(argv)
  work_root = args.workdir or os.path.join(REPO, 'workdirs', 'last_rung_quick' if args.quick else 'workloads')
  if args.quick:
    wider_rung.main(['--quick', '--workdir', work_root])
  eight_cells = [] if args.quick else [c for c in args.eight_seeds.split(',') if c]
  if not args.report_only:
    from hdet_jax import trainer

    trainer.setup_jax(workloads.base_config('lm', 16, True))
    for cell in [wider_rung.QUICK_CELL] if args.quick else [c for c in args.cells.split(',') if c]:
      for start, r in cell_rows(cell, args.quick, work_root, train=True).items():
        print(f'  {cell} {start}: kept {_gap_text(r["kept"])}, runner-up {_gap_text(r["runner_up"])}', flush=True)
    for cell in eight_cells:
      eight_seed_rows(cell, work_root, train=True)
  cells = [wider_rung.QUICK_CELL] if args.quick else list(bracket_mode.CELLS)
  rows = {c: r for c in cells if (r := cell_rows(c, args.quick, work_root))}
  eight = {} if args.quick else {c: e for c in EIGHT_SEED_CELLS if (e := eight_seed_rows(c, work_root))['starts']}
  out = args.out or (work_root if args.quick else os.path.join(REPO, 'results'))
  paths = write_report(out, rows, eight, args.quick)
  with open(paths[1], encoding='utf-8') as f:
    print(f.read())


if __name__ == '__main__':
  main()
