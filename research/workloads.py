"""Does one HDET run replace a learning-rate sweep on more than one workload? The auto-LR measurement of
``research/autolr.py``, over every task, at half, once and twice each task's default run length.

    python -m research.workloads                                   # everything (many hours on 2 cores)
    python -m research.workloads --workload mnist1d --steps 1000 --seeds 0   # one workload, length, seed
    python -m research.workloads --quick                           # a smoke run of every workload (~2 min)
    python -m research.workloads --report-only                     # redraw results/workloads.{md,json}

Per workload and run length: the 8-point plain data-parallel sweep (the grid of autolr.py), the default
HDET (``DEFAULT_VARIANT``, the main job's controller) from 10x below, at and 10x above the first
seed's best peak LR, and at the workload's default length the LR-free peers (AdamW-style). AdamW
everywhere; SGD with momentum on ``mnist1d`` too. Runs are ``autolr.py``'s, cached as JSON records:

- ``lm``: ``configs/default.py``; its records are autolr.py's own (``results/autolr/runs/``), reused.
- ``mnist1d``: ``configs/mnist1d.py``; records under ``results/workloads/runs/mnist1d/``.
- ``finetune``: ``configs/finetune.py`` from one LM checkpoint that every run starts from: plain data
  parallel AdamW at the LM sweep's best (0.03), 1500 steps, seed 0 (trained once, its workdir kept). The
  sweep fine-tunes that checkpoint exactly (``warm_init.nu = 0``: a user's plain fine-tuning); HDET adds
  its warm noisy init (eq. 10). Records under ``results/workloads/runs/finetune/``.
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
from research import records
from hdet_jax.trainer.plots import save_figure

REPO = autolr.REPO
# The main job's controller (configs/default.py): 15 syncs per run, each at most 100 steps, whose replicas stop
# spreading once the climb has ended (hdet.settle). Its runs are its own at every length.
DEFAULT_VARIANT = autolr.DEFAULT_VARIANT
# The default before hdet.settle (its records: fit_K15's below 1500 steps, autolr.py's T=100 variant from 1500 on).
PREVIOUS_DEFAULT = 'fit_K15_cap100'
# Variants whose records may hold another variant's runs (the same config at that length: see record_variant).
SAME_RUNS_FROM = (autolr.PREVIOUS_DEFAULT, 'fit_K15', 'fit_backoff', 'fit_K15_backoff')
# Variants that differ from a strict back-off variant (hdet.backoff, any rise) only in the back-off's threshold
# (hdet.backoff_stderrs) and the rollback: where the strict variant's run never saw its window training loss rise,
# its back-off never fired, so neither would theirs (a higher threshold fires on fewer rises, and the rollback acts
# only where the back-off fires): they train that run bit for bit, and its record stands for theirs
# (alias_quiet_run; research/tests/test_workloads.py reruns one).
QUIET_BACKOFF_FROM = {'fit_K15_cap100_rollback_se2': 'fit_K15_cap100_backoff'}
_BACKOFF_FIELDS = frozenset({'hdet.backoff_stderrs', 'hdet.rollback'})
_WINDOW_FIELDS = frozenset({'hdet.sync_every', 'hdet.num_syncs', 'hdet.longest_window'})
WORKLOADS = {  # config file, default run length, optimizers measured
  'lm': ('default.py', 1500, ('adamw',)),
  'mnist1d': ('mnist1d.py', 1000, ('adamw', 'sgd')),
  'finetune': ('finetune.py', 300, ('adamw',)),
}
LENGTHS = (0.5, 1.0, 2.0)  # run lengths as multiples of the workload's default
# The checkpoint every fine-tuning run starts from: plain AdamW at the LM sweep's best peak LR.
PRETRAIN = {**autolr.PLAIN, 'optim.name': 'adamw', 'optim.max_lr': 0.03, 'seed': 0, 'num_train_steps': 1500}
QUICK = {  # per workload, on top of its config (autolr.QUICK for the LM and the fine-tuning)
  'mnist1d': {
    'num_train_steps': 16,
    'data.num_samples': 400,
    'data.batch_size': 4,
    'model.channels': 4,
    'hdet.sync_every': 8,
    'log_every': 8,
    'eval_every': 0,
    'checkpoint_every': 0,
    'compilation_cache': '',
  },
}


def lengths(workload: str, quick: bool) -> list[int]:
  default = WORKLOADS[workload][1]
  return [16] if quick else [int(round(f * default)) for f in LENGTHS]


def base_config(workload: str, steps: int, quick: bool, init_from: str | None = None):
  """The workload's config with autolr's run settings, at ``steps`` (quick: a tiny model)."""
  from hdet_jax.trainer import config_lib

  c = records.load_config(os.path.join(REPO, 'configs', WORKLOADS[workload][0]))
  config_lib.with_overrides(c, autolr.RUN)
  if quick:
    config_lib.with_overrides(c, QUICK.get(workload, autolr.QUICK))
  c.num_train_steps = int(steps)
  if workload == 'finetune':
    c.init_from = init_from
  return c


def task_overrides(workload: str, steps: int) -> dict:
  """What sets a workload's runs apart from the LM's default task (the cache folder's key)."""
  o = {} if steps == WORKLOADS['lm'][1] and workload == 'lm' else {'num_train_steps': int(steps)}
  # Fields the runs' recorded configs hold (a cached record is reused only where they match): the fine-tuning
  # task is the LM task on another corpus.
  return {'lm': {}, 'mnist1d': {'task': 'mnist1d'}, 'finetune': {'data.corpus': 'wyc'}}[workload] | o


def records_dir(workload: str, steps: int, quick: bool, work_root: str) -> str:
  """The LM's records are autolr.py's; the others' under results/workloads/runs/<workload>/."""
  tag = autolr.task_tag(task_overrides(workload, steps), quick)
  if quick:
    return os.path.join(work_root, workload, 'records')
  if workload == 'lm':
    return os.path.join(REPO, 'results', 'autolr', 'runs', tag)
  return os.path.join(REPO, 'results', 'workloads', 'runs', workload, f'steps{steps}')


def pretrained(work_root: str, quick: bool) -> str:
  """The fine-tuning checkpoint's workdir, trained once (plain AdamW on the KJV) and kept."""
  from hdet_jax.trainer import config_lib

  cache = records.RunCache(
    os.path.join(work_root, 'finetune', 'pretrain_records'),
    os.path.join(work_root, 'finetune'),
    autolr.make_record,
    autolr.describe,
  )
  steps = 40 if quick else PRETRAIN['num_train_steps']
  c = config_lib.with_overrides(base_config('lm', steps, quick), {**PRETRAIN, 'num_train_steps': steps})
  workdir = cache.workdir('pretrain')
  if not os.path.isdir(os.path.join(workdir, 'checkpoints')):  # a record without its checkpoint: train again
    for p in (cache.path('pretrain'),):
      if os.path.exists(p):
        os.remove(p)
  cache.run('pretrain', c, keep_workdir=True)
  return workdir


def plain_runner(
  cache: records.RunCache, workload: str, steps: int, optim: str, quick: bool, work_root: str, train: bool
):
  """``(name, lr, seed, extra) -> record``: the sweep's plain run at peak LR ``lr`` with the ``extra`` fields, read
  from ``cache`` and trained there unless cached (and ``train``; None where another process trains it). For the
  studies that train more of the sweep's runs than the sweep keeps."""
  from hdet_jax.trainer import config_lib

  init_from = pretrained(work_root, quick) if workload == 'finetune' and train else None
  plain_extra = {'warm_init.nu': 0.0} if workload == 'finetune' else {}  # (the sweep's plain fine-tuning)

  def run(name, lr, seed, extra):
    if not train:
      return cache.get(name)
    o = {**autolr.run_overrides('grid', optim, lr, seed, steps), **plain_extra, **extra}
    if quick:
      o.pop('hdet.sync_every', None)
    return cache.run(name, config_lib.with_overrides(base_config(workload, steps, quick, init_from), o), skip_busy=True)

  return run


def record_variant(variant: str, workload: str, steps: int) -> str:
  """The variant whose records hold ``variant``'s runs of ``workload`` at ``steps``: itself, or the first of
  SAME_RUNS_FROM (before it, if it is one) that trains the same config there (the same fields but the two that set the
  windows, and the same windows). The default's 15 syncs of at most 100 steps are fit_K15's windows below 1500 steps and
  autolr.py's T=100 from 1500 on: those records are its runs, bit for bit (research/tests/test_workloads.py checks
  one)."""
  from hdet_jax.trainer import config_lib, run_settings, schema

  def trained(v, optim):
    c = config_lib.with_overrides(
      base_config(workload, steps, False), autolr.run_overrides('hdet', optim, 0.01, 0, steps, variant=v)
    )
    flat = config_lib.flatten(c)
    return {k: x for k, x in flat.items() if k not in _WINDOW_FIELDS}, run_settings.sync_windows(schema.complete(flat))

  # A variant of SAME_RUNS_FROM may read only those before it (the first to have trained a run keeps it).
  earlier = SAME_RUNS_FROM[: SAME_RUNS_FROM.index(variant)] if variant in SAME_RUNS_FROM else SAME_RUNS_FROM
  for other in earlier:
    if all(trained(variant, o) == trained(other, o) for o in WORKLOADS[workload][2]):
      return other
  return variant


def never_rose(rec: dict) -> bool:
  """Whether a run with the back-off on saw its window training loss (the controller records' ``train_loss``)
  never rise from one sync to the next, every window finite."""
  losses = [c.get('train_loss') for c in rec.get('controller', [])]
  return (
    bool(losses)
    and all(x is not None and math.isfinite(x) for x in losses)
    and all(b <= a for a, b in zip(losses, losses[1:]))
  )


def with_quiet_defaults(recorded: dict, fields) -> dict:
  """A recorded (flattened) config with each of ``fields`` it lacks, added since it was written, at its
  ``compat.QUIET_DEFAULTS`` value: what the record's run trained with. Only ``fields``: QUIET_DEFAULTS also names
  other tasks' fields (mnist1d's model.kind), which a record of this task never had."""
  from hdet_jax.trainer import compat

  return {**{k: compat.QUIET_DEFAULTS[k] for k in fields if k in compat.QUIET_DEFAULTS}, **recorded}


def alias_quiet_run(cache: records.RunCache, name: str, config, sibling: str) -> bool:
  """Writes run ``name``'s record (``config``) from the strict back-off run ``sibling``'s, where that run's loss
  never rose and the two configs differ only in the back-off's threshold and rollback (see QUIET_BACKOFF_FROM).
  The record keeps ``same_run_as``: the run it was read from. Returns whether it wrote one."""
  from hdet_jax.trainer import config_lib, run_settings, schema

  rec = cache.get(sibling)
  if rec is None or os.path.exists(cache.path(name)) or not never_rose(rec):
    return False
  new = json.loads(config.to_json())
  ours = config_lib.flatten(new)
  # (a record written before 1.0 holds the fields removed then: at their old defaults it trains what ours does)
  theirs = with_quiet_defaults(records.without_removed(config_lib.flatten(rec['config'])), ours)
  # (run fields steer logging only, and a bracket's fields are not read by one run: a record made before one
  # existed, or changed, still trains the same)
  differ = {k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k) and schema.defines_a_run(k)}
  windows = differ & _WINDOW_FIELDS  # the same windows written another way (see record_variant)
  windows_of = lambda flat: run_settings.sync_windows(schema.complete(flat))  # (theirs need not validate)
  if windows and windows_of(ours) == windows_of({**ours, **{k: theirs[k] for k in windows}}):
    differ -= windows
  if not differ <= _BACKOFF_FIELDS or not theirs.get('hdet.backoff') or theirs.get('hdet.backoff_stderrs', 0.0) != 0.0:
    raise ValueError(f'{name} is not {sibling} but for the back-off threshold and rollback: {sorted(differ)}')
  out = {
    **rec,
    'name': name,
    'config': {**rec['config'], 'hdet': {**rec['config']['hdet'], **new['hdet']}},
    'same_run_as': rec['name'],
  }
  cache.write(name, out)
  return True


