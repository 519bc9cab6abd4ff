"""Does the trainer train as before now that its rollback is the library's (``hdet(..., rollback=True)``)?

    python -m research.library_rollback                 # 6 runs (about 20 minutes on 2 cores), cached, resumable
    python -m research.library_rollback --quick         # a smoke run of two cells on tiny models (about 2 minutes)
    python -m research.library_rollback --report-only   # redraw results/library_rollback.{md,json}

Until this change the trainer kept its own rollback (one copy per device of the state the last sync left, and a
program of its own that returned to it). It now builds ``hdet(..., rollback=True)`` and passes the library's
anchor, one copy per device (``hdet_jax.replicas.share_anchors``), to its window end. The default HDET behind the
verdict's text workloads at their default lengths (the LM at 1500 steps and fine-tuning at 300), started 10x above
the sweep's best peak LR (where a blow-up is likeliest), seeds 0-2, is trained again from each committed record's own
config and compared with that record, which the trainer's own rollback trained. The back-off, where the rollback
acts, fired in none of the verdict's 18 default runs at those lengths (their records say so); where it fires, the
move is checked bit for bit in the side by side runs below and by tests/test_trainer_controller.py's divergences.

The records were trained on 2026-11-24 by the trainer of then, and the trainer has changed since in ways that move
the last bits of these runs (the main job, 8 replicas on 8 devices, is pinned bit for bit; these runs hold 8
replicas on one device), so a rerun is compared with its record against the spread of the record's three seeds:
equal within noise is a difference within 2 sqrt(2) standard deviations of the seeds, the two-sided 95% band of the
difference of two runs drawn alike (one standard deviation, this study's first criterion, is missed by half of such
pairs). The fine-tuning reruns start from a pretrained checkpoint trained again here (the records' was not kept).
Whether the rollback's move itself changed any bit is checked apart, on the commit before it and this one side by
side (the page's last section).

Records under results/library_rollback/runs/; the report compares each with the committed record it reran.
"""

from __future__ import annotations

import argparse
import json
import os

from research import autolr
from research import records
from research import workloads

REPO = autolr.REPO
OUT = os.path.join(REPO, 'results', 'library_rollback')
SEEDS = (0, 1, 2)
# (workload, steps, variant, start, seed): the verdict's default cells, the cheaper fine-tuning ones first.
CELLS = tuple(
  (workload, steps, autolr.DEFAULT_VARIANT, 'high', seed)
  for workload, steps in (('finetune', 300), ('lm', 1500))
  for seed in SEEDS
)
QUICK_CELLS = (('lm', 1500, autolr.DEFAULT_VARIANT, 'high', 0), ('finetune', 300, autolr.DEFAULT_VARIANT, 'high', 0))


def run_name(workload: str, variant: str, start: str, seed: int) -> str:
  return f'{workload}/' + autolr.hdet_name('adamw', variant, start, seed)


def committed(workload: str, steps: int, variant: str, start: str, seed: int) -> dict:
  """The committed record of that run (the trainer's own rollback trained it)."""
  path = os.path.join(
    workloads.records_dir(workload, steps, False, ''), autolr.hdet_name('adamw', variant, start, seed)
  )
  with open(path + '.json', encoding='utf-8') as f:
    return json.load(f)


def config_of(rec: dict, quick: bool, init_from: str | None):
  """The record's own config as today's trainer reads it (a field added since at its legacy value, what the run
  trained with; ``--quick``: at the quick runs' size and length)."""
  from hdet_jax.trainer import config_lib, schema

  flat = schema.complete(records.without_removed(config_lib.flatten(rec['config'])))
  if init_from is not None:  # (under the repository: as a relative path, which its records keep, as workloads' do)
    inside = os.path.abspath(init_from).startswith(REPO + os.sep)
    flat['init_from'] = os.path.relpath(init_from, REPO) if inside else init_from
  workload = 'finetune' if flat.get('data.corpus') == 'wyc' else 'lm'
  if quick:
    base = workloads.base_config(workload, 40, True, init_from)
    keep = {k: v for k, v in flat.items() if k.startswith('hdet.') or k in ('seed', 'optim.max_lr', 'init_from')}
    flat = {**keep, 'num_train_steps': 40, 'hdet.sync_every': 10}
    return config_lib.with_overrides(base, flat)
  return config_lib.with_overrides(records.load_config(os.path.join(REPO, 'configs', 'default.py')), flat)


def backoffs(rec: dict) -> list[int]:
  """The syncs whose back-off fired (where a run with the rollback returned to the sync before)."""
  return [c['step'] for c in rec.get('controller', []) if c.get('backed_off')]


