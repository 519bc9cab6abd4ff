"""A finer LR grid for the bracket: 15 points a factor 2^0.5 apart instead of 8 a factor 2 apart, on every workload.

Issue 26, twenty-fifth pass. The twenty-fourth (``results/last_rung.md``) found the default bracket's real misses on
mnist1d where its factor-2 grid has no point near a sharp optimum (it keeps the point below it on every seed), not
in its last pick. The plain fix is a finer grid over the same span: 15 points a factor 2^0.5 apart are the default's
8 (``max_lr * 2 ** (k - 3.5)``) and the 7 points between them. It costs more, and at 0.1 of the run, where the
higher peaks lead (they are further up their warmup), keeping the same count keeps a narrower span. So the first
rung keeps 5, 7 or 9 of the 15 (3.2, 3.6 and 4.0 runs; 9 keeps the default's 16x span). One real bracket keeping 9
is trained per cell, start and seed; keeping 5 or 7 is composed from its record (the same runs: the best 5 or 7 at
the first rung, ranked again at the last; ``kept_at``), its kept point trained to the end where it differs.
``--check`` trains one composed bracket for real and compares, bit for bit.

Cells: mnist1d's six (where the misses are), the held-out classifiers of ``research.heldout_task`` (chosen on
nothing), and the LM at 750 steps and fine-tuning at 150 and 300 (where the default bracket is within 1%: does the
finer grid keep that?). Against the sweep's best LR, paired by seed, with the standard error of the per-seed gaps
(``records.paired_gap``; ``last_rung.verdict``), beside the default bracket (8-5-1) on the same seeds. Footing: the
LM's and fine-tuning's records were made on another CPU. There the finer bracket's final enters as the default
bracket's recorded final plus the difference of the two kept points' ends, both trained here (as
``wider_rung.paired_final``); where both keep the same point it is the record's.

    python -m research.archive.finer_grid                   # train what is missing (cached, resumable), then report
    python -m research.archive.finer_grid --cells task:wide,mnist1d:1000:adamw
    python -m research.archive.finer_grid --report-only
    python -m research.archive.finer_grid --check mnist1d:1000:adamw:best:0   # one composed bracket trained for real
    python -m research.archive.finer_grid --quick           # a smoke run: a 5-point quick bracket on mnist1d's tiny CNN
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

from research import autolr
from research import bracket_mode
from research.archive import heldout_task
from research.archive import last_rung
from research import records
from research import wider_rung

REPO = autolr.REPO
FINE = {'bracket.points': 15, 'bracket.factor': 2**0.5, 'bracket.rungs': '0.1:9,0.3:1', 'bracket.compare_steps': 10}
KEEPS = (5, 7, 9)  # points the first rung keeps (the last: FINE's own, trained; the others composed)
QUICK_CELL = 'mnist1d:16:adamw'
QUICK_FINE = {
  'bracket.points': 5,
  'bracket.factor': 2**0.5,
  'bracket.rungs': '0.25:3,0.5:1',
  'bracket.compare_steps': 3,
}
QUICK_KEEPS = (2, 3)
MNIST1D = tuple(c for c in bracket_mode.CELLS if c.startswith('mnist1d'))
# The held-out classifiers it was run on: heldout_task.CHECKS' first two, and (after the twenty-eighth pass) the MLP.
TASKS = ('task:wide', 'task:narrow', 'task:mlp')
CELLS = MNIST1D + TASKS + ('lm:750:adamw', 'finetune:150:adamw', 'finetune:300:adamw')


def fields(quick: bool) -> dict:
  return QUICK_FINE if quick else FINE


def keeps(quick: bool) -> tuple[int, ...]:
  return QUICK_KEEPS if quick else KEEPS


def _site(cell: str) -> heldout_task.Site:
  return heldout_task.Site(cell.split(':')[1], False, '')


def cell_dir(cell: str, quick: bool, work_root: str) -> str:
  root = os.path.join(work_root, 'records') if quick else os.path.join(REPO, 'results', 'finer_grid', 'runs')
  return os.path.join(root, *cell.split(':'))


def record_path(cell: str, start: str, seed: int, quick: bool, work_root: str) -> str:
  return os.path.join(cell_dir(cell, quick, work_root), f'bracket_{start}_s{seed}.json')


def end_path(cell: str, start: str, seed: int, lr: float, quick: bool, work_root: str) -> str:
  return os.path.join(cell_dir(cell, quick, work_root), f'end_{start}_s{seed}_lr{lr:.6g}.json')


def config_for(cell: str, start: str, seed: int, quick: bool, work_root: str, rungs: str | None = None):
  """The finer bracket's config (``rungs``: another ``bracket.rungs``, for ``--check``)."""
  from hdet_jax.trainer import config_lib

  f = {**fields(quick), **({'bracket.rungs': rungs} if rungs else {})}
  if cell.startswith('task:'):  # (heldout_task's bracket config, with the finer grid)
    return config_lib.with_overrides(heldout_task.config_for(f'bracket_{start}_s{seed}', _site(cell)), f)
  return bracket_mode.config_for(cell, start, seed, quick, work_root, f)