def make_record(name: str, config, summary: dict, workdir: str, wall_s: float) -> dict:
  """autolr.py's record, with an ``init_from`` inside the repository written relative to it (records are
  committed: no machine's paths in them)."""
  rec = autolr.make_record(name, config, summary, workdir, wall_s)
  src = rec['config'].get('init_from')
  if src and os.path.abspath(src).startswith(REPO + os.sep):
    rec['config']['init_from'] = os.path.relpath(os.path.abspath(src), REPO)
  return rec


def run_workload(workload: str, steps: int, args, work_root: str) -> dict:
  """Every requested stage of one workload at one run length; returns its records by optimizer."""
  from hdet_jax.trainer import config_lib

  init_from = pretrained(work_root, args.quick) if workload == 'finetune' and args.stages else None
  cache = records.RunCache(
    records_dir(workload, steps, args.quick, work_root),
    os.path.join(work_root, workload, f'steps{steps}'),
    make_record,
    autolr.describe,
  )
  grids = autolr.QUICK_GRIDS if args.quick else autolr.GRIDS
  variant, default_steps = record_variant(args.variant, workload, steps), WORKLOADS[workload][1]
  plain_extra = {'warm_init.nu': 0.0} if workload == 'finetune' else {}
  task = task_overrides(workload, steps)

  def go(name, overrides):
    config = config_lib.with_overrides(base_config(workload, steps, args.quick, init_from), overrides)
    return cache.run(name, config, {**task, **overrides}, skip_busy=True)

  out = {}
  for optim in WORKLOADS[workload][2]:  # every optimizer the workload measures is reported; --optim selects training
    lrs = grids[optim]
    trains = optim in args.optim
    if 'grid' in args.stages and trains:
      # The full grid only decides the anchor (HDET's starts, fixed once found): it trains for the first seed
      # listed while there is none; every other seed, and every seed once it is fixed, trains around it.
      anchored = autolr.read_anchor(cache, optim) is not None
      for seed in args.seeds:
        full = args.full_grid or (not anchored and seed == args.seeds[0])
        for lr in lrs if full else neighbourhood(cache, optim, lrs, args.seeds[0]):
          go(autolr.grid_name(optim, lr, seed), {**autolr.run_overrides('grid', optim, lr, seed, steps), **plain_extra})
    best = autolr.anchor(cache, optim, lrs, args.seeds[0]) if trains else None  # None: nothing of it trains
    if 'hdet' in args.stages and best is not None:
      for seed in args.seeds:
        for start in args.starts:
          o = autolr.run_overrides('hdet', optim, best * autolr.STARTS[start], seed, steps, variant=variant)
          if args.quick:
            o.pop('hdet.sync_every', None)
          name = autolr.hdet_name(optim, variant, start, seed)
          if variant in QUIET_BACKOFF_FROM and not args.quick:
            sibling = autolr.hdet_name(optim, record_variant(QUIET_BACKOFF_FROM[variant], workload, steps), start, seed)
            alias_quiet_run(
              cache, name, config_lib.with_overrides(base_config(workload, steps, False, init_from), o), sibling
            )
          go(name, o)
    if 'peers' in args.stages and optim == 'adamw' and best is not None and (steps == default_steps or args.quick):
      for seed in args.seeds:
        for peer in args.peers:
          go(
            autolr.peer_name(peer, seed),
            {**autolr.run_overrides('peer', optim, best, seed, steps, peer=peer), **plain_extra},
          )
    collected = autolr.collect(
      cache, optim, lrs, (variant,), autolr.PEERS, autolr.SEEDS if not args.quick else args.seeds
    )
    if trains or collected['grid']:
      out[optim] = collected
  return out