def run_cells(cells, quick: bool, work_root: str, train: bool) -> dict:
  """Each cell's committed record and its rerun (None where not trained yet)."""
  cache = records.RunCache(
    os.path.join(work_root, 'records') if quick else os.path.join(OUT, 'runs'),
    work_root,
    autolr.make_record,
    autolr.describe,
  )
  out = {}
  for workload, steps, variant, start, seed in cells:
    old = committed(workload, steps, variant, start, seed)
    name = run_name(workload, variant, start, seed)
    init_from = workloads.pretrained(work_root, quick) if workload == 'finetune' and train else None
    new = cache.run(name, config_of(old, quick, init_from), skip_busy=True) if train else cache.get(name)
    out[name] = {
      'workload': workload,
      'steps': steps,
      'variant': variant,
      'start': start,
      'seed': seed,
      'trainer': old,
      'library': new,
    }
  return out


NOISE_BAND = 2.0 * 2.0**0.5  # seeds' standard deviations: the 95% band of the difference of two runs drawn alike


def seed_spread(workload: str, steps: int, variant: str, start: str) -> float | None:
  """The standard deviation of the committed records' final metric over :data:`SEEDS` (None if a seed lacks one)."""
  import numpy as np

  try:
    values = [committed(workload, steps, variant, start, seed)['val_bpb'] for seed in SEEDS]
  except FileNotFoundError:
    return None
  return float(np.std(values, ddof=1))


def summarize(cells: dict, quick: bool) -> dict:
  """Per run: the record's (the trainer's own rollback) and the rerun's (the library's) final metric, their
  difference against the record's seeds' spread, whether bit for bit equal, and the backed-off syncs of each."""
  rows = []
  for name, c in cells.items():
    new, old = c['library'], c['trainer']
    spread = None if quick else seed_spread(c['workload'], c['steps'], c['variant'], c['start'])
    diff = None if new is None else new['val_bpb'] - old['val_bpb']
    rows.append(
      {
        'run': name,
        'workload': c['workload'],
        'steps': c['steps'],
        'start': c['start'],
        'seed': c['seed'],
        'trainer_rollback': old['val_bpb'],
        'library_rollback': None if new is None else new['val_bpb'],
        'difference': diff,
        'seed_std': spread,
        'within_noise': None if diff is None or spread is None else abs(diff) <= NOISE_BAND * spread,
        'equal': None if new is None or quick else new['val_bpb'] == old['val_bpb'],
        'backoffs_trainer': backoffs(old),
        'backoffs_library': None if new is None else backoffs(new),
        'machine': None if new is None else new.get('machine'),
      }
    )
  done = [r for r in rows if r['library_rollback'] is not None]
  return {
    'runs': rows,
    'trained': len(done),
    'equal': sum(bool(r['equal']) for r in done),
    'within_noise': sum(bool(r['within_noise']) for r in done),
    'within_one_std': sum(abs(r['difference']) <= r['seed_std'] for r in done if r['seed_std'] is not None),
    'mean_difference': {
      w: (sum(d) / len(d) if d else None)
      for w in ('finetune', 'lm')
      for d in [[r['difference'] for r in done if r['workload'] == w]]
    },
    'max_abs_diff': max((abs(r['difference']) for r in done), default=None),
    'with_backoff': sum(bool(r['backoffs_trainer']) for r in rows),
    'side_by_side': SIDE_BY_SIDE,
  }


# The rollback's move checked bit for bit on its own: the same short runs with the commit before it (c71ebcc) and
# the one after (30dbbba), final validation loss in nats. The main job's config (8 replicas on one device, T=25) at
# the default's high start and at 10x that; configs/tiny.py at peak LR 1 with a guard that fires on any rise
# (tests/test_trainer_controller.py's divergence), on 1, 2 and 8 devices, where it backs off at step 15. Measured once
# (2026-11-29), not regenerable from one checkout: `git worktree add ../before c71ebcc`, then the same `python
# train.py` command in each checkout (the arguments in the row's 'command').
_DEFAULT = '--config configs/default.py --config.mesh.devices=1 --config.hdet.sync_every=25 --config.eval_every=0'
_TINY = (
  '--config configs/tiny.py --config.num_train_steps=24 --config.optim.max_lr=1.0 --config.hdet.controller=fit '
  '--config.hdet.score=common --config.hdet.warmup_steps=0 --config.hdet.backoff=True '
  '--config.hdet.backoff_stderrs=0.0 --config.hdet.backoff_fraction=0.0 --config.hdet.rollback=True'
)
SIDE_BY_SIDE = [
  {
    'run': 'default, 150 steps, peak LR 0.3',
    'command': f'{_DEFAULT} --config.num_train_steps=150 --config.optim.max_lr=0.3',
    'before': 2.548766613006592,
    'after': 2.548766613006592,
    'backoffs': [],
  },
  {
    'run': 'default, 200 steps, peak LR 3',
    'command': f'{_DEFAULT} --config.num_train_steps=200 --config.optim.max_lr=3.0 --config.stop_on_nan=False',
    'before': 2.8442330360412598,
    'after': 2.8442330360412598,
    'backoffs': [],
  },
  *(
    {
      'run': f'tiny, a guard that fires, {d} device(s)',
      'command': f'{_TINY} --config.mesh.devices={d}',
      'before': before,
      'after': before,
      'backoffs': [15],
    }
    for d, before in ((1, 6.564118385314941), (2, 6.608942985534668), (8, 6.578945159912109))
  ),
]