def anchor(cell: str, quick: bool) -> float:
  return heldout_task.anchor_lr(_site(cell)) if cell.startswith('task:') else bracket_mode.anchor_lr(cell, quick)


_load = wider_rung._load  # (a JSON record, or None where it is not written)


def _train(name: str, config, path: str, work_root: str) -> dict:
  workdir = os.path.join(work_root, 'finer_grid', name)
  rec = records.train_run(name, config, workdir)
  records.write_record(path, rec, indent=1)
  shutil.rmtree(workdir, ignore_errors=True)
  return rec


def bracket_record(cell: str, start: str, seed: int, quick: bool, work_root: str, train: bool) -> dict | None:
  """The finer bracket (first rung keeping ``max(keeps)``): its record (cached; None: not trained, ``train`` off)."""
  path = record_path(cell, start, seed, quick, work_root)
  got = _load(path)
  if got is None and train:
    got = _train(
      f'{cell.replace(":", "_")}_{start}_s{seed}', config_for(cell, start, seed, quick, work_root), path, work_root
    )
    print(
      f'  {cell} {start} s{seed}: kept {got["kept_lr"] / anchor(cell, quick):.3g}x, final {got["final_metric"]}, '
      f'{got["wall_s"]:.0f}s',
      flush=True,
    )
  return got


def kept_at(rec: dict, keep: int) -> float:
  """The point the same bracket keeps with its first rung keeping ``keep`` (at most the record's): the best ``keep``
  at the first rung (``bracket.survivors``), ranked again by their losses at the last."""
  from hdet_jax.trainer import bracket

  first, last = rec['rungs'][0], rec['rungs'][-1]
  # (the rungs' keys are the LRs to 6 digits: the points' own LRs are the record's, exactly)
  pool = bracket.survivors({lr: first['losses'][f'{lr:.6g}'] for lr in rec['lrs']}, keep)
  (kept,) = bracket.survivors({lr: last['losses'][f'{lr:.6g}'] for lr in pool}, 1)
  return kept


def end(cell: str, start: str, seed: int, lr: float, quick: bool, work_root: str, train: bool) -> float | None:
  """The finer bracket's point ``lr`` trained to the end, as a bracket trains its winner (cached)."""
  from hdet_jax.trainer import bracket

  path = end_path(cell, start, seed, lr, quick, work_root)
  got = _load(path)
  if got is None and train:
    config = bracket.point_config(config_for(cell, start, seed, quick, work_root), lr, 0)
    got = _train(f'{cell.replace(":", "_")}_end_{start}_s{seed}_lr{lr:.6g}', config, path, work_root)
  return None if got is None else got['final_metric']


def composed(cell: str, start: str, seed: int, quick: bool, work_root: str, train: bool) -> dict | None:
  """Per first-rung count: the kept point and its final metric, trained here (None: something not trained)."""
  rec = bracket_record(cell, start, seed, quick, work_root, train)
  if rec is None:
    return None
  out = {}
  for keep in keeps(quick):
    lr = kept_at(rec, keep)
    final = rec['final_metric'] if lr == rec['kept_lr'] else end(cell, start, seed, lr, quick, work_root, train)
    if lr != rec['kept_lr'] and final is None and _load(end_path(cell, start, seed, lr, quick, work_root)) is None:
      return None
    out[keep] = {'kept_lr': lr, 'final_metric': final}
  return out


