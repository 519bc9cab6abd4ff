"""Reading HDET's hyperparameters from an optimizer state, the way optax users look for them.

optax users read a learning rate from the state of ``optax.inject_hyperparams(...)`` as
``state.hyperparams['learning_rate']``, or find it anywhere in a state with
``optax.tree_utils.tree_get(state, 'learning_rate')``. Neither works on :class:`hdet_jax.HDETState`:

- ``tree_get(state, 'learning_rate')`` returns None: the state has no field of that name. HDET keeps every
  explored hyperparameter of every replica in one ``values`` array of shape ``[G, N]`` (G hyperparameters,
  N replicas, row g named by :func:`hdet_jax.hyperparam_names`) and the base values in ``base`` ``[G]``;
  the wrapped optimizer is rebuilt at each update with this replica's values, so its own state holds no
  learning rate either. Looking for ``'base'`` raises, because two fields carry that name
  (``HDETState.base``, the coming step's, and ``ControllerState.base``, the current window's).
  Renaming fields to match would not help: ``tree_get`` returns a field whole, and a ``[G, N]`` array
  has no name per row.
- ``optax.inject_hyperparams(hdet)`` does not apply: ``inject_hyperparams`` calls its factory with the
  hyperparameters turned into arrays (``num_replicas`` then fails as an array, and ``hdet`` takes an
  optimizer *factory*, not values), and HDET already does that injection itself, once per replica.

:func:`hyperparams` gives the same view as ``inject_hyperparams``' ``state.hyperparams``: a dict from
name to value, for every replica and for the base.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from hdet_jax import arguments
from hdet_jax.param_groups import path_string
from hdet_jax.settings import hyperparam_names
from hdet_jax.transform import BuiltOptimizerState, HDETState


def find_state(opt_state: Any) -> HDETState:
  """The one :class:`HDETState` in ``opt_state``: itself, or inside ``optax.chain``, ``multi_transform``,
  ``MultiSteps`` (``inner_opt_state``) or a train state; in an nnx split state (where it is a mapping of its
  fields, each leaf in a variable) it comes back as an ``HDETState`` of those arrays."""
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_hdet_state) if _is_hdet_state(x)]
  if len(found) != 1:
    raise ValueError(f'hyperparams: expected one HDETState in the optimizer state, found {len(found)}.')
  return found[0] if isinstance(found[0], HDETState) else _from_mapping(found[0])


def _is_hdet_state(x) -> bool:
  required = set(HDETState._fields) - {'anchor'}  # a split state may leave out an anchor of None
  return isinstance(x, HDETState) or (isinstance(x, Mapping) and required <= set(x.keys()) <= set(HDETState._fields))


def _from_mapping(fields: Mapping) -> HDETState:
  """An nnx split state's view of an ``HDETState``: a mapping of its fields, arrays held in variables."""
  inner = fields['inner_state']
  if isinstance(inner, Mapping) and set(inner.keys()) == set(BuiltOptimizerState._fields):
    inner = BuiltOptimizerState(inner['built_optimizer_state'])
  unwrap = lambda x: x.get_value() if callable(getattr(x, 'get_value', None)) else x  # an nnx variable's array
  return HDETState(**{k: inner if k == 'inner_state' else unwrap(fields[k]) for k in HDETState._fields if k in fields})


def is_built(state: HDETState) -> bool:
  """Whether ``state`` wraps a built optimizer (its learning-rate rows are factors, ``lr_scale``)."""
  return isinstance(state.inner_state, BuiltOptimizerState)


def hyperparams(opt_state: Any, names: Sequence[str] | None = None) -> dict[str, chex.Array]:
  """Every replica's and the base value of each hyperparameter HDET explores, for the *coming* step.

  Args:
    opt_state: an :class:`hdet_jax.HDETState`, or an optimizer state holding exactly one (``optax.chain``,
      ``optax.multi_transform``). Either one replica's (inside the mapped train step) or the stacked state
      outside it (every leaf with a leading replica axis: the replicas' copies agree, the first is read).
    names: the rows of the state's ``[G]`` fields, ``hdet_jax.hyperparam_names(param_groups=...,
      explore=...)`` for the arguments ``hdet`` was built with; may be left out when the only explored
      hyperparameter is the learning rate.

  Returns:
    ``{name: [N] every replica's value}`` (replica r's at index r) and ``{'base_' + name: [] the base
    value}`` for each name, e.g. ``{'learning_rate': [N], 'base_learning_rate': []}``, or with parameter
    groups ``'learning_rate/<group>'`` and ``'base_learning_rate/<group>'``, then each explored name
    (``'weight_decay'``, ``'base_weight_decay'``, ...). Read it before ``tx.update`` to log what a step
    trains with.

  Example:
    >>> import jax, jax.numpy as jnp, optax, hdet_jax
    >>> tx = hdet_jax.hdet(optax.sgd, 0.1, num_replicas=4)
    >>> opt_state = jax.vmap(tx.init)(hdet_jax.stack_replicas({'w': jnp.zeros(3)}, 4))
    >>> hp = hdet_jax.hyperparams(opt_state)  # the stacked state, outside the train step
    >>> hp['learning_rate']  # [N]
    Array([0.075     , 0.09166667, 0.10833334, 0.125     ], dtype=float32)
    >>> hp['base_learning_rate']  # []
    Array(0.1, dtype=float32)
  """
  state = find_state(opt_state)
  values, base = jnp.asarray(state.values), jnp.asarray(state.base)
  if values.ndim == 3:  # the stacked state: [N, G, N] and [N, G]; identical along the leading axis
    values, base = values[0], base[0]
  chex.assert_rank([values, base], [2, 1])
  g = values.shape[0]
  if names is None:
    if g != 1:
      raise ValueError(
        f'hyperparams: the state explores {g} hyperparameters; pass names=hdet_jax.hyperparam_names('
        'param_groups=..., explore=...) with the arguments hdet was built with.'
      )
    names = hyperparam_names(built=is_built(state))
  names = tuple(names)
  if len(names) != g:
    raise ValueError(f'hyperparams: {len(names)} names {names} for a state exploring {g} hyperparameters.')
  out: dict[str, chex.Array] = {}
  for i, name in enumerate(names):
    out[name] = values[i]
  for i, name in enumerate(names):
    out[f'base_{name}'] = base[i]
  return out