def neighbourhood(cache: records.RunCache, optim: str, lrs, seed: int) -> list[float]:
  """The first seed's best peak LR and its two neighbours on the grid (where the sweep's best can move with
  more seeds; the grid's far ends are decided on one seed), or nothing before that seed's grid is complete."""
  best = autolr.anchor(cache, optim, lrs, seed)
  if best is None:
    return []
  i = min(range(len(lrs)), key=lambda k: abs(math.log(lrs[k] / best)))
  return list(lrs[max(0, i - 1) : i + 2])


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------


def _value(recs: list[dict]) -> dict:
  """Mean, sd and n of the primary metric over seeds (autolr_report's statistics; None where a run diverged)."""
  st = autolr_report._stats(recs)  # pylint: disable=protected-access
  return {
    'value': st['val_bpb'],
    'sd': st['sd'],
    'n': st['n'],
    **({'diverged': st['diverged']} if st.get('diverged') else {}),
  }


def summarize(runs: dict, metric: str) -> dict:
  """One optimizer's block of results/workloads.json."""
  grid = {lr: rs for lr, rs in runs['grid'].items() if rs}
  if not grid:
    return {'metric': metric, 'grid_best': None, 'hdet': {}, 'peers': {}}
  stats = {lr: _value(rs) for lr, rs in grid.items()}
  lr = min((k for k in stats if stats[k]['value'] is not None), key=lambda k: stats[k]['value'])
  hdet = next(iter(runs['hdet'].values()), {})
  out = {
    'metric': metric,
    'grid_best': {'lr': lr, 'value': stats[lr]['value'], 'sd': stats[lr]['sd'], 'n': stats[lr]['n']},
    'grid': {f'{k:.4g}': v for k, v in sorted(stats.items())},
    'hdet': {
      start: {**_value(rs), 'peak_lr': autolr_report._mean_of(rs, autolr_report._peak_lr)}
      for start, rs in hdet.items()
      if rs
    },
    'peers': {p: _value(rs) for p, rs in runs['peers'].items() if rs},
  }
  accuracy = [r['val_accuracy'] for r in grid[lr] if r.get('val_accuracy') is not None]
  if accuracy:
    out['grid_best']['accuracy'] = float(np.mean(accuracy))
    out['hdet_accuracy'] = {
      s: float(np.mean([r['val_accuracy'] for r in rs]))
      for s, rs in hdet.items()
      if rs and all(r.get('val_accuracy') is not None for r in rs)
    }
  return out