def default_bracket(cell: str, start: str, seed: int) -> dict | None:
  """The default bracket (8-5-1) on the same seed: its kept LR, its final on the records' footing, and whether that
  footing is this CPU's (None: not recorded)."""
  if cell.startswith('task:'):
    rec = heldout_task.load(f'bracket_{start}_s{seed}', _site(cell))
    return None if rec is None else {'kept_lr': rec['kept_lr'], 'final_metric': rec['final_metric'], 'here': True}
  got = last_rung.runner_up(cell, start, seed, False, '', False)
  return (
    None if got is None else {'kept_lr': got['kept_lr'], 'final_metric': got['final_metric'], 'here': got['reproduced']}
  )


def on_footing(
  final: float | None, kept_lr: float, default: dict, cell: str, start: str, seed: int, work_root: str, train: bool
) -> float | None:
  """A finer bracket's final trained here, on the records' footing: itself where the records are this CPU's; else
  the default's recorded final plus the difference of the two kept points' ends trained here."""
  if default['here'] or final is None:
    return final
  if abs(kept_lr / default['kept_lr'] - 1) < 1e-9:  # (the same point: the default's own run)
    return default['final_metric']
  here = wider_rung.end(cell, start, seed, default['kept_lr'], False, work_root, train)
  if here is None or None in (here['final_metric'], default['final_metric']):
    return None
  return default['final_metric'] + final - here['final_metric']


def sweep_reference(cell: str) -> tuple[float, list[float | None]]:
  """The sweep's best LR (best 3-seed mean) and its final per seed."""
  if cell.startswith('task:'):
    site = _site(cell)
    best = heldout_task.summarize(site)['best_lr']
    lr = next(x for x in heldout_task.plan(site)['grid'] if f'{x:g}' == best)
    return lr, [heldout_task.load(heldout_task.grid_name(lr, s), site)['final_metric'] for s in bracket_mode.SEEDS]
  return bracket_mode.sweep_cell(cell)['grid_best']['lr'], last_rung.sweep_finals(cell, bracket_mode.SEEDS)


def cell_rows(cell: str, quick: bool, work_root: str, train: bool = False) -> dict:
  """Per start (every seed recorded): the default bracket's and each finer bracket's per-seed finals, kept points
  (x the start's reference) and paired gaps (± se) against the sweep's best LR on the same seeds."""
  seeds = [0] if quick else list(bracket_mode.SEEDS)
  ref = None if quick else sweep_reference(cell)
  out = {}
  for start in ['best'] if quick else list(bracket_mode.STARTS):
    got = [composed(cell, start, s, quick, work_root, train) for s in seeds]
    if None in got:
      continue
    a = anchor(cell, quick)
    row = {'kept_x': {k: [g[k]['kept_lr'] / a for g in got] for k in keeps(quick)}}
    if ref is None:
      row['finals'] = {k: [g[k]['final_metric'] for g in got] for k in keeps(quick)}
      out[start] = row
      continue
    defaults = [default_bracket(cell, start, s) for s in seeds]
    if None in defaults:
      continue
    row['sweep_lr'], row['sweep'] = ref
    row['default'] = {'finals': [d['final_metric'] for d in defaults], 'kept_x': [d['kept_lr'] / a for d in defaults]}
    row['finals'] = {
      k: [
        on_footing(g[k]['final_metric'], g[k]['kept_lr'], d, cell, start, s, work_root, train)
        for g, d, s in zip(got, defaults, seeds)
      ]
      for k in keeps(quick)
    }
    for name, finals in [('default', row['default']['finals'])] + [(k, row['finals'][k]) for k in keeps(quick)]:
      gap, se = records.paired_gap(finals, ref[1])
      row.setdefault('gaps', {})[name] = {'gap': gap, 'se': se, 'verdict': last_rung.verdict({'gap': gap, 'se': se})}
    # (the widest finer bracket against the default on the same seeds: ahead or behind beyond 2 se, or neither)
    row['vs_default'] = _versus(row['finals'][max(keeps(quick))], row['default']['finals'])
    out[start] = row
  return out


