"""python train.py --config configs/hdet_no_auto_lr.py --workdir workdirs/hdet_no_auto_lr

HDET without auto-LR: LR spread and periodic averaging from a warm noisy start, at the high
peak LR; the base LR follows the one-cycle schedule. Needs an earlier run's checkpoint: by
default workdirs/default (run `python train.py` first), or --config.init_from=WORKDIR.

One row of the paper's Table 1 ablation (§4): everything else as in default.py, with the
ablation family's high peak LR (HIGH_LR, about 3x default's; baseline_low uses a ninth of it).
"""

from hdet_jax.trainer.config_lib import sibling

HIGH_LR = 1e-2  # The ablation family's aggressive peak LR (the paper's 9e-4 against a 1e-4 baseline).


def get_config():
  config = sibling(__file__, 'default')
  config.optim.max_lr = HIGH_LR  # Aggressive peak LR.
  config.hdet.auto_lr = False  # No controller: the base LR follows the one-cycle schedule.
  config.init_from = 'workdirs/default'  # Warm noisy start from this workdir's latest checkpoint (eq. 10).
  return config