_HOST_REDUCTIONS = {'mean': np.mean, 'sum': np.sum}  # over the replicas, in float64 on the host


def host_metrics(
  metrics: Any = None,
  opt_state: Any = None,
  *,
  reduce: Any = 'mean',
  names: Sequence[str] | None = None,
  optimizer_lr: float | Callable[[Any], Any] | None = None,
  per_replica: bool = False,
) -> dict[str, float]:
  """The train step's metrics and the learning rate in use, as Python floats to log on the host.

  Everything a step mapped by :func:`hdet_jax.over_replicas` or :func:`hdet_jax.shard_map_replicas` returns is
  stacked ``[N]``, row r replica r's, and ``float()`` of an ``[N]`` array raises. What is per replica and what
  is global:

  - per replica, ``[N]``: every step output (the loss on the replica's ``B / N`` rows, its token count, its
    gradient norm), and in the state each replica's hyperparameter values (``hyperparams(opt_state)[name]``,
    e.g. its learning rate) and its window loss (``loss_sum``, ``last_loss``, ``replica_ok``);
  - global, the same on every replica: the base values (``base_<name>``), ``count``, ``sync_count``,
    ``finite_replicas`` and the controller's fields; a step output already ``pmean`` -ed over the replicas.

  A metric leaf at path ``p`` (``'loss'``, ``'aux/tokens'``) of shape ``[N]`` gives ``p``, reduced over the
  replicas as ``reduce`` says, and ``p/spread``, the replicas' standard deviation
  :math:`\\sqrt{\\frac{1}{N}\\sum_r (y_r - \\bar y)^2}`; ``per_replica=True`` adds ``p/r`` for each replica. A
  ``[]`` leaf gives ``p`` as it is. ``reduce`` is :func:`hdet_jax.evaluate_over_replicas`' vocabulary on the host:
  ``'mean'`` (a mean over each replica's rows: the mean over replicas is the global batch's, each holding ``B /
  N`` rows), ``'sum'`` (counts and sums: the global batch's is the sum), or a pytree of those, a prefix of
  ``metrics`` (``{'loss': 'mean', 'tokens': 'sum'}``).

  ``opt_state`` (stacked, or one replica's) adds, for each row of :func:`hyperparams`, ``base_<name>`` (the base
  value) and ``<name>/min``, ``<name>/max`` over the replicas (and ``<name>/r``), plus ``sync_count`` and
  ``finite_replicas``. These are the values of the *coming* step: pass the state given to the step (read it before
  the call where the state is donated) to log what that step trains with. With a factory (``hdet(optax.adamw,
  schedule, ...)``) the ``learning_rate`` rows are the learning rates in use, the schedule and the controller
  included. Around a built optimizer the rows are ``lr_scale``, factors on the optimizer's own learning rate:
  pass that schedule (or float) as ``optimizer_lr`` to get ``learning_rate`` rows too,
  ``optimizer_lr(count) * lr_scale`` (``count``: the updates so far, where the coming update reads its schedule).

  Args:
    metrics: the step's outputs to log, a pytree of ``[N]`` per-replica scalars or ``[]`` global ones (host
      or device arrays); None for none.
    opt_state: an optimizer state holding one :class:`hdet_jax.HDETState` (as :func:`hyperparams` takes it), or
      None.
    reduce: ``'mean'``, ``'sum'`` or a pytree prefix of ``metrics`` holding those.
    names: :func:`hyperparams`' ``names`` (needed where ``hdet`` explores more than the learning rate).
    optimizer_lr: a built optimizer's own learning rate, a schedule of the step count or a float.
    per_replica: also each replica's value, ``<key>/<r>``.

  Returns:
    ``{key: float}``, flat, to hand to a logger.

  Example:
    >>> import jax, jax.numpy as jnp, optax, hdet_jax
    >>> tx = hdet_jax.hdet(optax.sgd(optax.linear_schedule(0.2, 0.0, 100)), num_replicas=4)
    >>> opt_state = jax.vmap(tx.init)(hdet_jax.stack_replicas({'w': jnp.zeros(3)}, 4))
    >>> metrics = {'loss': jnp.array([1.0, 2.0, 3.0, 6.0]), 'tokens': jnp.array([8, 8, 7, 9])}  # [N] each
    >>> logs = hdet_jax.host_metrics(metrics, opt_state, reduce={'loss': 'mean', 'tokens': 'sum'},
    ...                              optimizer_lr=optax.linear_schedule(0.2, 0.0, 100))
    >>> logs['loss'], logs['loss/spread'], logs['tokens']
    (3.0, 1.8708286933869707, 32.0)
    >>> round(logs['base_learning_rate'], 6), round(logs['learning_rate/min'], 6), round(logs['learning_rate/max'], 6)
    (0.2, 0.15, 0.25)
  """
  per_replica = arguments.flag(per_replica, 'per_replica', who='host_metrics')
  hows = jax.tree.leaves(reduce)
  if not hows or any(not isinstance(h, str) or h not in _HOST_REDUCTIONS for h in hows):
    bad = next((h for h in hows if not isinstance(h, str) or h not in _HOST_REDUCTIONS), reduce)
    raise ValueError(
      f"host_metrics: reduce={bad!r} is not a reduction; pass reduce='mean' (a mean over each replica's rows), "
      "'sum' (counts and sums) or a pytree of those matching the metrics (e.g. {'loss': 'mean', 'tokens': 'sum'})."
    )
  if optimizer_lr is not None and opt_state is None:
    raise ValueError('host_metrics: optimizer_lr= reads the state: pass opt_state= too, or leave optimizer_lr out.')
  out: dict[str, float] = {}
  if metrics is not None:
    _add_metrics(out, metrics, reduce, per_replica)
  if opt_state is not None:
    _add_hyperparams(out, opt_state, names, optimizer_lr, per_replica)
  return out


