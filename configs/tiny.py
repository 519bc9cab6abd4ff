"""python train.py --config configs/tiny.py --workdir workdirs/tiny

A few-second smoke run: full HDET (spread, averaging every 8 steps, the default controller from the first sync) on a
one-block model, 40 steps. Step 20 falls mid-fan-out (replicas differ). Everything not set here is as in default.py.
The tests run it with the controller tuning it held in 1.0, before research's fields left the config (the controller
from the sync at step 16, the plain fit): tests/trainer_testing.py's TINY_TUNING, given in Python.
"""

from hdet_jax.trainer.config_lib import sibling


def get_config():
  config = sibling(__file__, 'default')
  config.num_train_steps = 40  # Total steps: seconds, not minutes.
  config.data.seq_len = 32  # Bytes per window.
  config.data.batch_size = 4  # Windows per replica per step.
  config.model.d_model = 32  # Residual width.
  config.model.num_layers = 1  # One transformer block.
  config.model.num_heads = 2  # Attention heads.
  config.optim.max_lr = 1e-2  # A high peak LR: a tiny model learns the byte statistics fast.
  config.hdet.sync_every = 8  # Average every 8 steps: after steps 8, 16, 24, 32 and 40.
  config.hdet.initial_scale = 1.0  # Starts at the schedule.
  config.hdet.param_groups = True  # The smoke run exercises per-group LRs too.
  config.log_every = 5  # Flush metrics every 5 steps.
  config.eval_every = 20  # Validate at step 20 (and at the end).
  config.eval_windows = 64  # 8 validation windows per replica.
  config.checkpoint_every = 20  # Checkpoint at step 20 (and at the end).
  config.progress_bar = False  # No bar in test logs.
  config.compilation_cache = ''  # No persistent cache (tests leave nothing outside tmp_path).
  return config
