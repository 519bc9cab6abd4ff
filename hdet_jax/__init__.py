"""hdet-jax: Hyperparameter-Divergent Ensemble Training as an optax transformation.

The core (this package's top-level modules) depends on jax, optax, numpy and chex only; the trainer in
``hdet_jax.trainer`` adds flax, orbax and I/O on top and is never imported from here.
"""

from hdet_jax.controller import ControllerState, controller_update, decay_for_schedule, reference_decay, softmax_weights
from hdet_jax.multipliers import draw_permutations, geometric_multipliers, spread_multipliers
from hdet_jax.packing import PackedState, pack_state, packed, unpack_state
from hdet_jax.replicas import (all_gather, average_replicas, axis_index, finite_mean, group_shardings, pmean,
                               pmean_finite, psum, replica, replica_axes, shard_map_replicas, stack_replicas)
from hdet_jax.schedules import one_cycle
from hdet_jax.param_groups import group_labels
from hdet_jax.settings import AutoLR, Explore, hyperparam_names
from hdet_jax.sync import apply_updates
from hdet_jax.transform import HDETState, hdet, replica_value, state_shardings
from hdet_jax.views import hyperparams
from hdet_jax.windows import is_sync_step

__all__ = [
    'AutoLR', 'ControllerState', 'Explore', 'group_labels', 'hyperparam_names', 'replica_value', 'HDETState', 'apply_updates', 'average_replicas',
    'controller_update', 'decay_for_schedule', 'draw_permutations', 'finite_mean', 'group_shardings', 'hdet', 'is_sync_step',
    'one_cycle', 'PackedState', 'pack_state', 'packed', 'unpack_state', 'all_gather', 'axis_index', 'pmean', 'psum',
    'pmean_finite', 'replica_axes',
    'reference_decay', 'replica', 'shard_map_replicas', 'softmax_weights', 'spread_multipliers', 'geometric_multipliers',
    'stack_replicas', 'state_shardings', 'hyperparams',
]
__version__ = '0.6.1'  # pyproject.toml's; CHANGELOG.md says when it moves
