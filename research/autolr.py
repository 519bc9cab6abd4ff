"""Does one HDET run replace a learning-rate sweep? Auto-LR against an LR grid and LR-free optimizers.

    python -m research.autolr                    # every stage, resuming from the cache (hours on 2 cores)
    python -m research.autolr --stage grid --optim adamw --seeds 0      # one stage, one seed
    python -m research.autolr --quick            # a smoke run of every stage, about a minute
    python -m research.autolr --report-only      # redraw results/autolr.{md,json} from cached runs
    python -m research.autolr --config.data.path=my_corpus.txt          # any trainer override

Every run is the trainer's own ``train_and_evaluate`` on ``configs/default.py`` (1500 steps, the
KJV byte-level LM, 8 replicas) plus the overrides of its stage:

1. **grid**: plain data parallel (no spread, no averaging, no controller) at 8 peak LRs, a
   factor 2 apart, bracketing the best; per optimizer (``adamw``, ``sgd``).
2. **hdet**: HDET with auto-LR started at the grid's best peak LR (``best``), 10x below it (``low``)
   and 10x above it (``high``), for every controller variant in ``--variants``. The starts are
   fixed by the first seed's grid (``anchor.json``), so adding grid seeds later never moves them.
3. **peers**: the LR-free and adaptive methods of ``optax.contrib`` at their documented defaults
   (AdamW only).

A finished run is one JSON record under ``results/autolr/runs/<task>/`` (its final validation
bits/byte, its base-LR trajectory and the controller's per-sync signal), committed with the
project, so a later session resumes where this one stopped. A run cut short resumes from its
workdir's checkpoint. ``--quick`` runs every stage on a tiny model for 40 steps into
``workdirs/autolr_quick`` (nothing under ``results/``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import sys

import numpy as np

from research import autolr_report
from research import records
from research.peers import baselines  # noqa: F401  (autolr's peers: records.trainer_arguments gives them)
from hdet_jax.trainer import run_settings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---- The experiment's settings. ----
GRIDS = {  # peak LRs of the plain data-parallel sweep, a factor 2 apart
  'adamw': tuple(0.03 * 2.0**k for k in range(-3, 5)),  # 3.75e-3 ... 0.48
  'sgd': tuple(0.25 * 2.0**k for k in range(-3, 5)),  # 0.031 ... 4 (momentum 0.9)
}
STARTS = {'low': 0.1, 'best': 1.0, 'high': 10.0}  # HDET's peak LR as a multiple of the anchor (grid best)
SEEDS = (0, 1, 2)
PEERS = ('prodigy', 'dog', 'dadapt_adamw', 'mechanize_adam', 'schedule_free_adamw', 'adam_plateau')
# Controller variants: the trainer's hdet.* settings of each. Warmup and stop are fractions of the run.
# Every variant pins the fields the main job's defaults have changed since it was measured (T, the
# first scale), so its records stay the runs they describe.
_PINNED = {'hdet.sync_every': 25, 'hdet.initial_scale': 1.0, 'hdet.after_stop': 'hold', 'hdet.step_growth': 1.0}
_FIT = {
  'hdet.controller': 'fit',
  'hdet.trust': 0.25,
  'hdet.memory': 0.5,
  'warmup': 0.0,
  'hdet.stop_fraction': 0.7,
  **_PINNED,
}
# The T=100 family, each adding one setting to the one before.
_T100 = {
  **_FIT,
  'hdet.score': 'common',
  'hdet.stop_fraction': 0.3,
  'hdet.param_groups': False,
  'hdet.sync_every': 100,
  'hdet.trust': 1.0,
}
_CAUTIOUS = {**_T100, 'hdet.initial_scale': 0.1}
_RISE = {**_CAUTIOUS, 'hdet.after_stop': 'rise'}
_ACCEL = {**_RISE, 'hdet.step_growth': 2.0, 'hdet.max_gain': 4.0}
# The default (configs/default.py): the above, rise-only from the first sync, with 15 windows per run of at most
# 100 steps; and with the rollback on a 2-standard-error rise of the window's training loss.
_K15_CAP100 = {
  **_ACCEL,
  'hdet.stop_fraction': 0.01,
  'hdet.sync_every': 0,
  'hdet.num_syncs': 15,
  'hdet.longest_window': 100,
}
# The guard off (configs/default.py leaves it at None: on for the 'fit' controller).
GUARD_OFF = {f'hdet.{k}': v for k, v in run_settings.GUARD_OFF._asdict().items()}
_ROLLBACK_SE2 = {'hdet.backoff': True, 'hdet.rollback': True, 'hdet.backoff_stderrs': 2.0}
# The default since the guard (configs/default.py's None fields, written out so its records stay its own).
_GUARDED = {**_K15_CAP100, **_ROLLBACK_SE2, 'hdet.backoff_fraction': 0.05, 'hdet.settle': True}
# The open-loop probe's base: the default's windows with nothing that moves the LR (a trust region of 1e-6, no
# cautious start, guard, settling, gain or memory across syncs), so the line search only records its fits.
_OPEN_LOOP = {
  **_K15_CAP100,
  **GUARD_OFF,
  'hdet.settle': False,
  'hdet.initial_scale': 1.0,
  'hdet.trust': 1e-6,
  'hdet.memory': 0.0,
  'hdet.step_growth': 1.0,
}
# ... with its first window stretched to 0.3 of the run (trust 5: the first sync's ask is not clipped short).
_FIRST30 = {**_OPEN_LOOP, 'hdet.trust': 5.0, 'syncs': 10 / 3}
# Retired in 1.0 with the knob each measured (hdet.overshoot != 1, hdet.early_sync_*, hdet.score_tail,
# hdet.score_anneal, hdet.fan='geometric'), their records kept under results/ as data (the reports read the variants
# below only; `git checkout 98c94c2` trains them): fit_window and fit_common (overshoot 1.5), fit_k1p5,
# fit_lr_T100_cautious_rise_accel_early25x100 / _early25x200, fit_lr_T100_cautious_riseonly_accel_tail50,
# fit_K15_cap100_rollback_se2_f5_settle_tail25 / _tail50 / _anneal20 / _anneal50 / _anneal20_T50 / _anneal20_T200,
# open_first30_wide and open_first30_wide_lowcomm.
VARIANT_SETTINGS = {
  'paper': {'hdet.controller': 'paper', 'hdet.score': 'window', 'warmup': 0.5, 'hdet.stop_fraction': 1.0, **_PINNED},
  'paper_common': {
    'hdet.controller': 'paper',
    'hdet.score': 'common',
    'warmup': 0.5,
    'hdet.stop_fraction': 1.0,
    **_PINNED,
  },
  'fit_common_k1': {**_FIT, 'hdet.score': 'common'},  # (no overshoot: fit_common's was 1.5, PAL's)
  # Learns the LR scale while the schedule warms up, then holds it through the decay; no overshoot.
  # (Designed after fit_common's first seed on AdamW: the line search over-raised the LR early in the
  # warmup and, after the peak, pulled it far below the grid's best: see results/autolr.md.)
  'fit_warmup': {**_FIT, 'hdet.score': 'common', 'hdet.stop_fraction': 0.3},
  # The same with one LR for all parameters, as the grid sweeps (the variants above adapt the default
  # config's three per-group LRs: a 7-parameter regression on 8 replicas per sync, whose weakest group,
  # biases and norms, random-walked upward).
  'fit_lr': {**_FIT, 'hdet.score': 'common', 'hdet.stop_fraction': 0.3, 'hdet.param_groups': False},
  # fit_lr with a 4x longer horizon (average and compare every 100 steps; the same largest change per
  # step): does the line search's preference for small LRs (short-horizon bias) shrink with the horizon?
  'fit_lr_T100': _T100,
  # fit_lr_T100 starting at a tenth of the user's LR (hdet.initial_scale): the line search cannot see a
  # too-high LR's damage coming in the warmup (the 10x-high runs are lost in their first ~200 steps)
  # but does raise a too-low one, so begin low and let it climb.
  'fit_lr_T100_cautious': _CAUTIOUS,
  # fit_lr_T100_cautious whose correction may still rise after the warmup (hdet.after_stop='rise'): from
  # far below, the line search still asks for more at the stop (+0.29 a sync from 100x low, AdamW), and
  # after the warmup a pull up goes against the short-horizon bias (which pulls down).
  'fit_lr_T100_cautious_rise': _RISE,
  # fit_lr_T100_cautious_rise whose steps grow while the fit keeps asking one way (hdet.step_growth, Rprop):
  # the asks' signs are reliable but their sizes compressed (starts 10x apart ask log-steps ~0.4 apart at
  # the same sync), so the 100x-low start climbed only 10x.
  'fit_lr_T100_cautious_rise_accel': _ACCEL,
  # Screens of the accelerated fit from 100x low, where a trust of 1 a sync capped its climb (steps 1.0,
  # 1.0 at the second and third syncs): twice the syncs in the warmup, or a larger trust region.
  'fit_lr_T50_cautious_rise_accel': {**_ACCEL, 'hdet.sync_every': 50},
  'fit_lr_T100_cautious_rise_accel_trust1p5': {**_ACCEL, 'hdet.trust': 1.5},
  # The accelerated fit with a milder cautious start (a third): 10x low is then a 30x-low start and 10x high
  # a 3x-high one, which the line search has to pull down before the damage shows.
  'fit_lr_T100_third_rise_accel': {**_ACCEL, 'hdet.initial_scale': 0.3},
  # The default: the accelerated fit taking only steps up from its first sync (the stop
  # before it, after_stop='rise'; the main job writes it hdet.stop_fraction=0, the same decisions). The
  # line search's asks for less fall far below the sweep's best from step ~200 on ("where the line search
  # turns"), and on a 3000-step run the previous default followed them to 0.02-0.25x the sweep's schedule
  # by the warmup's end; the too-high start is the cautious start's job.
  'fit_lr_T100_cautious_riseonly_accel': {**_ACCEL, 'hdet.stop_fraction': 0.01},
  # The defaults issue's screens (research/workloads.py --variant): the controller above with its windows
  # counted per run (T = steps / 15: T=100 at the LM's 1500 steps, the same runs as above), so a short run gets
  # as many syncs as a long one (a 300-step fine-tuning run had 2 useful syncs at T=100).
  'fit_K15': {**_ACCEL, 'hdet.stop_fraction': 0.01, 'syncs': 15},
  # ... with its windows at most 100 steps (configs/default.py: hdet.num_syncs = 15, hdet.longest_window = 100):
  # short runs train fit_K15's runs, runs of 1500 steps and more those of the T=100 variant above (the climb's
  # end point is set by the syncs of a run's first few hundred steps, where the asks still point up).
  'fit_K15_cap100': {**_K15_CAP100},
  # The default with the back-off (hdet.backoff): a window whose mean training loss rose steps the LR down by
  # trust whatever the fit asked; against the overshoots that rise-only never undoes (mnist1d SGD at chance).
  'fit_backoff': {**_ACCEL, 'hdet.stop_fraction': 0.01, 'hdet.backoff': True},
  'fit_K15_backoff': {**_ACCEL, 'hdet.stop_fraction': 0.01, 'hdet.backoff': True, 'syncs': 15},
  # ... and with the default's windows (15 syncs of at most 100 steps): fit_K15_backoff's runs below 1500 steps,
  # fit_backoff's from 1500 on.
  'fit_K15_cap100_backoff': {**_K15_CAP100, 'hdet.backoff': True},
  # ... and a sync that backs off also returns the replicas to the previous sync's state (hdet.rollback): the
  # window past the stability edge is undone, not only followed by a lower LR.
  'fit_K15_cap100_rollback': {**_K15_CAP100, 'hdet.backoff': True, 'hdet.rollback': True},
  # ... counting only a rise beyond 2 sqrt(2) standard errors of the window before's mean (hdet.backoff_stderrs,
  # its noise from the step-to-step changes): the plain rule fired on flat, noisy late windows (mnist1d: 0.241
  # after 0.241; fine-tuning: rises of 0.003-0.01 in 13 of 21 runs) and each firing costs a window and a
  # factor e of LR.
  'fit_K15_cap100_rollback_se2': {**_K15_CAP100, **_ROLLBACK_SE2},
  # The default whose spread ends with its climb (hdet.settle): after two confident asks down in a row once the
  # LR has risen (which rise-only does not take; in the default's LM and fine-tuning records no later sync but
  # one, at the last syncs of a 150-step run, raised the LR), the replicas train at the base LR, so the run
  # stops paying the ensemble's price (results/climb_and_price.md).
  'fit_K15_cap100_settle': {**_K15_CAP100, 'hdet.settle': True},
  # ... with the rollback and the 2-standard-error back-off (the two act on different runs: settling after the
  # climb, the rollback at a blow-up).
  'fit_K15_cap100_rollback_se2_settle': {**_K15_CAP100, **_ROLLBACK_SE2, 'hdet.settle': True},
  # ... counting only a rise beyond 5% of the window before's loss too (hdet.backoff_fraction): where the 2-se
  # back-off fired, mnist1d's loss had risen by 13% and more (a blow-up), the LM's with SGD by 0.9% (the bump
  # after a climb's step up, which cost that run 10%).
  'fit_K15_cap100_rollback_se2_f5_settle': _GUARDED,
  # The default's guard without its rollback (hdet.rollback=False: no anchor, so no extra copy of the state on
  # the devices): the back-off alone steps the LR down but keeps the window that blew up.
  'fit_K15_cap100_backoff_se2_f5_settle': {**_GUARDED, 'hdet.rollback': False},
  # The default with half its spread (0.125): the fan-out puts the top replica at 1 + spread times the base, and
  # on mnist1d with SGD the best LR (0.25) lies one factor of 2 below divergence, where the guard fired in 13 of
  # 27 runs (results/climb_and_price.md). Is that the spread's doing? (A screen, mnist1d only.)
  'fit_K15_cap100_rollback_se2_f5_settle_a0p125': {**_GUARDED, 'hdet.spread': 0.125},
  # The default with its windows halved (30 syncs per run of at most 50 steps): a climb takes about five syncs
  # whatever T is, and the line search's turn comes at a lower LR the later in the run it comes (the LM at 1500
  # steps from 10x low, the best and 10x high: turns at steps 599 / 499 / 299, at base LRs 0.014 / 0.017 / 0.027
  # against the sweep's 0.03). Halving T before (T=200 -> 100 at 3000 steps, 100 -> 50 at 750) helped from below.
  'fit_K30_cap50_rollback_se2_f5_settle': {**_GUARDED, 'hdet.num_syncs': 30, 'hdet.longest_window': 50},
  # ... and the default with a fixed window length T at the main job's 1500 steps (15 syncs there is T=100): where
  # does the climb end as T alone changes? (With hdet.sync_every > 0 the per-run count is not used.)
  **{f'fit_K15_cap100_rollback_se2_f5_settle_T{t}': {**_GUARDED, 'hdet.sync_every': t} for t in (25, 50, 200)},
  # ... and with the replicas on their own gradients (the low-communication mode, with the optimizer state averaged
  # at each sync, which the rollback needs): they then no longer lie on one line along the window's shared
  # update. Does T still set the climb's end point? (Exploratory: each replica's gradient is 8x noisier too.)
  **{
    f'fit_K15_cap100_rollback_se2_f5_settle_lowcomm_T{t}': {
      **_GUARDED,
      'hdet.low_communication': True,
      'hdet.average_opt_state': True,
      'hdet.sync_every': t,
    }
    for t in (50, 100, 200)
  },
  # An open-loop probe of the line search (the twelfth pass): the controller fits and records its slope at every
  # sync but moves nothing (a trust region of 1e-6, no cautious start, no guard, no settling, no memory across
  # syncs), so every T sees the same schedule. At the same step, do windows of 25 / 50 / 100 / 200 steps agree on
  # which way the LR should go (the time in the run sets the turn) or not (the window sets it)?
  **{f'open_T{t}': {**_OPEN_LOOP, 'hdet.sync_every': t} for t in (25, 50, 100, 200)},
  # ... and with the default's windows (15 per run, at most 100 steps), on every workload (research.workloads).
  'open_K15': _OPEN_LOOP,
  # ... and its first window stretched to the end of the warmup (three and a third windows per run): the replicas
  # part at step 0 and are first compared at 0.3 of the run, where the sweep's own plain runs, ranked, already put
  # the final best in front in most cells (results/climb_and_price.md, "the sweep's own leader"). The first sync's
  # ask (the fitted step, trust 5 so that it is not clipped short; later syncs are not read) says whether a
  # comparison over the whole history points at the sweep's best.
  'open_first30': _FIRST30,
  # The ensemble's price: HDET with no controller (spread and average only) at the sweep's best LR.
  **{
    f'ensemble_a{a:g}_T{t}'.replace('.', 'p'): {
      **_PINNED,
      'warmup': 0.0,
      'hdet.auto_lr': False,
      'hdet.spread': a,
      'hdet.sync_every': t,
    }
    for a in (0.125, 0.25, 0.5)
    for t in (25, 100, 400)
  },
  # ... and its controls: no spread (the replicas identical, the average a no-op: what is left is not the
  # ensemble's) and a twentieth of the default's, to see whether the price goes to 0 with the spread.
  **{
    f'ensemble_a{a:g}_T100'.replace('.', 'p'): {
      **_PINNED,
      'warmup': 0.0,
      'hdet.auto_lr': False,
      'hdet.spread': a,
      'hdet.sync_every': 100,
    }
    for a in (0.0, 0.0125)
  },
  'paper_lr': {
    'hdet.controller': 'paper',
    'hdet.score': 'window',
    'warmup': 0.5,
    'hdet.stop_fraction': 1.0,
    'hdet.param_groups': False,
    **_PINNED,
  },
}
# The retired variants (above), each after the variant it followed: the report still reads their records, as data, in
# the order they were measured; none trains (their knobs are gone: --variants refuses them).
_RETIRED_AFTER = {
  'paper_common': ('fit_window', 'fit_common'),
  'fit_lr_T100_third_rise_accel': (
    'fit_lr_T100_cautious_rise_accel_early25x100',
    'fit_lr_T100_cautious_rise_accel_early25x200',
  ),
  'fit_lr_T100_cautious_riseonly_accel': ('fit_lr_T100_cautious_riseonly_accel_tail50',),
  'fit_K15_cap100': ('fit_k1p5',),
  'fit_K15_cap100_backoff_se2_f5_settle': tuple(f'fit_K15_cap100_rollback_se2_f5_settle_tail{t}' for t in (25, 50)),
  'fit_K15_cap100_rollback_se2_f5_settle_T200': tuple(
    f'fit_K15_cap100_rollback_se2_f5_settle_anneal{a}' for a in ('20', '50', '20_T50', '20_T200')
  ),
  'open_first30': ('open_first30_wide', 'open_first30_wide_lowcomm'),
}
RETIRED_VARIANTS = tuple(v for after in _RETIRED_AFTER.values() for v in after)
REPORTED_VARIANTS = tuple(x for v in VARIANT_SETTINGS for x in (v, *_RETIRED_AFTER.get(v, ())))
VARIANTS = (
  'fit_lr',
  'paper',
  'fit_lr_T100',
  'fit_lr_T100_cautious',
  'fit_lr_T100_cautious_rise',
  'fit_lr_T100_cautious_rise_accel',
  'fit_lr_T100_cautious_riseonly_accel',
  'fit_K15_cap100_rollback_se2_f5_settle',
)  # run by default
# The variant reported as HDET's: the main job's controller (configs/default.py: hdet.settle and the back-off's
# guard, None, on where they apply) at its 1500 steps, where its 15 syncs per run are T=100.
# research/workloads.py reports it at every length.
DEFAULT_VARIANT = 'fit_K15_cap100_rollback_se2_f5_settle'
# The default before the guard (hdet.backoff and the rest left at None): the same runs wherever its back-off never
# fired (every LM and fine-tuning run; research/workloads_discussion.md).
UNGUARDED_DEFAULT = 'fit_K15_cap100_settle'
# The default before hdet.settle: the same controller with its spread to the end ('fit_K15_cap100' at every length).
PREVIOUS_DEFAULT = 'fit_lr_T100_cautious_riseonly_accel'
# The LR-free methods at their documented LR: the trainer's one-cycle shape peaking at it where the docs
# recommend a schedule (prodigy, dog, D-Adaptation, Mechanic), constant for schedule-free. reduce_on_plateau
# can only lower an LR, so adam_plateau starts from the 'high' start (10x the grid's best).
PEER_SETTINGS = {
  'prodigy': {'optim.max_lr': 1.0},
  'dog': {'optim.max_lr': 1.0},
  'dadapt_adamw': {'optim.max_lr': 1.0},
  'mechanize_adam': {'optim.max_lr': 1.0},
  'schedule_free_adamw': {'optim.max_lr': 0.0025, 'optim.schedule': 'constant'},
  'adam_plateau': {'optim.max_lr': 'high', 'optim.schedule': 'constant'},
}


PLAIN = {'hdet.spread': 0.0, 'hdet.sync_every': 0, 'hdet.num_syncs': 0, 'hdet.auto_lr': False}
RUN = {'progress_bar': False, 'plots': False, 'checkpoint_every': 500, 'max_checkpoints': 1}
QUICK = {
  'num_train_steps': 40,
  'data.seq_len': 32,
  'data.batch_size': 4,
  'model.d_model': 32,
  'model.num_layers': 1,
  'model.num_heads': 2,
  'hdet.sync_every': 8,
  'hdet.warmup_steps': 8,
  'log_every': 8,
  'eval_every': 0,
  'eval_windows': 64,
  'checkpoint_every': 0,
  'compilation_cache': '',
}
QUICK_GRIDS = {'adamw': (3e-3, 3e-2), 'sgd': (0.3, 3.0)}


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------


def base_config(task_overrides: dict, quick: bool):
  from hdet_jax.trainer import config_lib

  c = records.load_config(os.path.join(REPO, 'configs', 'default.py'))
  config_lib.with_overrides(c, RUN)
  if quick:
    config_lib.with_overrides(c, QUICK)
  return config_lib.with_overrides(c, task_overrides)


def run_overrides(
  kind: str, optim: str, lr: float, seed: int, steps: int, *, variant: str | None = None, peer: str | None = None
) -> dict:
  """The config fields one run sets on top of the task's config (``lr``: the peak LR, or for peers
  the grid's best, whose 10x is adam_plateau's start)."""
  o = {'seed': int(seed), 'optim.name': optim, 'optim.max_lr': float(lr)}
  if kind == 'grid':
    o.update(PLAIN)
  elif kind == 'hdet':
    settings = dict(VARIANT_SETTINGS[variant])
    o['hdet.warmup_steps'] = int(settings.pop('warmup') * steps)
    syncs = settings.pop('syncs', None)  # windows counted per run: T = steps / syncs
    # hdet.settle and the back-off's guard are pinned off but where a variant sets them: the variants before them
    # were measured without, which configs/default.py's None (on wherever it applies) would no longer train.
    o.update({'hdet.auto_lr': True, 'hdet.settle': False, **GUARD_OFF, **settings})
    if syncs:
      o['hdet.sync_every'] = max(1, int(round(steps / syncs)))
  elif kind == 'peer':
    o.update(PLAIN)
    o.update({'optim.name': peer, 'hdet.param_groups': False, 'optim.schedule': 'one_cycle'})
    o.update({k: (10.0 * lr if v == 'high' else v) for k, v in PEER_SETTINGS[peer].items()})
  return o


def task_tag(task_overrides: dict, quick: bool) -> str:
  """The cache folder of a task: 'default', or a short hash of the overrides that change it."""
  if quick:
    return 'quick'
  if not task_overrides:
    return 'default'
  text = json.dumps(task_overrides, sort_keys=True)
  return 'task-' + hashlib.sha256(text.encode()).hexdigest()[:10]


def _fmt(x) -> str:
  return 'n/a' if x is None else f'{x:.3g}'


def describe(rec: dict) -> str:
  """A finished run in one line."""
  vb, unit = rec['val_bpb'], {'val_loss': 'nats'}.get(rec.get('metric'), 'bits/byte')
  return (
    f'val {"nan" if vb is None else f"{vb:.4f}"} {unit}, final base LR {_fmt(rec["final_lr"])}, {rec["wall_s"]:.0f}s'
  )


def make_record(name: str, config, summary: dict, workdir: str, wall_s: float) -> dict:
  """What the report needs from a finished run: final figures, LR trajectory, controller signal."""
  from hdet_jax.trainer import metrics as metrics_lib

  m = metrics_lib.read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  train = m.get('train', [])
  every = max(1, int(config.log_every))
  finite_or_none = records.finite_or_none
  traj = [
    {
      'step': r['step'],
      'loss': finite_or_none(np.mean(r['loss'])),
      'bases': [finite_or_none(b) for b in np.ravel(r['bases'])],
    }
    for r in train
    if r['step'] % every == every - 1 or r['step'] == len(train) - 1
  ]
  values = {r['step']: r['values'] for r in train}  # a sync step's values are its window's
  controller = [
    {
      **{k: np.asarray(v).tolist() for k, v in r.items() if k not in ('kind', 'time')},
      'values': np.asarray(values.get(r['step'], [])).tolist(),
    }
    for r in m.get('controller', [])
  ]
  names = next((r['names'] for r in m.get('hyperparams', [])), [])
  final_lr = traj[-1]['bases'][0] if traj and traj[-1]['bases'] else None
  metric = summary.get('metric', 'val_bits_per_byte')
  return {
    'name': name,
    'config': json.loads(config.to_json()),
    'hyperparams': names,
    # The task's primary metric, lower is better (the name predates other tasks: for the LM it is the
    # validation bits/byte, for mnist1d the test cross-entropy; 'metric' names it).
    'val_bpb': finite_or_none(summary.get('final_metric', summary.get('final_val_bits_per_byte'))),
    'metric': metric,
    **({'val_accuracy': finite_or_none(summary['final_val_accuracy'])} if 'final_val_accuracy' in summary else {}),
    'train_loss': finite_or_none(summary['final_train_loss']),
    'diverged_at': summary['diverged_at'],
    'final_lr': finite_or_none(final_lr),
    'evals': [{'step': r['step'], 'val_bpb': finite_or_none(r.get(metric))} for r in m.get('eval', [])],
    'trajectory': traj,
    'controller': controller,
    'wall_s': wall_s,
    # At each sync, just before the average: the replicas' RMS distance from their mean, relative to the
    # mean's norm (how far apart the ensemble had drifted).
    'distance': [
      {
        'step': r['step'],
        'relative': finite_or_none(
          float(np.sqrt(np.mean(np.square(r['distance']))) / max(float(r['mean_norm']), 1e-30))
        ),
      }
      for r in m.get('distance', [])
    ],
  }


# ---------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------


def grid_name(optim, lr, seed):
  return f'{optim}/grid_lr{records.lr_tag(lr, 4)}_s{seed}'


def hdet_name(optim, variant, start, seed):
  return f'{optim}/hdet_{variant}_{start}_s{seed}'


def peer_name(peer, seed):
  return f'adamw/peer_{peer}_s{seed}'


def anchor_path(cache: records.RunCache, optim: str) -> str:
  return os.path.join(cache.dir, optim, 'anchor.json')


def read_anchor(cache: records.RunCache, optim: str) -> float | None:
  """The anchor fixed by :func:`anchor`, or None before the first seed's grid is complete."""
  path = anchor_path(cache, optim)
  if not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as f:
    return float(json.load(f)['lr'])


