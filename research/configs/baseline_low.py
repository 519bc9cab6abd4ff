"""research/configs/baseline_low.py: one row of the Table 1 ablation, run by ``python -m research.archive.table1``
(its tuning fields go to the trainer in Python: ``research.records.trainer_arguments``).

Baseline-Low: plain data parallel (no spread, no averaging, no auto-LR) at a conservative
peak LR, a ninth of the ablation family's. Its seed-100 run is the warm rows' checkpoint.

One row of the paper's Table 1 ablation (§4), as run by ``python -m research.archive.table1``
(results/table1.md): everything else as in default.py, 500 steps, and the ablation family's
high peak LR HIGH_LR, chosen by that experiment's plain data-parallel LR sweep (the lowest grid
LR where plain data parallel crashed or clearly degraded); baseline_low uses a ninth of it.
"""

from hdet_jax.trainer.config_lib import sibling


def get_config():
  config = sibling(__file__, 'baseline_high')  # Plain data parallel, cold, 500 steps.
  config.optim.max_lr = config.optim.max_lr / 9  # Conservative peak LR: a ninth of HIGH_LR (as in the paper).
  return config
