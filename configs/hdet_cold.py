"""python train.py --config configs/hdet_cold.py --workdir workdirs/hdet_cold

HDET without warm init: LR spread, periodic averaging and auto-LR from a random init (cold
start), at the high peak LR.

One row of the paper's Table 1 ablation (§4): everything else as in default.py, with the
ablation family's high peak LR (HIGH_LR, about 3x default's; baseline_low uses a ninth of it).
"""

from hdet_jax.trainer.config_lib import sibling

HIGH_LR = 1e-2  # The ablation family's aggressive peak LR (the paper's 9e-4 against a 1e-4 baseline).


def get_config():
  config = sibling(__file__, 'default')
  config.optim.max_lr = HIGH_LR  # Aggressive peak LR.
  config.init_from = None  # Cold start: random init.
  return config