def anchor(cache: records.RunCache, optim: str, grid_lrs, seed: int) -> float | None:
  """The grid's best peak LR on its first seed, fixed once found (HDET's starts are multiples of it)."""
  path = anchor_path(cache, optim)
  if os.path.exists(path):
    return read_anchor(cache, optim)
  recs = {lr: [cache.get(grid_name(optim, lr, seed))] for lr in grid_lrs}
  if any(r[0] is None for r in recs.values()):
    return None
  lr, bpb = autolr_report.grid_best(recs)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    json.dump({'lr': lr, 'val_bpb': bpb, 'seed': seed}, f)
  return lr


def collect(cache: records.RunCache, optim: str, grid_lrs, variants, peers, seeds) -> dict:
  """The cached records of one optimizer by stage: grid by LR, HDET by variant and start, peers by name."""
  grid = {lr: [r for s in seeds if (r := cache.get(grid_name(optim, lr, s)))] for lr in grid_lrs}
  grid = {lr: rs for lr, rs in grid.items() if rs}
  out = {'grid': grid, 'hdet': {}, 'peers': {}}
  for v in variants:
    out['hdet'][v] = {st: [r for s in seeds if (r := cache.get(hdet_name(optim, v, st, s)))] for st in STARTS}
  if optim == 'adamw':
    out['peers'] = {p: [r for s in seeds if (r := cache.get(peer_name(p, s)))] for p in peers}
  return out


