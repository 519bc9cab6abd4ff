"""Another schedule: does the bracket's "compare at the peak", and the default controller, carry to a linear warmup
and cosine decay?

The fifteenth pass found one comparison of runs apart at the full batch keeping a run within 1% of the sweep's best in
32 of 43 seed-cells when made at 0.3 of the run, which is where the one-cycle schedule (the only one the workloads
used) peaks. Whether the rule is "at the schedule's peak" or "at 0.3 of the run" could not be told apart there. This
trains the sweep again under the usual LM schedule, ``optim.schedule='warmup_cosine'`` with its peak at
``optim.pct_start = 0.05`` of the run, on one length of every workload (3 seeds, the whole grid each), and the default
HDET controller (``workloads.DEFAULT_VARIANT``) from 10x below, at and 10x above the first seed's best.

Runs record their training loss at every step (mean over the replicas), so a comparison reads the mean of the
``COMPARE_STEPS`` steps before it, on batches common to the grid at one seed (every grid run draws the same batches).

    python -m research.archive.schedule_bracket              # train what is missing (cached, resumable), then report
    python -m research.archive.schedule_bracket --report-only
    python -m research.archive.schedule_bracket --quick      # a smoke run: the tiny LM, two grid points, one start
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

from research import autolr
from research import autolr_report
from research.archive import climb_and_price
from research.archive import early_bracket
from research import records
from research import workloads

REPO = autolr.REPO
PEAK = 0.05  # the warmup's end, where every run of the sweep reaches its peak LR
SCHEDULE = {'optim.schedule': 'warmup_cosine', 'optim.pct_start': PEAK}
# The LM at 750 steps (the length where the default misses most, at half its compute), fine-tuning at every length,
# mnist1d at 500 and 1000 (the LM at 1500 is DEVICE_CELLS').
CELLS = (
  ('lm', 750, 'adamw'),
  ('finetune', 300, 'adamw'),
  ('mnist1d', 1000, 'adamw'),
  ('mnist1d', 1000, 'sgd'),
  ('finetune', 150, 'adamw'),
  ('finetune', 600, 'adamw'),
  ('mnist1d', 500, 'adamw'),
  ('mnist1d', 500, 'sgd'),
)
QUICK_CELLS = (('lm', 16, 'adamw'),)
# Cells trained on a lent GPU (``--device``), each a sweep of its own there (records under runs_<device>/): the LM at
# the main job's 1500 steps on one NVIDIA H200, 8 replicas on the one GPU.
DEVICE_CELLS = {'h200': (('lm', 1500, 'adamw'),)}
# A control for the warmup's length: the LM at 750 steps under the same cosine decay, warmed up over 0.3 of the run
# (one-cycle's) instead of 0.05, at the one-cycle sweep's best and its two neighbours (3 seeds).
# A control for the default's cautious start (hdet.initial_scale = 0.1: the run starts at a tenth of its schedule and
# climbs), which under a short warmup may act as the warmup the schedule lacks: the default without it, on the LM.
HDET_CONTROLS = {('lm', 750, 'adamw'): {'start1': {'hdet.initial_scale': 1.0}}}
WARMUP_CONTROL = ('lm', 750, 'adamw', (0.0075, 0.015, 0.03), {**SCHEDULE, 'optim.pct_start': 0.3})
FRACTIONS = (PEAK, 0.1, 0.2, 0.3, 0.5, 1.0)
HALVING = {'8-4-1 at 0.1 / 0.3': ((0.1, 4), (0.3, 1)), '8-4-1 at 0.05 / 0.1': ((0.05, 4), (0.1, 1))}
SCHEDULES = {'fractions': {f'{f:g}': ((f, 1),) for f in FRACTIONS}, 'halving': HALVING}
COMPARE_STEPS = 10  # a comparison reads the mean training loss of this many steps before it
SEEDS = (0, 1, 2)
MAX_EXTEND = 2  # grid points the sweep may add past an edge (see grid_lrs)


def make_record(name: str, config, summary: dict, workdir: str, wall_s: float) -> dict:
  """The sweep's record plus the training loss at every step (mean over the replicas, 6 significant digits)."""
  from hdet_jax.trainer import metrics as metrics_lib

  rec = workloads.make_record(name, config, summary, workdir, wall_s)
  train = metrics_lib.read_metrics(os.path.join(workdir, 'metrics.jsonl')).get('train', [])
  rec['step_loss'] = [records.finite_or_none(float(f'{np.mean(r["loss"]):.6g}')) for r in train]
  return rec


