"""Where should the guarded climb start? One rule for ``AutoLR(total_steps=S)``, chosen by the records (issue 84).

The default controller (``workloads.DEFAULT_VARIANT``) corrects the schedule it is given by a factor that starts at
``hdet.initial_scale`` and only rises (``after_stop='rise'``; the guard's back-off is the one step down). Two start
rules were in the library: 0.1 (a tenth of what is passed: the trainer's, every record's) and 1 (what is passed:
``hdet`` around a built optimizer until issue 84). Given a guess 10x below / at / 10x above the sweep's best peak LR,
rule 0.1 starts the climb at 0.01 / 0.1 / 1 of the best, rule 1 at 0.1 / 1 / 10. The first two of rule 1's starts
are rule 0.1's runs from the best and from 10x high (the same start and schedule: ``results/workloads.md``'s
records); its third, a climb from 10x the best, is trained here on every workload, length and optimizer but the
fine-tuning (3 seeds each). The LM at 750 steps under a warmup-cosine schedule has both rules at every start in
the archived schedule study's records (``results/schedule_bracket/runs/``, its ``start1`` control), read as data.

    python -m research.start_rule                # train what is missing (cached, resumable), then write the report
    python -m research.start_rule --report-only  # redraw results/start_rule.{md,json} byte for byte from the records
    python -m research.start_rule --quick        # a smoke run: the tiny LM, 16 steps, one seed (into workdirs/)

Run time: about 25 minutes on 2 CPU cores (mnist1d's 18 runs of 10-30 s, the LM's 9 of 1.5-5 min).
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
  (w, s, o)
  for w in ('lm', 'mnist1d')
  for s in workloads.lengths(w, False)
  for o in workloads.WORKLOADS[w][2]
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


def train_cell(workload: str, steps: int, optim: str, seeds, quick: bool, work_root: str) -> None:
  anchor = autolr.read_anchor(sweep_cache(workload, steps, quick, work_root), optim)
  if anchor is None:
    raise SystemExit(f'start_rule: {workload} at {steps} steps ({optim}) has no anchor; run research.workloads first.')
  cache = own_cache(workload, steps, quick, work_root)
  for seed in seeds:
    name = autolr.hdet_name(optim, RULE1_VARIANT, 'high', seed)
    cache.run(name, rule1_high_config(workload, steps, optim, seed, anchor, quick), skip_busy=True)