def parse_overrides(argv: list[str]) -> tuple[list[str], dict]:
  """Splits ``--config.a.b=v`` arguments (values parsed as Python literals where they are) from the rest."""
  import ast

  rest, overrides = [], {}
  for arg in argv:
    m = re.fullmatch(r'--config\.([\w.]+)=(.*)', arg)
    if not m:
      rest.append(arg)
      continue
    try:
      value = ast.literal_eval(m.group(2))
    except (ValueError, SyntaxError):
      value = m.group(2)
    overrides[m.group(1)] = value
  return rest, overrides


def _among(lr: float, lrs) -> bool:
  """Whether peak LR ``lr`` is one of ``lrs`` (up to float rounding: the grids are computed, flags typed)."""
  return any(math.isclose(lr, g) for g in lrs)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, dict]:
  """(the command's options, its ``--config.*`` overrides); ``--quick`` narrows what was not given."""
  rest, task_overrides = parse_overrides(argv)
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--quick', action='store_true', help='a smoke run of every stage on a tiny model')
  parser.add_argument('--stage', default='all', choices=('all', 'grid', 'hdet', 'peers', 'report'))
  parser.add_argument('--optim', default='adamw,sgd', help='comma-separated: adamw, sgd')
  parser.add_argument('--seeds', default=','.join(map(str, SEEDS)), help='comma-separated seeds to train')
  parser.add_argument(
    '--report-seeds',
    default=None,
    help=f'comma-separated seeds the report averages over (default {",".join(map(str, SEEDS))}, '
    'whatever --seeds trained; quick: --seeds)',
  )
  parser.add_argument('--variants', default=','.join(VARIANTS), help='comma-separated controller variants')
  parser.add_argument('--starts', default=','.join(STARTS), help='comma-separated: low, best, high')
  parser.add_argument(
    '--grid-lrs',
    default='',
    help="comma-separated subset of the grid's peak LRs to train (default: all); the first "
    "seed's grid must be complete, since it fixes the HDET starts",
  )
  parser.add_argument('--peers', default=','.join(PEERS), help='comma-separated LR-free methods')
  parser.add_argument('--report-only', action='store_true', help='only redraw the report from cached runs')
  parser.add_argument('--out', default=None, help='report folder (default results/, quick: the workdir)')
  parser.add_argument(
    '--workdir',
    default=None,
    help='where runs train (default workdirs/autolr; --quick: workdirs/autolr_quick, records too)',
  )
  args = parser.parse_args(rest)
  if args.quick:  # one run per stage: the grid's two points, one HDET start, one peer
    args.optim = args.optim if '--optim' in rest else 'adamw'
    args.variants = args.variants if '--variants' in rest else 'fit_common_k1'
    args.starts = args.starts if '--starts' in rest else 'high'
    args.peers = args.peers if '--peers' in rest else 'adam_plateau'
  retired = [v for v in args.variants.split(',') if v in RETIRED_VARIANTS]
  unknown = [v for v in args.variants.split(',') if v and v not in VARIANT_SETTINGS and v not in RETIRED_VARIANTS]
  if retired:
    parser.error(
      f'--variants: {retired} retired in 1.0 with the knob each measured (their records stay under results/; '
      'git checkout 98c94c2 trains them)'
    )
  if unknown:
    parser.error(f'--variants: {unknown} not among {sorted(VARIANT_SETTINGS)}')
  args.seeds = [int(x) for x in args.seeds.split(',') if x][: 1 if args.quick else None]
  args.report_seeds = (
    args.seeds
    if args.quick
    else list(SEEDS)
    if args.report_seeds is None
    else [int(x) for x in args.report_seeds.split(',') if x]
  )
  args.grids = QUICK_GRIDS if args.quick else GRIDS
  args.grid_lrs = [float(x) for x in args.grid_lrs.split(',') if x]
  for optim in [o for o in args.optim.split(',') if o]:
    off = [lr for lr in args.grid_lrs if not _among(lr, args.grids[optim])]
    if off:
      parser.error(f'--grid-lrs: {off} not in the {optim} grid {[float(f"{g:.4g}") for g in args.grids[optim]]}')
  return args, task_overrides