def _on_host(x) -> np.ndarray:
  """``x`` as a float64 numpy array; a global array other processes hold rows of is gathered first (every process
  calls host_metrics, as it calls the step)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils  # only where a run spans processes

    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x), np.float64)


def _add_metrics(out: dict[str, float], metrics, reduce, per_replica: bool) -> None:
  """``out`` with each metric leaf's reduced value, spread and (``per_replica``) rows."""
  try:
    per_leaf = jax.tree.map(lambda how, part: jax.tree.map(lambda _: how, part), reduce, metrics)
  except (ValueError, TypeError) as e:
    raise ValueError(
      f'host_metrics: reduce={reduce!r} does not match the metrics {jax.tree.structure(metrics)}; give '
      "'mean' or 'sum' for each metric (a dict with the metrics' keys), or one for all."
    ) from e
  for (path, x), how in zip(jax.tree_util.tree_flatten_with_path(metrics)[0], jax.tree.leaves(per_leaf)):
    key = path_string(path) or 'value'
    y = _on_host(x)
    if y.ndim == 0:
      out[key] = float(y)
      continue
    if y.ndim != 1:
      raise ValueError(
        f'host_metrics: metric {key!r} has shape {y.shape}; give per-replica scalars [N] (the step outputs) or '
        'global ones [], reducing a vector inside the step.'
      )
    out[key] = float(_HOST_REDUCTIONS[how](y))
    out[f'{key}/spread'] = float(np.std(y))
    if per_replica:
      out.update({f'{key}/{r}': float(v) for r, v in enumerate(y)})


def _add_hyperparams(out: dict[str, float], opt_state, names, optimizer_lr, per_replica: bool) -> None:
  """``out`` with the base, min, max (and rows) of each hyperparameter for the coming step, and the sync counts."""
  state = find_state(opt_state)
  hp = hyperparams(opt_state, names)
  count = int(np.ravel(_on_host(state.count))[0])
  if optimizer_lr is not None:
    if not is_built(state):
      raise ValueError(
        'host_metrics: optimizer_lr= is for hdet around a built optimizer (its rows are lr_scale factors); this '
        "state's learning_rate rows are the learning rates in use already: leave optimizer_lr out."
      )
    lr = float(optimizer_lr(count) if callable(optimizer_lr) else optimizer_lr)
    for name in [n for n in hp if n.split('/')[0] in ('lr_scale', 'base_lr_scale')]:
      hp[name.replace('lr_scale', 'learning_rate', 1)] = np.asarray(hp[name], np.float64) * lr
  for name, value in hp.items():
    v = _on_host(value)
    if v.ndim == 0:  # base_<name>: the base, one for all replicas
      out[name] = float(v)
      continue
    out[f'{name}/min'], out[f'{name}/max'] = float(v.min()), float(v.max())
    if per_replica:
      out.update({f'{name}/{r}': float(x) for r, x in enumerate(v)})
  for field in ('sync_count', 'finite_replicas'):
    out[field] = float(np.ravel(_on_host(getattr(state, field)))[0])