def _versus(finals: list, default: list) -> dict:
  """The widest finer bracket against the default on the same seeds: paired gap, se, and the side beyond 2 se."""
  gap, se = records.paired_gap(finals, default)
  side = None if gap is None or se is None or abs(gap) <= 2 * se else ('behind' if gap > 0 else 'ahead')
  return {'gap': gap, 'se': se, 'resolved': side}


EIGHT_SEEDS = tuple(bracket_mode.SEEDS) + tuple(last_rung.FRESH_SEEDS)


def eight_seed_reference(cell: str, work_root: str) -> dict | None:
  """The sweep's best LR over the 8 seeds (among the LRs recorded on all 8) with its finals, and per start the
  default bracket's finals and kept points on the same seeds (None: not recorded). mnist1d: ``last_rung``'s table
  (seeds 0-2 its composition, 3-7 trained there); a held-out classifier: ``heldout_task``'s records."""
  if not cell.startswith('task:'):
    base = last_rung.eight_seed_rows(cell, work_root)
    return {
      'sweep_lr': base['sweep_lr'],
      'sweep': base['sweep'],
      'default': {start: {'finals': d['finals'], 'kept_x': d['kept_x']} for start, d in base['starts'].items()},
    }
  site, a = _site(cell), anchor(cell, False)
  grid = {}
  for lr in heldout_task.plan(site)['grid']:
    got = [heldout_task.load(heldout_task.grid_name(lr, s), site) for s in EIGHT_SEEDS]
    if None not in got:
      grid[lr] = [r['final_metric'] for r in got]
  if not grid:
    return None
  best_lr = records.best_lr(grid)
  out = {'sweep_lr': best_lr, 'sweep': grid[best_lr], 'default': {}}
  for start in bracket_mode.STARTS:
    got = [heldout_task.load(f'bracket_{start}_s{s}', site) for s in EIGHT_SEEDS]
    if None not in got:
      out['default'][start] = {'finals': [r['final_metric'] for r in got], 'kept_x': [r['kept_lr'] / a for r in got]}
  return out


def eight_seed_rows(cell: str, work_root: str) -> dict:
  """A cell on 8 seeds (the sweep's 3 and 5 fresh ones, where the default bracket has them too): per start, each
  finer bracket's finals and kept points (seeds 0-2 as in the 3-seed rows, 3-7 their own records), the paired gap
  (± se) against the sweep's best LR over the 8 seeds, and the widest against the default."""
  ref = eight_seed_reference(cell, work_root)
  if ref is None:
    return {'starts': {}}
  out = {'sweep_lr': ref['sweep_lr'], 'sweep': ref['sweep'], 'starts': {}}
  three, a = cell_rows(cell, False, work_root), anchor(cell, False)
  for start, d in ref['default'].items():
    fresh = [composed(cell, start, s, False, work_root, False) for s in last_rung.FRESH_SEEDS]
    if start not in three or None in fresh:
      continue
    gap, se = records.paired_gap(d['finals'], ref['sweep'])
    row = {'default': {**d, 'gap': gap, 'se': se}}
    for k in KEEPS:
      finals = three[start]['finals'][k] + [g[k]['final_metric'] for g in fresh]
      gap, se = records.paired_gap(finals, ref['sweep'])
      row[str(k)] = {
        'finals': finals,
        'kept_x': three[start]['kept_x'][k] + [g[k]['kept_lr'] / a for g in fresh],
        'gap': gap,
        'se': se,
      }
    for g in row.values():
      g['verdict'] = last_rung.verdict(g)
    row['vs_default'] = _versus(row[str(max(KEEPS))]['finals'], d['finals'])
    out['starts'][start] = row
  return out


