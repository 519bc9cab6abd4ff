"""python train.py --config configs/bracket.py --workdir workdirs/bracket

An LR bracket on the main job's LM instead of one HDET run: 8 plain data-parallel runs at peak LRs a factor 2
apart, centred on optim.max_lr (here 2.65e-3 to 0.34), trained on the same batches; at 0.1 of the run the 5 with
the lowest training loss (mean of the 10 steps before) go on, at 0.3 the best of those runs to the end. 2.5 runs
of compute (hdet_jax/trainer/bracket.py). Use it where the LR is unknown within about 10x either way and 2.5 runs
are affordable: one HDET run does not find the sweep's best from every start (docs/verdict.md). A finer grid
at 4.0 runs, better on mnist1d's sharp optima (results/finer_grid.md): --config.bracket.points=15
--config.bracket.factor=1.4142135623730951 --config.bracket.rungs=0.1:9,0.3:1.
"""

from hdet_jax.trainer.config_lib import sibling


def get_config():
  config = sibling(__file__, 'default')
  # Each point is plain data parallel: no spread, no averaging, no auto-LR (the bracket chooses the LR).
  config.hdet.spread = 0.0
  config.hdet.sync_every = 0
  config.hdet.num_syncs = 0
  config.hdet.auto_lr = False
  config.bracket.points = 8
  return config
