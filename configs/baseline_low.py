"""python train.py --config configs/baseline_low.py --workdir workdirs/baseline_low

Baseline-Low: plain data parallel (no spread, no averaging, no auto-LR) at a conservative
peak LR, a ninth of the ablation family's.

One row of the paper's Table 1 ablation (§4): everything else as in default.py, with the
ablation family's high peak LR (HIGH_LR, about 3x default's; baseline_low uses a ninth of it).
"""

from hdet_jax.trainer.config_lib import sibling

HIGH_LR = 1e-2  # The ablation family's aggressive peak LR (the paper's 9e-4 against a 1e-4 baseline).


def get_config():
  config = sibling(__file__, 'default')
  config.hdet.spread = 0.0  # No LR spread: every replica trains at the base LR.
  config.hdet.sync_every = 0  # Never average (plain data parallel: replicas share the all-reduced gradient).
  config.hdet.auto_lr = False  # No controller: the one-cycle schedule as is.
  config.optim.max_lr = HIGH_LR / 9  # Conservative peak LR.
  return config