def eight_seed_lines(eight: dict) -> list[str]:
  """The 8-seed table, its tally and the paired comparison with the default."""
  n, top = FINE['bracket.points'], max(KEEPS)
  lines = [
    '',
    '## On 8 seeds: mnist1d and the held-out classifiers',
    '',
    "The finer bracket trained on the sweep's fresh seeds 3-7 too, beside the default bracket on the same 8 "
    "seeds (mnist1d: `results/last_rung.md`'s 8-seed table, seeds 0-2 its composition, 3-7 trained there; the "
    'held-out classifiers: their sweep and the default bracket trained on seeds 3-7 in '
    "`results/heldout_task/runs/`). Against the sweep's best LR over the 8 seeds (among the LRs recorded on "
    'all 8), paired by seed. The tally is over all rows; by start and family in the discussion.',
    '',
    '| cell | start | sweep best LR (8 seeds) | default 8-5-1 | '
    + ' | '.join(f'{n}-{k}-1' for k in KEEPS)
    + f" | {n}-{top}-1 against the default, paired | kept (x the start's reference), per seed: default; "
    f'{n}-{top}-1 |',
    '|---|---|---|---|' + '---|' * len(KEEPS) + '---|---|',
  ]
  t = {}
  for cell, e in eight.items():
    for start, r in e['starts'].items():
      kept = '; '.join(' / '.join(f'{x:.3g}' for x in r[name]['kept_x']) for name in ('default', str(top)))
      vs = r['vs_default']
      lines.append(
        f'| {cell} | {start} | {e["sweep_lr"]:g} | '
        + ' | '.join(_gap(r[name]) for name in ['default'] + [str(k) for k in KEEPS])
        + f' | {_versus_text(vs)} | {kept} |'
      )
      for name in ['default'] + [str(k) for k in KEEPS]:
        t.setdefault(name, {'within': 0, 'miss': 0, 'not resolved': 0})[r[name]['verdict']] += 1
      t.setdefault('vs', []).append(vs['resolved'])
  sides = t.pop('vs', [])
  lines += [
    '',
    f'{n}-{top}-1 against the default bracket on the same 8 seeds, beyond 2 standard errors: ahead in '
    f'{sides.count("ahead")}, behind in {sides.count("behind")}, neither in {sides.count(None)} of '
    f'{len(sides)} cell-starts.',
    '',
    '| bracket | within 1% | miss (beyond 2 se) | not resolved |',
    '|---|---|---|---|',
  ]
  for name, c in t.items():
    label = 'default 8-5-1' if name == 'default' else f'{n}-{name}-1 ({compute_runs(int(name), False):.2g} runs)'
    lines.append(f'| {label} | {c["within"]} | {c["miss"]} | {c["not resolved"]} |')
  return lines


def compute_runs(keep: int, quick: bool) -> float:
  from hdet_jax.trainer import bracket, schema

  (first, k), *rest = schema.parse_rungs(fields(quick)['bracket.rungs'])
  return bracket.compute_runs(fields(quick)['bracket.points'], [(first, keep)] + rest, 1000)


def tally(rows: dict, cells) -> dict:
  """Over ``cells``' starts: per bracket the count within 1%, resolved misses and the rest."""
  out = {}
  for cell in cells:
    for row in rows.get(cell, {}).values():
      for name, g in row.get('gaps', {}).items():
        t = out.setdefault(str(name), {'within': 0, 'miss': 0, 'not resolved': 0})
        t[g['verdict']] += 1
  return out


def _versus_text(vs: dict) -> str:
  return last_rung._gap_text(vs) + ('' if vs['resolved'] is None else f' ({vs["resolved"]})')


def _gap(g: dict) -> str:
  text = last_rung._gap_text(g)
  return f'**{text}**' if g['verdict'] == 'miss' else text


