"""The paper's Table 1 ablation on the KJV byte-level LM, with an LR sweep and mechanism runs.

    python -m hdet_jax.experiments.table1           # the full experiment (about an hour on 2 cores)
    python -m hdet_jax.experiments.table1 --quick   # a smoke run of every stage (about a minute)

Stages (every run's result is kept as JSON under ``--workdir``, so a rerun skips finished runs
and only redraws the report):

1. **LR sweep.** Plain data parallel (no spread, no averaging, no controller) over a log grid of
   peak LRs, several seeds each. ``baseline_high`` is the lowest grid LR above the best one that
   is *bad*: some seed crashed, or the mean validation bits/byte is more than ``DEGRADE_BPB``
   above the best LR's. ``baseline_low`` is ``baseline_high / 9`` (two grid points lower).
2. **Warm checkpoint.** One Baseline-Low run (its own seed) whose averaged final model is the
   warm rows' starting point (eq. 10 noise is added per replica and seed).
3. **The paper's rows** at ``baseline_high``'s peak LR: Warm-Init, HDET w/o auto-LR, HDET w/o warm
   init, HDET (full); Baseline-Low and Baseline-High are the sweep's runs at those LRs.
4. **Mechanism runs** at the same LR: averaging without spread, spread without averaging, spread
   and averaging without the controller (cold), and a control: Baseline-Low from the warm checkpoint.

The loop below is the trainer's (same optimizer, programs, init, warm init, batches and
evaluation; :mod:`hdet_jax.trainer.train_step`), without checkpoints, and it also records each
replica's distance from the replicas' mean just before every sync (every ``T`` steps for runs
that never average). The report goes to ``results/table1.md`` and ``results/figures/``
(``--quick``: into the workdir only).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time
from typing import Any

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ---- The experiment's settings (the full run). ----
STEPS = 500  # Optimizer steps of every run (warm rows: after the pre-training run).
WARMUP = 250  # The auto-LR controller starts at the first sync at or after this step (half, as default.py).
GRID = tuple(1e-3 * 3.0 ** k for k in range(7))  # Peak LRs of the plain-DP sweep: 1e-3 ... 0.729, ratio 3.
SEEDS = (0, 1, 2)  # Seeds of every row and sweep point.
PRETRAIN_SEED = 100  # Seed of the Baseline-Low run that makes the warm checkpoint.
DEGRADE_BPB = 0.05  # "Clearly degrades": mean val bits/byte this much above the sweep's best LR.
BLOWUP_NATS = 0.5  # A crash: non-finite loss, or a final loss this far above the run's best (25-step means).
LOG = 25  # Steps per logged mean (the trainer's log_every) and the distance cadence of non-syncing runs.

QUICK = dict(steps=40, warmup=20, grid=(3e-3, 3e-1), seeds=(0,), sync_every=10,
             model=dict(d_model=32, num_layers=1, num_heads=2, mlp_ratio=2), seq_len=32, batch_size=4,
             eval_windows=64)

ROWS = ('baseline_low', 'baseline_high', 'warm_init', 'hdet_no_auto_lr', 'hdet_cold', 'hdet_full')
PAPER = {  # Table 1 of arXiv 2604.24708: (description, avg LR, train loss, crashed)
    'baseline_low': ('Standard DDP, alpha=0', '0.0001', 3.294, False),
    'baseline_high': ('Standard DDP, alpha=0', '0.0009', 4.169, True),
    'warm_init': ('Perturbed init, alpha=0', '0.0009', 4.674, True),
    'hdet_no_auto_lr': ('LR spread + warm init, no auto-LR', '0.0009', 3.280, False),
    'hdet_cold': ('LR spread + auto-LR, cold start', '0.0009', 3.281, False),
    'hdet_full': ('LR spread + warm init + auto-LR', '0.0009', 3.277, False),
}
TITLES = {
    'baseline_low': 'Baseline-Low', 'baseline_high': 'Baseline-High', 'warm_init': 'Warm-Init',
    'hdet_no_auto_lr': 'HDET w/o auto-LR', 'hdet_cold': 'HDET w/o warm init', 'hdet_full': 'HDET (full)',
    'avg_no_spread': 'Averaging, no spread', 'spread_no_avg': 'Spread, no averaging',
    'hdet_cold_no_auto_lr': 'Spread + averaging (cold, no auto-LR)',
    'baseline_low_warm': 'Baseline-Low from the warm checkpoint',
}
MECHANISM = ('avg_no_spread', 'spread_no_avg', 'hdet_cold_no_auto_lr', 'baseline_low_warm')


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------

def load_row_config(name: str):
  from hdet_jax.trainer import config_lib
  return config_lib.load_config_file(os.path.join(REPO, 'configs', name + '.py'))


def experiment_config(base: str, settings: dict, *, lr: float, seed: int, **changes):
  """``configs/<base>.py`` with the experiment's steps, peak LR and seed (and ``changes``)."""
  c = load_row_config(base)
  c.num_train_steps = settings['steps']
  c.hdet.warmup_steps = settings['warmup']
  c.optim.max_lr = float(lr)
  c.seed = int(seed)
  c.init_from = None  # the loop below does the warm start itself
  c.progress_bar = False
  c.plots = False
  c.eval_windows = settings.get('eval_windows', c.eval_windows)
  if settings.get('model'):
    for k, v in settings['model'].items():
      c.model[k] = v
    c.data.seq_len = settings['seq_len']
    c.data.batch_size = settings['batch_size']
  if settings.get('sync_every') and c.hdet.sync_every > 0:
    c.hdet.sync_every = settings['sync_every']
  for path, v in changes.items():
    node = c
    *parents, leaf = path.split('.')
    for p in parents:
      node = node[p]
    node[leaf] = v
  return c