def write_report(result: dict, out_dir: str = os.path.join(REPO, 'results')) -> list[str]:
  fmt = lambda x, spec='.6f': '—' if x is None else format(x, spec)
  lines = [
    "# The trainer on the library's rollback (`python -m research.library_rollback`)",
    '',
    "The default HDET on the verdict's text cells at their default lengths (the LM at 1500 steps, fine-tuning at "
    "300), started 10x above the sweep's best peak LR, 3 seeds, trained again with the trainer on "
    "`hdet(..., rollback=True)` from each committed record's config, against that record (trained with the "
    "trainer's own rollback on 2026-11-24). Validation bits per byte; "
    "the trainer has changed since the records in ways that move these runs' last bits, so a rerun is equal "
    "within noise if its difference is within 2 sqrt(2) standard deviations of the record's three seeds (the 95% "
    "band of the difference of two runs drawn alike; within one standard deviation, this study's first criterion: "
    f'{result["within_one_std"]} of {result["trained"]}). The fine-tuning reruns start from a pretrained '
    "checkpoint trained again (the records' was not kept): their mean difference is "
    f"{fmt(result['mean_difference']['finetune'], '+.4f')}, the LM's {fmt(result['mean_difference']['lm'], '+.4f')}.",
    '',
    f'{result["within_noise"]} of {result["trained"]} reruns end within noise of their record '
    f'({result["equal"]} bit for bit; the largest difference {fmt(result["max_abs_diff"], ".4f")}); the back-off '
    f'fired in {result["with_backoff"]} of the {len(result["runs"])} records.',
    '',
    "| run | the record (trainer's own rollback) | rerun (library's) | difference | seeds' std | within noise "
    '| syncs that backed off (record / rerun) |',
    '|---|---|---|---|---|---|---|',
  ]
  for r in result['runs']:
    noise = '—' if r['within_noise'] is None else ('yes' if r['within_noise'] else 'no')
    lib = '—' if r['backoffs_library'] is None else (r['backoffs_library'] or 'none')
    lines.append(
      f'| {r["run"]} | {fmt(r["trainer_rollback"])} | {fmt(r["library_rollback"])} | {fmt(r["difference"], "+.4f")} '
      f'| {fmt(r["seed_std"], ".4f")} | {noise} | {r["backoffs_trainer"] or "none"} / {lib} |'
    )
  lines += [
    '',
    "## The rollback's move alone, bit for bit",
    '',
    'The same short runs with the trainer just before the move (c71ebcc: its own rollback) and just after it '
    "(30dbbba: the library's), side by side on one machine; final validation loss, nats (every logged training "
    'loss was equal too). Measured once, by hand: `python train.py` with the arguments below in each checkout.',
    '',
    '| run | before | after | bit for bit | syncs that backed off |',
    '|---|---|---|---|---|',
  ]
  for r in result['side_by_side']:
    same = 'yes' if r['before'] == r['after'] else 'no'
    lines.append(f'| {r["run"]} | {r["before"]!r} | {r["after"]!r} | {same} | {r["backoffs"] or "none"} |')
  lines += ['', 'The arguments:', '']
  lines += [f'- {r["run"]}: `{r["command"]}`' for r in result['side_by_side']]
  return records.write_report(out_dir, 'library_rollback', result, lines)


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--quick', action='store_true', help='two cells on tiny models, into --work-root')
  p.add_argument('--report-only', action='store_true', help='read the records, train nothing')
  p.add_argument('--work-root', default=os.path.join(REPO, 'workdirs', 'library_rollback'))
  p.add_argument('--out', default=os.path.join(REPO, 'results'), help='where the report goes')
  return p.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  cells = run_cells(QUICK_CELLS if args.quick else CELLS, args.quick, args.work_root, not args.report_only)
  result = summarize(cells, args.quick)
  if not args.quick:
    for path in write_report(result, args.out):
      print(f'wrote {os.path.relpath(path, REPO)}')
  return result


if __name__ == '__main__':
  main()