def loss_before(rec: dict, fraction: float) -> float | None:
  """The mean training loss over the ``COMPARE_STEPS`` steps before ``fraction`` of the run (those completed by
  then; None: none is; inf: one is not finite or the run had diverged, so it cannot win)."""
  end = int(math.floor(fraction * rec['config']['num_train_steps'] + 1e-9))
  if end < 1:
    return None
  if rec.get('diverged_at') is not None and rec['diverged_at'] < end:
    return math.inf  # (its record may stop at the divergence)
  window = rec['step_loss'][max(0, end - COMPARE_STEPS) : end]
  if len(window) < min(end, COMPARE_STEPS):
    return None
  if any(x is None for x in window):
    return math.inf
  return float(np.mean(window))


def cache_for(workload: str, steps: int, quick: bool, work_root: str, device: str = 'cpu') -> records.RunCache:
  folder = (
    os.path.join(work_root, 'schedule_bracket', workload, f'steps{steps}')
    if quick
    else os.path.join(
      REPO, 'results', 'schedule_bracket', 'runs' if device == 'cpu' else f'runs_{device}', workload, f'steps{steps}'
    )
  )
  return records.RunCache(
    folder, os.path.join(work_root, workload, f'cosine_steps{steps}'), make_record, autolr.describe
  )


def train_cell(workload: str, steps: int, optim: str, args, work_root: str, stage: str) -> None:
  """The cell's grid on every seed (``stage='grid'``) or the default HDET from each start (``'hdet'``, once the first
  seed's grid fixes its anchor); cached, and shared with other processes running the same list."""
  from hdet_jax.trainer import config_lib

  cache = cache_for(workload, steps, args.quick, work_root, args.device)
  if stage == 'grid':
    run = workloads.plain_runner(cache, workload, steps, optim, args.quick, work_root, train=True)
    while True:  # the first seed's grid, extended while its best sits at an edge
      lrs, settled = grid_lrs(cache, optim, args.quick, args.seeds[0])
      todo = [lr for lr in lrs if cache.get(autolr.grid_name(optim, lr, args.seeds[0])) is None]
      trained = [run(autolr.grid_name(optim, lr, args.seeds[0]), lr, args.seeds[0], SCHEDULE) for lr in todo]
      if settled or not any(trained):  # (nothing trained here: the rest is another process's; a rerun extends)
        break
    for seed in args.seeds[1:]:
      for lr in lrs:
        run(autolr.grid_name(optim, lr, seed), lr, seed, SCHEDULE)
    return
  lrs, settled = grid_lrs(cache, optim, args.quick, args.seeds[0])
  best = autolr.anchor(cache, optim, lrs, args.seeds[0]) if settled else None
  if best is None:
    return
  init_from = workloads.pretrained(work_root, args.quick) if workload == 'finetune' else None
  variants = {'': {}, **({} if args.quick else HDET_CONTROLS.get((workload, steps, optim), {}))}
  for suffix, extra in variants.items():  # the default, then its controls
    for seed in args.seeds:
      for start in args.starts:
        o = {
          **autolr.run_overrides(
            'hdet', optim, best * autolr.STARTS[start], seed, steps, variant=workloads.DEFAULT_VARIANT
          ),
          **SCHEDULE,
          **extra,
        }
        if args.quick:
          o.pop('hdet.sync_every', None)
        config = config_lib.with_overrides(workloads.base_config(workload, steps, args.quick, init_from), o)
        cache.run(hdet_run_name(optim, suffix, start, seed), config, skip_busy=True)