# ---------------------------------------------------------------------------------------------
# One run (the trainer's loop without checkpoints, plus the distance measurement)
# ---------------------------------------------------------------------------------------------

_DATA: dict = {}
_PROGRAMS: dict = {}


def _data(config, n):
  from hdet_jax.trainer import input_pipeline
  key = (config.data.path, config.data.val_fraction)
  if key not in _DATA:
    corpus = input_pipeline.load_corpus(config.data.path)
    _DATA[key] = input_pipeline.split(corpus, config.data.val_fraction)
  train_bytes, val_bytes = _DATA[key]
  batches = input_pipeline.TrainBatches(train_bytes, config.data.seq_len, config.data.batch_size, n, config.seed)
  val = input_pipeline.validation_windows(val_bytes, config.data.seq_len, n, config.eval_windows)
  return batches, val


def _program_key(config) -> str:
  d = json.loads(config.to_json())
  d.pop('seed'), d.pop('init_from')  # the seed only enters the initial state (dropout is off)
  return json.dumps(d, sort_keys=True)


def _programs(config, n, tx, mesh, graphdef, params, opt_state, batch0):
  """Both step programs, the distance and the eval, compiled once per config (up to the seed)."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  from hdet_jax import replicas
  from hdet_jax.trainer import train_step as ts
  key = _program_key(config)
  if key not in _PROGRAMS:
    steps = {s: ts.make_train_step(graphdef, tx, mesh, sync=s, config=config).lower(
        params, opt_state, batch0).compile() for s in (False, True)}

    def dist(p):  # each replica's L2 distance from the mean, and the mean's norm
      d = jax.tree.map(lambda x: x - lax.pmean(x, ts.AXIS), p)
      sq = lambda t: sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(t))
      return jnp.sqrt(sq(d)), jnp.sqrt(sq(jax.tree.map(lambda x: lax.pmean(x, ts.AXIS), p)))
    dist_fn = jax.jit(replicas.shard_map_replicas(dist, mesh, ts.AXIS))
    _PROGRAMS[key] = (steps, dist_fn, ts.make_eval_step(graphdef, mesh), ts.make_average(mesh))
  return _PROGRAMS[key]


def run_one(config, warm_tree: Any = None) -> dict:
  """Trains ``config`` from a random init (or from ``warm_tree`` + eq. 10 noise); returns the record."""
  import jax
  from hdet_jax.trainer import model as model_lib
  from hdet_jax.trainer import train_step as ts
  from hdet_jax.trainer import warm_init
  t0 = time.time()
  n = jax.device_count()
  batches, val = _data(config, n)
  tx = ts.make_optimizer(config, n)
  mesh = ts.make_mesh(n)
  rs, rep = ts.replica_sharding(mesh), ts.replicated(mesh)
  graphdef, _ = model_lib.abstract_model(config.model, config.data.seq_len)
  root = jax.random.key(config.seed)
  if warm_tree is None:
    params, opt_state = ts.make_init(config, tx, mesh, n)(jax.random.fold_in(root, 1))
  else:
    avg = jax.device_put(warm_tree, rep)
    params = jax.jit(lambda p, k: warm_init.warm_noisy_init(p, n, config.warm_init.nu, k), out_shardings=rs)(
        avg, jax.random.fold_in(root, 2))
    opt_state = ts.make_opt_init(tx, mesh)(params)
  batch0 = ts.put_stacked(batches.batch(0), mesh)
  steps, dist_fn, eval_fn, average = _programs(config, n, tx, mesh, graphdef, params, opt_state, batch0)
  setup_s = time.time() - t0

  S = config.num_train_steps
  T = ts.sync_every(config)
  syncing = T <= S
  names = list(ts.hyperparam_names(config))
  loss_mean, loss_min, loss_max, bases, vmin, vmax = [], [], [], [], [], []
  dists = []  # (step, [N] distances, norm of the mean)
  diverged_at = None
  pending = []

  def flush():
    nonlocal diverged_at
    got = ts.fetch([m for _, m in pending])
    for (step, _), m in zip(pending, got):
      loss = m['loss']
      loss_mean.append(float(np.mean(loss)))
      loss_min.append(float(np.min(loss)))
      loss_max.append(float(np.max(loss)))
      bases.append([float(x) for x in m['bases'][0]])
      vals = np.asarray(m['values'][0])  # [G, N]
      vmin.append([float(x) for x in vals.min(1)])
      vmax.append([float(x) for x in vals.max(1)])
      if 'pre_sync_dist' in m:
        dists.append((step, [float(x) for x in m['pre_sync_dist']], float(m['mean_norm'][0])))
      if diverged_at is None and not np.isfinite(loss).any():
        diverged_at = step
    pending.clear()

  t_train = time.time()
  step = 0
  while step < S:
    sync = ts.is_sync_step(config, step)
    batch = batch0 if step == 0 else ts.put_stacked(batches.batch(step), mesh)
    params, opt_state, m = steps[sync](params, opt_state, batch)
    pending.append((step, m))
    if sync or (not syncing and (step + 1) % LOG == 0):
      d, norm = ts.fetch(dist_fn(params))  # after the sync: the norm of the (averaged) mean
      if sync:
        m['mean_norm'] = norm
      else:
        dists.append((step, [float(x) for x in d], float(norm[0])))
    step += 1
    if step % LOG == 0 or step == S:
      flush()
      if diverged_at is not None:
        break
  train_s = time.time() - t_train
  val_loss = float(np.mean(ts.fetch(eval_fn(params, ts.put_stacked(val, mesh)))))
  record = {
      'config': json.loads(config.to_json()), 'hyperparam_names': names, 'steps_run': step,
      'diverged_at': diverged_at, 'loss_mean': loss_mean, 'loss_min': loss_min, 'loss_max': loss_max,
      'bases': bases, 'values_min': vmin, 'values_max': vmax, 'dists': dists,
      'val_loss': val_loss, 'val_bpb': model_lib.bits_per_byte(val_loss) if math.isfinite(val_loss) else None,
      'setup_s': setup_s, 'train_s': train_s, 'wall_s': time.time() - t0,
  }
  record.update(summarize(record))
  record['_avg_params'] = average(params)
  return record


def summarize(r: dict) -> dict:
  """Final train loss (mean of the last LOG steps), crash flags and the loss's largest rise."""
  loss = np.asarray(r['loss_mean'], dtype=np.float64)
  k = len(loss) // LOG
  windows = loss[:k * LOG].reshape(k, LOG).mean(1) if k else loss[None].mean(1)
  final = float(np.mean(loss[-LOG:])) if len(loss) else math.nan
  finite = np.isfinite(windows)
  best = float(np.min(windows[finite])) if finite.any() else math.nan
  rise = 0.0
  if finite.any():
    running = np.minimum.accumulate(np.where(finite, windows, np.inf))
    rise = float(np.max(np.where(finite, windows - running, np.inf)))
  nonfinite = r['diverged_at'] is not None or not np.all(np.isfinite(loss))
  blowup = (not nonfinite) and final > best + BLOWUP_NATS
  return {'final_train_loss': final if math.isfinite(final) else None, 'best_window_loss': best,
          'max_rise': rise if math.isfinite(rise) else None, 'nonfinite': bool(nonfinite),
          'crashed': bool(nonfinite or blowup)}


