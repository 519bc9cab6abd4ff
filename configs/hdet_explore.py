"""python train.py --config configs/hdet_explore.py --workdir workdirs/hdet_explore

HDET exploring regularization too (paper Remark 1): besides the three per-group learning rates,
each replica gets its own weight decay (multiplicative spread), dropout rate and label smoothing
(additive spreads, since a base of 0 cannot be spread multiplicatively), each with its own
permutation and controller velocity. From scratch; everything else as in default.py.
"""

from hdet_jax.trainer.config_lib import sibling


def get_config():
  config = sibling(__file__, 'default')
  config.model.dropout = 0.05  # Base dropout rate; replicas span 0.05 -+ 0.05.
  config.optim.label_smoothing = 0.05  # Base label smoothing; replicas span 0.05 -+ 0.05.
  config.hdet.explore.weight_decay = 0.5  # Replicas' weight decay spans 0.1 * [0.5, 1.5].
  config.hdet.explore.dropout = 0.05  # Additive half-width of the dropout spread.
  config.hdet.explore.label_smoothing = 0.05  # Additive half-width of the label-smoothing spread.
  return config