def hdet_run_name(optim: str, control: str, start: str, seed: int) -> str:
  """The default HDET's run (``control=''``) or one of its controls' (``HDET_CONTROLS``)."""
  return autolr.hdet_name(optim, workloads.DEFAULT_VARIANT + (f'_{control}' if control else ''), start, seed)


def grids(quick: bool) -> dict:
  return autolr.QUICK_GRIDS if quick else autolr.GRIDS


def grid_lrs(cache: records.RunCache, optim: str, quick: bool, seed: int) -> tuple[list[float], bool]:
  """The sweep's grid (``autolr.GRIDS``), extended by a factor 2 past an edge where ``seed``'s best sits (at most
  ``MAX_EXTEND`` points), and whether it is settled: that seed's runs all recorded and its best inside the grid or
  the extension used up. Under this schedule the LM's best can fall below the grid's lowest point."""
  lrs, extend = list(grids(quick)[optim]), 0 if quick else MAX_EXTEND  # (the smoke run's grid stays as it is)
  for _ in range(extend + 1):
    recs = {lr: cache.get(autolr.grid_name(optim, lr, seed)) for lr in lrs}
    if any(r is None for r in recs.values()):
      return lrs, False
    best = min(lrs, key=lambda lr: autolr_report.mean_bpb([recs[lr]]))
    if len(lrs) - len(grids(quick)[optim]) >= extend or lrs[0] < best < lrs[-1]:
      return lrs, True
    if best == lrs[0]:
      lrs.insert(0, lrs[0] / 2)
    else:
      lrs.append(lrs[-1] * 2)
  return lrs, True


def cell_report(cache: records.RunCache, optim: str, lrs, seeds, one_cycle_folder: str | None) -> dict | None:
  """One cell: the sweep's best under this schedule (and under one-cycle, from the workloads' records), each bracket's
  kept LR and paired gap per complete seed, and the default HDET's gap from each start (means over seeds)."""
  by_seed = {s: {lr: r for lr in lrs if (r := cache.get(autolr.grid_name(optim, lr, s)))} for s in seeds}
  by_seed = {s: g for s, g in by_seed.items() if len(g) == len(lrs)}
  if not by_seed:
    return None
  grid = {lr: [g[lr] for g in by_seed.values()] for lr in lrs}
  best_lr, best = autolr_report.grid_best(grid)
  out = {
    'best_lr': best_lr,
    'best': best,
    'seeds': sorted(by_seed),
    'points': len(lrs),
    'fractions': {},
    'halving': {},
    'hdet': {},
    'grid': {f'{lr:.4g}': autolr_report.mean_bpb(rs) for lr, rs in grid.items()},
  }
  if one_cycle_folder:
    oc = climb_and_price._grid(one_cycle_folder, optim)  # pylint: disable=protected-access
    if oc:
      out['one_cycle_best_lr'], out['one_cycle_best'] = autolr_report.grid_best(oc)
  for table, by_name in SCHEDULES.items():
    for name, rungs in by_name.items():
      got = early_bracket.kept_by_seed(by_seed, rungs, best_lr, loss_before)
      if got:
        out[table][name] = {'compute_runs': early_bracket.compute_runs(rungs, len(lrs)), **got}
  controls = sorted({n for c in HDET_CONTROLS.values() for n in c})
  for control in [''] + controls:
    for start in autolr.STARTS:
      recs = [r for s in seeds if (r := cache.get(hdet_run_name(optim, control, start, s)))]
      if recs:
        v = autolr_report.mean_bpb(recs)
        row = {
          'value': v,
          'gap_pct': records.finite_or_none(100.0 * (v / best - 1.0)),
          'n': len(recs),
          'scale_x': [_scale_x(r, best_lr) for r in recs],
        }
        (out['hdet'] if not control else out.setdefault('controls', {}).setdefault(control, {}))[start] = row
  return out


