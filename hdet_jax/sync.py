"""The sync windows: when each ends (every T steps, or a schedule of window lengths), and what its end does.

When: ``sync_every=100`` averages after steps 100, 200, ...; ``sync_every=(25, 25, 25, 25, 100)`` averages after
steps 25, 50, 75, 100, then every 100 (200, 300, ...). Short early windows let a controller compare the
replicas more often while the learning rate may still be far off, at one average per window. Steps are 0-based:
step t belongs to the window ``[start, start + length)``, and the sync after it happens when
``t + 1 == start + length`` (``count``, the steps done, equals the window's end). The window functions take
Python/numpy integers (the trainer's host loop) or JAX arrays (inside ``jit``).

What: average the replicas, update the controller, reshuffle. The average is eq. 3 (one all-reduce over the
replica axis, only on sync steps). The controller reads each replica's window loss (or the caller's ``score``,
e.g. every replica's loss on one common batch), all-gathered so every replica computes the same update, then every
hyperparameter gets a fresh permutation from the key all replicas share.

The rollback's :class:`Anchor` (what the last sync left, where a sync whose guard backs off returns) is here too,
with its sharing: a map that runs several replicas on a device may hold one copy per device (:func:`share_anchors`).
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

from chex import ArrayTree
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from hdet_jax import arguments
from hdet_jax import axes as axes_lib
from hdet_jax import controller as ctrl
from hdet_jax import multipliers

if TYPE_CHECKING:  # settings reads the windows from here
  from hdet_jax.settings import Plan

# The default windows: NUM_SYNCS syncs a run, each window at most LONGEST_WINDOW steps (the trainer's
# hdet.num_syncs and hdet.longest_window), so a short run gets as many controller decisions as a long one
# (why 15 and 100: research/workloads_discussion.md, "What changed: windows counted per run").
NUM_SYNCS = 15
LONGEST_WINDOW = 100


def default_period(total_steps: int, num_syncs: int = NUM_SYNCS, longest_window: int = LONGEST_WINDOW) -> int:
  """T for a run of ``total_steps`` steps: ``round(total_steps / num_syncs)``, at least 1, at most
  ``longest_window`` (0: no cap). ``default_period(1500)`` is 100, ``default_period(300)`` is 20."""
  period = max(1, int(round(total_steps / num_syncs)))
  return min(period, int(longest_window)) if longest_window > 0 else period


def as_windows(sync_every: int | Sequence[int]) -> tuple[int, ...]:
  """``sync_every`` as a tuple of window lengths (the last one repeats), validated."""
  lengths = (sync_every,) if arguments.is_int(sync_every) else tuple(sync_every) if _is_seq(sync_every) else ()
  if not lengths or not all(arguments.is_int(w) and w >= 1 for w in lengths):
    raise ValueError(
      f'sync_every (T) must be an integer >= 1, or a sequence of them (window lengths in order, the last '
      f'repeating, e.g. (25, 25, 100)); got {sync_every!r}.'
    )
  return tuple(int(w) for w in lengths)


def _layout(windows: tuple[int, ...]) -> tuple[np.ndarray, int, int]:
  """([K] the listed windows' starts, the last one repeating; ``tail``, where the repeats begin; their length)."""
  starts = np.cumsum((0,) + windows[:-1])
  return starts, int(starts[-1]), windows[-1]


def window_of(windows: tuple[int, ...], t: Any) -> tuple[Any, Any]:
  """(start, length) of the window holding step ``t`` (0-based; scalars or arrays)."""
  xp, int_type = (jnp, jnp.int32) if isinstance(t, jax.Array) else (np, np.int64)
  t = xp.asarray(t)
  listed_starts, tail, period = _layout(windows)
  starts, lengths = xp.asarray(listed_starts, int_type), xp.asarray(windows, int_type)
  i = (t[..., None] >= starts[1:]).sum(-1)  # which of the listed windows (the last: any repeat)
  start = xp.where(t >= tail, tail + (t - tail) // period * period, starts[i])
  return start, lengths[i]


def ends_window(windows: tuple[int, ...], count: Any) -> Any:
  """Whether a sync follows the step that made ``count`` steps done (count >= 1)."""
  start, length = window_of(windows, count - 1)
  return count == start + length


def window_length(windows: tuple[int, ...], count: Any) -> Any:
  """The length of the window that the step making ``count`` steps done belongs to."""
  return window_of(windows, count - 1)[1]


def syncs_through(windows: tuple[int, ...], count: int) -> int:
  """How many syncs have happened once ``count`` steps are done (host side)."""
  starts, tail, period = _layout(windows)
  return int((starts[1:] <= count).sum()) + max(count - tail, 0) // period  # listed windows ended, then repeats


def first_sync_at_or_after(windows: tuple[int, ...], count: int) -> int:
  """The first sync's ``count`` (steps done) that is >= ``count`` and >= 1 (host side)."""
  start, length = window_of(windows, max(int(count), 1) - 1)
  return int(start + length)


def syncs_between(windows: tuple[int, ...], first: int, last: int) -> float:
  """Syncs from step ``first`` to step ``last`` counted continuously: each step adds 1 / its window's length
  (for a fixed T, ``(last - first) / T``)."""
  if last <= first:
    return 0.0
  _, lengths = window_of(windows, np.arange(first, last))
  length, steps = np.unique(lengths, return_counts=True)  # exact for a fixed T: (last - first) / T
  return float(sum(int(c) / int(w) for w, c in zip(length, steps)))


def _is_seq(x: Any) -> bool:
  return isinstance(x, (tuple, list)) or (isinstance(x, np.ndarray) and x.ndim == 1)


def is_sync_step(sync_every: int | Sequence[int], step: Any) -> Any:
  """Whether the update of (0-based) step ``step`` averages the replicas, for ``hdet``'s ``sync_every``.

  For a training loop that compiles the sync step apart (``tx.update(..., sync=True)``).

  Example:
    >>> import hdet_jax
    >>> [t for t in range(300) if hdet_jax.is_sync_step((25, 25, 100), t)]
    [24, 49, 149, 249]
  """
  if not isinstance(step, jax.Array) and not (arguments.is_int(step) and step >= 0):
    raise ValueError(f'is_sync_step: step must be an integer >= 0 (the 0-based step) or an int array, got {step!r}.')
  ends = ends_window(as_windows(sync_every), step + 1)
  return ends if isinstance(ends, jax.Array) else bool(ends)


class Anchor(NamedTuple):
  """What the last sync left (``hdet(..., rollback=True)``): where a sync whose guard backs off returns.

  Every replica holds the same copy (the sync's average, and the optimizer state, which the shared gradient
  keeps equal), laid out like the parameters and the optimizer state. Where a map runs several replicas on a
  device, it may hold one copy per device (:func:`share_anchors`).
  """

  params: Any  # the parameters the last sync left (the average), as the parameters.
  inner_state: Any  # the wrapped optimizer's state then, as ``HDETState.inner_state``.
  train_loss: jax.Array  # [] float32: the training loss of the window that sync ended (the guard's baseline).
  train_loss_se: jax.Array  # [] float32: its standard error.


def _is_anchor(node) -> bool:
  return isinstance(node, Anchor)


def share_anchors(stacked: ArrayTree, per_device: int) -> ArrayTree:
  """A stacked tree ``[N, ...]`` whose :class:`Anchor` s are held once per device: ``[N / per_device, ...]``.

  Every replica's anchor is the same (the last sync's average and the optimizer state the all-reduced gradient
  keeps equal), so the k replicas a device runs under :func:`~hdet_jax.over_replicas` (``per_device=k``) can share one
  copy: the rollback then costs one copy of the state per device, not k. The maps take both forms, and give
  back the form they were given. The other leaves are left as they are.

  Example:
    >>> import jax, jax.numpy as jnp, optax, hdet_jax
    >>> tx = hdet_jax.hdet(optax.adam, 1e-3, num_replicas=8, auto_lr=hdet_jax.AutoLR(total_steps=100),
    ...                    rollback=True)
    >>> stacked = jax.vmap(tx.init)(hdet_jax.stack_replicas(jnp.ones(3), 8))
    >>> state = hdet_jax.sync.share_anchors(stacked, per_device=4)
    >>> state.count.shape, state.anchor.params.shape  # 8 replicas, 2 anchors: one for each device's 4
    ((8,), (2, 3))
  """
  if per_device == 1:
    return stacked
  every = lambda node: jax.tree.map(lambda x: x[::per_device], node) if _is_anchor(node) else node
  return jax.tree.map(every, stacked, is_leaf=_is_anchor)


# While a map traces its function with the anchors held once per device (its vmap does not batch them).
_SHARED_ANCHORS: contextvars.ContextVar[bool] = contextvars.ContextVar('hdet_jax_shared_anchors', default=False)


def shared_anchor(anchor: Anchor, axis_name: axes_lib.AxisName) -> Anchor:
  """The anchor a sync leaves, as the map holds it: where it holds one copy per device (:func:`share_anchors`),
  the device's first local replica's (all hold the same), unbatched by the local ``vmap``; else as it is."""
  local = axes_lib._MAPPED.get()[1]
  axes = sorted(a for a in axes_lib._axes(axis_name) if a in local)
  if not _SHARED_ANCHORS.get() or not axes:
    return anchor

  def first(x):
    for a in axes:
      x = lax.all_gather(x, a)[0]  # the local replicas' copies, stacked; replica 0's, with no arithmetic
    return x

  return jax.tree.map(first, anchor)


def _anchor_axes(value, per_device: int) -> tuple[Any, Any, bool]:
  """(``value`` as the local vmap reads it, its ``in_axes``, whether it holds a shared anchor): in a stacked
  argument, an anchor held once per device (its leaves' leading axis 1 where the others' is ``per_device``) loses
  that axis and is not batched."""
  shared = lambda node: _is_anchor(node) and all(jnp.shape(x)[:1] == (1,) for x in jax.tree.leaves(node))
  if per_device == 1 or not any(shared(n) for n in jax.tree.leaves(value, is_leaf=_is_anchor)):
    return value, 0, False
  local = jax.tree.map(lambda n: jax.tree.map(lambda x: x[0], n) if shared(n) else n, value, is_leaf=_is_anchor)
  return local, jax.tree.map(lambda n: None if shared(n) else 0, value, is_leaf=_is_anchor), True


def _anchors_to_devices(out: Any) -> Any:
  """The map's outputs with their anchors (unbatched inside) back to one copy per device."""
  return jax.tree.map(
    lambda node: jax.tree.map(lambda x: x[:1], node) if _is_anchor(node) else node, out, is_leaf=_is_anchor
  )


def anchor_at(params: Any, state) -> Anchor:
  """The anchor a sync that did not back off leaves (and the first one, at init): the parameters it landed on,
  the wrapped optimizer's state, and its window's training loss with its standard error (the guard's baseline)."""
  c = state.controller
  return Anchor(params, state.inner_state, c.train_loss, c.train_loss_se)


def average(tree: Any, axis_name: axes_lib.AxisName, guard_nonfinite: bool, ok=None) -> tuple[Any, jax.Array]:
  """(the replicas' mean, how many replicas entered it); with the guard, only the ``ok`` finite ones."""
  if guard_nonfinite:
    return axes_lib.finite_mean(tree, axis_name, ok)
  return axes_lib.pmean(tree, axis_name), jnp.asarray(axes_lib.axis_size(axis_name), jnp.int32)


def end_window(plan: Plan, params, updates, state, *, gather: bool, score=None):
  """(updates, state) of a sync step: the update now lands on the average, and the controller moved.

  ``state`` is an :class:`hdet_jax.HDETState` after the step's inner update. With ``plan.exact_sync``
  the update is left alone and :func:`apply_updates` assigns the average.
  """
  stepped = optax.apply_updates(params, updates)
  ok = jnp.ones([], bool)
  if plan.guard_nonfinite:
    # A replica whose parameters or window loss went non-finite sits this average out
    # and is reset to the others' average.
    ok = jnp.logical_and(axes_lib.all_finite(stepped), jnp.isfinite(state.loss_sum))
  if plan.exact_sync and not plan.rollback:  # apply_updates does the averaging, reading replica_ok.
    count = axes_lib.psum(ok.astype(jnp.int32), plan.replica_axis)
  else:
    new_params, count = average(stepped, plan.replica_axis, plan.guard_nonfinite, ok)
  state = state._replace(finite_replicas=count, replica_ok=ok)
  if plan.average_opt_state:
    state = state._replace(inner_state=average_inner_state(plan, state.inner_state, ok))
  state = sync_controller(plan, state, score=score, gather=gather)
  if plan.rollback:  # a backed-off sync lands on the anchor; any other one becomes the next anchor
    state = roll_back(plan, state, new_params)
    new_params = state.anchor.params
  if not plan.exact_sync:
    updates = jax.tree.map(lambda a, b: (a - b).astype(b.dtype), new_params, params)
  return updates, state


def roll_back(plan: Plan, state, new_params):
  """The state after a sync with ``rollback``: where the guard backed off (``controller.backed_off``, the same on
  every replica), the anchor's optimizer state and its window's loss as the guard's next baseline, the anchor
  kept; else the sync's, and the anchor moves to it (the average ``new_params``). An anchor the map holds once per
  device (:func:`share_anchors`) is picked once there, not once per replica."""
  back, anchor, c = state.controller.backed_off, state.anchor, state.controller
  c = c._replace(
    train_loss=_where(back, anchor.train_loss, c.train_loss),
    train_loss_se=_where(back, anchor.train_loss_se, c.train_loss_se),
  )
  state = state._replace(inner_state=_where(back, anchor.inner_state, state.inner_state), controller=c)
  moved = shared_anchor(anchor_at(new_params, state), plan.replica_axis)
  return state._replace(anchor=_where(axes_lib.unbatched(back, plan.replica_axis), anchor, moved))


def _where(flag: jax.Array, old: Any, new: Any) -> Any:
  """``old`` where ``flag``, else ``new``, leaf by leaf (in ``new``'s dtypes)."""
  return jax.tree.map(lambda a, b: jnp.where(flag, a, b).astype(b.dtype), old, new)


def average_inner_state(plan: Plan, inner_state: Any, ok: jax.Array) -> Any:
  """The wrapped optimizer's state averaged over the replicas (its float leaves; the rest agree).

  Only needed when the replicas step on their own gradients (the low-communication mode):
  with the shared, all-reduced gradient the states are already equal. A leaf is assigned the
  average directly, so the replicas hold it bit for bit alike afterwards.
  """
  floats = [jnp.issubdtype(jnp.result_type(x), jnp.floating) for x in jax.tree.leaves(inner_state)]
  leaves = [x for x, f in zip(jax.tree.leaves(inner_state), floats) if f]
  if not leaves:  # e.g. plain SGD: no state to average
    return inner_state
  mean, _ = average(leaves, plan.replica_axis, plan.guard_nonfinite, ok)
  mean = iter(axes_lib.match_vma(mean, leaves))
  out = [next(mean) if f else x for x, f in zip(jax.tree.leaves(inner_state), floats)]
  return jax.tree.unflatten(jax.tree.structure(inner_state), out)


def sync_controller(plan: Plan, st, *, gather: bool, score=None):
  """The non-parameter part of a sync: window losses, controller update, fresh permutations."""
  c = st.controller
  window_losses = c.window_losses
  if score is not None:  # the caller's comparison (e.g. every replica on one common batch)
    window_losses = axes_lib.all_gather(jnp.asarray(score, jnp.float32), plan.replica_axis)
  elif gather:
    window_losses = axes_lib.all_gather(st.loss_sum / window_length(plan.sync_windows, st.count), plan.replica_axis)
  new_c = c._replace(window_losses=window_losses)
  a = plan.auto_lr
  if ctrl.is_fit(a) and a.backoff:
    new_c = new_c._replace(**window_train_loss(plan, st))
  if a is not None:
    started = st.count >= plan.controller_start
    stopped = st.count > a.stop_steps if a.stop_steps is not None else jnp.zeros([], bool)
    if ctrl.is_paper(a):
      new_c = _paper_controller(plan, c, new_c, window_losses, started & ~stopped)
    elif a.after_stop == 'rise':  # the fit goes on after the stop, taking only steps up
      new_c = _fit_controller(plan, c, new_c, window_losses, started, st.count, rise_only=stopped)
    else:
      new_c = _fit_controller(plan, c, new_c, window_losses, started & ~stopped, st.count)
    new_c = hold_after_last_step(a, st.count, c, new_c)
  key, sub = jax.random.split(jax.random.wrap_key_data(c.key))
  new_c = new_c._replace(
    key=jax.random.key_data(key), perm=multipliers.draw_permutations(sub, len(plan.names), plan.num_replicas)
  )
  return st._replace(
    controller=new_c,
    loss_sum=jnp.zeros_like(st.loss_sum),
    loss_diff_sq_sum=jnp.zeros_like(st.loss_diff_sq_sum),
    sync_count=st.sync_count + 1,
    synced=jnp.ones([], bool),
  )


# The controller's fields an update moves: the values the next window trains at and the fits behind them. Not
# ``backed_off``, the guard's verdict on the window just trained (with ``rollback`` it returns the replicas), nor the
# measurements ``window_losses``, ``train_loss`` and ``train_loss_se``.
MOVED = ('base', 'velocity', 'weights', 'delta', 'correction', 'xtx', 'xty', 'gain', 'asked', 'stderr', 'settled')
# Of those, the ones that say what the sync itself did (the step taken, and the 'fit' step asked): a held sync
# sets them to 0, as a sync before the controller starts leaves them.
HELD_AT_ZERO = ('delta', 'asked')


def hold_after_last_step(auto_lr, count: jax.Array, c, new_c):
  """``new_c`` with the controller's update undone at a sync on or after the run's last step.

  .. math:: c_{k+1} = c_k \\quad\\text{if}\\ t \\ge S

  with t the updates applied (``state.count``) and S ``auto_lr.total_steps``. No step trains at what such an update
  would set, so the state (logged, checkpointed, the warm start of a next run) keeps the learning-rate factor and
  base the run's last window trained with, instead of one it never used. The fields that say what the sync did,
  the step taken (``delta``) and the step asked (``asked``), are 0 there: nothing moved and nothing was asked. The
  window's end still averages the replicas (the final model is their average), and the guard still judges the
  window: with ``rollback`` a window whose loss rose still returns the replicas to the last sync, only the LRs do
  not step down.

  Args:
    auto_lr: the :class:`hdet_jax.AutoLR` (its ``total_steps``).
    count: [] int32, the updates applied, this sync's step included.
    c: the controller state before the sync.
    new_c: the controller state after the sync's update.

  Example:
    >>> import jax.numpy as jnp, hdet_jax
    >>> from hdet_jax import controller, sync
    >>> c = controller.init_controller_state(jnp.ones(1), 4, jnp.zeros(2, jnp.uint32))
    >>> c = c._replace(delta=jnp.full(1, 0.5))  # the sync before took a step of 0.5
    >>> moved = c._replace(correction=jnp.ones(1), delta=jnp.ones(1))
    >>> a = hdet_jax.AutoLR(total_steps=100)
    >>> float(sync.hold_after_last_step(a, jnp.asarray(99), c, moved).correction[0])  # a step is left: it moves
    1.0
    >>> held = sync.hold_after_last_step(a, jnp.asarray(100), c, moved)  # the last step: it holds
    >>> float(held.correction[0]), float(held.delta[0])  # the factor trained with; this sync's step: none
    (0.0, 0.0)
  """
  ended = count >= auto_lr.total_steps
  held = {f: jnp.where(ended, getattr(c, f), getattr(new_c, f)) for f in MOVED}
  # What this sync did, not the one before's: no step taken, none asked (the logged record says nothing moved).
  held.update({f: jnp.where(ended, jnp.zeros_like(getattr(c, f)), getattr(new_c, f)) for f in HELD_AT_ZERO})
  return new_c._replace(**held)


def window_train_loss(plan: Plan, st) -> dict[str, jax.Array]:
  """``train_loss``, the replicas' mean training loss over the window that ends here, and ``train_loss_se``, its
  standard error from the step-to-step changes (von Neumann's estimator, which a trend within the window
  leaves alone): with n steps, replica r's losses x_t and its noise variance s_r^2 = sum_t (x_t - x_{t-1})^2 / 2n,
  ``se = sqrt(mean_r s_r^2 / n)`` (the steps taken as independent)."""
  n = window_length(plan.sync_windows, st.count).astype(jnp.float32)
  train_loss, var = axes_lib.pmean((st.loss_sum / n, st.loss_diff_sq_sum / (2.0 * n)), plan.replica_axis)
  return {
    'train_loss': jnp.asarray(train_loss, jnp.float32).reshape(()),
    'train_loss_se': jnp.sqrt(jnp.asarray(var, jnp.float32) / n).reshape(()),
  }


def _paper_controller(plan: Plan, c, new_c, window_losses, active):
  """Eqs. 4-9 (:func:`hdet_jax.controller.controller_update`), held while not ``active``."""
  a = plan.auto_lr
  # The window's nominal values: the controller's base under each replica's spread (the
  # actual LRs differ from these by a factor common to all replicas, which leaves the
  # softmax-weighted signal's direction unchanged).
  nominal = multipliers.replica_values(plan, c.base, c.perm).T  # [N, G]
  out = ctrl.controller_update(
    c.base,
    c.velocity,
    window_losses,
    nominal,
    temperature=a.temperature,
    lr_of_lr=a.lr_of_lr,
    momentum=a.momentum,
    decay=jnp.asarray(plan.decay, jnp.float32),
    floor=jnp.asarray(plan.floors, jnp.float32),
  )
  new_base = jnp.minimum(out.base, jnp.asarray(plan.highs, jnp.float32))
  keep = lambda new, old: jnp.where(active, new, old)
  return new_c._replace(
    base=keep(new_base, c.base),
    velocity=keep(out.velocity, c.velocity),
    weights=keep(out.weights, c.weights),
    delta=keep(out.delta, c.delta),
  )


# A fitted slope is confident beyond this many standard errors: the gain grows only on such steps, and settle ends
# a climb on two such asks down in a row.
CONFIDENT_STDERRS = 2.0


def _fit_controller(plan: Plan, c, new_c, scores, active, count, rise_only=False):
  """The 'fit' controller's update of the correction (see :func:`hdet_jax.controller.fit_update`);
  ``rise_only`` (after the stop, ``after_stop='rise'``): steps that would lower a value are not taken. From
  ``plan.anneal_from`` on (``count``, the updates applied, at or past it) the learning rates' steps up are not
  taken either (:func:`anneal`)."""
  a = plan.auto_lr
  # Each replica's nominal offset u from the base in the window that ends here: rho - 1
  # (multiplicative) or the additive offset, under the window's permutations.
  add = np.asarray(plan.additive)
  rho = jnp.take_along_axis(jnp.asarray(plan.scale), c.perm, axis=1)
  u = jnp.where(add[:, None], jnp.take_along_axis(jnp.asarray(plan.offset), c.perm, axis=1), rho - 1.0).T  # [N, G]
  if a.settle:
    u = jnp.where(c.settled[None, :], 0.0, u)  # a settled hyperparameter did not spread
  trust = jnp.asarray([sp if ad else a.trust for sp, ad in zip(plan.spreads, plan.additive)], jnp.float32)
  out = ctrl.fit_update(c.xtx, c.xty, scores, u, jnp.asarray(~add), memory=a.memory, trust=trust)
  step, gain = ctrl.accelerate(
    out.step,
    c.gain,
    growth=a.step_growth,
    max_gain=a.max_gain,
    trust=trust,
    confident=jnp.abs(out.slope) > CONFIDENT_STDERRS * out.stderr,
  )
  step = jnp.where(rise_only, jnp.maximum(step, 0.0), step)
  settled = c.settled
  if a.settle:  # the climb ends at a second confident ask down in a row once the value has risen above its start
    risen = c.correction > jnp.asarray(plan.initial_correction, jnp.float32)
    down = out.slope > CONFIDENT_STDERRS * out.stderr
    was_down = c.velocity > CONFIDENT_STDERRS * c.stderr  # c: the last sync's fit
    ends = jnp.asarray(rise_only) & risen & down & was_down
    step, gain = jnp.where(c.settled, 0.0, step), jnp.where(c.settled, 0.0, gain)
    settled = c.settled | (ends & active)
  back = jnp.zeros_like(step, bool)
  if a.backoff:  # the window's mean training loss rose (or went non-finite): the LRs step down by trust
    # With backoff_stderrs = k > 0 only a rise beyond k standard errors of the difference counts, both windows'
    # noise taken as the window before's: a blowing-up window's own spread is the rise, not noise.
    margin = a.backoff_stderrs * np.sqrt(2.0) * c.train_loss_se if a.backoff_stderrs > 0 else 0.0
    if a.backoff_fraction > 0:  # and beyond this fraction of the window before's loss: a blow-up multiplies it
      margin = jnp.maximum(margin, a.backoff_fraction * jnp.abs(c.train_loss))
    rose = jnp.isfinite(c.train_loss) & ~(new_c.train_loss <= c.train_loss + margin)
    is_lr = jnp.asarray(plan.learning_rates)
    back = rose & is_lr
    step, gain = jnp.where(back, -trust, step), jnp.where(back, -1.0, gain)
  step = anneal(plan, count, step)
  keep = lambda new, old: jnp.where(active, new, old)
  return new_c._replace(
    backed_off=jnp.logical_and(jnp.any(back), active).reshape(()),
    settled=settled,
    correction=keep(c.correction + step, c.correction),
    xtx=keep(out.xtx, c.xtx),
    xty=keep(out.xty, c.xty),
    delta=keep(step, c.delta),
    velocity=keep(out.slope, c.velocity),
    gain=keep(gain, c.gain),
    asked=keep(out.step, c.asked),
    stderr=keep(out.stderr, c.stderr),
  )


def anneal(plan: Plan, count: jax.Array, step: jax.Array) -> jax.Array:
  """[G] the 'fit' controller's step with the learning rates' rises dropped once the schedule anneals.

  .. math:: \\Delta c_g \\leftarrow \\min(\\Delta c_g, 0) \\quad\\text{if}\\ t \\ge t_a
    \\text{ and } g \\text{ is a learning rate}

  with t the updates applied (``count``) and t_a ``plan.anneal_from``, the first step after the schedule's peak at
  which it has fallen below ``AutoLR.anneal_fraction`` of it (:func:`hdet_jax.schedules.anneal_start`). Late in a
  decaying schedule a larger factor looks better over one window, so a climb left to run cancels the decay; from
  t_a on the factor only holds or falls, so ``lr_t / s(t)`` is non-increasing and the anneal keeps the schedule's
  shape. A run whose factor never asks to rise from t_a on is unchanged bit for bit; with no decay (``anneal_from``
  None) no op is added.

  Args:
    plan: the validated plan (its ``anneal_from`` and ``names``).
    count: [] int32, the updates applied, this sync's step included.
    step: [G] float32, the step the controller would take.

  Example:
    >>> import inspect, jax.numpy as jnp, optax, hdet_jax
    >>> from hdet_jax import settings, sync
    >>> cosine = optax.cosine_decay_schedule(1e-2, 101)  # below half its peak past its midpoint, 50.5
    >>> args = inspect.signature(hdet_jax.hdet).bind(  # hdet's arguments, its defaults for the rest
    ...   optax.sgd, cosine, num_replicas=4, sync_every=10, auto_lr=hdet_jax.AutoLR(100, anneal_fraction=0.5))
    >>> args.apply_defaults()
    >>> plan = settings.make_plan(args.arguments)
    >>> plan.anneal_from
    51
    >>> [float(sync.anneal(plan, jnp.asarray(t), jnp.asarray([0.5]))[0]) for t in (50, 51)]  # rises stop at 51
    [0.5, 0.0]
    >>> float(sync.anneal(plan, jnp.asarray(80), jnp.asarray([-0.5]))[0])  # falls are still taken
    -0.5
  """
  if plan.anneal_from is None:
    return step
  is_lr = jnp.asarray(plan.learning_rates)
  return jnp.where(is_lr & (count >= plan.anneal_from), jnp.minimum(step, 0.0), step)


def apply_updates(
  params: Any,
  updates: Any,
  state,
  *,
  replica_axis: axes_lib.AxisName = 'data',
  sync: bool | None = None,
  guard_nonfinite: bool = True,
) -> Any:
  """``optax.apply_updates`` that assigns the replicas' average exactly on sync steps.

  For a transformation built with ``exact_sync=True`` (whose sync-step update leaves the
  averaging to this function): ``p + u`` on ordinary steps, ``pmean(p + u)`` over
  ``replica_axis`` on sync steps (``state.synced``, or the static ``sync``), so every replica
  holds bitwise the same average. Call it inside the same mapped context as the update, with
  ``state`` the :class:`hdet_jax.HDETState` the update returned.

  Example:
    >>> import jax, jax.numpy as jnp, optax, hdet_jax
    >>> tx = hdet_jax.hdet(optax.sgd, 0.1, num_replicas=4, sync_every=2, exact_sync=True)
    >>> def train_step(params, opt_state, grads):  # one replica's view
    ...   updates, opt_state = tx.update(grads, opt_state, params)
    ...   return hdet_jax.apply_updates(params, updates, opt_state), opt_state
    >>> step = jax.vmap(train_step, axis_name='data')
    >>> params = hdet_jax.stack_replicas(jnp.ones(3), 4)
    >>> params, opt_state = step(params, jax.vmap(tx.init)(params), jnp.ones((4, 3)))
    >>> params[:, 0]  # each replica stepped at its own learning rate
    Array([0.925     , 0.9083333 , 0.89166665, 0.875     ], dtype=float32)
    >>> params, opt_state = step(params, opt_state, jnp.ones((4, 3)))  # the window's end
    >>> bool(opt_state.synced[0]), bool((params == params[0]).all())  # every replica holds the average
    (True, True)
  """
  arguments.axis_name(replica_axis, 'replica_axis', who='apply_updates')
  guard_nonfinite = arguments.flag(guard_nonfinite, 'guard_nonfinite', who='apply_updates')
  if sync is not None and not isinstance(sync, bool):
    raise ValueError(f'apply_updates: sync must be None or a Python bool, got {type(sync).__name__}.')
  if not all(hasattr(state, f) for f in ('synced', 'replica_ok', 'anchor')) or jnp.ndim(state.synced) != 0:
    raise ValueError(
      f'apply_updates: state must be the hdet_jax.HDETState that tx.update returned (not the whole optimizer '
      f'state of a chain, nor a stacked one outside the map), got {type(state).__name__}.'
    )
  new_params = optax.apply_updates(params, updates)
  mean = lambda p: average(p, replica_axis, guard_nonfinite, state.replica_ok)[0]
  if sync is False:
    return new_params
  if state.anchor is not None:  # with rollback the sync already holds where the replicas land: assign it
    mean = lambda p: state.anchor.params
  if sync:
    return mean(new_params)
  synced = axes_lib.unbatched(state.synced, replica_axis)  # a cond, not a select, under per_device > 1
  return lax.cond(synced, lambda p: axes_lib.match_vma(mean(p), p), lambda p: p, new_params)
