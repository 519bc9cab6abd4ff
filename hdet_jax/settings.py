"""What ``hdet()`` is built from: the settings (:class:`Explore`; :class:`AutoLR` and its checks are
:mod:`hdet_jax.auto_lr`'s) and the validated plan.

Every check of ``hdet``'s arguments runs here, eagerly, before anything is traced; each error
names the parameter and the fix. The result is a frozen :class:`Plan`, the only thing the
transformation's ``init`` and ``update`` read. The ``[G]`` order of the explored hyperparameters (the
rows of ``HDETState.values``, ``base`` and the controller's fields) is defined once, by
:func:`hyperparam_names`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
from typing import Any, Callable, Mapping, NamedTuple

import jax
import numpy as np

from hdet_jax import arguments
from hdet_jax import controller as ctrl
from hdet_jax import multipliers
from hdet_jax import sync as sync_lib
from hdet_jax.auto_lr import DEFAULT_INITIAL_SCALE, AutoLR, check_auto_lr  # (the trainer reads them here too)
from hdet_jax.schedules import anneal_start, evaluate_schedules


@dataclasses.dataclass(frozen=True)
class Explore:
  """One more hyperparameter to explore across replicas (paper Remark 1).

  Replica r uses ``clip(base * (1 + spread u) , low, high)`` (multiplicative) or
  ``clip(base + spread u, low, high)`` (additive), with ``u`` the eq. 1 offsets in [-1, 1]
  (``u_r = (r - (N-1)/2) / max((N-1)/2, 0.5)``) under the hyperparameter's own permutation.
  Use multiplicative spreads for scale-like values (learning rates, weight decay, eps) and
  additive ones for values whose natural base can be 0 or that live in a bounded interval
  (dropout, label smoothing, Adam's b1/b2 near 1).

  Attributes:
    value: the base value, or an optax schedule of it.
    spread: multiplicative: alpha in [0, 1); additive: the half-width, >= 0.
    additive: additive instead of multiplicative spread.
    low, high: the valid range; values and the controller's base are clipped to it, and
      a spread that leaves it at the start raises.
    to_optimizer: pass the replica's value to the optimizer factory as this keyword; False
      for model or loss hyperparameters, which the train step reads from
      ``state.values`` (see :func:`hdet_jax.replica_value`).
  """

  value: Any
  spread: float
  additive: bool = False
  low: float | None = None
  high: float | None = None
  to_optimizer: bool = True


class Plan(NamedTuple):
  """``hdet()``'s arguments, validated and frozen (G = explored hyperparameters, N = replicas).

  The per-hyperparameter fields follow the ``[G]`` order of :func:`hyperparam_names`.
  """

  # the wrapped optax factory (called with learning_rate=), or with ``built`` the user's built transformation.
  optimizer: Callable[..., Any] | Any
  optimizer_kwargs: dict[str, Any]  # fixed keywords for it (e.g. weight_decay=0.1).
  names: tuple[str, ...]  # [G] hyperparameter names.
  schedules: tuple[Any, ...]  # [G] float or optax schedule: the base value at step t.
  spreads: tuple[float, ...]  # [G] alpha (multiplicative) or half-width (additive).
  additive: tuple[bool, ...]  # [G] additive spread.
  lows: tuple[float, ...]  # [G] valid range (-inf when unbounded).
  highs: tuple[float, ...]  # [G] (inf when unbounded).
  to_optimizer: tuple[bool, ...]  # [G] passed to the optimizer factory as a keyword.
  learning_rates: tuple[bool, ...]  # [G] a learning-rate row (a factory's learning rate, a built one's factor).
  scale: np.ndarray  # [G, N] float32: multiplier rho of each slot (1 when additive).
  offset: np.ndarray  # [G, N] float32: additive offset of each slot (0 when multiplicative).
  groups: tuple[tuple[str, str], ...]  # (group, regex) of the per-group learning rates; () for one LR.
  num_replicas: int  # N, the replica axis size.
  sync_windows: tuple[int, ...]  # the windows' lengths in steps, the last repeating ((T,): every T).
  replica_axis: str | tuple[str, ...]  # the mapped axis the replicas live on (or (device, local) axes).
  auto_lr: AutoLR | None  # the controller's settings, or None.
  controller_start: int  # the first step whose sync updates the controller (0: no controller).
  decay: tuple[float, ...]  # [G] the paper controller's gamma (0 when not used).
  floors: tuple[float, ...]  # [G] the paper controller's lowest base.
  start_values: tuple[float, ...]  # [G] the schedule at controller_start (the controller's first base).
  # [G] the 'fit' correction before the first sync (log of auto_lr.initial_scale for learning rates, else 0).
  initial_correction: tuple[float, ...]
  exact_sync: bool  # the sync's average is assigned by hdet_jax.apply_updates.
  guard_nonfinite: bool  # non-finite replicas sit the average out.
  seed: int  # seeds the permutation key.
  average_opt_state: bool = False  # a sync averages the wrapped optimizer's state too (low-communication mode).
  # ``optimizer`` is a built transformation: its updates are scaled by each replica's learning-rate rows, which
  # are then factors on the optimizer's own learning rate (``lr_scale``), not learning rates.
  built: bool = False
  # a sync whose guard backs off returns the replicas to the last sync's parameters and optimizer state.
  rollback: bool = False
  # 'fit': from the first sync at or after this step the learning rates' correction no longer rises (the schedule's
  # anneal, see anneal_start); None: it may rise to the end.
  anneal_from: int | None = None


# The learning-rate rows' names: a factory's learning rate; a built optimizer's factor on its own learning rate.
LR_NAMES = ('learning_rate', 'lr_scale')


def is_learning_rate(name: str) -> bool:
  """Whether row ``name`` of the ``[G]`` order is a learning rate (``learning_rate``, ``lr_scale``, or either
  ``/<group>``)."""
  return any(name == n or name.startswith(n + '/') for n in LR_NAMES)


def hyperparam_names(
  *, param_groups: dict[str, str] | None = None, explore: dict[str, Any] | None = None, built: bool = False
) -> tuple[str, ...]:
  """The order of the state's [G] fields for these ``hdet`` arguments.

  The learning rate (``'learning_rate'``, or ``'learning_rate/<group>'`` per parameter group, in order),
  then each explored hyperparameter in order. Around a built optimizer (``built=True``) the learning-rate rows
  are ``'lr_scale'`` (``'lr_scale/<group>'``): the factor each replica applies to the optimizer's own
  learning rate, 1 being that learning rate.

  Example:
    >>> import hdet_jax
    >>> hdet_jax.hyperparam_names(param_groups={'embed': 'embed', 'rest': '.'}, explore={'weight_decay': (0.1, 0.5)})
    ('learning_rate/embed', 'learning_rate/rest', 'weight_decay')
    >>> hdet_jax.hyperparam_names(built=True)
    ('lr_scale',)
  """
  for name, given in (('param_groups', param_groups), ('explore', explore)):
    if given is not None and not isinstance(given, dict):
      raise ValueError(f'hyperparam_names: {name} must be None or a dict, as hdet() takes it, got {given!r}.')
  lr = LR_NAMES[1] if built else LR_NAMES[0]
  lrs = tuple(f'{lr}/{g}' for g in param_groups) if param_groups else (lr,)
  return lrs + tuple(explore or ())


def make_plan(args: Mapping[str, Any]) -> Plan:
  """Validates every ``hdet`` argument eagerly and returns the frozen plan.

  ``args``: hdet's arguments by name, as hdet received them (its ``locals()``, ``**optimizer_kwargs`` as the dict
  ``optimizer_kwargs``). hdet's signature is the one list of them and of their defaults.
  """
  hdet = types.SimpleNamespace(**args)
  removed = sorted(set(hdet.optimizer_kwargs) & set(REMOVED_ARGUMENTS))
  if removed:
    raise ValueError(f'hdet: {removed[0]}= was removed in hdet-jax 1.0: {REMOVED_ARGUMENTS[removed[0]]}.')
  built = is_built(hdet.optimizer)
  extra = _explored(hdet.explore, hdet.optimizer_kwargs)
  learning_rate = _checked_optimizer(hdet.optimizer, hdet.learning_rate, hdet.optimizer_kwargs, extra, hdet.auto_lr)
  groups = _param_groups(hdet.param_groups)
  _check_replicas(hdet.num_replicas, hdet.spread, hdet.replica_axis)
  exact_sync = arguments.flag(hdet.exact_sync, 'exact_sync', who='hdet')
  guard_nonfinite = arguments.flag(hdet.guard_nonfinite, 'guard_nonfinite', who='hdet')
  if not arguments.is_int(hdet.seed):
    raise ValueError(f"hdet: seed must be an integer (it seeds the multipliers' permutations), got {hdet.seed!r}.")
  sync_windows = sync_lib.as_windows(_sync_every(hdet.sync_every, hdet.auto_lr))
  lr = Explore(learning_rate, float(hdet.spread), low=None, high=None)
  names = hyperparam_names(param_groups=dict(groups), explore=dict(extra), built=built)
  hps = tuple(zip(names, (lr,) * (len(names) - len(extra)) + tuple(h for _, h in extra)))
  for name, h in extra:
    _check_explored_value(name, h)
  lows = tuple(-math.inf if h.low is None else float(h.low) for _, h in hps)
  controlled = _controller_plan(hdet.auto_lr, hps, lows, hdet.spread, sync_windows, built)
  spreads = tuple(float(h.spread) for _, h in hps)
  additive = tuple(bool(h.additive) for _, h in hps)
  scale, offset = _spread_tables(int(hdet.num_replicas), spreads, additive)
  _warn_if_plain(int(hdet.num_replicas), spreads, hdet.auto_lr)
  return Plan(
    optimizer=hdet.optimizer,
    optimizer_kwargs=dict(hdet.optimizer_kwargs),
    names=names,
    schedules=tuple(h.value for _, h in hps),
    spreads=spreads,
    additive=additive,
    lows=lows,
    highs=tuple(math.inf if h.high is None else float(h.high) for _, h in hps),
    to_optimizer=tuple(h.to_optimizer for _, h in hps),
    learning_rates=tuple(is_learning_rate(name) for name in names),
    scale=scale,
    offset=offset,
    groups=groups,
    num_replicas=int(hdet.num_replicas),
    sync_windows=sync_windows,
    replica_axis=hdet.replica_axis,
    auto_lr=hdet.auto_lr,
    **controlled,
    exact_sync=exact_sync,
    guard_nonfinite=guard_nonfinite,
    seed=hdet.seed,
    average_opt_state=arguments.flag(hdet.average_opt_state, 'average_opt_state', who='hdet'),
    built=built,
    rollback=check_rollback(hdet.rollback, hdet.auto_lr),
  )


# hdet()'s removed arguments, each with what to do instead (research/README.md, 'Retired in 1.0'): without this
# check they would reach the wrapped optimizer as keywords and fail there.
REMOVED_ARGUMENTS = {'fan': 'the learning rates fan out linearly (eq. 1, spread in [0, 1)); drop the argument'}


def _sync_every(sync_every, auto_lr):
  """``sync_every`` with None as the measured default: ``round(S / 15)``, at most 100, with ``auto_lr``'s S, else 100
  (a ``total_steps`` that is not a count is refused with the other settings)."""
  if sync_every is not None:
    return sync_every
  counted = isinstance(auto_lr, AutoLR) and arguments.is_int(auto_lr.total_steps)
  return sync_lib.default_period(auto_lr.total_steps) if counted else 100


def _checked_optimizer(optimizer, learning_rate, optimizer_kwargs, extra, auto_lr):
  """The learning rate the plan spreads: the factory's ``learning_rate``, or around a built optimizer the factor
  1 it scales (see :func:`_built_reference`); one clear error for an optimizer that is neither."""
  if is_built(optimizer):
    return _built_reference(learning_rate, optimizer_kwargs, extra, auto_lr)
  if not callable(optimizer):
    raise ValueError(
      f'optimizer must be a built optax transformation (e.g. optax.adamw(3e-3)) or an optax factory such as '
      f'optax.adamw (called with learning_rate=), got {optimizer!r}.'
    )
  if learning_rate is None:
    raise ValueError(
      'hdet: learning_rate is required with an optimizer factory (e.g. hdet(optax.adamw, 3e-3, ...)); '
      'or pass the optimizer you already built, hdet(optax.adamw(3e-3), ...), which keeps its own.'
    )
  _check_value('learning_rate', learning_rate)
  return learning_rate


def _check_value(who: str, value, finite: bool = True) -> None:
  """A hyperparameter's value: a finite number (or array scalar), or a schedule (a function of the step)."""
  if callable(value) or isinstance(value, jax.core.Tracer):
    return  # (a traced value gets its own error line where it is read, evaluate_schedules)
  array = isinstance(value, (jax.Array, np.ndarray)) and np.ndim(value) == 0
  if not (arguments.is_number(value) or array) or (finite and not math.isfinite(float(value))):
    raise ValueError(f'{who} must be a finite number or an optax schedule (a function of the step), got {value!r}.')


