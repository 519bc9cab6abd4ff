"""Where should the guarded climb start? One rule for ``AutoLR(total_steps=S)``, chosen by the records (issue 84).

The default controller (``workloads.DEFAULT_VARIANT``) corrects the schedule it is given by a factor that starts at
``hdet.initial_scale`` and only rises (``after_stop='rise'``; the guard's back-off is the one step down). Two start
rules were in the library: 0.1 (a tenth of what is passed: the trainer's, every record's) and 1 (what is passed:
``hdet`` around a built optimizer until issue 84). Given a guess 10x below / at / 10x above the sweep's best peak LR,
rule 0.1 starts the climb at 0.01 / 0.1 / 1 of the best, rule 1 at 0.1 / 1 / 10. The first two of rule 1's starts
are rule 0.1's runs from the best and from 10x high (the same start and schedule: ``results/workloads.md``'s
records); its third, a climb from 10x the best, is trained here on every workload, length and optimizer but the
fine-tuning (3 seeds each; committed so far: mnist1d's 18 runs and the LM's 6 at 750 and 1500 steps; the LM at 3000
trains on the next ``python -m research.start_rule``). The LM at 750 steps under a warmup-cosine schedule has both
rules at every start in the archived schedule study's records (``results/schedule_bracket/runs/``, its ``start1``
control), read as data.

    python -m research.start_rule                # train what is missing (cached, resumable), then write the report
    python -m research.start_rule --report-only  # redraw results/start_rule.{md,json} byte for byte from the records
    python -m research.start_rule --quick        # a smoke run: the tiny LM, 16 steps, one seed (into workdirs/)

Run times (measured on a 2-core CPU shared with other jobs): mnist1d 15-120 s a run, the LM about 7 min a run at
750 steps and 15 min at 1500 (3000: not yet trained).
"""

from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np

from research import autolr
from research import autolr_report
from research import records
from research import workloads

REPO = autolr.REPO
VARIANT = workloads.DEFAULT_VARIANT
RULE1 = {'hdet.initial_scale': 1.0}  # rule 1: the climb starts at the schedule it is given
RULE1_VARIANT = f'{VARIANT}_start1'  # (the records' name, as the schedule study's control)
SEEDS = (0, 1, 2)
# The cells trained here (workload, steps, optim): every workload's lengths but the fine-tuning's (its runs start
# from one pretrained LM checkpoint, which the study would have to train first).
CELLS = tuple(
  (w, s, o) for w in ('lm', 'mnist1d') for s in workloads.lengths(w, False) for o in workloads.WORKLOADS[w][2]
)
# The order they train in (the cheap ones first): mnist1d, then the LM by length.
TRAIN_ORDER = tuple(sorted(CELLS, key=lambda c: (c[0] != 'mnist1d', c[1])))


def records_dir(workload: str, steps: int, quick: bool, work_root: str) -> str:
  root = os.path.join(work_root, 'start_rule_quick') if quick else os.path.join(REPO, 'results', 'start_rule', 'runs')
  return os.path.join(root, workload, f'steps{steps}')


def rule1_high_config(workload: str, steps: int, optim: str, seed: int, anchor: float, quick: bool):
  """The default controller under rule 1 from a guess 10x above the sweep's best: its schedule peaks at 10x the
  anchor and the climb starts there."""
  from hdet_jax.trainer import config_lib

  o = autolr.run_overrides('hdet', optim, anchor * autolr.STARTS['high'], seed, steps, variant=VARIANT)
  if quick:
    o.pop('hdet.sync_every', None)
  return config_lib.with_overrides(workloads.base_config(workload, steps, quick), {**o, **RULE1})


def sweep_cache(workload: str, steps: int, quick: bool, work_root: str) -> records.RunCache:
  """The workloads study's records of a cell (its sweep, its anchor and the default's runs under rule 0.1)."""
  return records.RunCache(
    workloads.records_dir(workload, steps, quick, work_root),
    os.path.join(work_root, workload, f'steps{steps}'),
    workloads.make_record,
    autolr.describe,
  )


def own_cache(workload: str, steps: int, quick: bool, work_root: str) -> records.RunCache:
  return records.RunCache(
    records_dir(workload, steps, quick, work_root),
    os.path.join(work_root, 'start_rule', workload, f'steps{steps}'),
    workloads.make_record,
    autolr.describe,
  )