def _scale_x(rec: dict, best_lr: float) -> float | None:
  """The peak LR of the schedule an HDET run ended on (its last base LR over the schedule's end factor), as a
  multiple of the sweep's best peak LR: where its controller's correction settled."""
  o = rec['config']['optim']
  return None if not rec.get('final_lr') else rec['final_lr'] * o['div_factor'] * o['final_div_factor'] / best_lr


def one_cycle_hdet(workload: str, steps: int, optim: str) -> dict:
  """The default's gaps under one-cycle at the same cell (results/workloads.json), by start."""
  path = os.path.join(REPO, 'results', 'workloads.json')
  if not os.path.exists(path):
    return {}
  with open(path, encoding='utf-8') as f:
    cell = json.load(f).get(workload, {}).get(str(steps), {}).get(optim, {})
  best = (cell.get('grid_best') or {}).get('value')
  return {
    s: 100.0 * (h['value'] / best - 1.0) for s, h in cell.get('hdet', {}).items() if best and h.get('value') is not None
  }


def measure(args, work_root: str) -> dict:
  own = QUICK_CELLS if args.quick else CELLS if args.device == 'cpu' else DEVICE_CELLS[args.device]
  if not args.report_only:
    for stage in ('grid', 'hdet'):  # every cell's grids first: the HDET runs need their anchors
      for workload, steps, optim in own:
        train_cell(workload, steps, optim, args, work_root, stage)
    if args.device == 'cpu' and not args.quick:
      warmup_control(args, work_root, train=True)
  cells = [(*c, 'cpu') for c in (QUICK_CELLS if args.quick else CELLS)]
  cells += [] if args.quick else [(*c, d) for d, cs in DEVICE_CELLS.items() for c in cs]
  results = {}
  for workload, steps, optim, device in cells:
    folder = None if args.quick else workloads.records_dir(workload, steps, False, work_root)
    cache = cache_for(workload, steps, args.quick, work_root, device)
    c = cell_report(cache, optim, grid_lrs(cache, optim, args.quick, args.seeds[0])[0], args.seeds, folder)
    if c:
      c['device'] = device
      c['one_cycle_hdet_gap_pct'] = {} if args.quick else one_cycle_hdet(workload, steps, optim)
      results.setdefault(workload, {}).setdefault(str(steps), {})[optim] = c
  if not args.quick:
    control = warmup_control(args, work_root, train=False)
    if control:
      results['warmup_control'] = control
  return results


def warmup_control(args, work_root: str, train: bool) -> dict | None:
  """The LM's sweep points of ``WARMUP_CONTROL`` (mean final over the seeds recorded, by peak LR)."""
  workload, steps, optim, lrs, schedule = WARMUP_CONTROL
  cache = records.RunCache(
    os.path.join(REPO, 'results', 'schedule_bracket', 'runs', workload, f'steps{steps}_warmup30'),
    os.path.join(work_root, workload, f'cosine30_steps{steps}'),
    make_record,
    autolr.describe,
  )
  run = workloads.plain_runner(cache, workload, steps, optim, False, work_root, train=train)
  got = {
    lr: [r for seed in args.seeds if (r := run(autolr.grid_name(optim, lr, seed), lr, seed, schedule))] for lr in lrs
  }
  if not all(got.values()):
    return None
  return {
    'workload': workload,
    'steps': steps,
    'optim': optim,
    'pct_start': schedule['optim.pct_start'],
    'seeds': sorted({int(r['config']['seed']) for rs in got.values() for r in rs}),
    'grid': {f'{lr:.4g}': autolr_report.mean_bpb(rs) for lr, rs in got.items()},
  }


def _label(workload: str, cell: dict) -> str:
  return workload if cell.get('device', 'cpu') == 'cpu' else f'{workload} ({cell["device"].upper()})'


def _mean_scale(row: dict) -> float:
  """The mean over seeds of the scale an HDET start's runs ended on (runs without a final LR left out)."""
  return float(np.mean([x for x in row['scale_x'] if x]))