def _pct(v, best) -> str:
  if v is None:
    return 'diverged'
  return f'{v:.4g} ({100 * (v / best - 1):+.1f}%)'


def lr_figure(fig_dir: str, workload: str, steps: int, optim: str, runs: dict) -> str | None:
  """Each HDET run's base LR (the followed LR) against the sweep's best schedule, one colour per start."""
  grid = {lr: rs for lr, rs in runs['grid'].items() if rs}
  hdet = next(iter(runs['hdet'].values()), {})
  if not grid or not any(hdet.values()):
    return None
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  best = min(grid, key=lambda k: autolr_report.mean_bpb(grid[k]))
  schedule = autolr_report._best_schedule(grid, {'lr': best})  # pylint: disable=protected-access
  fig, ax = plt.subplots(figsize=(6.4, 3.6))
  ax.plot(np.arange(len(schedule)), schedule, 'k--', lw=1.6, label=f'sweep best ({best:.3g}) schedule')
  for (start, recs), color in zip(sorted(hdet.items()), ('tab:blue', 'tab:green', 'tab:red')):
    for i, r in enumerate(recs):
      x, y = autolr_report.lr_path(r)
      ax.plot(x, y, color=color, lw=1.0, alpha=0.8, label=f'HDET from {start}' if i == 0 else None)
  ax.set_yscale('log')
  ax.set_xlabel('step')
  ax.set_ylabel('base learning rate')
  ax.set_title(f"{workload}, {steps} steps, {optim}: the base LR against the sweep's best", fontsize=9)
  ax.legend(fontsize=7)
  os.makedirs(fig_dir, exist_ok=True)
  return save_figure(fig, fig_dir, f'workloads_lr_{workload}_{steps}_{optim}.png')