def check_rollback(rollback: bool, auto_lr: 'AutoLR | None') -> bool:
  """``hdet(rollback=...)`` checked against its controller (raises ValueError, one line): the rollback returns to the
  last sync where the guard backs off, so it needs the guard, the 'fit' controller with ``backoff=True``. The trainer
  checks its config with it too.

  Example:
    >>> from hdet_jax import settings
    >>> settings.check_rollback(True, settings.AutoLR(total_steps=100))
    True
    >>> settings.check_rollback(True, None)
    Traceback (most recent call last):
    ...
    ValueError: rollback=True returns the replicas to the last sync where the guard backs off, so it needs the ...
  """
  rollback = arguments.flag(rollback, 'rollback', who='hdet')
  if rollback and not (isinstance(auto_lr, AutoLR) and ctrl.is_fit(auto_lr) and auto_lr.backoff):
    raise ValueError(
      'rollback=True returns the replicas to the last sync where the guard backs off, so it needs the guard: '
      "the 'fit' controller with backoff=True (hdet_jax.AutoLR(total_steps=...), its default), or rollback=False."
    )
  return rollback


def is_built(optimizer) -> bool:
  """Whether ``optimizer`` is a built transformation (``init`` and ``update``), not a factory of the LR."""
  return callable(getattr(optimizer, 'init', None)) and callable(getattr(optimizer, 'update', None))