def checked_base_config(task_overrides: dict, quick: bool):
  """The base config with the command's overrides, or exit 2 with one line naming a bad one (before any run)."""
  from hdet_jax.trainer import config_lib

  try:
    known = config_lib.flatten(base_config({}, quick))
    for key in task_overrides:
      if key not in known and not any(k.startswith(key + '.') for k in known):
        raise KeyError(f'no field named {key!r} (the fields, each with its help, are in hdet_jax/trainer/fields.py)')
    base = base_config(task_overrides, quick)
    records.resolve(base)  # (raises ConfigError, a ValueError, naming the field)
  except (KeyError, AttributeError, TypeError, ValueError) as e:
    print(f'error: bad --config override: {e.args[0] if e.args else e}', file=sys.stderr)
    sys.exit(2)
  return base


def run_stages(cache: records.RunCache, args: argparse.Namespace, task_overrides: dict, steps: int) -> None:
  """Every requested stage's runs, per optimizer, seed, variant and start; cached runs are skipped."""
  from hdet_jax.trainer import config_lib

  grids, seeds = args.grids, args.seeds
  stages = () if args.report_only else ('grid', 'hdet', 'peers') if args.stage == 'all' else (args.stage,)

  def go(name, overrides):
    config = config_lib.with_overrides(base_config(task_overrides, args.quick), overrides)
    # skip_busy: runs another worker is training are left to it (start two workers to share a stage).
    return cache.run(name, config, {**task_overrides, **overrides}, skip_busy=True)

  for optim in [o for o in args.optim.split(',') if o]:
    lrs = grids[optim]
    if 'grid' in stages:
      # A subset (--grid-lrs) repeats the best's neighbourhood on more seeds; the report shows each point's n.
      train = [lr for lr in lrs if not args.grid_lrs or _among(lr, args.grid_lrs)]
      print(f'[{optim}] grid: {len(train)} peak LRs x seeds {seeds}', flush=True)
      for seed in seeds:
        for lr in train:
          go(grid_name(optim, lr, seed), run_overrides('grid', optim, lr, seed, steps))
    best = anchor(cache, optim, lrs, seeds[0])
    if 'hdet' in stages and best is None:
      print(f'[{optim}] hdet: skipped, the grid of seed {seeds[0]} is not complete.', flush=True)
    elif 'hdet' in stages:
      for seed in seeds:
        for variant in args.variants.split(','):
          for start in args.starts.split(','):
            o = run_overrides('hdet', optim, best * STARTS[start], seed, steps, variant=variant)
            if args.quick:  # the smoke run's short windows (QUICK) replace the variant's T
              o.pop('hdet.sync_every', None)
            go(hdet_name(optim, variant, start, seed), o)
    if 'peers' in stages and optim == 'adamw' and best is not None:
      for seed in seeds:
        for peer in args.peers.split(','):
          go(peer_name(peer, seed), run_overrides('peer', optim, best, seed, steps, peer=peer))