def write_report(
  out_dir: str, results: dict, quick: bool, all_runs: dict | None = None, variant: str = DEFAULT_VARIANT
) -> list[str]:
  """results/workloads.json and .md: one table per workload, a row per run length and optimizer, and the
  LR trajectories of each workload's default run length against the sweep's best schedule."""
  os.makedirs(out_dir, exist_ok=True)
  jpath, mpath = os.path.join(out_dir, 'workloads.json'), os.path.join(out_dir, 'workloads.md')
  with open(jpath, 'w', encoding='utf-8') as f:
    json.dump(results, f, indent=1, sort_keys=True)
  lines = [
    '# Does one HDET run replace a learning-rate sweep? Every workload, three run lengths',
    '',
    f'Generated by `python -m research.workloads{" --quick" if quick else ""}` from cached records; '
    "the reading is in `research/workloads_discussion.md`. Values are each workload's primary metric "
    '(lower is better: LM and fine-tuning validation bits/byte, mnist1d test cross-entropy in nats), '
    'the mean over n seeds; HDET is '
    + (
      f"the default controller (`{variant}`, the main job's)"
      if variant == DEFAULT_VARIANT
      else f'the variant `{variant}` (a screen)'
    )
    + ", started 10x below, at and 10x above the first seed's sweep best; the percentage is against "
    'the sweep\'s best mean. "peak" is the geometric mean over seeds of the highest base LR the run reached.',
    '',
  ]
  for workload, by_steps in results.items():
    lines += [
      f'## {workload}',
      '',
      '| steps | optim | sweep best (n) | HDET 10x low (n) | HDET best LR | HDET 10x high | '
      'peak LR low / best / high |',
      '|---|---|---|---|---|---|---|',
    ]
    for steps, by_optim in sorted(by_steps.items(), key=lambda kv: int(kv[0])):
      for optim, r in by_optim.items():
        g = r['grid_best']
        if not g:
          continue
        cells = []
        for start in ('low', 'best', 'high'):
          h = r['hdet'].get(start)
          cells.append(
            'not run'
            if h is None
            else f'{h.get("diverged", h["n"])} of {h["n"]} diverged'
            if h['value'] is None
            else f'{_pct(h["value"], g["value"])} (n={h["n"]})'
          )
        peaks = ' / '.join(
          '-' if r['hdet'].get(s, {}).get('peak_lr') is None else f'{r["hdet"][s]["peak_lr"]:.3g}'
          for s in ('low', 'best', 'high')
        )
        acc = f', acc {g["accuracy"]:.3f}' if 'accuracy' in g else ''
        sd = f' ± {g["sd"]:.3g}' if g['sd'] is not None else ''
        lines.append(
          f'| {steps} | {optim} | {g["value"]:.4g}{sd} at {g["lr"]:.4g} (n={g["n"]}{acc}) | '
          + ' | '.join(cells)
          + f' | {peaks} |'
        )
    peer_rows = [
      (steps, optim, p, v)
      for steps, by_optim in by_steps.items()
      for optim, r in by_optim.items()
      for p, v in r['peers'].items()
    ]
    if peer_rows:
      lines += ['', 'LR-free peers (AdamW-style, default run length):', '']
      for steps, optim, p, v in peer_rows:
        best = by_steps[steps][optim]['grid_best']['value']
        lines.append(f'- {p}: {_pct(v["value"], best)}, n={v["n"]}')
    lines.append('')
    default = str(WORKLOADS[workload][1]) if not quick else '16'
    for optim in by_steps.get(default, {}):
      fig = lr_figure(
        os.path.join(out_dir, 'figures'),
        workload,
        int(default),
        optim,
        (all_runs or {}).get(workload, {}).get(default, {}).get(optim, {'grid': {}, 'hdet': {}}),
      )
      if fig:
        lines += [f'![{workload} {optim} LR](figures/{os.path.basename(fig)})', '']
  lines += conclusion(results)
  with open(mpath, 'w', encoding='utf-8') as f:
    f.write('\n'.join(lines))
  return [jpath, mpath]