# ---------------------------------------------------------------------------------------------
# The experiment
# ---------------------------------------------------------------------------------------------

def _lr_tag(lr: float) -> str:
  return f'{lr:.3g}'


class Runner:
  """Runs (or reloads) named runs; each finished run is ``WORKDIR/runs/<name>.json``."""

  def __init__(self, workdir: str, log=print):
    self.dir = os.path.join(workdir, 'runs')
    os.makedirs(self.dir, exist_ok=True)
    self.log = log
    self.records: dict[str, dict] = {}

  def path(self, name):
    return os.path.join(self.dir, name + '.json')

  def run(self, name: str, config, warm_tree=None, keep_params=False) -> dict:
    path = self.path(name)
    want = json.loads(config.to_json())
    if os.path.exists(path):
      with open(path, encoding='utf-8') as f:
        rec = json.load(f)
      if rec['config'] == want and (not keep_params or os.path.exists(path[:-5] + '.npz')):
        self.records[name] = rec
        return rec
    rec = run_one(config, warm_tree=warm_tree)
    avg = rec.pop('_avg_params')
    if keep_params:
      import jax
      from hdet_jax.trainer import train_step as ts
      flat, _ = jax.tree_util.tree_flatten_with_path(ts.fetch(avg))
      np.savez(path[:-5] + '.npz', **{jax.tree_util.keystr(k): v for k, v in flat})
    rec['name'] = name
    tmp = path + '.tmp'
    with open(tmp, 'w', encoding='utf-8') as f:
      json.dump(rec, f)
    os.replace(tmp, path)
    self.records[name] = rec
    status = 'CRASHED' if rec['crashed'] else 'ok'
    vb = rec['val_bpb']
    self.log(f'  {name}: train {rec["final_train_loss"]} nats, val '
             f'{"nan" if vb is None else f"{vb:.4f}"} bits/byte, {status}, {rec["wall_s"]:.0f}s')
    return rec

  def load_params(self, name: str, like: Any) -> Any:
    import jax
    data = np.load(self.path(name)[:-5] + '.npz')
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(treedef, [data[jax.tree_util.keystr(k)] for k, _ in flat])