def hdet_rows(cells) -> list[str]:
  """The first table's rows: each cell's sweep under both schedules and the default HDET's gaps, scale and
  one-cycle comparison."""
  lines = []
  for w, steps, optim, c in cells:
    h = ' / '.join(
      '-' if k not in c['hdet'] else ('+inf' if c['hdet'][k]['gap_pct'] is None else f'{c["hdet"][k]["gap_pct"]:+.1f}%')
      for k in autolr.STARTS
    )
    same = c.get('device', 'cpu') == 'cpu' and c.get('one_cycle_best')  # one-cycle's sweep is the CPU's
    vs = ' / '.join(
      f'{100 * (c["hdet"][k]["value"] / c["one_cycle_best"] - 1):+.1f}%'
      if same and k in c['hdet'] and c['hdet'][k]['gap_pct'] is not None
      else '-'
      for k in autolr.STARTS
    )
    oc = ' / '.join(
      f'{c["one_cycle_hdet_gap_pct"][k]:+.1f}%' if k in c['one_cycle_hdet_gap_pct'] else '-' for k in autolr.STARTS
    )
    scale = ' / '.join('-' if k not in c['hdet'] else f'{_mean_scale(c["hdet"][k]):.2g}' for k in autolr.STARTS)
    lines.append(
      f'| {_label(w, c)} | {steps} | {optim} | {c["best_lr"]:g} | {c["best"]:.4g} | '
      f'{c.get("one_cycle_best_lr", math.nan):g} / {c.get("one_cycle_best", math.nan):.4g} | {h} | {scale} | '
      f'{vs} | '
      f'{oc} |'
    )
  return lines


def control_lines(cells) -> list[str]:
  """One line per HDET control run (HDET_CONTROLS): its gaps from each start and the scale it ended on."""
  lines = []
  for w, steps, optim, c in cells:
    for control, by_start in c.get('controls', {}).items():
      lines += [
        '',
        f'The default without its cautious start (`{control}`: {HDET_CONTROLS[(w, int(steps), optim)][control]}), '
        f"{_label(w, c)} at {steps} steps, from 10x low / the best / 10x high against this sweep's best: "
        + ' / '.join(
          '-'
          if k not in by_start or by_start[k]['gap_pct'] is None
          else f'{by_start[k]["gap_pct"]:+.1f}% (scale {_mean_scale(by_start[k]):.2g}, {by_start[k]["n"]} seeds)'
          for k in autolr.STARTS
        )
        + '.',
      ]
  return lines


