"""The HDET trainer: a flax.nnx byte-level LM on real text, orbax checkpoints, metrics and plots.

Entry point: ``train.py`` (``python train.py --config configs/default.py --workdir workdirs/default``),
or :func:`train_and_evaluate` from Python. This package imports the core (``hdet_jax``), never the reverse.
"""

from hdet_jax.trainer.config_lib import ConfigError
from hdet_jax.trainer.process import setup_jax
from hdet_jax.trainer.trainer import format_summary, train_and_evaluate

__all__ = ['ConfigError', 'format_summary', 'setup_jax', 'train_and_evaluate']