def conclusion(results: dict) -> list[str]:
  """The plain count: which (workload, length, optimizer, start) cells end within 1% of the sweep's best, the
  worst misses, and whether each start is ahead of the best LR-free peer where peers ran."""
  cells, ahead = [], []
  for workload, by_steps in results.items():
    for steps, by_optim in by_steps.items():
      for optim, r in by_optim.items():
        g = r['grid_best']
        if not g:
          continue
        peers = [v['value'] for v in r['peers'].values() if v['value'] is not None]
        for start, h in r['hdet'].items():
          gap = None if h['value'] is None else 100 * (h['value'] / g['value'] - 1)
          cells.append((workload, int(steps), optim, start, gap, h['n']))
          if peers:
            ahead.append((workload, int(steps), start, h['value'] is not None and h['value'] < min(peers)))
  if not cells:
    return []
  within = [c for c in cells if c[4] is not None and c[4] <= 1.0]
  worst = sorted(cells, key=lambda c: -math.inf if c[4] is None else -c[4])[:5]
  fmt = lambda c: (
    f'{c[0]} {c[1]} steps {c[2]} from {c[3]}: ' + ('diverged' if c[4] is None else f'{c[4]:+.1f}%') + f' (n={c[5]})'
  )
  out = [
    '## Conclusion (computed from the table)',
    '',
    f"- The default controller ends within 1% of the sweep's best in {len(within)} of {len(cells)} cells "
    '(workload x run length x optimizer x start).',
    '- The largest misses: ' + '; '.join(fmt(c) for c in worst) + '.',
  ]
  if ahead:
    n_ahead = sum(a[3] for a in ahead)
    behind = [f'{a[0]} {a[1]} steps from {a[2]}' for a in ahead if not a[3]]
    out.append(
      f'- Ahead of every LR-free peer in {n_ahead} of {len(ahead)} cells with peers'
      + (f'; behind the best peer: {", ".join(behind)}.' if behind else '.')
    )
  return out + ['']


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def parse_cells(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """The comma-separated ``--workload``, ``--steps`` and ``--seeds`` of an experiment on the workloads' records as
  lists, in place (an unknown workload is a parser error naming the known ones)."""
  args.workload = [w for w in args.workload.split(',') if w]
  bad = [w for w in args.workload if w not in WORKLOADS]
  if bad:
    p.error(f'--workload: {bad} not among {list(WORKLOADS)}')
  args.steps = [int(s) for s in args.steps.split(',') if s]
  args.seeds = [int(s) for s in args.seeds.split(',') if s]


def parse_args(argv: list[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--quick', action='store_true', help='a smoke run of every workload on tiny models')
  p.add_argument('--workload', default=','.join(WORKLOADS), help=f'comma-separated: {", ".join(WORKLOADS)}')
  p.add_argument('--steps', default='', help='comma-separated run lengths (default: half, once and twice each default)')
  p.add_argument('--stage', default='all', choices=('all', 'grid', 'hdet', 'peers'))
  p.add_argument('--optim', default='adamw,sgd', help='comma-separated (each workload runs those it measures)')
  p.add_argument('--seeds', default=','.join(map(str, autolr.SEEDS)))
  p.add_argument('--peers', default=','.join(autolr.PEERS))
  p.add_argument('--starts', default=','.join(autolr.STARTS), help='comma-separated HDET starts: low, best, high')
  p.add_argument(
    '--full-grid',
    action='store_true',
    help="every grid point on every seed (default: the seeds after the first train the first seed's best "
    'and its two neighbours)',
  )
  p.add_argument(
    '--variant',
    default=DEFAULT_VARIANT,
    help="the HDET variant run and reported (autolr.VARIANT_SETTINGS; default: the main job's); another "
    "variant's report goes to results/workloads_screens/<variant>/",
  )
  p.add_argument('--report-only', action='store_true', help='read the records, train nothing')
  p.add_argument(
    '--out',
    default=None,
    help="the report's folder (default: results/, a screen's "
    'results/workloads_screens/<variant>/; --quick: the workdir)',
  )
  p.add_argument(
    '--workdir', default=None, help='where runs train (default workdirs/workloads; quick: workdirs/workloads_quick)'
  )
  args = p.parse_args(argv)
  if args.variant not in autolr.VARIANT_SETTINGS:
    p.error(f'--variant: {args.variant!r} not among {sorted(autolr.VARIANT_SETTINGS)}')
  args.workloads = [w for w in args.workload.split(',') if w]
  bad = [w for w in args.workloads if w not in WORKLOADS]
  if bad:
    p.error(f'--workload: {bad} not among {list(WORKLOADS)}')
  args.steps = [int(s) for s in args.steps.split(',') if s]
  given = ' '.join(argv)
  if args.quick:  # one run of each kind: the grid's two points, one HDET start, one peer; AdamW
    args.optim = args.optim if '--optim' in given else 'adamw'
    args.starts = args.starts if '--starts' in given else 'high'
  args.optim = [o for o in args.optim.split(',') if o]
  args.starts = [s for s in args.starts.split(',') if s]
  if set(args.starts) - set(autolr.STARTS):
    p.error(f'--starts: {sorted(set(args.starts) - set(autolr.STARTS))} not among {list(autolr.STARTS)}')
  args.seeds = [int(s) for s in args.seeds.split(',') if s][: 1 if args.quick else None]
  args.peers = [q for q in args.peers.split(',') if q][: 1 if args.quick else None]
  args.stages = () if args.report_only else ('grid', 'hdet', 'peers') if args.stage == 'all' else (args.stage,)
  return args


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  from hdet_jax.trainer import process

  work_root = args.workdir or os.path.join(REPO, 'workdirs', 'workloads_quick' if args.quick else 'workloads')
  process.setup_jax(base_config('lm', 16, args.quick))
  results, all_runs = {}, {}
  for workload in args.workloads:
    metric = 'val_loss' if workload == 'mnist1d' else 'val_bits_per_byte'
    for steps in args.steps or lengths(workload, args.quick):
      runs = run_workload(workload, steps, args, work_root)
      all_runs.setdefault(workload, {})[str(steps)] = runs
      results.setdefault(workload, {})[str(steps)] = {o: summarize(r, metric) for o, r in runs.items()}
  # The report covers every workload and run length with records (collected, nothing trained), whatever ran.
  collect_only = argparse.Namespace(**{**vars(args), 'stages': ()})
  for workload in args.workloads if args.quick else WORKLOADS:
    metric = 'val_loss' if workload == 'mnist1d' else 'val_bits_per_byte'
    for steps in lengths(workload, args.quick):
      if str(steps) not in all_runs.get(workload, {}):
        runs = run_workload(workload, steps, collect_only, work_root)
        all_runs.setdefault(workload, {})[str(steps)] = runs
        results.setdefault(workload, {})[str(steps)] = {o: summarize(r, metric) for o, r in runs.items()}
  out = work_root if args.quick else os.path.join(REPO, 'results')
  if args.variant != DEFAULT_VARIANT:
    out = os.path.join(out, 'workloads_screens', args.variant)
  out = args.out or out
  ordered = {w: dict(sorted(results[w].items(), key=lambda kv: int(kv[0]))) for w in WORKLOADS if w in results}
  print('\n'.join(f'  {p}' for p in write_report(out, ordered, args.quick, all_runs, args.variant)))


if __name__ == '__main__':
  main()