def write_report(out_dir: str, results: dict, quick: bool) -> list[str]:
  cells = [
    (w, s, o, c)
    for w, by_steps in results.items()
    if w != 'warmup_control'
    for s, by_optim in by_steps.items()
    for o, c in by_optim.items()
  ]
  lines = [
    '# Another schedule: linear warmup to 0.05 of the run, cosine decay',
    '',
    f'Generated by `python -m research.schedule_bracket{" --quick" if quick else ""}`; the reading is in '
    '`research/workloads_discussion.md` (sixteenth pass). Every run: `optim.schedule=warmup_cosine`, '
    f'`optim.pct_start={PEAK}` (the peak LR at {PEAK:g} of the run), the rest as in `results/workloads.md`.',
    '',
    '## The sweep and the default HDET',
    '',
    "The sweep's best grid point (mean of the seeds) under this schedule and under one-cycle (the workloads' "
    "sweep); the default HDET (3-seed means) from 10x below, at and 10x above the first seed's best, against "
    "this sweep's best, the schedule's scale it ended on (mean over seeds, x the sweep's best peak LR), and against "
    "the one-cycle sweep's best (same device only), and the same cell's gaps under "
    "one-cycle (`results/workloads.md`, this machine's CPU). "
    'Cells marked with a GPU were trained there (sweep and HDET alike); the rest on the CPU.',
    '',
    '| workload | steps | optim | best LR (cosine) | best (cosine) | best LR / best (one-cycle, CPU) | '
    'HDET low / best / '
    "high (cosine) | its scale at the end (x best LR) | against one-cycle's best | HDET under one-cycle |",
    '|---|---|---|---|---|---|---|---|---|---|',
  ]
  lines += hdet_rows(cells) + control_lines(cells)
  control = results.get('warmup_control')
  if control:
    lines += [
      '',
      f"The warmup's length (a control): the {control['workload'].upper()} at {control['steps']} steps under "
      f'the same cosine decay warmed up over {control["pct_start"]:g} of the run, mean final over seeds '
      f'{",".join(map(str, control["seeds"]))} by peak LR: '
      + ', '.join(f'{lr}: {v:.4g}' for lr, v in control['grid'].items())
      + '.',
    ]
  lines += [
    '',
    '## One comparison, and successive halving',
    '',
    f"The grid's runs compared by their mean training loss over the {COMPARE_STEPS} steps before a fraction "
    "f of the run (common batches), the lowest kept: its final against the same seed's run at the sweep's "
    'best grid point (paired, mean over seeds; in brackets the seeds that kept the best point). Compute in '
    f'runs for 8 points (a grid extended past an edge holds more: see `points` in the JSON). f = {PEAK:g} is '
    "this schedule's peak; 0.3 is one-cycle's.",
    '',
    '| workload | steps | optim | '
    + ' | '.join(f'{n} ({early_bracket.compute_runs(r):.2g} runs)' for by in SCHEDULES.values() for n, r in by.items())
    + ' |',
    '|---|---|---|' + '---|' * sum(len(by) for by in SCHEDULES.values()),
  ]
  for w, steps, optim, c in cells:
    lines.append(
      f'| {_label(w, c)} | {steps} | {optim} | '
      + ' | '.join(early_bracket.fmt(c[t].get(n)) for t, by in SCHEDULES.items() for n in by)
      + ' |'
    )
  lines += early_bracket.tally(cells, SCHEDULES) + early_bracket.kept_table(cells, FRACTIONS, _label)
  return records.write_report(out_dir, 'schedule_bracket', results, lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--quick', action='store_true', help='a smoke run (the tiny LM, two grid points, one seed and start)')
  p.add_argument('--workdir', default=None, help='where runs train (default workdirs/workloads[_quick])')
  p.add_argument('--report-only', action='store_true', help='only redraw the report from the records')
  p.add_argument('--out', default=None, help="the report's folder (default: results/; --quick: the workdir)")
  p.add_argument('--seeds', default=None, help='comma-separated seeds (default 0,1,2; --quick: 0)')
  p.add_argument('--starts', default=None, help='comma-separated HDET starts: low, best, high (--quick: best)')
  p.add_argument(
    '--device',
    default='cpu',
    choices=('cpu', *DEVICE_CELLS),
    help="which cells to train: this machine's CPU ones, or those of a lent GPU (DEVICE_CELLS)",
  )
  args = p.parse_args(sys.argv[1:] if argv is None else argv)
  args.seeds = [int(s) for s in (args.seeds or ('0' if args.quick else '0,1,2')).split(',')]
  args.starts = (args.starts or ('best' if args.quick else ','.join(autolr.STARTS))).split(',')
  for s in args.starts:
    if s not in autolr.STARTS:
      p.error(f'--starts: {s!r} is not one of {", ".join(autolr.STARTS)}')
  work_root = args.workdir or os.path.join(REPO, 'workdirs', 'workloads_quick' if args.quick else 'workloads')
  if not args.report_only:
    from hdet_jax.trainer import process

    process.setup_jax(workloads.base_config('lm', 16, args.quick))  # 8 CPU devices, as the sweep's runs had
  out = args.out or (work_root if args.quick else os.path.join(REPO, 'results'))
  print('\n'.join(f'  {path}' for path in write_report(out, measure(args, work_root), args.quick)))


if __name__ == '__main__':
  main()
