"""python train.py --config configs/mnist1d.py --workdir workdirs/mnist1d

Task 'mnist1d': a small 1-D CNN classifier (the dataset's reference ConvBase, 5.2k parameters) on
MNIST-1D (Greydanus 2020), generated offline by the PyPI package mnist1d, trained with the main job's
HDET (spread 0.25, averaging 15 times per run, the 'fit' auto-LR controller from a tenth of
optim.max_lr), 8 replicas. The metric is the averaged model's test cross-entropy (nats, lower is
better); test accuracy beside it. Bring your own signals with --config.data.path=FILE.npz (arrays x,
y, x_test, y_test: signals [n, L] or [n, L, C], integer labels in [0, model.num_classes)).

Every field not set here is as in default.py (the hdet.*, optim.* and run fields); any can be overridden.
"""

import ml_collections

from hdet_jax.trainer import fields
from hdet_jax.trainer.config_lib import sibling
from hdet_jax.trainer.tasks import mnist1d


def get_config() -> ml_collections.ConfigDict:
  config = sibling(__file__, 'default')
  config.task = 'mnist1d'  # The workload (hdet_jax/trainer/tasks/mnist1d.py).
  config.num_train_steps = (
    1000  # S: total optimizer steps (3.2 epochs of the 80,000 training examples at 8 x 32 a step).
  )

  # The task's own data.* and model.* (each field with its help: hdet_jax/trainer/tasks/mnist1d.py, Mnist1dData
  # and Mnist1dModel); e.g. --config.model.kind=mlp.
  config.data = fields.config_dict_of(mnist1d.Mnist1dData)
  config.model = fields.config_dict_of(mnist1d.Mnist1dModel)

  config.optim.max_lr = 3e-2  # Peak LR, the high end of the guess: the run starts at a tenth (hdet.initial_scale).
  config.eval_every = 250  # Steps between test evaluations of the averaged model (and one at the end).
  config.eval_windows = 0  # Test examples per evaluation (0: the whole test split, split evenly over the replicas).
  return config