QUICK_ANCHOR = 0.01  # (quick mode has no sweep: the tiny LM's start is 10x this)


def train_cell(workload: str, steps: int, optim: str, seeds, quick: bool, work_root: str) -> None:
  """Rule 1's run from 10x high on every seed (cached records; a preempted run resumes)."""
  anchor = QUICK_ANCHOR if quick else autolr.read_anchor(sweep_cache(workload, steps, quick, work_root), optim)
  if anchor is None:
    raise SystemExit(f'start_rule: {workload} at {steps} steps ({optim}) has no anchor; run research.workloads first.')
  cache = own_cache(workload, steps, quick, work_root)
  for seed in seeds:
    name = autolr.hdet_name(optim, RULE1_VARIANT, 'high', seed)
    cache.run(name, rule1_high_config(workload, steps, optim, seed, anchor, quick), skip_busy=True)


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------

GUESSES = ('low', 'best', 'high')  # the LR passed: 10x below, at, 10x above the sweep's best (workloads' starts)
# Rule 1 given a guess starts where rule 0.1 given 10x that guess starts: its runs from 10x low and from the best are
# rule 0.1's from the best and from 10x high (the same schedule shape, the same start; the schedule study's control
# shows the two agree, ``alias_check``); from 10x high it is this study's own run.
RULE1_FROM_RULE01 = {'low': 'best', 'best': 'high'}
RULES = ('0.1', '1')
SCHEDULE_CELL = ('lm', 750, 'adamw')  # the schedule study's cell with both rules (warmup-cosine)
SCHEDULE_RUNS = os.path.join(REPO, 'results', 'schedule_bracket', 'runs', 'lm', 'steps750', 'adamw')


def _read(path: str) -> dict | None:
  if not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def _stat(recs: list[dict]) -> dict | None:
  """Mean, n and diverged count of the primary metric over seeds (None: no record)."""
  if not recs:
    return None
  st = autolr_report._stats(recs)  # pylint: disable=protected-access
  return {'value': st['val_bpb'], 'n': st['n'], 'diverged': st.get('diverged', 0)}


def _gap(st: dict | None, best: float) -> float | None:
  return None if st is None or st['value'] is None else 100.0 * (st['value'] / best - 1.0)


def workload_cells(quick: bool, work_root: str) -> list[dict]:
  """Every workload, length and optimizer of the workloads study: the sweep's best and both rules' runs from each
  guess (rule 0.1: the workloads study's default runs; rule 1: two of those and this study's own)."""
  collect_only = argparse.Namespace(
    variant=VARIANT, quick=quick, stages=(), optim=[], seeds=list(SEEDS), full_grid=False, starts=[], peers=[]
  )
  cells = []
  for workload, (_, _, optims) in workloads.WORKLOADS.items():
    if quick and workload != 'lm':
      continue
    for steps in workloads.lengths(workload, quick):
      runs = workloads.run_workload(workload, steps, collect_only, work_root)
      own = own_cache(workload, steps, quick, work_root)
      for optim in optims:
        r = runs.get(optim)
        grid = {lr: rs for lr, rs in (r or {}).get('grid', {}).items() if rs}
        stats = {lr: _stat(rs) for lr, rs in grid.items()}
        ok = [lr for lr in stats if stats[lr]['value'] is not None]
        best_lr = min(ok, key=lambda k: stats[k]['value']) if ok else None
        hdet = next(iter(r['hdet'].values()), {}) if r else {}
        rule01 = {g: _stat(hdet.get(g, [])) for g in GUESSES}
        mine = [x for s in SEEDS if (x := own.get(autolr.hdet_name(optim, RULE1_VARIANT, 'high', s)))]
        rule1 = {**{g: rule01[src] for g, src in RULE1_FROM_RULE01.items()}, 'high': _stat(mine)}
        ends = [e for x in mine if (e := _end_scale(x))]
        cells.append(
          {
            'workload': workload,
            'steps': steps,
            'optim': optim,
            'schedule': 'one_cycle',
            'best_lr': best_lr,
            'best': None if best_lr is None else stats[best_lr]['value'],
            'rule': {'0.1': rule01, '1': rule1},
            'rule1_high_end_scale': _geomean(ends),
          }
        )
  return cells