def choose_lrs(sweep: dict[float, list[dict]]) -> dict:
  """baseline_high: the lowest grid LR above the best whose seeds crashed or clearly degraded."""
  lrs = sorted(sweep)
  def mean_bpb(lr):
    v = [r['val_bpb'] for r in sweep[lr] if r['val_bpb'] is not None and not r['crashed']]
    return float(np.mean(v)) if len(v) == len(sweep[lr]) else math.inf
  bpb = {lr: mean_bpb(lr) for lr in lrs}
  best = min(lrs, key=lambda lr: bpb[lr])
  reasons = {}
  for lr in lrs:
    crashes = sum(r['crashed'] for r in sweep[lr])
    if crashes:
      reasons[lr] = f'{crashes}/{len(sweep[lr])} seeds crashed'
    elif bpb[lr] > bpb[best] + DEGRADE_BPB:
      reasons[lr] = f'mean val {bpb[lr]:.3f} bits/byte, {bpb[lr] - bpb[best]:+.3f} vs the best LR'
  bad = [lr for lr in lrs if lr > best and lr in reasons]
  found = bool(bad)
  high = bad[0] if found else lrs[-1]
  return {'best': best, 'high': high, 'low': high / 9, 'found_edge': found, 'reasons': reasons,
          'mean_bpb': bpb}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--quick', action='store_true', help='a smoke run of every stage (about a minute)')
  parser.add_argument('--workdir', default=None, help='where runs are kept (default workdirs/table1[_quick])')
  parser.add_argument('--report-only', action='store_true', help='redraw the report from finished runs')
  args = parser.parse_args(argv)

  from hdet_jax.trainer import trainer
  settings = dict(steps=STEPS, warmup=WARMUP, grid=GRID, seeds=SEEDS)
  if args.quick:
    settings.update(QUICK)
  workdir = args.workdir or os.path.join(REPO, 'workdirs', 'table1_quick' if args.quick else 'table1')
  out_dir = workdir if args.quick else os.path.join(REPO, 'results')
  trainer.setup_jax(load_row_config('default'))
  t0 = time.time()
  runner = Runner(workdir)
  seeds = settings['seeds']
  cfg = lambda base, lr, seed, **kw: experiment_config(base, settings, lr=lr, seed=seed, **kw)
  go = (lambda name, c, **kw: runner.run(name, c, **kw)) if not args.report_only else (
      lambda name, c, **kw: runner.records.setdefault(name, json.load(open(runner.path(name), encoding='utf-8'))))

  print(f'1. LR sweep, plain data parallel: {len(settings["grid"])} peak LRs x {len(seeds)} seeds, '
        f'{settings["steps"]} steps.', flush=True)
  sweep = {}
  for lr in settings['grid']:
    sweep[lr] = [go(f'sweep_lr{_lr_tag(lr)}_s{s}', cfg('baseline_high', lr, s)) for s in seeds]
  choice = choose_lrs(sweep)
  high, low = choice['high'], choice['low']
  print(f'   best LR {_lr_tag(choice["best"])}; baseline_high {_lr_tag(high)} '
        f'({choice["reasons"].get(high, "no LR in the grid was bad: the largest")}); baseline_low {_lr_tag(low)}.',
        flush=True)
  named = {}
  named['baseline_high'] = sweep[high]
  if any(math.isclose(low, g, rel_tol=1e-6) for g in sweep):
    named['baseline_low'] = sweep[min(sweep, key=lambda g: abs(g - low))]
  else:
    named['baseline_low'] = [go(f'baseline_low_lr{_lr_tag(low)}_s{s}', cfg('baseline_low', low, s)) for s in seeds]

  print('2. Warm checkpoint: Baseline-Low, seed', PRETRAIN_SEED, flush=True)
  go('pretrain', cfg('baseline_low', low, PRETRAIN_SEED), keep_params=True)
  warm = None
  if not args.report_only:
    import jax
    from hdet_jax.trainer import model as model_lib
    c0 = cfg('baseline_low', low, PRETRAIN_SEED)
    _, like = model_lib.abstract_model(c0.model, c0.data.seq_len)
    warm = runner.load_params('pretrain', jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), like))

  print(f'3. The paper\'s rows at peak LR {_lr_tag(high)}.', flush=True)
  for row in ('warm_init', 'hdet_no_auto_lr', 'hdet_cold', 'hdet_full'):
    is_warm = row != 'hdet_cold'
    named[row] = [go(f'{row}_s{s}', cfg(row, high, s), warm_tree=warm if is_warm else None) for s in seeds]

  print('4. Mechanism runs.', flush=True)
  mech = {
      'avg_no_spread': ('baseline_high', dict(**{'hdet.sync_every': 25}), False),
      'spread_no_avg': ('hdet_cold', {'hdet.spread': 0.25, 'hdet.sync_every': 0, 'hdet.auto_lr': False}, False),
      'hdet_cold_no_auto_lr': ('hdet_cold', {'hdet.auto_lr': False}, False),
      'baseline_low_warm': ('baseline_low', {}, True),
  }
  for name, (base, changes, is_warm) in mech.items():
    if args.quick and 'hdet.sync_every' in changes and changes['hdet.sync_every']:
      changes = dict(changes, **{'hdet.sync_every': settings['sync_every']})
    lr = low if name == 'baseline_low_warm' else high
    named[name] = [go(f'{name}_s{s}', cfg(base, lr, s, **changes), warm_tree=warm if is_warm else None)
                   for s in seeds]
  total = time.time() - t0
  print(f'Runs done in {total:.0f}s; writing the report.', flush=True)
  from hdet_jax.experiments import report
  paths = report.write(out_dir, settings, sweep, choice, named, runner.records, quick=args.quick)
  print('\n'.join(f'  {p}' for p in paths))


if __name__ == '__main__':
  main()