def main(argv=None):
  args, task_overrides = parse_args(sys.argv[1:] if argv is None else argv)
  from hdet_jax.trainer import process

  tag = task_tag(task_overrides, args.quick)
  work_root = os.path.join(
    args.workdir or os.path.join(REPO, 'workdirs', 'autolr_quick' if args.quick else 'autolr'), tag
  )
  records_dir = (
    os.path.join(work_root, 'records') if args.quick else os.path.join(REPO, 'results', 'autolr', 'runs', tag)
  )
  base = checked_base_config(task_overrides, args.quick)
  cache = records.RunCache(records_dir, work_root, make_record, describe)
  process.setup_jax(base)
  run_stages(cache, args, task_overrides, int(base.num_train_steps))
  # Another task's report goes beside its records, never over the default task's results/autolr.md.
  out = args.out or (
    work_root
    if args.quick
    else os.path.join(REPO, 'results')
    if tag == 'default'
    else os.path.join(REPO, 'results', 'autolr', 'tasks', tag)
  )
  # The report is over the sweep's seeds whatever --seeds trained (fresh seeds are compared elsewhere:
  # research.climb_and_price); --report-seeds picks others.
  runs = {o: collect(cache, o, args.grids[o], REPORTED_VARIANTS, PEERS, args.report_seeds) for o in ('adamw', 'sgd')}
  anchors = {o: read_anchor(cache, o) for o in runs}
  paths = autolr_report.write(
    out, runs, anchors, default_variant=DEFAULT_VARIANT, quick=args.quick, task=task_overrides
  )
  print('\n'.join(f'  {p}' for p in paths))


if __name__ == '__main__':
  main()