def schedule_cell() -> tuple[dict | None, dict]:
  """The schedule study's LM at 750 steps under warmup-cosine: both rules from every guess, its own sweep; and
  how closely rule 1's runs from 10x low and the best equal rule 0.1's from the best and 10x high (per seed)."""
  workload, steps, optim = SCHEDULE_CELL
  read = lambda name: _read(os.path.join(SCHEDULE_RUNS, name + '.json'))
  lrs = sorted({float(n[len('grid_lr') :].rsplit('_s', 1)[0]) for n in os.listdir(SCHEDULE_RUNS) if 'grid_lr' in n})
  if not lrs:
    return None, {}
  stats = {lr: _stat([x for s in SEEDS if (x := read(f'grid_lr{records.lr_tag(lr, 4)}_s{s}'))]) for lr in lrs}
  best_lr = min((lr for lr in stats if stats[lr]['value'] is not None), key=lambda k: stats[k]['value'])
  runs = {
    rule: {g: [read(f'hdet_{v}_{g}_s{s}') for s in SEEDS] for g in GUESSES}
    for rule, v in (('0.1', VARIANT), ('1', RULE1_VARIANT))
  }
  cell = {
    'workload': workload,
    'steps': steps,
    'optim': optim,
    'schedule': 'warmup_cosine',
    'best_lr': best_lr,
    'best': stats[best_lr]['value'],
    'rule': {rule: {g: _stat([x for x in rs if x]) for g, rs in by.items()} for rule, by in runs.items()},
    'rule1_high_end_scale': _geomean([e for x in runs['1']['high'] if x and (e := _end_scale(x))]),
  }
  diffs = [
    abs(a['val_bpb'] / b['val_bpb'] - 1.0)
    for g, src in RULE1_FROM_RULE01.items()
    for a, b in zip(runs['1'][g], runs['0.1'][src])
    if a and b and a['val_bpb'] is not None and b['val_bpb'] is not None
  ]
  return cell, {'pairs': len(diffs), 'max_rel_diff': max(diffs) if diffs else None}


def _end_scale(rec: dict) -> float | None:
  """The peak of the schedule a run ended on, its peak LR times the controller's last correction (the weights'
  learning rate where there are groups): the LR the climb settled on, in the units of the LR passed."""
  ctrl = rec.get('controller') or []
  if not ctrl or not ctrl[-1].get('corrections'):
    return None
  return rec['config']['optim']['max_lr'] * math.exp(ctrl[-1]['corrections'][autolr_report.lr_index(rec)])


def _end_span(cells: list[dict], text: bool) -> str:
  xs = [
    c['rule1_high_end_scale'] / c['best_lr']
    for c in cells
    if (c['workload'] != 'mnist1d') == text and c.get('rule1_high_end_scale') and c['best_lr']
  ]
  return '-' if not xs else f'{min(xs):.3g}x' if len(xs) == 1 else f'{min(xs):.3g}x to {max(xs):.3g}x'


def _geomean(xs: list[float]) -> float | None:
  return float(np.exp(np.mean(np.log(xs)))) if xs else None


def summary(cells: list[dict]) -> dict:
  """Per rule and guess, over the cells that have it: how many end within 1% of the sweep's best, the median and
  the worst gap (a diverged run counts as the worst)."""
  out = {}
  for rule in RULES:
    for g in GUESSES:
      gaps = [_gap(c['rule'][rule][g], c['best']) for c in cells if c['best'] and c['rule'][rule][g] is not None]
      finite = sorted(x for x in gaps if x is not None)
      worst = max(cells, key=lambda c: -math.inf if c['best'] is None else _worst_key(c, rule, g))
      out[f'{rule}/{g}'] = {
        'cells': len(gaps),
        'within_1pct': sum(1 for x in finite if x <= 1.0),
        'median': float(np.median(finite)) if finite else None,
        'worst': None if len(finite) < len(gaps) else (max(finite) if finite else None),
        'worst_cell': f'{worst["workload"]} {worst["steps"]} {worst["optim"]}' if gaps else None,
        'text': sorted(
          x
          for c in cells
          if c['workload'] != 'mnist1d' and c['best'] and (x := _gap(c['rule'][rule][g], c['best'])) is not None
        ),
      }
  return out


