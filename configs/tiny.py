"""python train.py --config configs/tiny.py --workdir workdirs/tiny

A few-second smoke run for tests: full HDET (spread, averaging every 5 steps, auto-LR after 10
steps) on a one-block model, 40 steps. Everything not set here is as in default.py.
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
  config.hdet.sync_every = 5  # Average every 5 steps (8 syncs in the run).
  config.hdet.warmup_steps = 10  # The controller starts at step 10's sync.
  config.log_every = 5  # Flush metrics every 5 steps.
  config.eval_every = 20  # Validate at step 20 (and at the end).
  config.eval_windows = 64  # 8 validation windows per replica.
  config.checkpoint_every = 20  # Checkpoint at step 20 (and at the end).
  config.progress_bar = False  # No bar in test logs.
  config.compilation_cache = ''  # No persistent cache (tests leave nothing outside tmp_path).
  return config