def write_report(out_dir: str, rows: dict, quick: bool, eight: dict | None = None) -> str:
  n, f = fields(quick)['bracket.points'], fields(quick)['bracket.factor']
  names = [f'{n}-{k}-1 ({compute_runs(k, quick):.2g} runs)' for k in keeps(quick)]
  lines = [
    f'# A finer LR grid: {n} points a factor {f:.4g} apart, the first rung keeping {", ".join(map(str, keeps(quick)))}',
    '',
    f'Made by `python -m research.finer_grid{" --quick" if quick else ""}` (records in `results/finer_grid/runs/`). '
    f"One bracket of {n} points a factor 2^0.5 apart (the default bracket's 8 and the 7 between them; the "
    f'same 128x span), its first rung at 0.1 of the run keeping {max(keeps(quick))}, per cell, start and seed; '
    'keeping fewer is composed from its record and the kept point trained to the end where it differs. Gaps: '
    "paired by seed against the sweep's best LR (3-seed means) ± the standard error of the per-seed gaps; bold: "
    'a miss beyond 2 standard errors (`last_rung.verdict`). The default bracket (8-5-1, 2.5 runs) is on the same '
    'seeds: `results/last_rung.md`\'s and `results/heldout_task.md`\'s records. "task:" cells are '
    "`research.heldout_task`'s classifiers. The LM and fine-tuning: the finer bracket trained here, entered on "
    "the records' footing (the module's docstring). The reading is in `research/workloads_discussion.md` "
    '(twenty-fifth and twenty-sixth passes).',
    '',
    '| cell | start | sweep best LR | default 8-5-1 | '
    + ' | '.join(names)
    + f' | {n}-{max(keeps(quick))}-1 against the '
    "default, paired | kept (x the start's reference), per seed: "
    f'default; {n}-{max(keeps(quick))}-1 |',
    '|---|---|---|---|' + '---|' * len(names) + '---|---|',
  ]
  for cell, starts in rows.items():
    for start, r in starts.items():
      if 'gaps' not in r:
        lines.append(
          f'| {cell} | {start} | - | - | '
          + ' | '.join(' / '.join(map(str, r['finals'][k])) for k in keeps(quick))
          + ' | - | - |'
        )
        continue
      kept = '; '.join(
        ' / '.join(f'{x:.3g}' for x in xs) for xs in (r['default']['kept_x'], r['kept_x'][max(keeps(quick))])
      )
      lines.append(
        f'| {cell} | {start} | {r["sweep_lr"]:g} | {_gap(r["gaps"]["default"])} | '
        + ' | '.join(_gap(r['gaps'][k]) for k in keeps(quick))
        + f' | {_versus_text(r["vs_default"])} | {kept} |'
      )
  groups = {'mnist1d': MNIST1D, 'held-out classifiers': TASKS, 'LM and fine-tuning': CELLS[len(MNIST1D) + len(TASKS) :]}
  tallies = {g: tally(rows, cells) for g, cells in groups.items()}
  tallies['all'] = tally(rows, list(rows))
  sides = [r['vs_default']['resolved'] for starts in rows.values() for r in starts.values() if 'vs_default' in r]
  if not quick:
    lines += [
      '',
      f'{n}-{max(keeps(quick))}-1 against the default bracket on the same seeds, beyond 2 standard errors: '
      f'ahead in {sides.count("ahead")}, behind in {sides.count("behind")}, neither in {sides.count(None)} of '
      f'{len(sides)} cell-starts.',
    ]
    lines += ['', '| cells | bracket | within 1% | miss (beyond 2 se) | not resolved |', '|---|---|---|---|---|']
    for g, t in tallies.items():
      for name, c in t.items():
        label = 'default 8-5-1' if name == 'default' else f'{n}-{name}-1'
        lines.append(f'| {g} | {label} | {c["within"]} | {c["miss"]} | {c["not resolved"]} |')
  done = [c for c in (_load(check_path(cell, quick, out_dir if quick else '')) for cell in rows) if c]
  if done:
    lines += [
      '',
      'Checked (`--check`): a composed bracket trained for real: '
      + '; '.join(
        f'{c["spec"]} (rungs {c["rungs"]}): kept {c["bracket"]["kept_lr"]:.6g}, final {c["bracket"]["final_metric"]}, '
        f'{"equal to" if c["equal"] else "NOT equal to"} its composition'
        for c in done
      )
      + '.',
    ]
  if eight:
    lines += eight_seed_lines(eight)
  os.makedirs(out_dir, exist_ok=True)
  records.write_json(
    os.path.join(out_dir, 'finer_grid.json'),
    {
      'rows': rows,
      'tally': tallies,
      'compute_runs': {str(k): compute_runs(k, quick) for k in keeps(quick)},
      **({'eight_seeds': eight} if eight else {}),
    },
    indent=1,
  )
  md = os.path.join(out_dir, 'finer_grid.md')
  with open(md, 'w', encoding='utf-8') as fh:
    fh.write('\n'.join(lines) + '\n')
  return md


def check_path(cell: str, quick: bool, work_root: str) -> str:
  return os.path.join(cell_dir(cell, quick, work_root), 'check.json')


