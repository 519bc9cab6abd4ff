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

from typing import Any, Mapping, Sequence

import chex
import jax
import jax.numpy as jnp

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