def _built_reference(learning_rate, optimizer_kwargs, extra, auto_lr) -> float:
  """The learning-rate row's reference around a built optimizer, after checking what cannot apply to one.

  The row is a factor on the optimizer's own learning rate, 1 at the reference: the guarded climb starts its
  correction at ``initial_scale`` (0.1) of it, as it starts a factory's schedule at a tenth.
  """
  if learning_rate is not None:
    raise ValueError(
      'hdet: the optimizer is already built and carries its own learning rate; drop learning_rate= (HDET then '
      'scales its updates per replica), or pass a factory such as optax.adamw with learning_rate=.'
    )
  if optimizer_kwargs:
    raise ValueError(
      f'hdet: {sorted(optimizer_kwargs)[0]}= goes to an optimizer factory, but the optimizer is already built; '
      'set it where you build the optimizer.'
    )
  passed = [name for name, h in extra if h.to_optimizer]
  if passed:
    raise ValueError(
      f'hdet: explore[{passed[0]!r}] is passed to the optimizer, which is already built; explore it with a '
      f'factory (hdet(optax.adamw, schedule, explore=...)), or set to_optimizer=False if the step reads it.'
    )
  if isinstance(auto_lr, AutoLR) and ctrl.is_paper(auto_lr):
    raise ValueError(
      "hdet: AutoLR.paper replaces the schedule with the controller's own, which a built optimizer keeps "
      'inside; use AutoLR(total_steps=...) (it scales your schedule), or a factory with learning_rate=.'
    )
  return 1.0


