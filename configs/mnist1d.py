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
from ml_collections import config_dict

from hdet_jax.trainer.config_lib import sibling


def get_config() -> ml_collections.ConfigDict:
  config = sibling(__file__, 'default')
  config.task = 'mnist1d'  # The workload (hdet_jax/trainer/tasks/mnist1d.py).
  config.num_train_steps = (
    1000  # S: total optimizer steps (3.2 epochs of the 80,000 training examples at 8 x 32 a step).
  )

  config.data = ml_collections.ConfigDict()
  config.data.path = config_dict.placeholder(str)  # An .npz with x, y, x_test, y_test; None: generate MNIST-1D.
  # MNIST-1D's make_dataset arguments (the rest at get_dataset_args' defaults: 40-sample signals, 10 classes).
  # 20x the published 5,000, so that the test cross-entropy varies less from seed to seed
  # (research/workloads_discussion.md, 'The noise floor'). Generated once per process.
  config.data.num_samples = 100000
  config.data.train_split = 0.8  # The first 80% of the generated examples train, the rest test.
  config.data.dataset_seed = 42  # The generator's seed (the package's default): the same data for every config.seed.
  config.data.batch_size = 32  # Examples per replica per step (the global batch is num_replicas times this).

  config.model = ml_collections.ConfigDict()
  config.model.kind = 'cnn'  # 'cnn': the reference CNN below; 'mlp': two ReLU layers of model.hidden units.
  config.model.hidden = 128  # Units of each of the MLP's two hidden layers (model.kind='mlp' only).
  config.model.channels = 25  # Channels of each of the three convolutions (the reference CNN's 25).
  config.model.num_classes = 10  # Output classes (labels must lie in [0, num_classes)).
  config.model.dropout = 0.0  # Dropout on the flattened features before the linear head (base value if explored).

  config.optim.max_lr = 3e-2  # Peak LR, the high end of the guess: the run starts at a tenth (hdet.initial_scale).
  config.eval_every = 250  # Steps between test evaluations of the averaged model (and one at the end).
  config.eval_windows = 0  # Test examples per evaluation (0: the whole test split, split evenly over the replicas).
  return config
