"""The HDET optax transformation: fan-out, converge and the auto-LR controller.

``hdet`` wraps an optax optimizer, either the one you built (``optax.adamw(1e-3)``, a chain with its own
schedule inside: each replica's update is scaled by its learning rate's factor) or a *factory* of the
learning rate (``optax.adam``, ``optax.sgd``, any callable that takes ``learning_rate=`` and returns a
transformation: each replica builds it at its own learning rate), and turns a plain data-parallel
training step into Hyperparameter-Divergent Ensemble Training. It runs wherever the replica
axis is bound: ``jax.shard_map`` (the primary path), ``jax.pmap`` and
``jax.vmap(axis_name=...)``. With ``auto_lr=AutoLR(total_steps=S)`` the climb starts at a tenth of the learning
rate you pass, in either form: pass the highest learning rate you would consider.

The module reads top to bottom: the state, the factory (which validates its arguments into a frozen
:class:`hdet_jax.settings.Plan`), then ``init`` and ``update`` as functions of that plan. The end of a
window (when, and the average, controller and reshuffle) is :mod:`hdet_jax.sync`; each replica's values under
the spread are :func:`hdet_jax.multipliers.replica_values`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from hdet_jax import arguments
from hdet_jax import axes as axes_lib
from hdet_jax import controller as ctrl
from hdet_jax import multipliers
from hdet_jax import settings
from hdet_jax import sync as sync_lib
from hdet_jax.param_groups import group_labels
from hdet_jax.settings import AutoLR, Explore, Plan
from hdet_jax.sync import Anchor


class HDETState(NamedTuple):
  """The state of :func:`hdet` on one replica (G = explored hyperparameters, N = replicas).

  The replica's own loss statistics (``loss_sum``, ``loss_diff_sq_sum``, ``last_loss``) and
  ``replica_ok`` differ between replicas; the controller's fields are identical on all of them
  (its inputs are all-gathered). ``inner_state`` is identical where the wrapped optimizer's state
  is a function of the gradients alone (Adam's moments, SGD's momentum): every replica sees the
  same all-reduced gradient. It differs where the state reads the parameters or the step taken
  (Prodigy's and D-Adaptation's d, DoG's distance, Mechanize's scale, schedule-free's z: the
  replicas' own LRs set them apart), and in the low-communication mode, where each replica steps
  on its own gradient, until a sync with ``average_opt_state=True``.

  ``values`` and ``base`` hold what the *coming* step uses, computed at the end of the previous
  update (or by ``init``): an update reads its hyperparameters from the state instead of
  recomputing the schedule, and the train step can log, or feed to the model, exactly the
  values the step trains with. The fields are ordered so that every field an update may
  overwrite without reading (``base``, ``synced``) comes last among the fields of its shape:
  jit drops unread inputs, and JAX pairs donated input buffers with outputs in order per
  shape, so an unread field placed earlier would shift that pairing and cost a copy of every
  later same-shaped field on every step.
  """

  count: jax.Array  # [] int32: updates applied so far.
  inner_state: Any  # the wrapped optimizer's state.
  loss_sum: jax.Array  # [] float32: this replica's sum of ``value`` in the current window.
  # [] float32: this replica's sum of the squared change of ``value`` from the step before, in the current window
  # (the back-off's noise estimate; kept only with ``auto_lr.backoff``).
  loss_diff_sq_sum: jax.Array
  # [] float32: this replica's last ``value`` (NaN before the first step; kept only with ``auto_lr.backoff``).
  last_loss: jax.Array
  # [G, N] float32: every replica's value for the coming step (read them in the forward pass for model and loss
  # hyperparameters).
  values: jax.Array
  sync_count: jax.Array  # [] int32: syncs (parameter averages) done so far.
  finite_replicas: jax.Array  # [] int32: replicas that entered the last average (N when all were finite).
  replica_ok: jax.Array  # [] bool: whether this replica entered the last average.
  controller: ctrl.ControllerState  # base for the window, velocity, perm, key, losses, weights, delta.
  base: jax.Array  # [G] float32: the base value for the coming step.
  synced: jax.Array  # [] bool: whether the last update was a sync step.
  anchor: Anchor | None = None  # with ``rollback``: what the last sync left, where a backed-off sync returns.

  @property
  def learning_rates(self) -> jax.Array:
    """[N]: every replica's learning rate for the coming step."""
    return self.values[..., 0, :]

  @property
  def base_learning_rate(self) -> jax.Array:
    """[]: the base learning rate for the coming step."""
    return self.base[..., 0]


class BuiltOptimizerState(NamedTuple):
  """``HDETState.inner_state`` around a built optimizer: its state, as its own ``init`` made it.

  The wrapper marks the state as a built optimizer's, where every view of it keeps the mark (a chain,
  ``MultiSteps``, an orbax restore, an nnx split state), so :func:`hdet_jax.hyperparams` names the
  learning-rate rows ``lr_scale``.
  """

  built_optimizer_state: Any  # the built optimizer's state (e.g. ``(ClipState, (ScaleByAdamState, ...))``).


def hdet(
  optimizer: optax.GradientTransformation | Callable[..., optax.GradientTransformation],
  learning_rate: optax.ScalarOrSchedule | None = None,
  *,
  num_replicas: int,
  spread: float = 0.25,
  sync_every: int | Sequence[int] | None = None,
  replica_axis: axes_lib.AxisName = 'data',
  auto_lr: AutoLR | None = None,
  exact_sync: bool = False,
  seed: int = 0,
  explore: dict[str, Explore | tuple[optax.ScalarOrSchedule, float]] | None = None,
  param_groups: dict[str, str] | None = None,
  guard_nonfinite: bool = True,
  average_opt_state: bool = False,
  rollback: bool = False,
  **optimizer_kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
  """Hyperparameter-Divergent Ensemble Training around an optax optimizer.

  ``optimizer`` is either the optimizer you already built (``optax.chain(clip, adamw(schedule, mask=...))``,
  ``inject_hyperparams``, layerwise scales: its own schedule inside), or a factory of the learning rate
  (``optax.adamw``) with ``learning_rate=``.

  *Around a built optimizer* replica r takes the optimizer's update ``u(t)`` (on the shared gradient, with
  the optimizer's own learning rate inside) scaled by ``c(t) rho[perm[r]]``, where ``c`` is the controller's
  factor (1 without ``auto_lr``; with ``AutoLR(total_steps=S)`` the climb starts at a tenth of the learning rate
  you pass, ``c = 0.1``, as it starts a factory's schedule, and the guarded climb moves it). For an optimizer
  whose update is linear in its learning rate and whose state does not read it (SGD, momentum, Adam, AdamW
  with a mask, Lion, Adafactor, any of them after ``clip_by_global_norm`` or under ``inject_hyperparams``),
  this is the factory path with the learning rate
  ``c rho lr(t)``: with ``AutoLR``, ``hdet(optax.adamw(lr), auto_lr=a)`` equals ``hdet(optax.adamw, lr,
  auto_lr=a)`` to float32 rounding (tests/test_built_optimizer.py). The state rows of the
  learning rate are then factors, named ``lr_scale`` (:func:`hdet_jax.hyperparams`). Optimizers whose state
  reads the learning rate or the step taken (schedule-free, Prodigy, D-Adaptation, Mechanic, DoG, COCOB,
  MoMo, MADGRAD, Lookahead, L-BFGS, line searches, Rprop, SAM) are refused at ``init`` where their state
  shows it; a clip *after* the learning rate (``chain(adamw(lr), clip(...))``) or ``polyak_sgd`` cannot be
  recognised: use a factory for those.

  *Around a factory*, replica r (its index on ``replica_axis``) trains with learning rate
  ``base(t) * rho[perm[r]]`` on the shared, already all-reduced gradient, where

  .. math::

    \\rho_r = 1 + \\alpha \\frac{r - (N-1)/2}{\\max((N-1)/2, 0.5)}

  (eq. 1). Every ``sync_every`` steps the replicas' parameters are averaged over the axis
  (eq. 3, one all-reduce, only on those steps) and the multipliers are reassigned by a fresh
  permutation drawn from a key shared by all replicas. With ``auto_lr`` set, each sync at or
  after its warmup also all-gathers each replica's score (its mean loss over the window, or ``score=``)
  and moves the base: ``AutoLR(total_steps=S)``, the guarded climb, fits a quadratic to the scores along
  the replicas' line and scales the schedule by a learned, rise-only factor
  (:func:`hdet_jax.controller.fit_update`); ``AutoLR.paper(...)`` is the paper's eqs. 4-9,
  ``w = softmax((mean L - L) / sigma)``, ``v = beta v + (1 - beta) (sum_r w_r lr_r - mean_r lr_r)``,
  ``base = mean_r lr_r (1 - gamma) + lambda v``, floored to stay positive.

  With ``spread=0`` and no controller the updates equal ``optimizer(learning_rate)``'s bit
  for bit between syncs (and the sync is a no-op up to rounding, since the replicas agree); such a build, or one
  of ``num_replicas=1``, is plain training, and says so once (:class:`hdet_jax.arguments.PlainTrainingWarning`).

  Sync steps: the update of step t that ends a window (``(t + 1) % sync_every == 0`` for a fixed T) returns
  ``pmean(p + u) - p``. Applied with ``optax.apply_updates`` the replicas then agree to
  rounding: ``|p'_r - avg| <= eps (|avg| + |avg - p_r|)`` with eps the unit roundoff
  (2**-24 for float32), about one ulp. For a bitwise-exact assignment build with
  ``exact_sync=True`` and apply with :func:`hdet_jax.apply_updates`, which assigns ``pmean(p + u)``.

  Args:
    optimizer: the optimizer you built (an ``optax.GradientTransformation``), or an optax factory taking
      ``learning_rate=`` (e.g. ``optax.adamw``), called inside every update with this replica's learning rate
      (for per-group learning rates and exploring the optimizer's other hyperparameters).
    learning_rate: with a factory, the base schedule (any optax schedule or a float), e.g.
      :func:`hdet_jax.one_cycle`; None with a built optimizer, which keeps its own.
    num_replicas: N, the size of ``replica_axis`` (the map cannot tell it to the factory: the state's
      ``[G, N]`` shapes are fixed at ``init``, outside any map).
    spread: alpha in [0, 1).
    sync_every: T >= 1, steps between parameter averages (None: the measured default, ``round(S / 15)`` at
      most 100 with ``auto_lr``'s ``total_steps = S``, else 100); or a schedule of window lengths whose last one
      repeats, e.g. ``(25, 25, 25, 25, 100)``: averages after steps 25, 50, 75, 100, 200, 300, ...
    replica_axis: the mapped axis the replicas live on. Keep it distinct from any axis
      the model is sharded over (FSDP, tensor parallel): only it is averaged over. On a mesh
      such as ``('replica', 'fsdp')`` a replica is a group of devices: map with
      :func:`hdet_jax.shard_map_replicas` (manual over this axis only) and lay the state out
      with :func:`hdet_jax.stacked_shardings` (``mesh=``). With several replicas
      per device (:func:`hdet_jax.shard_map_replicas` with ``per_device > 1``) it is the pair
      ``(device axis, local axis)``, e.g. ``('data', 'local')``: replica d * (N / D) + v.
    auto_lr: controller settings, or None for fan-out/converge only.
    exact_sync: if True the sync step returns the inner update only and
      :func:`hdet_jax.apply_updates` does the averaging, assigning the average exactly.
    seed: seeds the permutation key (identical on every replica).
    explore: more hyperparameters to explore like the learning rate,
      ``{name: Explore(...)}`` or ``{name: (value or schedule, spread)}`` (multiplicative),
      e.g. ``{'weight_decay': (1e-2, 0.5), 'dropout': Explore(0.1, 0.05, additive=True,
      low=0.0, high=0.9, to_optimizer=False)}``. Each gets its own permutation, velocity and
      base; optimizer hyperparameters are passed to ``optimizer`` as that keyword.
    param_groups: per-group learning rates, ``{group: regex}`` on parameter paths such as
      ``'blocks/0/attn/kernel'`` (``re.search``); every parameter must match exactly one
      group. Each group gets its own base LR, velocity and permutation, and the wrapped
      optimizer becomes ``optax.multi_transform`` over the groups. Index g of the state's [G]
      fields follows ``hyperparam_names(...)``: the learning rate (or ``learning_rate/<group>``
      per group, in order), then ``explore`` in order.
    guard_nonfinite: if True (default) a sync averages only the replicas whose parameters
      are all finite and resets the others to that average (with ``exact_sync=True`` and
      :func:`hdet_jax.apply_updates`; an additive optax update cannot reset a NaN parameter, so on that path
      the replica stays out of every later average), and a replica whose window loss
      is not finite gets controller weight 0 (its LR counts as too large: the signal moves
      away from it). ``state.finite_replicas`` says how many entered the average; 0 means
      every replica blew up and the parameters stay non-finite. Pair it with
      :func:`hdet_jax.pmean_finite` for the gradient all-reduce, since every replica shares
      the averaged gradient.
    average_opt_state: if True a sync also averages the wrapped optimizer's state (its float
      leaves, e.g. Adam's moments) over the replicas. Only matters in the low-communication
      (DiLoCo-like) mode, where each replica (or group) steps on its own gradient instead of the
      all-reduced one, so the states drift apart between syncs. Off by default, as DiLoCo keeps
      each worker's inner optimizer state local: averaging it costs one more all-reduce of the
      state's size at each sync (twice the parameters' bytes for Adam, so three times the
      sync's traffic). With the shared gradient the states are already equal and this is
      a no-op up to rounding.
    rollback: if True, a sync whose guard backs off (``auto_lr``'s ``backoff``: the window's training loss rose
      past its margins, or went non-finite) also returns every replica to the parameters and the wrapped
      optimizer's state the last sync left (:class:`Anchor`), instead of averaging the window that rose; the
      trainer's ``hdet.rollback``, in any trainer (the trainer builds it). It costs one more copy of the parameters
      and the optimizer state per replica, laid out as they are (FSDP-sharded with them): AdamW's anchor is 3x the
      parameters' bytes, and the add-to-trainer example's state 1.75x on each device. With several replicas on a
      device (``over_replicas(..., per_device=k)``) they share one copy (``stack_replicas(state, N,
      per_device=k)``): 8 replicas on a device hold 1.125x the state instead of 2x, and the step between syncs
      compiles to the same flops and bytes as without the rollback (``python -m benchmarks.rollback_memory``).
      Off by default: it changes the state's structure (a 1.0 checkpoint restores only without it), it costs that
      memory, and on the verdict's default runs the guard never backed off (docs/verdict.md). With
      ``exact_sync=True`` and
      :func:`hdet_jax.apply_updates` the replicas land on the anchor bit for bit; with ``optax.apply_updates``
      to about an ulp, as on every sync.
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
    Four replicas on one device (``jax.vmap`` binds the replica axis; :func:`hdet_jax.over_replicas` and
    :func:`hdet_jax.shard_map_replicas` spread them over devices), around an optimizer already built:

    >>> import jax, jax.numpy as jnp, optax, hdet_jax
    >>> tx = hdet_jax.hdet(optax.adamw(1e-2, weight_decay=0.1), num_replicas=4, auto_lr=hdet_jax.AutoLR(1000))
    >>> opt_state = jax.vmap(tx.init)(hdet_jax.stack_replicas({'w': jnp.ones(2)}, 4))
    >>> [round(x, 4) for x in hdet_jax.hyperparams(opt_state)['lr_scale'].tolist()]  # factors on 1e-2: a tenth, spread
    [0.075, 0.0917, 0.1083, 0.125]

    Around a factory:

    >>> import jax, jax.numpy as jnp, optax, hdet_jax
    >>> tx = hdet_jax.hdet(optax.adamw, hdet_jax.one_cycle(max_lr=3e-3, total_steps=1000), num_replicas=4,
    ...                    auto_lr=hdet_jax.AutoLR(total_steps=1000), weight_decay=0.1)  # guarded climb, T = 67
    >>> def train_step(params, opt_state, x):  # one replica's view
    ...   loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p['w']) ** 2))(params)
    ...   grads = hdet_jax.pmean_finite(grads, 'data')  # plain data parallelism
    ...   updates, opt_state = tx.update(grads, opt_state, params, value=loss)
    ...   return optax.apply_updates(params, updates), opt_state
    >>> params = hdet_jax.stack_replicas({'w': jnp.ones(2)}, 4)  # [N, ...] on every leaf
    >>> opt_state = jax.vmap(tx.init)(params)
    >>> params, opt_state = jax.vmap(train_step, axis_name='data')(params, opt_state, jnp.ones((4, 8, 2)))
    >>> [f'{lr:.2g}' for lr in hdet_jax.hyperparams(opt_state)['learning_rate'].tolist()]  # the next step's
    ['9e-06', '1.1e-05', '1.3e-05', '1.5e-05']
  """
  # First, while locals() holds only hdet's arguments: its signature is their one list, make_plan reads them by name.
  plan = settings.make_plan(locals())

  def init_fn(params):
    return init(plan, params)

  def update_fn(updates, state, params=None, **kwargs):
    return update(plan, updates, state, params, **kwargs)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def inner_optimizer(plan: Plan, values: list[jax.Array]) -> optax.GradientTransformation:
  """The wrapped optimizer built with one replica's values [G] (per-group LRs: a multi_transform); a built
  optimizer's updates scaled by them."""
  if plan.built:
    return _scaled(plan, values)
  hp = dict(zip(plan.names, values))
  kwargs = {
    k: v
    for k, v, to_opt, is_lr in zip(plan.names, values, plan.to_optimizer, plan.learning_rates)
    if to_opt and not is_lr
  }
  make = lambda lr: plan.optimizer(learning_rate=lr, **kwargs, **plan.optimizer_kwargs)
  if not plan.groups:
    return make(hp['learning_rate'])
  return optax.multi_transform(
    {group: make(hp[f'learning_rate/{group}']) for group, _ in plan.groups},
    lambda params: group_labels(params, dict(plan.groups)),
  )


def _scaled(plan: Plan, values: list[jax.Array]) -> optax.GradientTransformation:
  """The built optimizer, its updates times this replica's learning-rate factor (its group's, with groups)."""
  built = optax.with_extra_args_support(plan.optimizer)
  factors = dict(zip(plan.names, values))

  def scale(updates):
    if not plan.groups:
      return jax.tree.map(lambda u: u * factors['lr_scale'].astype(u.dtype), updates)
    labels = group_labels(updates, dict(plan.groups))  # the updates' paths are the parameters'
    return jax.tree.map(lambda u, g: u * factors[f'lr_scale/{g}'].astype(u.dtype), updates, labels)

  def update(updates, state, params=None, **extra_args):
    updates, inner = built.update(updates, state.built_optimizer_state, params, **extra_args)
    return scale(updates), BuiltOptimizerState(inner)

  return optax.GradientTransformationExtraArgs(lambda params: BuiltOptimizerState(built.init(params)), update)


# State classes of optax optimizers whose state reads the learning rate or the step taken (so scaling their
# updates is not the same as changing their learning rate), by module and name so that a missing one (older
# optax) is no error.
NOT_LINEAR_IN_LR = (
  'optax.contrib.ScheduleFreeState',
  'optax.contrib.ProdigyState',
  'optax.contrib.DAdaptAdamWState',
  'optax.contrib.MechanicState',
  'optax.contrib.DoGState',
  'optax.contrib.DoWGState',
  'optax.contrib.COCOBState',
  'optax.contrib.MomoState',
  'optax.contrib.MomoAdamState',
  'optax.contrib.MadgradState',
  'optax.contrib.SAMState',
  'optax.LookaheadState',
  'optax.ScaleByLBFGSState',
  'optax.ScaleByBacktrackingLinesearchState',
  'optax.ScaleByZoomLinesearchState',
  'optax.ScaleByRpropState',
)


def _not_linear_state_types() -> dict[type, str]:
  found = {}
  for name in NOT_LINEAR_IN_LR:
    module, _, cls = name.rpartition('.')
    kind = getattr(optax.contrib if module == 'optax.contrib' else optax, cls, None)
    if isinstance(kind, type):
      found[kind] = name
  return found


def check_linear_in_lr(built_state: Any) -> None:
  """Raises where a built optimizer's state shows that its update is not linear in its learning rate."""
  kinds = _not_linear_state_types()
  nodes = jax.tree.leaves(built_state, is_leaf=lambda x: isinstance(x, tuple(kinds)))
  bad = next((kinds[type(x)] for x in nodes if type(x) in kinds), None)
  if bad is not None:
    raise ValueError(
      f'hdet: the built optimizer holds a {bad}: its state reads the learning rate or the step taken, so HDET '
      'cannot give each replica its LR by scaling its updates. Pass its factory with learning_rate= instead, '
      'e.g. hdet(optax.contrib.prodigy, 1.0, ...).'
    )


def init(plan: Plan, params: Any) -> HDETState:
  """The state before the first step: the schedules' values at step 0, identity permutations."""
  g, n = len(plan.names), plan.num_replicas
  controller = ctrl.init_controller_state(
    jnp.asarray(plan.start_values, jnp.float32),
    n,
    jax.random.key_data(jax.random.key(plan.seed)),
    correction=jnp.asarray(plan.initial_correction, jnp.float32),
  )
  start = base_values(plan, jnp.zeros([], jnp.int32), controller)
  inner_state = inner_optimizer(plan, list(start)).init(params)
  if plan.built:
    check_linear_in_lr(inner_state.built_optimizer_state)
  return HDETState(
    count=jnp.zeros([], jnp.int32),
    inner_state=inner_state,
    loss_sum=jnp.zeros([], jnp.float32),
    loss_diff_sq_sum=jnp.zeros([], jnp.float32),
    last_loss=jnp.full([], jnp.nan, jnp.float32),
    values=multipliers.replica_values(plan, start, multipliers.identity_permutations(g, n), _settled(plan, controller)),
    sync_count=jnp.zeros([], jnp.int32),
    finite_replicas=jnp.full([], n, jnp.int32),
    replica_ok=jnp.ones([], bool),
    controller=controller,
    base=start,
    synced=jnp.zeros([], bool),
    anchor=_first_anchor(plan, params, inner_state, controller),
  )


def _first_anchor(plan: Plan, params: Any, inner_state: Any, controller: ctrl.ControllerState) -> Anchor | None:
  """The anchor before the first sync: the start (the parameters as given, the optimizer's initial state)."""
  if not plan.rollback:
    return None
  copy = lambda tree: jax.tree.map(jnp.array, tree)  # its own buffers: the state may be donated
  return Anchor(copy(params), copy(inner_state), controller.train_loss, controller.train_loss_se)


def update(
  plan: Plan, updates, state: HDETState, params=None, *, value=None, sync=None, score=None, **extra_args
) -> tuple[Any, HDETState]:
  """One step on one replica: the inner update at this replica's values, then the sync on sync steps.

  See :func:`hdet` for the arguments. ``updates=None`` runs only the end of a window.
  """
  _check_update_args(plan, updates, state, params, value, sync, score)
  window_end_only = updates is None
  if window_end_only:  # the step itself already ran, with sync=False
    updates = jax.tree.map(jnp.zeros_like, params)
  else:
    updates, state = _inner_step(plan, updates, state, params, value, extra_args)
  end = lambda ops: sync_lib.end_window(plan, params, *ops, score=score, gather=value is not None or window_end_only)
  if sync is None:
    updates, state = lax.cond(
      sync_lib.ends_window(plan.sync_windows, axes_lib.unbatched(state.count, plan.replica_axis)),
      lambda ops: axes_lib.match_vma(end(ops), ops),
      lambda ops: ops,
      (updates, state),
    )
  elif sync:
    updates, state = end((updates, state))
  # What the next step will use (after any reshuffle).
  base = base_values(plan, state.count, state.controller)
  return updates, state._replace(
    base=base, values=multipliers.replica_values(plan, base, state.controller.perm, _settled(plan, state.controller))
  )


def base_values(plan: Plan, t: jax.Array, controller: ctrl.ControllerState) -> jax.Array:
  """[G] base values for step t: the schedule, or the controller's base once it has started."""
  scheduled = jnp.stack([jnp.asarray(s(t) if callable(s) else s, jnp.float32) for s in plan.schedules])
  if plan.auto_lr is None:
    return scheduled
  if ctrl.is_fit(plan.auto_lr):  # the user's schedule under the controller's correction
    add = jnp.asarray(plan.additive)
    corrected = jnp.where(add, scheduled + controller.correction, scheduled * jnp.exp(controller.correction))
    return jnp.clip(corrected, jnp.asarray(plan.lows, jnp.float32), jnp.asarray(plan.highs, jnp.float32))
  if plan.auto_lr.smooth_decay:
    # From base_k / (1 - gamma) at the sync (the previous base, with no signal) to base_k at
    # the next sync, so the no-signal path is one continuous geometric curve.
    start, length = sync_lib.window_of(plan.sync_windows, t)
    into_window = (t - start).astype(jnp.float32) / length
    controlled = controller.base * jnp.asarray(1.0 - np.asarray(plan.decay), jnp.float32) ** (into_window - 1.0)
  else:
    controlled = controller.base
  return jnp.where(t >= plan.controller_start, controlled, scheduled)


def _settled(plan: Plan, controller: ctrl.ControllerState) -> jax.Array | None:
  """The settled flags where ``AutoLR.settle`` is on, else None (no per-step work for them)."""
  return controller.settled if plan.auto_lr is not None and plan.auto_lr.settle else None


def _inner_step(plan: Plan, grads, state: HDETState, params, value, extra_args) -> tuple[Any, HDETState]:
  """The wrapped optimizer's update at this replica's values; the loss joins the window's sum."""
  values = state.values[:, axes_lib.axis_index(plan.replica_axis)]  # [G]: this replica's, for this step
  inner = optax.with_extra_args_support(inner_optimizer(plan, [values[i] for i in range(len(plan.names))]))
  if value is not None:  # the wrapped optimizer may read the loss too (reduce_on_plateau)
    extra_args = dict(extra_args, value=value)
  updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
  loss = jnp.zeros([], jnp.float32) if value is None else jnp.asarray(value, jnp.float32)
  state = state._replace(
    count=state.count + 1, inner_state=inner_state, loss_sum=state.loss_sum + loss, synced=jnp.zeros([], bool)
  )
  if plan.auto_lr is not None and plan.auto_lr.backoff:  # the back-off's noise estimate; no work without it
    change = jnp.where(jnp.isnan(state.last_loss), 0.0, jnp.square(loss - state.last_loss))
    state = state._replace(loss_diff_sq_sum=state.loss_diff_sq_sum + change, last_loss=loss)
  return updates, state


def _check_update_args(plan: Plan, updates, state, params, value, sync, score) -> None:
  axes_lib.axis_size_or_raise(plan.replica_axis, plan.num_replicas)
  expected = (len(plan.names), plan.num_replicas)
  values = getattr(state, 'values', None)  # (a Mapping's .values is a method: not checked here)
  if isinstance(values, (jax.Array, np.ndarray)) and values.shape != expected:
    raise ValueError(
      f"hdet: state must be one replica's HDETState, its values [G, N] = {expected}, got values of shape "
      f'{jnp.shape(state.values)}: call tx.update inside the map (shard_map_replicas, over_replicas, vmap) on the '
      "state this tx.init built, not on the stacked [N, ...] state or another build's."
    )
  window_end_only = updates is None
  if window_end_only and (sync is not True or params is None or value is not None):
    raise ValueError(
      'hdet: updates=None runs only the end of a window (the average and the controller, on the '
      'parameters after the last step): call tx.update(None, state, params, sync=True).'
    )
  if score is not None and (sync is False or jnp.ndim(score) != 0):
    raise ValueError(
      "hdet: score= is this replica's scalar loss for the controller at a sync (e.g. on a batch "
      'common to all replicas); pass it with sync=True (or sync=None on a sync step).'
    )
  if plan.auto_lr is not None and value is None and not window_end_only:
    raise ValueError(
      "hdet: auto_lr is on, so update() needs this replica's loss: call tx.update(grads, state, params, value=loss)."
    )
  if value is not None and (not _is_real(value) or jnp.ndim(value) != 0):
    got = f'shape {jnp.shape(value)}' if _is_real(value) else type(value).__name__
    raise ValueError(
      f"hdet: value must be this replica's scalar loss, got {got}. Reduce the per-example losses to their mean first."
    )
  if params is None:
    raise ValueError('hdet: update() needs params (the sync averages them).')
  if sync is not None and not isinstance(sync, bool):
    raise ValueError(f'hdet: sync must be None or a Python bool, got {type(sync).__name__}.')


def _is_real(value) -> bool:
  """Whether ``value`` is a real number or array (a loss), not a tuple, dict or string that ``jnp.ndim`` lets by."""
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    return not jnp.issubdtype(value.dtype, jnp.complexfloating)
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def replica_value(state: HDETState, index: int, replica_axis: axes_lib.AxisName = 'data') -> jax.Array:
  """This replica's value of hyperparameter ``index`` for the coming step (e.g. its dropout rate).

  Call it in the train step, before the update (the update moves ``state.values`` on to the
  step after), inside the mapped context.
  """
  arguments.axis_name(replica_axis, 'replica_axis', who='replica_value')
  if jnp.ndim(state.values) != 2:
    raise ValueError(
      f"replica_value: state must be one replica's HDETState (values [G, N]), got values of shape "
      f'{jnp.shape(state.values)}: call it inside the map, on the state the step was given.'
    )
  g = jnp.shape(state.values)[0]
  arguments.index(index, 'index', g, who='replica_value', of='hyperparameter, in hdet_jax.hyperparam_names order')
  return state.values[index, axes_lib.axis_index(replica_axis)]
