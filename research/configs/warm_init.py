"""research/configs/warm_init.py: one row of the Table 1 ablation, run by ``python -m research.archive.table1``
(its tuning fields go to the trainer in Python: ``research.records.trainer_arguments``).

Warm-Init: plain data parallel at the high peak LR from a warm noisy start (eq. 10), no
spread, no averaging. Needs the warm checkpoint first: a Baseline-Low run,
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
  config.hdet.spread = 0.0  # No LR spread: every replica trains at the base LR.
  config.hdet.sync_every = 0  # Never average (plain data parallel: replicas share the all-reduced gradient) ...
  config.hdet.num_syncs = 0  # ... (no windows counted per run either).
  config.hdet.auto_lr = False  # No controller: the one-cycle schedule as is.
  return config