def _explored(explore, optimizer_kwargs) -> tuple[tuple[str, Explore], ...]:
  """``explore`` as (name, Explore) pairs, in order."""
  extra = []
  for name, spec in (explore or {}).items():
    if name == 'learning_rate' or name in optimizer_kwargs:
      raise ValueError(f'explore: {name!r} is already set; name each hyperparameter once.')
    if isinstance(spec, tuple) and len(spec) == 2:
      spec = Explore(spec[0], spec[1])
    if not isinstance(spec, Explore):
      raise ValueError(
        f'explore[{name!r}] must be an hdet_jax.Explore or a (value or schedule, spread) pair, got {spec!r}.'
      )
    extra.append((name, spec))
  return tuple(extra)


def _param_groups(param_groups) -> tuple[tuple[str, str], ...]:
  if param_groups is not None and not isinstance(param_groups, dict):
    raise ValueError(
      f'param_groups must be None or a dict of group name -> regex of parameter paths, got {param_groups!r}.'
    )
  groups = tuple((param_groups or {}).items())
  for group, pattern in groups:
    try:
      re.compile(pattern)
    except (re.error, TypeError) as e:
      raise ValueError(f'param_groups[{group!r}]: {pattern!r} is not a valid regex: {e}') from None
  return groups


def _check_replicas(num_replicas, spread, replica_axis) -> None:
  arguments.count(num_replicas, 'num_replicas', who='hdet', what=' (the replica axis size)')
  if not arguments.is_spread(spread):
    raise ValueError(
      f'spread (alpha) must be in [0, 1): the lowest multiplier 1 - spread must stay positive; got {spread!r}.'
    )
  arguments.axis_name(replica_axis, 'replica_axis', who='hdet')


