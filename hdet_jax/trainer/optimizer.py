"""The HDET optimizer from its settings: the base optax optimizer (with its clipping and weight-decay mask) inside
``hdet_jax.hdet``. ``run_settings`` reads the config into :class:`OptimizerSettings`; tasks never need to touch this
file (a task's parameter groups and explorable model hyperparameters are attributes of its :class:`tasks.Task`).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

import hdet_jax as H
from hdet_jax import arguments
from hdet_jax.trainer.mesh import AXIS


def _decay_mask(params: Any) -> Any:
  """Weight decay on matrices (kernels, embeddings, positions) only, not on biases and norms."""
  return jax.tree.map(lambda x: jnp.ndim(x) >= 2, params)


# optim.name's choices, each an optax factory of the learning rate reading the optimizer's settings (b1, b2, the
# weight decay). Their state is a function of the gradients alone (moments, momentum), so that the shared gradient
# gives every replica the same state (the guard's rollback keeps one copy of it: run_settings.shared_opt_state).
FACTORIES: dict[str, Callable[..., Callable[..., optax.GradientTransformation]]] = {
  'adamw': lambda o: (
    lambda learning_rate, weight_decay=o.weight_decay: optax.adamw(
      learning_rate, b1=o.b1, b2=o.b2, weight_decay=weight_decay, mask=_decay_mask
    )
  ),
  'adam': lambda o: lambda learning_rate: optax.adam(learning_rate, b1=o.b1, b2=o.b2),
  'sgd': lambda o: lambda learning_rate: optax.sgd(learning_rate, momentum=o.b1),
}
OPTIMIZERS = tuple(FACTORIES)


class Base(NamedTuple):
  """A base optimizer given in Python instead of ``optim.name``'s: ``train_and_evaluate(config, workdir,
  optimizer=Base('prodigy', optax.contrib.prodigy))`` (research's LR-free baselines, research/autolr.py). ``name``
  stands for it where the run is recorded (``optim.name`` of its training fields and config.json); its state may
  depend on the LR, so the guard never rolls back to one copy of it."""

  name: str
  factory: Callable[..., optax.GradientTransformation]  # learning_rate -> the optimizer (at its documented defaults)
  plateau: bool = False  # it reads value= (optax.contrib.reduce_on_plateau): every replica passes the global loss
  schedule_free: bool = False  # evaluated at its eval params (optax.contrib.schedule_free_*)


class OptimizerSettings(NamedTuple):
  """What :func:`make_optimizer` builds from (``run_settings.optimizer_settings`` reads them from the config)."""

  name: str  # optim.name: the base optax optimizer (:data:`OPTIMIZERS`), or a given :class:`Base`'s name
  b1: float  # Adam's b1, SGD's momentum
  b2: float  # Adam's b2
  weight_decay: float  # AdamW's decoupled weight decay (matrices only)
  grad_clip_norm: float  # global-norm clipping before the optimizer (0: none)
  runtime_lr_scale: bool  # the LR's power of two is a state value (optim.runtime_lr_scale)
  schedule: optax.Schedule  # the base LR by step, at the programs' peak
  spread: float  # eq. 1's alpha
  windows: tuple[int, ...]  # the sync windows (hdet()'s sync_every)
  auto_lr: H.AutoLR | None  # the controller, None: fixed base LR
  param_groups: dict | None  # regexes on parameter paths: one LR per group
  explore: dict | None  # name -> hdet_jax.Explore: the hyperparameters explored besides the LR
  average_opt_state: bool  # the low-communication mode averages the optimizer state too
  base: Base | None = None  # a base optimizer given in Python, in place of :data:`FACTORIES`' ``name``


class RuntimeScaleState(NamedTuple):
  """The state of :func:`with_runtime_lr_scale`'s optimizer."""

  scale: jax.Array  # [] float32: the factor on the learning rate (1 from init; :func:`set_runtime_lr_scale`).
  inner: Any  # the wrapped optimizer's state.


def with_runtime_lr_scale(factory: Callable[..., optax.GradientTransformation]) -> Callable[..., Any]:
  """An optax factory like ``factory`` whose learning rate is multiplied by a factor held in its state.

  ``with_runtime_lr_scale(optax.adamw)(lr)`` updates as ``optax.adamw(lr * s)`` with ``s`` its state's ``scale``:
  a run-time value, so one compiled program serves every ``s``. ``init`` sets ``s = 1``; a run sets its own with
  :func:`set_runtime_lr_scale` before the first step (a checkpoint keeps it).
  """

  def make(learning_rate, **kwargs):
    def init(params):
      return RuntimeScaleState(jnp.ones([], jnp.float32), factory(learning_rate, **kwargs).init(params))

    def update(updates, state, params=None, **extra_args):
      inner = optax.with_extra_args_support(factory(learning_rate * state.scale, **kwargs))
      updates, inner_state = inner.update(updates, state.inner, params, **extra_args)
      return updates, state._replace(inner=inner_state)

    return optax.GradientTransformationExtraArgs(init, update)

  return make


def set_runtime_lr_scale(opt_state: Any, scale: jax.Array) -> Any:
  """``opt_state`` with every :class:`RuntimeScaleState`'s ``scale`` set to ``scale`` (a jit argument)."""
  is_scaled = lambda x: isinstance(x, RuntimeScaleState)
  return jax.tree.map(
    lambda x: x._replace(scale=jnp.full_like(x.scale, scale)) if is_scaled(x) else x, opt_state, is_leaf=is_scaled
  )


def make_optimizer(
  settings: OptimizerSettings, num_replicas: int, *, seed: int, rollback: bool = False
) -> optax.GradientTransformationExtraArgs:
  """``hdet_jax.hdet`` around the base optax optimizer, schedule and HDET settings of ``settings``, for N replicas
  on the replica axis ``'data'`` (however many devices: the programs map it with ``over_replicas``); ``seed``: the
  run's (``RunSettings.seed``: the multipliers' permutations); ``rollback``: the guard's
  (``hdet(..., rollback=True)``)."""
  o = settings
  if o.base is None and o.name not in FACTORIES:
    raise ValueError(f'optim.name={o.name!r} is not one of {sorted(FACTORIES)}.')
  base = o.base.factory if o.base is not None else FACTORIES[o.name](o)
  if o.runtime_lr_scale:
    base = with_runtime_lr_scale(base)
  if o.grad_clip_norm > 0:
    factory = lambda learning_rate, **kw: optax.chain(
      optax.clip_by_global_norm(o.grad_clip_norm), base(learning_rate, **kw)
    )
  else:
    factory = base
  # The config says plainly when a run is plain training (hdet.spread=0 with no controller: a bracket's baselines,
  # docs/trainer.md's plain data parallelism), so the core's warning for a build that may not mean it is not said.
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', arguments.PlainTrainingWarning)
    return H.hdet(
      factory,
      o.schedule,
      num_replicas=num_replicas,
      spread=o.spread,
      sync_every=o.windows,
      replica_axis=AXIS,  # the programs map it with over_replicas: it stands for each device's replicas too
      auto_lr=o.auto_lr,
      exact_sync=True,
      seed=seed,
      param_groups=o.param_groups,
      explore=o.explore,
      average_opt_state=o.average_opt_state,
      rollback=rollback,
    )
