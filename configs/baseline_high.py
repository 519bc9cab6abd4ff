"""python train.py --config configs/baseline_high.py --workdir workdirs/baseline_high

Baseline-High: plain data parallel at the high peak LR: no ensemble to stabilise it.

One row of the paper's Table 1 ablation (§4), as run by ``python -m hdet_jax.experiments.table1``
(results/table1.md): everything else as in default.py, 500 steps, and the ablation family's
high peak LR HIGH_LR, chosen by that experiment's plain data-parallel LR sweep (the lowest grid
LR where plain data parallel crashed or clearly degraded); baseline_low uses a ninth of it.
"""

from hdet_jax.trainer.config_lib import sibling

HIGH_LR = 8.1e-2  # The ablation family's aggressive peak LR: the sweep's edge (the paper's 9e-4 against a 1e-4 baseline).


def get_config():
  config = sibling(__file__, 'default')
  config.num_train_steps = 500  # S: every row trains this many steps (warm rows after their pre-training run).
  config.hdet.warmup_steps = 250  # S_warm: the auto-LR controller (where on) starts halfway, as in default.py.
  config.hdet.spread = 0.0  # No LR spread: every replica trains at the base LR.
  config.hdet.sync_every = 0  # Never average (plain data parallel: replicas share the all-reduced gradient).
  config.hdet.auto_lr = False  # No controller: the one-cycle schedule as is.
  config.optim.max_lr = HIGH_LR  # Aggressive peak LR.
  return config
