"""The HDET optax transformation: fan-out, converge and the auto-LR controller.

``hdet`` wraps an optax optimizer *factory* (``optax.adam``, ``optax.sgd``, any callable that
takes ``learning_rate=`` and returns a transformation) and turns a plain data-parallel
training step into Hyperparameter-Divergent Ensemble Training. It runs wherever the replica
axis is bound: ``jax.shard_map`` (the primary path), ``jax.pmap`` and
``jax.vmap(axis_name=...)``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from hdet_jax import controller as ctrl
from hdet_jax import multipliers
from hdet_jax import replicas
from hdet_jax import schedules


@dataclasses.dataclass(frozen=True)
class AutoLR:
  """Settings of the auto-LR controller (paper §3.4, eqs. 4-9).

  Attributes:
    total_steps: S, the length of the run; gamma is chosen so that with no signal the
      base decays geometrically to the base schedule's value at step S - 1.
    warmup_steps: S_warm; the controller updates at the first sync at or after this step.
      Before that the base follows the schedule (the replicas are already spread).
    temperature: sigma of the softmax over window losses (eq. 4). The paper used 0.1,
      the reference code defaults to 0.002. Loss differences are divided by it, so it
      should be on the scale of the replicas' loss differences.
    lr_of_lr: lambda, the step size of the base update (eq. 7).
    momentum: beta, the velocity's momentum (eq. 7), in [0, 1).
    decay: gamma override. None picks the geometric decay described above; pass
      ``hdet_jax.controller.reference_decay(div, final_div, K)`` to reproduce the reference.
    min_value: floor on every base value, keeping every replica's LR positive. None uses
      a tenth of the schedule's final value.
    smooth_decay: if True, within a window the base decays continuously,
      ``base_k (1 - gamma) ** (i / T - 1)`` at step i of the window (from the previous base,
      absent signal, to base_k), so with no signal the LR follows one continuous geometric
      curve; this fixes the reference's LR being frozen between syncs. False holds it at
      base_k between syncs, as the reference does.
    controller: ``'paper'`` (eqs. 4-9: softmax weights, additive step, geometric decay that
      replaces the schedule; the fields above) or ``'fit'`` (a quadratic line search along the
      replicas' line moving a multiplicative correction of the schedule; the fields below).
      See :mod:`hdet_jax.controller`.
    overshoot: 'fit': kappa >= 1, the target scale is kappa times the fitted best (PAL's 1.5-1.8;
      counters short-horizon bias). Learning rates and other multiplicative values only.
    trust: 'fit': the largest change of the log-correction per sync (multiplicative values;
      0.25 is a factor 1.28). Additive values move at most their spread per sync.
    memory: 'fit': forgetting factor in [0, 1) of the regression's statistics across syncs.
    stop_steps: 'fit' and 'paper': the controller makes no update at syncs after this step (the
      correction, or the base, then holds); None: it runs to the end.
  """
  total_steps: int
  warmup_steps: int = 0
  temperature: float = 0.1
  lr_of_lr: float = 0.5
  momentum: float = 0.9
  decay: float | None = None
  min_value: float | None = None
  smooth_decay: bool = True
  controller: str = 'paper'
  overshoot: float = 1.5
  trust: float = 0.25
  memory: float = 0.5
  stop_steps: int | None = None


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
      ``state.values`` (see :func:`replica_value`).
  """
  value: Any
  spread: float
  additive: bool = False
  low: float | None = None
  high: float | None = None
  to_optimizer: bool = True


class HDETState(NamedTuple):
  """The state of :func:`hdet` on one replica (G = explored hyperparameters, N = replicas).

  Everything except ``loss_sum`` is identical on all replicas: the wrapped optimizer sees
  the same all-reduced gradient everywhere, and the controller's inputs are all-gathered.

  ``values`` and ``base`` hold what the *coming* step uses, computed at the end of the previous
  update (or by ``init``): an update reads its hyperparameters from the state instead of
  recomputing the schedule, and the train step can log, or feed to the model, exactly the
  values the step trains with. The fields are ordered so that every field an update may
  overwrite without reading (``base``, ``synced``) comes last among the fields of its shape:
  jit drops unread inputs, and JAX pairs donated input buffers with outputs in order per
  shape, so an unread field placed earlier would shift that pairing and cost a copy of every
  later same-shaped field on every step.
  """
  count: jax.Array          # [] int32: updates applied so far.
  inner_state: Any          # the wrapped optimizer's state.
  loss_sum: jax.Array       # [] float32: this replica's sum of ``value`` in the current window.
  values: jax.Array         # [G, N] float32: every replica's value for the coming step (read them in
                            #   the forward pass for model and loss hyperparameters).
  sync_count: jax.Array     # [] int32: syncs (parameter averages) done so far.
  finite_replicas: jax.Array  # [] int32: replicas that entered the last average (N when all were finite).
  replica_ok: jax.Array     # [] bool: whether this replica entered the last average.
  controller: ctrl.ControllerState  # base for the window, velocity, perm, key, losses, weights, delta.
  base: jax.Array           # [G] float32: the base value for the coming step.
  synced: jax.Array         # [] bool: whether the last update was a sync step.

  @property
  def learning_rates(self) -> jax.Array:
    """[N]: every replica's learning rate for the coming step."""
    return self.values[..., 0, :]

  @property
  def base_learning_rate(self) -> jax.Array:
    """[]: the base learning rate for the coming step."""
    return self.base[..., 0]


class _Config(NamedTuple):
  names: tuple[str, ...]
  schedules: tuple[Any, ...]
  spreads: tuple[float, ...]
  additive: tuple[bool, ...]
  lows: tuple[float, ...]
  highs: tuple[float, ...]
  to_optimizer: tuple[bool, ...]
  groups: tuple[tuple[str, str], ...]
  num_replicas: int
  sync_every: int
  replica_axis: str
  auto_lr: AutoLR | None
  controller_start: int
  decay: tuple[float, ...]
  floors: tuple[float, ...]
  start_values: tuple[float, ...]


def hdet(
    optimizer: Callable[..., optax.GradientTransformation],
    learning_rate: optax.ScalarOrSchedule,
    *,
    num_replicas: int,
    spread: float = 0.25,
    sync_every: int = 100,
    replica_axis: str = 'data',
    auto_lr: AutoLR | None = None,
    exact_sync: bool = False,
    seed: int = 0,
    explore: dict[str, Explore | tuple[optax.ScalarOrSchedule, float]] | None = None,
    param_groups: dict[str, str] | None = None,
    guard_nonfinite: bool = True,
    **optimizer_kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
  """Hyperparameter-Divergent Ensemble Training around an optax optimizer.

  Replica r (its index on ``replica_axis``) trains with learning rate
  ``base(t) * rho[perm[r]]`` on the shared, already all-reduced gradient, where

  .. math::

    \\rho_r = 1 + \\alpha \\frac{r - (N-1)/2}{\\max((N-1)/2, 0.5)}

  (eq. 1). Every ``sync_every`` steps the replicas' parameters are averaged over the axis
  (eq. 3, one all-reduce, only on those steps) and the multipliers are reassigned by a fresh
  permutation drawn from a key shared by all replicas. With ``auto_lr`` set, each sync at or
  after its warmup also all-gathers each replica's mean loss over the window and moves the
  base (eqs. 4-9): ``w = softmax((mean L - L) / sigma)``,
  ``delta = sum_r w_r lr_r - mean_r lr_r``, ``v = beta v + (1 - beta) delta``,
  ``base = mean_r lr_r (1 - gamma) + lambda v``, floored to stay positive.

  With ``spread=0`` and no controller the updates equal ``optimizer(learning_rate)``'s bit
  for bit between syncs (and the sync is a no-op up to rounding, since the replicas agree).

  Sync steps: the update of step t with ``(t + 1) % sync_every == 0`` returns
  ``pmean(p + u) - p``. Applied with ``optax.apply_updates`` the replicas then agree to
  rounding: ``|p'_r - avg| <= eps (|avg| + |avg - p_r|)`` with eps the unit roundoff
  (2**-24 for float32), about one ulp. For a bitwise-exact assignment build with
  ``exact_sync=True`` and apply with :func:`apply_updates`, which assigns ``pmean(p + u)``.

  Args:
    optimizer: an optax factory taking ``learning_rate=`` (e.g. ``optax.adamw``); it is
      called inside every update with this replica's learning rate.
    learning_rate: the base schedule (any optax schedule or a float), e.g.
      :func:`hdet_jax.one_cycle`.
    num_replicas: N, the size of ``replica_axis``.
    spread: alpha in [0, 1).
    sync_every: T >= 1, steps between parameter averages.
    replica_axis: the mapped axis the replicas live on. Keep it distinct from any axis
      the model is sharded over (FSDP, tensor parallel): only it is averaged over.
    auto_lr: controller settings, or None for fan-out/converge only.
    exact_sync: if True the sync step returns the inner update only and
      :func:`apply_updates` does the averaging, assigning the average exactly.
    seed: seeds the permutation key (identical on every replica).
    explore: more hyperparameters to explore like the learning rate,
      ``{name: Explore(...)}`` or ``{name: (value or schedule, spread)}`` (multiplicative),
      e.g. ``{'weight_decay': (1e-2, 0.5), 'dropout': Explore(0.1, 0.05, additive=True,
      low=0.0, high=0.9, to_optimizer=False)}``. Each gets its own permutation, velocity and
      base; optimizer hyperparameters are passed to ``optimizer`` as that keyword.
    param_groups: per-group learning rates, ``{group: regex}`` on parameter paths such as
      ``'blocks/0/attn/kernel'`` (``re.search``); every parameter must match exactly one
      group. Each group gets its own base LR, velocity and permutation, and the wrapped
      optimizer becomes ``optax.multi_transform`` over the groups.
    Index g of the state's [G] fields follows ``hyperparam_names(...)``: the learning rate
    (or ``learning_rate/<group>`` per group, in order), then ``explore`` in order.
    guard_nonfinite: if True (default) a sync averages only the replicas whose parameters
      are all finite and resets the others to that average (with ``exact_sync=True`` and
      :func:`apply_updates`; an additive optax update cannot reset a NaN parameter, so on that path
      the replica stays out of every later average), and a replica whose window loss
      is not finite gets controller weight 0 (its LR counts as too large: the signal moves
      away from it). ``state.finite_replicas`` says how many entered the average; 0 means
      every replica blew up and the parameters stay non-finite. Pair it with
      :func:`hdet_jax.pmean_finite` for the gradient all-reduce, since every replica shares
      the averaged gradient.
    **optimizer_kwargs: passed to ``optimizer`` (e.g. ``weight_decay=0.1``).

  Returns:
    An ``optax.GradientTransformationExtraArgs``. ``update(grads, state, params, *,
    value=None, sync=None)``: ``value`` is this replica's loss (required with ``auto_lr``,
    the convention of ``optax.contrib.reduce_on_plateau``); ``sync`` may be a Python bool
    to pick the sync or non-sync program at trace time (it must agree with the step count;
    the default decides with ``lax.cond``). ``update(None, state, params, sync=True)`` runs only
    the end of a window (the average and the controller) on the parameters after a step that
    ran with ``sync=False``: a training loop can then compile its step once and run the sync as
    a separate small program, instead of compiling the whole step a second time.

  Example:
    >>> tx = hdet(optax.adam, one_cycle(max_lr=3e-3, total_steps=1000), num_replicas=8,
    ...           spread=0.25, sync_every=20, auto_lr=AutoLR(total_steps=1000, warmup_steps=100))
    >>> # inside shard_map over 'data', on one replica's params and the pmean'd grads:
    >>> updates, opt_state = tx.update(grads, opt_state, params, value=loss)
    >>> params = optax.apply_updates(params, updates)
  """
  extra = []
  for name, spec in (explore or {}).items():
    if name == 'learning_rate' or name in optimizer_kwargs:
      raise ValueError(f'explore: {name!r} is already set; name each hyperparameter once.')
    if isinstance(spec, tuple) and len(spec) == 2:
      spec = Explore(spec[0], spec[1])
    if not isinstance(spec, Explore):
      raise ValueError(
          f'explore[{name!r}] must be an hdet_jax.Explore or a (value or schedule, spread) pair, got {spec!r}.')
    extra.append((name, spec))
  groups = tuple((param_groups or {}).items())
  for group, pattern in groups:
    try:
      re.compile(pattern)
    except (re.error, TypeError) as e:
      raise ValueError(f'param_groups[{group!r}]: {pattern!r} is not a valid regex: {e}') from None
  cfg = _make_config(
      learning_rate=learning_rate, num_replicas=num_replicas, spread=spread,
      sync_every=sync_every, replica_axis=replica_axis, auto_lr=auto_lr, extra=tuple(extra),
      groups=groups)
  if not callable(optimizer):
    raise ValueError(
        f'optimizer must be an optax factory such as optax.adam (called with learning_rate=), '
        f'got {optimizer!r}. To wrap an existing instance use lambda learning_rate: ...')
  n, g = cfg.num_replicas, len(cfg.names)
  unit = multipliers.unit_offsets(n)
  scale = jnp.asarray([
      np.ones(n) if add else multipliers.spread_multipliers(n, sp)
      for sp, add in zip(cfg.spreads, cfg.additive)], jnp.float32)  # [G, N]
  offset = jnp.asarray([
      sp * unit if add else np.zeros(n)
      for sp, add in zip(cfg.spreads, cfg.additive)], jnp.float32)  # [G, N]
  low = jnp.asarray(cfg.lows, jnp.float32)[:, None]
  high = jnp.asarray(cfg.highs, jnp.float32)[:, None]
  tables = (scale, offset)

  def replica_values(base, perm):
    """[G, N]: every replica's value for base [G] under permutations perm [G, N]."""
    v = (base[:, None] * jnp.take_along_axis(scale, perm, axis=1)
         + jnp.take_along_axis(offset, perm, axis=1))
    return jnp.clip(v, low, high)

  def build_inner(values):
    hp = dict(zip(cfg.names, values))
    kwargs = {k: v for k, v, to_opt in zip(cfg.names, values, cfg.to_optimizer)
              if to_opt and not k.startswith('learning_rate')}
    if not cfg.groups:
      return optimizer(learning_rate=hp['learning_rate'], **kwargs, **optimizer_kwargs)
    return optax.multi_transform(
        {group: optimizer(learning_rate=hp[f'learning_rate/{group}'], **kwargs, **optimizer_kwargs)
         for group, _ in cfg.groups},
        lambda params: group_labels(params, dict(cfg.groups)))

  def init_fn(params):
    start = _base_values(cfg, jnp.zeros([], jnp.int32), None)
    inner = build_inner(list(start))
    perm0 = multipliers.identity_permutations(g, n)
    return HDETState(
        count=jnp.zeros([], jnp.int32),
        inner_state=inner.init(params),
        loss_sum=jnp.zeros([], jnp.float32),
        values=replica_values(start, perm0),
        sync_count=jnp.zeros([], jnp.int32),
        finite_replicas=jnp.full([], n, jnp.int32),
        replica_ok=jnp.ones([], bool),
        controller=ctrl.init_controller_state(
            jnp.asarray(cfg.start_values, jnp.float32), n,
            jax.random.key_data(jax.random.key(seed))),
        base=start,
        synced=jnp.zeros([], bool),
    )

  def update_fn(updates, state, params=None, *, value=None, sync=None, score=None, **extra_args):
    replicas.axis_size_or_raise(cfg.replica_axis, cfg.num_replicas)
    window_end_only = updates is None
    if window_end_only and (sync is not True or params is None or value is not None):
      raise ValueError(
          'hdet: updates=None runs only the end of a window (the average and the controller, on the '
          'parameters after the last step): call tx.update(None, state, params, sync=True).')
    if score is not None and (sync is False or jnp.ndim(score) != 0):
      raise ValueError(
          'hdet: score= is this replica\'s scalar loss for the controller at a sync (e.g. on a batch '
          'common to all replicas); pass it with sync=True (or sync=None on a sync step).')
    if cfg.auto_lr is not None and value is None and not window_end_only:
      raise ValueError(
          'hdet: auto_lr is on, so update() needs this replica\'s loss: call '
          'tx.update(grads, state, params, value=loss).')
    if value is not None and jnp.ndim(value) != 0:
      raise ValueError(
          f'hdet: value must be this replica\'s scalar loss, got shape {jnp.shape(value)}. '
          'Reduce the per-example losses to their mean first.')
    if params is None:
      raise ValueError('hdet: update() needs params (the sync averages them).')
    if sync is not None and not isinstance(sync, bool):
      raise ValueError(f'hdet: sync must be None or a Python bool, got {type(sync).__name__}.')

    if window_end_only:  # the step itself already ran, with sync=False
      updates = jax.tree.map(jnp.zeros_like, params)
    else:
      values = state.values[:, lax.axis_index(cfg.replica_axis)]  # [G]: this replica's, for this step
      inner = optax.with_extra_args_support(build_inner([values[i] for i in range(g)]))
      if value is not None:  # the wrapped optimizer may read the loss too (reduce_on_plateau)
        extra_args = dict(extra_args, value=value)
      updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
      loss = jnp.zeros([], jnp.float32) if value is None else jnp.asarray(value, jnp.float32)
      state = state._replace(
          count=state.count + 1, inner_state=inner_state, loss_sum=state.loss_sum + loss,
          synced=jnp.zeros([], bool))
    new_count = state.count

    def do_sync(operands):
      upd, st = operands
      stepped = optax.apply_updates(params, upd)
      ok = jnp.ones([], bool)
      if guard_nonfinite:
        # A replica whose parameters or window loss went non-finite sits this average out
        # and is reset to the others' average.
        ok = jnp.logical_and(replicas.all_finite(stepped), jnp.isfinite(st.loss_sum))
      if exact_sync:  # apply_updates does the averaging, reading replica_ok.
        count = lax.psum(ok.astype(jnp.int32), cfg.replica_axis)
      else:
        new_params, count = _average(stepped, cfg.replica_axis, guard_nonfinite, ok)
        upd = jax.tree.map(lambda a, b: (a - b).astype(b.dtype), new_params, params)
      st = st._replace(finite_replicas=count, replica_ok=ok)
      st = _sync_controller(cfg, replica_values, tables, st, score=score,
                            gather=value is not None or window_end_only)
      return upd, st

    def no_sync(operands):
      return operands

    if sync is None:
      is_sync = new_count % cfg.sync_every == 0
      operands = (updates, state)
      updates, state = lax.cond(
          is_sync,
          lambda ops: replicas.match_vma(do_sync(ops), ops),
          no_sync,
          operands)
    elif sync:
      updates, state = do_sync((updates, state))
    # What the next step will use (after any reshuffle).
    base = _base_values(cfg, state.count, state.controller)
    state = state._replace(base=base, values=replica_values(base, state.controller.perm))
    return updates, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _average(tree, axis_name, guard_nonfinite, ok=None):
  if guard_nonfinite:
    return replicas.finite_mean(tree, axis_name, ok)
  return lax.pmean(tree, axis_name), jnp.asarray(lax.axis_size(axis_name), jnp.int32)


def apply_updates(params: Any, updates: Any, state: HDETState, *, replica_axis: str = 'data',
                  sync: bool | None = None, guard_nonfinite: bool = True) -> Any:
  """``optax.apply_updates`` that assigns the replicas' average exactly on sync steps.

  For a transformation built with ``exact_sync=True`` (whose sync-step update leaves the
  averaging to this function): ``p + u`` on ordinary steps, ``pmean(p + u)`` over
  ``replica_axis`` on sync steps (``state.synced``, or the static ``sync``), so every replica
  holds bitwise the same average. Call it inside the same mapped context as the update.
  """
  new_params = optax.apply_updates(params, updates)
  average = lambda p: _average(p, replica_axis, guard_nonfinite, state.replica_ok)[0]
  if sync is False:
    return new_params
  if sync:
    return average(new_params)
  return lax.cond(
      state.synced,
      lambda p: replicas.match_vma(average(p), p),
      lambda p: p,
      new_params)


def _make_config(*, learning_rate, num_replicas, spread, sync_every, replica_axis, auto_lr,
                 extra=(), groups=()) -> _Config:
  """Validates every setting eagerly; each error names the parameter and the fix."""
  if not _is_int(num_replicas) or num_replicas < 1:
    raise ValueError(f'num_replicas must be a positive integer (the replica axis size), got {num_replicas!r}.')
  if not isinstance(spread, (int, float)) or not 0.0 <= spread < 1.0:
    raise ValueError(
        f'spread (alpha) must be in [0, 1): the lowest multiplier 1 - spread must stay positive; got {spread!r}.')
  if not _is_int(sync_every) or sync_every < 1:
    raise ValueError(f'sync_every (T) must be an integer >= 1, got {sync_every!r}.')
  if not isinstance(replica_axis, str) or not replica_axis:
    raise ValueError(f'replica_axis must be a mesh/map axis name, got {replica_axis!r}.')
  sync_every = int(sync_every)
  lr = Explore(learning_rate, float(spread), low=None, high=None)
  if groups:
    hps = tuple((f'learning_rate/{group}', lr) for group, _ in groups) + tuple(extra)
  else:
    hps = (('learning_rate', lr),) + tuple(extra)
  names = tuple(name for name, _ in hps)
  scheds = tuple(h.value for _, h in hps)
  spreads = tuple(float(h.spread) for _, h in hps)
  additive = tuple(bool(h.additive) for _, h in hps)
  lows = tuple(-math.inf if h.low is None else float(h.low) for _, h in hps)
  highs = tuple(math.inf if h.high is None else float(h.high) for _, h in hps)
  for name, h in extra:
    lo = -math.inf if h.low is None else h.low
    hi = math.inf if h.high is None else h.high
    if not isinstance(h.spread, (int, float)) or not math.isfinite(h.spread) or h.spread < 0 or (
        not h.additive and h.spread >= 1):
      raise ValueError(
          f'explore[{name!r}]: spread must be in [0, 1) (multiplicative) or >= 0 (additive), got {h.spread!r}.')
    if not lo < hi:
      raise ValueError(f'explore[{name!r}]: low={h.low!r} must be below high={h.high!r}.')
    v0 = _eval(h.value, 0)
    if not math.isfinite(v0):
      raise ValueError(f'explore[{name!r}]: the value {v0!r} is not finite.')
    edge = (v0 - h.spread, v0 + h.spread) if h.additive else (v0 * (1 - h.spread), v0 * (1 + h.spread))
    if edge[0] < lo or edge[1] > hi:
      raise ValueError(
          f'explore[{name!r}]: value {v0!r} with spread {h.spread!r} spans [{edge[0]:.4g}, {edge[1]:.4g}], '
          f'which leaves the valid range [{lo}, {hi}]; lower the spread or move the value.')
  controller_start = 0
  decay = tuple(0.0 for _ in names)
  floors = lows
  start_values = tuple(0.0 for _ in names)
  if auto_lr is not None:
    if not isinstance(auto_lr, AutoLR):
      raise ValueError(f'auto_lr must be an hdet_jax.AutoLR or None, got {type(auto_lr).__name__}.')
    a = auto_lr
    if not _is_int(a.total_steps) or a.total_steps < 2:
      raise ValueError(f'auto_lr.total_steps must be an integer >= 2, got {a.total_steps!r}.')
    if not _is_int(a.warmup_steps) or not 0 <= a.warmup_steps < a.total_steps:
      raise ValueError(
          f'auto_lr.warmup_steps must be in [0, total_steps={a.total_steps}), got {a.warmup_steps!r}.')
    if not a.temperature > 0:
      raise ValueError(f'auto_lr.temperature (sigma) must be > 0, got {a.temperature!r}.')
    if not 0.0 <= a.momentum < 1.0:
      raise ValueError(f'auto_lr.momentum (beta) must be in [0, 1), got {a.momentum!r}.')
    if not a.lr_of_lr >= 0:
      raise ValueError(f'auto_lr.lr_of_lr (lambda) must be >= 0, got {a.lr_of_lr!r}.')
    if a.controller not in ctrl.VARIANTS:
      raise ValueError(f'auto_lr.controller must be one of {ctrl.VARIANTS}, got {a.controller!r}.')
    if not (isinstance(a.overshoot, (int, float)) and 1.0 <= a.overshoot < math.inf):
      raise ValueError(f'auto_lr.overshoot (kappa) must be >= 1, got {a.overshoot!r}.')
    if not (isinstance(a.trust, (int, float)) and 0.0 < a.trust < math.inf):
      raise ValueError(f'auto_lr.trust must be > 0 (the largest log-step per sync), got {a.trust!r}.')
    if not (isinstance(a.memory, (int, float)) and 0.0 <= a.memory < 1.0):
      raise ValueError(f'auto_lr.memory must be in [0, 1), got {a.memory!r}.')
    if a.stop_steps is not None and (not _is_int(a.stop_steps) or a.stop_steps < 0):
      raise ValueError(f'auto_lr.stop_steps must be None or an integer >= 0, got {a.stop_steps!r}.')
    if spread == 0.0:
      raise ValueError(
          'auto_lr needs spread > 0: with spread=0 every replica trains at the same LR and the '
          'controller gets no signal. Set spread (e.g. 0.25) or auto_lr=None.')
    # The first sync at or after the warmup; syncs happen after steps T, 2T, ...
    controller_start = max(sync_every, -(-int(a.warmup_steps) // sync_every) * sync_every)
    last = int(a.total_steps) - 1
    if controller_start >= last:
      raise ValueError(
          f'auto_lr: the first sync at or after warmup_steps={a.warmup_steps} is step '
          f'{controller_start}, not before total_steps={a.total_steps}; lower auto_lr.warmup_steps '
          f'or sync_every={sync_every}.')
    evaluated = _evaluate(scheds, [controller_start, last])
    start_values = tuple(v[0] for v in evaluated)
    finals = tuple(v[1] for v in evaluated)
    is_lr = tuple(name.startswith('learning_rate') for name in names)
    for name, v0, v1, add, lr in zip(names, start_values, finals, additive, is_lr):
      if add or a.controller == 'fit':  # 'fit' scales the schedule; it needs no positive end value
        continue
      who = 'learning_rate' if lr else f'explore[{name!r}]'
      if not (v1 > 0 and math.isfinite(v1)):
        raise ValueError(
            f'{who}: the {name} schedule ends at {v1!r} at step {last}; the auto-LR '
            'controller decays geometrically towards it and needs it > 0. Use a schedule with a '
            'positive final value (e.g. one_cycle), an additive spread, or auto_lr=None.')
      if not (v0 > 0 and math.isfinite(v0)):
        raise ValueError(
            f'{who}: the {name} schedule is {v0!r} at step {controller_start}, when the '
            'controller starts; it must be > 0.')
    if a.decay is not None and not a.decay < 1:
      raise ValueError(f'auto_lr.decay (gamma) must be < 1, got {a.decay!r}.')
    # K syncs from the controller's start to the last step (the smooth path reaches the final
    # value exactly at step S - 1; the staircase within one window of it). Additive
    # hyperparameters follow their schedule's start and end values' difference only through
    # the controller, so they get no decay.
    k = (last - controller_start) / sync_every
    decay = tuple(
        0.0 if add or a.controller == 'fit' else float(a.decay) if (a.decay is not None and lr) else
        ctrl.decay_for_schedule(v0, v1, k)
        for v0, v1, add, lr in zip(start_values, finals, additive, is_lr))
    if a.min_value is not None and not a.min_value > 0:
      raise ValueError(f'auto_lr.min_value must be > 0 (it keeps every LR positive), got {a.min_value!r}.')
    floors = tuple(
        lo if add else max(lo, float(a.min_value) if (a.min_value is not None and lr) else 0.1 * v1)
        for v1, add, lr, lo in zip(finals, additive, is_lr, lows))
  return _Config(
      names=names, schedules=scheds, spreads=spreads, additive=additive, lows=lows, highs=highs,
      to_optimizer=tuple(h.to_optimizer for _, h in hps), groups=tuple(groups),
      num_replicas=int(num_replicas),
      sync_every=sync_every, replica_axis=replica_axis, auto_lr=auto_lr,
      controller_start=controller_start, decay=decay, floors=floors, start_values=start_values)


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _eval(schedule, step: int) -> float:
  return _evaluate([schedule], [step])[0][0]


def _evaluate(schedules, steps) -> list[list[float]]:
  """Values of several schedules at several steps, in one compiled call.

  Evaluating an optax schedule eagerly compiles each of its ops separately (about 30 MB of
  host memory for a one-cycle schedule on XLA:CPU); one jit of all of them costs a few MB.
  """
  fns = [s for s in schedules if callable(s)]
  got = iter(np.asarray(jax.jit(lambda: jnp.stack([
      jnp.stack([jnp.asarray(f(t), jnp.float32) for t in steps]) for f in fns]))()).tolist() if fns else [])
  return [next(got) if callable(s) else [float(s)] * len(steps) for s in schedules]


def _base_values(cfg: _Config, t: jax.Array, controller: ctrl.ControllerState | None) -> jax.Array:
  """[G] base values for step t: the schedule, or the controller's base once it has started."""
  scheduled = jnp.stack([
      jnp.asarray(s(t) if callable(s) else s, jnp.float32) for s in cfg.schedules])
  if cfg.auto_lr is None or controller is None:
    return scheduled
  if cfg.auto_lr.controller == 'fit':  # the user's schedule under the controller's correction
    add = jnp.asarray(cfg.additive)
    corrected = jnp.where(add, scheduled + controller.correction, scheduled * jnp.exp(controller.correction))
    return jnp.clip(corrected, jnp.asarray(cfg.lows, jnp.float32), jnp.asarray(cfg.highs, jnp.float32))
  if cfg.auto_lr.smooth_decay:
    # From base_k / (1 - gamma) at the sync (the previous base, with no signal) to base_k at
    # the next sync, so the no-signal path is one continuous geometric curve.
    into_window = (t % cfg.sync_every).astype(jnp.float32) / cfg.sync_every
    controlled = controller.base * jnp.asarray(1.0 - np.asarray(cfg.decay), jnp.float32) ** (into_window - 1.0)
  else:
    controlled = controller.base
  return jnp.where(t >= cfg.controller_start, controlled, scheduled)


def _sync_controller(cfg: _Config, replica_values, tables, st: HDETState, *, gather: bool,
                     score=None) -> HDETState:
  """The non-parameter part of a sync: window losses, controller update, fresh permutations."""
  c = st.controller
  window_losses = c.window_losses
  if score is not None:  # the caller's comparison (e.g. every replica on one common batch)
    window_losses = lax.all_gather(jnp.asarray(score, jnp.float32), cfg.replica_axis)
  elif gather:
    window_losses = lax.all_gather(st.loss_sum / cfg.sync_every, cfg.replica_axis)
  new_c = c._replace(window_losses=window_losses)
  active = st.count >= cfg.controller_start
  if cfg.auto_lr is not None and cfg.auto_lr.stop_steps is not None:
    active = jnp.logical_and(active, st.count <= cfg.auto_lr.stop_steps)
  if cfg.auto_lr is not None and cfg.auto_lr.controller == 'fit':
    new_c = _fit_controller(cfg, tables, c, new_c, window_losses, active)
  elif cfg.auto_lr is not None:
    a = cfg.auto_lr
    # The window's nominal values: the controller's base under each replica's spread (the
    # actual LRs differ from these by a factor common to all replicas, which leaves the
    # softmax-weighted signal's direction unchanged).
    values = replica_values(c.base, c.perm).T  # [N, G]
    out = ctrl.controller_update(
        c.base, c.velocity, window_losses, values,
        temperature=a.temperature, lr_of_lr=a.lr_of_lr, momentum=a.momentum,
        decay=jnp.asarray(cfg.decay, jnp.float32), floor=jnp.asarray(cfg.floors, jnp.float32))
    new_base = jnp.minimum(out.base, jnp.asarray(cfg.highs, jnp.float32))
    keep = lambda new, old: jnp.where(active, new, old)
    new_c = new_c._replace(
        base=keep(new_base, c.base), velocity=keep(out.velocity, c.velocity),
        weights=keep(out.weights, c.weights), delta=keep(out.delta, c.delta))
  key, sub = jax.random.split(jax.random.wrap_key_data(c.key))
  new_c = new_c._replace(
      key=jax.random.key_data(key),
      perm=multipliers.draw_permutations(sub, len(cfg.names), cfg.num_replicas))
  return st._replace(
      controller=new_c, loss_sum=jnp.zeros_like(st.loss_sum),
      sync_count=st.sync_count + 1, synced=jnp.ones([], bool))


def _fit_controller(cfg: _Config, tables, c, new_c, scores, active):
  """The 'fit' controller's update of the correction (see :func:`hdet_jax.controller.fit_update`)."""
  a = cfg.auto_lr
  scale, offset = tables
  # Each replica's nominal offset u from the base in the window that ends here: rho - 1
  # (multiplicative) or the additive offset, under the window's permutations.
  add = np.asarray(cfg.additive)
  u = jnp.where(add[:, None], jnp.take_along_axis(offset, c.perm, axis=1),
                jnp.take_along_axis(scale, c.perm, axis=1) - 1.0).T  # [N, G]
  trust = jnp.asarray([sp if ad else a.trust for sp, ad in zip(cfg.spreads, cfg.additive)], jnp.float32)
  out = ctrl.fit_update(c.xtx, c.xty, scores, u, jnp.asarray(~add),
                        memory=a.memory, overshoot=a.overshoot, trust=trust)
  keep = lambda new, old: jnp.where(active, new, old)
  return new_c._replace(
      correction=keep(c.correction + out.step, c.correction), xtx=keep(out.xtx, c.xtx),
      xty=keep(out.xty, c.xty), delta=keep(out.step, c.delta), velocity=keep(out.slope, c.velocity))


def path_string(path) -> str:
  """'a/b/0/kernel' for a pytree key path (dict keys, attributes, sequence indices)."""
  parts = []
  for k in path:
    for attr in ('key', 'name', 'idx'):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return '/'.join(parts)


def group_labels(params: Any, groups: dict[str, str]) -> Any:
  """Labels every leaf with the one group whose regex matches its path (``re.search``).

  Raises a ValueError naming the problem when a leaf matches no group or several, or when a
  group matches no leaf.
  """
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  paths = [path_string(p) for p, _ in leaves]
  labels, used = [], set()
  for path in paths:
    hits = [g for g, pattern in groups.items() if re.search(pattern, path)]
    if len(hits) != 1:
      what = 'no group' if not hits else f'several groups {hits}'
      raise ValueError(
          f'param_groups: parameter {path!r} matches {what}; make the regexes '
          f'{dict(groups)} match each parameter exactly once.')
    labels.append(hits[0])
    used.add(hits[0])
  unused = [g for g in groups if g not in used]
  if unused:
    raise ValueError(
        f'param_groups: {unused} match no parameter (paths look like {paths[:3]}); fix or drop them.')
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), labels)


def hyperparam_names(*, param_groups: dict[str, str] | None = None,
                     explore: dict[str, Any] | None = None) -> tuple[str, ...]:
  """The order of the state's [G] fields for these ``hdet`` arguments."""
  lrs = tuple(f'learning_rate/{g}' for g in param_groups) if param_groups else ('learning_rate',)
  return lrs + tuple(explore or ())


def replica_value(state: HDETState, index: int, replica_axis: str = 'data') -> jax.Array:
  """This replica's value of hyperparameter ``index`` for the coming step (e.g. its dropout rate).

  Call it in the train step, before the update (the update moves ``state.values`` on to the
  step after), inside the mapped context.
  """
  return state.values[index, lax.axis_index(replica_axis)]