def _warn_if_plain(num_replicas: int, spreads: tuple[float, ...], auto_lr) -> None:
  """One warning where the settings leave nothing to compare (an error would refuse a baseline run meant so)."""
  if num_replicas == 1:
    arguments.warn_plain_training('hdet', 'num_replicas=1 (one replica)', stacklevel=5)
  elif auto_lr is None and not any(spreads):
    arguments.warn_plain_training('hdet', 'spread=0, no explored spread and auto_lr=None', stacklevel=5)


def _check_explored_value(name: str, h: Explore) -> None:
  lo = -math.inf if h.low is None else h.low
  hi = math.inf if h.high is None else h.high
  if (
    not arguments.is_number(h.spread)
    or not math.isfinite(h.spread)
    or h.spread < 0
    or (not h.additive and h.spread >= 1)
  ):
    raise ValueError(
      f'explore[{name!r}]: spread must be in [0, 1) (multiplicative) or >= 0 (additive), got {h.spread!r}.'
    )
  if not lo < hi:
    raise ValueError(f'explore[{name!r}]: low={h.low!r} must be below high={h.high!r}.')
  _check_value(f'explore[{name!r}]: value', h.value, finite=False)  # (its own line below says non-finite)
  v0 = evaluate_schedules([h.value], [0])[0][0]
  if not math.isfinite(v0):
    raise ValueError(f'explore[{name!r}]: the value {v0!r} is not finite.')
  edge = (v0 - h.spread, v0 + h.spread) if h.additive else (v0 * (1 - h.spread), v0 * (1 + h.spread))
  if edge[0] < lo or edge[1] > hi:
    raise ValueError(
      f'explore[{name!r}]: value {v0!r} with spread {h.spread!r} spans [{edge[0]:.4g}, {edge[1]:.4g}], '
      f'which leaves the valid range [{lo}, {hi}]; lower the spread or move the value.'
    )


def _controller_plan(auto_lr, hps, lows, spread, sync_windows, built: bool) -> dict[str, Any]:
  """The Plan's controller fields: ``controller_start``, and per hyperparameter ``decay``, ``floors``,
  ``start_values``."""
  g = len(hps)
  if auto_lr is None:
    return dict(
      controller_start=0, decay=(0.0,) * g, floors=lows, start_values=(0.0,) * g, initial_correction=(0.0,) * g
    )
  a = auto_lr
  check_auto_lr(a, spread)
  # The first sync at or after the warmup (syncs happen after steps T, 2T, ... for a fixed T).
  start = sync_lib.first_sync_at_or_after(sync_windows, int(a.warmup_steps))
  last = int(a.total_steps) - 1
  if start >= last:
    raise ValueError(
      f'auto_lr: the first sync at or after warmup_steps={a.warmup_steps} is step '
      f'{start}, not before total_steps={a.total_steps}; lower auto_lr.warmup_steps '
      f'or sync_every={sync_windows if len(sync_windows) > 1 else sync_windows[0]}.'
    )
  firsts, finals = zip(*evaluate_schedules([h.value for _, h in hps], [start, last]))
  if not ctrl.is_fit(a):  # 'fit' scales the schedule; it needs no positive end value
    for (name, h), v0, v1 in zip(hps, firsts, finals):
      _check_decays_to_positive(name, h, v0, v1, start, last)
  if a.decay is not None and not a.decay < 1:
    raise ValueError(f'auto_lr.decay (gamma) must be < 1, got {a.decay!r}.')
  decay = _decays(a, hps, firsts, finals, num_syncs=sync_lib.syncs_between(sync_windows, start, last))
  if a.min_value is not None and not a.min_value > 0:
    raise ValueError(f'auto_lr.min_value must be > 0 (it keeps every LR positive), got {a.min_value!r}.')
  floors = tuple(
    lo
    if h.additive
    else max(lo, float(a.min_value) if (a.min_value is not None and is_learning_rate(name)) else 0.1 * v1)
    for (name, h), v1, lo in zip(hps, finals, lows)
  )
  # One start rule, a factory's schedule and a built optimizer's own LR alike (issue 84; results/start_rule.md).
  start_scale = a.initial_scale if a.initial_scale is not None else DEFAULT_INITIAL_SCALE
  initial = tuple(math.log(start_scale) if is_learning_rate(name) else 0.0 for name, _ in hps)
  return dict(
    controller_start=start,
    decay=decay,
    floors=floors,
    start_values=tuple(firsts),
    initial_correction=initial,
    anneal_from=_anneal_from(a, hps[0][1].value, built),
  )


