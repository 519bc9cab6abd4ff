"""research/configs/hdet_cold.py: one row of the Table 1 ablation, run by ``python -m research.archive.table1``
(its tuning fields go to the trainer in Python: ``research.records.trainer_arguments``).

HDET without warm init: LR spread, periodic averaging and auto-LR from a random init (cold
start), at the high peak LR.

One row of the paper's Table 1 ablation (§4), as run by ``python -m research.archive.table1``
(results/table1.md): everything else as in default.py, 500 steps, and the ablation family's
high peak LR HIGH_LR, chosen by that experiment's plain data-parallel LR sweep (the lowest grid
LR where plain data parallel crashed or clearly degraded); baseline_low uses a ninth of it.
"""

from hdet_jax.trainer.config_lib import sibling


def get_config():
  config = sibling(__file__, 'hdet_full')  # HDET full's settings: 500 steps, peak LR HIGH_LR, warm start.
  config.init_from = None  # Cold start: random init.
  return config