def check(spec: str, quick: bool, work_root: str) -> dict:
  """Trains the bracket of ``cell:start:seed`` for real with its first rung keeping ``min(keeps)`` and compares its
  kept point and final with the composition's."""
  from hdet_jax.trainer import schema

  *cell, start, seed = spec.split(':')
  cell, seed, keep = ':'.join(cell), int(seed), min(keeps(quick))
  (first, _), *rest = schema.parse_rungs(fields(quick)['bracket.rungs'])
  rungs = ','.join(f'{f:g}:{k}' for f, k in [(first, keep)] + rest)
  workdir = os.path.join(work_root, 'finer_grid', 'check')
  shutil.rmtree(workdir, ignore_errors=True)
  summary = records.run_bracket(config_for(cell, start, seed, quick, work_root, rungs), workdir)
  shutil.rmtree(workdir, ignore_errors=True)
  comp = composed(cell, start, seed, quick, work_root, train=True)[keep]
  got = {
    'spec': spec,
    'rungs': rungs,
    'bracket': {
      'kept_lr': summary['bracket']['winner']['lr'],
      'final_metric': records.finite_or_none(summary['final_metric']),
    },
    'composed': comp,
  }
  got['equal'] = got['bracket'] == comp
  records.write_record(check_path(cell, quick, work_root), got, indent=1)
  return got


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--cells', default=','.join(CELLS), help='cells to train (mnist1d:1000:adamw, task:wide, ...)')
  p.add_argument('--starts', default=','.join(bracket_mode.STARTS), help='starts to train')
  p.add_argument(
    '--seeds',
    default=','.join(map(str, bracket_mode.SEEDS)),
    help='seeds to train (the report reads 0-2, and for mnist1d and the held-out classifiers 3-7 in its 8-seed table)',
  )
  p.add_argument('--report-only', action='store_true', help='read the records, train nothing')
  p.add_argument('--out', default=None, help="the report's folder (default: results/; --quick: the workdir)")
  p.add_argument('--check', default=None, help='cell:start:seed: train the narrowest composed bracket for real')
  p.add_argument('--quick', action='store_true', help="a smoke run: the quick bracket on mnist1d's tiny CNN")
  p.add_argument('--workdir', default=None, help='where runs train (default: workdirs/workloads)')
  args = p.parse_args(argv)
  if args.report_only and args.check:
    raise SystemExit('error: --check trains a bracket and --report-only trains nothing; drop one of them.')
  work_root = args.workdir or os.path.join(REPO, 'workdirs', 'finer_grid_quick' if args.quick else 'workloads')
  cells = [QUICK_CELL] if args.quick else [c for c in args.cells.split(',') if c]
  unknown = [c for c in cells if c not in CELLS + (QUICK_CELL,)]
  if unknown:
    raise SystemExit(f'error: --cells: unknown {unknown}; choose from {",".join(CELLS)}')
  if not args.report_only:
    from hdet_jax import trainer
    from research import workloads

    trainer.setup_jax(
      workloads.base_config('lm', 16, True)
    )  # (8 CPU devices, as every record's runs: before any JAX call)
    if args.check:
      print(json.dumps(check(args.check, args.quick, work_root), indent=1))
    for start in ['best'] if args.quick else args.starts.split(','):
      for cell in cells:
        for seed in [0] if args.quick else [int(x) for x in args.seeds.split(',')]:
          composed(cell, start, seed, args.quick, work_root, train=True)
          if not args.quick:
            default = default_bracket(cell, start, seed)
            got = composed(cell, start, seed, False, work_root, train=False)
            if default is not None and not default['here']:  # (the default's kept end here, for the footing)
              for k in KEEPS:
                on_footing(got[k]['final_metric'], got[k]['kept_lr'], default, cell, start, seed, work_root, True)
  rows = {c: cell_rows(c, args.quick, work_root) for c in ([QUICK_CELL] if args.quick else CELLS)}
  eight = {} if args.quick else {c: e for c in MNIST1D + TASKS if (e := eight_seed_rows(c, work_root))['starts']}
  out = args.out or (work_root if args.quick else os.path.join(REPO, 'results'))
  md = write_report(out, {c: r for c, r in rows.items() if r}, args.quick, eight)
  with open(md, encoding='utf-8') as f:
    print(f.read())


if __name__ == '__main__':
  main()
