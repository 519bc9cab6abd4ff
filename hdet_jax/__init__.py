"""hdet-jax: Hyperparameter-Divergent Ensemble Training as an optax transformation.

The user API is this module's ``__all__``; internals (the controllers' math, the collectives, state packing)
stay importable from their modules (``hdet_jax.controller``, ``hdet_jax.axes``, ``hdet_jax.packing``, ...).
The core (this package's top-level modules) depends on jax, optax, numpy and chex only; the trainer in
``hdet_jax.trainer`` adds flax, orbax and I/O on top and is never imported from here.
"""

from hdet_jax.accumulate import multi_steps
from hdet_jax.flax_utils import apply_gradients, dense_general_ok
from hdet_jax.packing import packed
from hdet_jax.axes import pmean_finite
from hdet_jax.pmap_utils import average_at_sync, pmap_average, replicas_to_devices, replicas_to_host
from hdet_jax.replicas import (
  average_replicas,
  evaluate_over_replicas,
  over_replicas,
  replica,
  shard_map_replicas,
  stack_replicas,
)
from hdet_jax.schedules import one_cycle
from hdet_jax.auto_lr import AutoLR
from hdet_jax.settings import Explore, hyperparam_names
from hdet_jax.sync import apply_updates, is_sync_step
from hdet_jax.shardings import batch_shardings, group_shardings, stacked_shardings, state_shardings
from hdet_jax.transform import HDETState, hdet, replica_value
from hdet_jax.views import host_metrics, hyperparams

__all__ = [
  # The transformation and its settings.
  'hdet',
  'AutoLR',
  'Explore',
  'HDETState',
  'one_cycle',
  'apply_updates',
  'multi_steps',
  'packed',
  # Reading the state.
  'hyperparams',
  'hyperparam_names',
  'replica_value',
  'is_sync_step',
  'host_metrics',
  # Replicas on a mesh.
  'shard_map_replicas',
  'stack_replicas',
  'average_replicas',
  'replica',
  'pmean_finite',
  'over_replicas',
  'evaluate_over_replicas',
  # A flax trainer of your own (hdet_jax.flax_utils: flax without the trainer extra).
  'apply_gradients',
  'dense_general_ok',
  # A jax.pmap trainer (hdet_jax.pmap_utils): checkpoints of every replica, the average for evaluation, BatchNorm.
  'replicas_to_host',
  'replicas_to_devices',
  'pmap_average',
  'average_at_sync',
  # The shardings of stacked replicas (hdet_jax.shardings).
  'stacked_shardings',
  'batch_shardings',
  # Deprecated: stacked_shardings(..., mesh=) under 1.0's names, until the next major release.
  'group_shardings',
  'state_shardings',
]
__version__ = '1.0.0'  # pyproject.toml's; CHANGELOG.md says when it moves
