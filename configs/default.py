"""python train.py --config configs/default.py --workdir workdirs/default

The main job: HDET from scratch on a small byte-level transformer and the King James Bible, 8 replicas (8
simulated CPU devices on a CPU-only machine; all 8 on one GPU). A few minutes on a 2-core CPU.

Its controller is the guarded climb, ``hdet_jax.AutoLR(total_steps=S)``: it starts at a tenth of the schedule
and only raises the LR (so give optim.max_lr as the high end of your guess), undoes a window whose loss blew up,
and stops spreading the replicas once the climb has ended. How it measures against an LR sweep: docs/verdict.md.
The paper's controller (eqs. 4-9, at the paper's values) is --config.hdet.controller=paper
--config.hdet.param_groups=True --config.hdet.sync_every=25 --config.optim.max_lr=3e-3.

Its fields are the trainer's defaults, each declared once (default, type and range, role, help) in the typed
config hdet_jax/trainer/fields.py, which this file returns. Every field can be overridden from the command line,
e.g. ``--config.hdet.spread=0.2``. What research varies beyond these (the controllers' tuning, e.g. the climb's
trust) it gives in Python: ``train_and_evaluate(config, workdir, tuning={'hdet.trust': 0.5})`` (docs/trainer.md).
"""

from hdet_jax.trainer import fields


def get_config():
  return fields.get_config()