def _worst_key(c: dict, rule: str, g: str) -> float:
  st = c['rule'][rule][g]
  if st is None:
    return -math.inf
  gap = _gap(st, c['best'])
  return math.inf if gap is None else gap


def _fmt_gap(st: dict | None, best: float | None) -> str:
  if st is None:
    return 'not run'
  if st['value'] is None:
    return f'{st["diverged"]} of {st["n"]} diverged'
  return f'{_gap(st, best):+.1f}%' + (f' (n={st["n"]})' if st['n'] != len(SEEDS) else '')


def _span(xs: list[float]) -> str:
  return '-' if not xs else f'{min(xs):+.1f}% to {max(xs):+.1f}%'


def write_report(out_dir: str, cells: list[dict], alias: dict, quick: bool) -> str:
  s = summary(cells)
  results = {'cells': cells, 'summary': s, 'alias_check': alias}
  lines = [
    '# Where the guarded climb starts: one rule for the learning rate you pass',
    '',
    f'Generated by `python -m research.start_rule{" --quick" if quick else ""}` from the committed records '
    '(issue 84). The default controller scales the schedule it is given by a factor that starts at '
    '`initial_scale` and only rises (`hdet_jax/sync.py`, `_fit_controller`: '
    '`step = jnp.where(rise_only, jnp.maximum(step, 0.0), step)`, rise-only from `stop_steps=0`; its one step '
    "down is the guard's back-off, at a window whose training loss rose by 2 standard errors and 5%). Rule 0.1 "
    "starts it at a tenth of the LR passed (the trainer's, every record's, and since issue 84 the library's "
    'for a built optimizer and a factory alike); rule 1 at the LR passed (the library around a built optimizer '
    "before issue 84). The LR passed is a guess 10x below, at, or 10x above the sweep's best (the first seed's "
    'best peak LR of the 8-run sweep, as in `results/workloads.md`); each cell is the 3-seed mean of the primary '
    "metric against the sweep's best mean (lower is better). Rule 1 from 10x low and from the best are rule 0.1's "
    'runs from the best and from 10x high (the same start and schedule); rule 1 from 10x high is trained here '
    '(not on fine-tuning). The last row, the LM under a warmup-cosine schedule, has both rules trained at every '
    "guess (`results/schedule_bracket.md`, its `start1` control), and there rule 1's runs from 10x low and the "
    f"best equal rule 0.1's from the best and 10x high to {alias.get('max_rel_diff') or 0:.1e} relative "
    f'({alias.get("pairs", 0)} seed pairs).',
    '',
    '| workload | steps | optim | schedule | sweep best | rule 0.1: 10x low / best / 10x high | '
    "rule 1: 10x low / best / 10x high | rule 1 from 10x high: the peak it ended on (x the sweep's best) |",
    '|---|---|---|---|---|---|---|---|',
  ]
  for c in cells:
    best = '-' if c['best'] is None else f'{c["best"]:.4g} at {c["best_lr"]:.4g}'
    row = [
      ' / '.join('-' if c['best'] is None else _fmt_gap(c['rule'][r][g], c['best']) for g in GUESSES) for r in RULES
    ]
    end = c.get('rule1_high_end_scale')
    end = '-' if end is None or not c['best_lr'] else f'{end / c["best_lr"]:.3g}x'
    lines.append(
      f'| {c["workload"]} | {c["steps"]} | {c["optim"]} | {c["schedule"]} | {best} | {row[0]} | {row[1]} | {end} |'
    )
  lines += ['', '## Each rule, by the guess passed (every row above)', '']
  lines += [
    '| rule | guess | cells | within 1% | median gap | worst gap | text cells |',
    '|---|---|---|---|---|---|---|',
  ]
  names = {'low': '10x low', 'best': 'the best', 'high': '10x high'}
  for r in RULES:
    for g in GUESSES:
      x = s[f'{r}/{g}']
      med = '-' if x['median'] is None else f'{x["median"]:+.1f}%'
      worst = 'a run diverged' if x['worst'] is None else f'{x["worst"]:+.1f}% ({x["worst_cell"]})'
      lines.append(f'| {r} | {names[g]} | {x["cells"]} | {x["within_1pct"]} | {med} | {worst} | {_span(x["text"])} |')
  low01, high1, high01, low1 = s['0.1/low'], s['1/high'], s['0.1/high'], s['1/low']
  lines += [
    '',
    '## The rule',
    '',
    '- **No single rule covers both errors.** The climb rises from a start too low; from one too high its only '
    "way down is the guard's back-off, after a window whose loss rose by its margins, and a run that is only bad "
    "never triggers it: rule 1's runs from 10x high ended on a peak of "
    f"{_end_span(cells, text=True)} the sweep's best on text and {_end_span(cells, text=False)} on MNIST-1D, "
    'where the back-off lowered them only after the first windows had done their damage. The two rules are the '
    'same runs shifted by a factor 10 in the guess: whichever start is the default, a guess 10x on one side of it '
    'is climbed from and 10x on the other is not.',
    f'- **The default, rule 0.1, protects against a guess 10x too high:** {high01["within_1pct"]} of '
    f"{high01['cells']} cells within 1% (median {high01['median']:+.1f}%), against rule 1's {high1['within_1pct']} "
    f'of {high1["cells"]} (median {high1["median"]:+.1f}%, worst {high1["worst"]:+.1f}%, {high1["worst_cell"]}).'
    if high1['median'] is not None and high1['worst'] is not None and high01['median'] is not None
    else "- **The default, rule 0.1, protects against a guess 10x too high** (rule 1's runs from 10x high: "
    'not all trained).',
    f'- **Its cost is the other error, a guess 10x too low:** {_span(low01["text"])} on text, median '
    f'{low01["median"]:+.1f}% over every cell (rule 1 from 10x low: {_span(low1["text"])} on text, median '
    f'{low1["median"]:+.1f}%).'
    if low01['median'] is not None and low1['median'] is not None
    else '- **Its cost is the other error, a guess 10x too low.**',
    '- **So pass the highest learning rate you would consider** (about 10x the one you would otherwise use): '
    '`AutoLR(total_steps=S)` starts the climb at a tenth of it, built optimizer or factory alike. '
    '`AutoLR(initial_scale=1.0)` starts at the learning rate passed, for one already tuned.',
    '- Held out (issue 84, not in these records): a GSPMD trainer started at its own LR ended at 1.889 under '
    'rule 1 and 1.912 under rule 0.1 (1.2% worse); a `jax.pmap` classifier started 10x above its own LR under '
    'rule 1 lost 2.3x to plain training at that LR (0.080 against 0.034).',
    '',
  ]
  os.makedirs(out_dir, exist_ok=True)
  return records.write_report(out_dir, 'start_rule', results, lines)[1]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--report-only', action='store_true', help='read the records, train nothing')
  p.add_argument('--out', default=None, help="the report's folder (default: results/; --quick: the workdir)")
  p.add_argument('--quick', action='store_true', help='a smoke run: the tiny LM, 16 steps, one seed')
  p.add_argument('--seeds', default=','.join(map(str, SEEDS)), help='seeds to train (the report reads them all)')
  p.add_argument('--workdir', default=None, help='where runs train (default: workdirs/workloads)')
  args = p.parse_args(argv)
  work_root = args.workdir or os.path.join(REPO, 'workdirs', 'start_rule_quick' if args.quick else 'workloads')
  if not args.report_only:
    from hdet_jax import trainer

    trainer.setup_jax(workloads.base_config('lm', 16, True))
    seeds = [0] if args.quick else [int(x) for x in args.seeds.split(',')]
    for w, steps, o in (('lm', 16, 'adamw'),) if args.quick else TRAIN_ORDER:
      train_cell(w, steps, o, seeds, args.quick, work_root)
  cells = workload_cells(args.quick, work_root)
  alias = {}
  if not args.quick:
    extra, alias = schedule_cell()
    cells += [extra] if extra else []
  md = write_report(args.out or (work_root if args.quick else os.path.join(REPO, 'results')), cells, alias, args.quick)
  with open(md, encoding='utf-8') as f:
    print(f.read())


if __name__ == '__main__':
  main()