def _anneal_from(a: AutoLR, learning_rate, built: bool) -> int | None:
  """The plan's ``anneal_from`` (see :func:`anneal_start`): from the factory's learning-rate schedule; around a
  built optimizer from ``auto_lr.schedule``, or where none is given the step a cosine decay from ``warmup_steps`` to
  ``total_steps`` would fall below ``anneal_fraction`` of its peak (halfway, at 0.5)."""
  if not ctrl.is_fit(a) or a.anneal_fraction == 0:
    return None
  if not built and a.schedule is not None:
    raise ValueError(
      'auto_lr.schedule is for a built optimizer, whose schedule hdet cannot see; with a factory hdet reads the '
      'schedule you pass as learning_rate: drop auto_lr.schedule.'
    )
  if built and a.schedule is None:
    into = math.acos(2.0 * a.anneal_fraction - 1.0) / math.pi  # cos decay (1 + cos(pi x)) / 2 = fraction at x
    return a.warmup_steps + math.ceil(into * (a.total_steps - a.warmup_steps))
  return anneal_start(a.schedule if built else learning_rate, a.total_steps, a.anneal_fraction)


def _check_decays_to_positive(name, h, v0, v1, start, last) -> None:
  """The paper controller decays geometrically: a multiplicative value's schedule must stay > 0."""
  if h.additive:
    return
  who = 'learning_rate' if is_learning_rate(name) else f'explore[{name!r}]'
  if not (v1 > 0 and math.isfinite(v1)):
    raise ValueError(
      f'{who}: the {name} schedule ends at {v1!r} at step {last}; the auto-LR '
      'controller decays geometrically towards it and needs it > 0. Use a schedule with a '
      'positive final value (e.g. one_cycle), an additive spread, or auto_lr=None.'
    )
  if not (v0 > 0 and math.isfinite(v0)):
    raise ValueError(
      f'{who}: the {name} schedule is {v0!r} at step {start}, when the controller starts; it must be > 0.'
    )


def _decays(a: AutoLR, hps, firsts, finals, num_syncs: float) -> tuple[float, ...]:
  """gamma per hyperparameter: reaches the schedule's final value after ``num_syncs`` syncs.

  The smooth path reaches it exactly at step S - 1, the staircase within one window of it. Additive
  hyperparameters follow their schedule's start and end values' difference only through the controller,
  so they get no decay; neither does the 'fit' controller, which follows the schedule itself.
  """
  return tuple(
    0.0
    if h.additive or ctrl.is_fit(a)
    else float(a.decay)
    if (a.decay is not None and is_learning_rate(name))
    else ctrl.decay_for_schedule(v0, v1, num_syncs)
    for (name, h), v0, v1 in zip(hps, firsts, finals)
  )


def _spread_tables(n: int, spreads, additive) -> tuple[np.ndarray, np.ndarray]:
  """[G, N] multipliers rho (eq. 1; 1 when additive) and [G, N] additive offsets (0 when multiplicative)."""
  unit = multipliers.unit_offsets(n)
  scale = np.asarray(
    [np.ones(n) if add else multipliers.spread_multipliers(n, sp) for sp, add in zip(spreads, additive)], np.float32
  )
  offset = np.asarray([sp * unit if add else np.zeros(n) for sp, add in zip(spreads, additive)], np.float32)
  return scale, offset
