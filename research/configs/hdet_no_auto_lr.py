"""research/configs/hdet_no_auto_lr.py: one row of the Table 1 ablation, run by ``python -m research.archive.table1``
(its tuning fields go to the trainer in Python: ``research.records.trainer_arguments``).

HDET without auto-LR: LR spread and periodic averaging from a warm noisy start, at the high
peak LR; the base LR follows the one-cycle schedule. Needs the warm checkpoint first: a Baseline-Low run,
the baseline_low row at seed 100
(the experiment's pre-training run), or point --config.init_from at another workdir.

One row of the paper's Table 1 ablation (§4), as run by ``python -m research.archive.table1``
(results/table1.md): everything else as in default.py, 500 steps, and the ablation family's
high peak LR HIGH_LR, chosen by that experiment's plain data-parallel LR sweep (the lowest grid
LR where plain data parallel crashed or clearly degraded); baseline_low uses a ninth of it.
"""

from hdet_jax.trainer.config_lib import sibling


def get_config():
  config = sibling(__file__, 'hdet_full')  # HDET full's settings: 500 steps, peak LR HIGH_LR, warm start.
  config.hdet.auto_lr = False  # No controller: the base LR follows the one-cycle schedule.
  return config
