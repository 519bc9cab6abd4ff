"""research/configs/baseline_high.py: one row of the Table 1 ablation, run by ``python -m research.archive.table1``
(its tuning fields go to the trainer in Python: ``research.records.trainer_arguments``).

Baseline-High: plain data parallel at the high peak LR: no ensemble to stabilise it.

One row of the paper's Table 1 ablation (§4), as run by ``python -m research.archive.table1``
(results/table1.md): everything else as in default.py, 500 steps, and the ablation family's
high peak LR HIGH_LR, chosen by that experiment's plain data-parallel LR sweep (the lowest grid
LR where plain data parallel crashed or clearly degraded); baseline_low uses a ninth of it.
"""

from hdet_jax.trainer.config_lib import sibling


def get_config():
  config = sibling(__file__, 'warm_init')  # Plain data parallel at HIGH_LR, 500 steps, from a warm start.
  config.init_from = None  # Cold start: random init.
  return config
