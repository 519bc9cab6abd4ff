"""Gradient accumulation that runs the wrapped optimizer once per optimizer step: :func:`multi_steps`.

``optax.MultiSteps`` calls the wrapped optimizer's ``update`` on every micro-batch, with the running mean of
the gradients, and keeps its result only on the last one (a ``jnp.where`` on the state, the updates times 0 or
1). That is exact and costs one optimizer update per micro-batch, which for most optimizers is cheap. For
:func:`hdet_jax.hdet` it is not: the update that ends a window averages the replicas' parameters (an all-reduce
of the parameters' bytes) and all-gathers the controller's scores, and under ``MultiSteps`` every micro-batch of
that optimizer step runs it, so the window's average is computed and sent k times instead of once. The wrapped
update cannot tell the micro-batches apart (it sees the same step count on each), so the fix is in the wrapper.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from hdet_jax import arguments
from hdet_jax import axes as axes_lib


def multi_steps(
  optimizer: optax.GradientTransformation, every_k: int, *, use_grad_mean: bool = True
) -> optax.GradientTransformationExtraArgs:
  """``optax.MultiSteps`` that runs ``optimizer``'s update only on the last of every ``every_k`` micro-batches.

  Each call adds the micro-batch's gradient g_j to the accumulator (``use_grad_mean``: the running mean
  :math:`a_j = a_{j-1} + (g_j - a_{j-1}) / j`, Welford's update as ``optax.MultiSteps`` has it; else the sum).
  On micro-batches 1 to k - 1 the update is zero and the wrapped state is left alone; on the k-th the
  wrapped optimizer's update runs on :math:`a_k`, inside a ``lax.cond``, so it runs once per optimizer step.
  The results are ``optax.MultiSteps(optimizer, every_k)``'s: the same state (``optax.MultiStepsState``, so
  ``state.inner_opt_state`` and checkpoints read as before) and the same updates, bit for bit where XLA
  compiles the wrapped update alike inside the conditional and in line (XLA:CPU at its default flags may
  fuse it differently there: a few float32 ulps). The zero updates of the first k - 1 micro-batches are +0,
  where ``MultiSteps`` multiplies the discarded update by 0 (-0 for a negative entry, NaN for a non-finite one).

  Why a replacement: ``MultiSteps`` runs the wrapped update on every micro-batch and keeps the last, so the
  end of an :func:`hdet_jax.hdet` window (the replicas' average, an all-reduce of the parameters) runs k
  times per window instead of once. Extra arguments of ``update`` (``value=loss``) reach the wrapped
  optimizer on the last micro-batch, as under ``MultiSteps``; HDET then compares the last micro-batch's loss.
  With several replicas per device (:func:`hdet_jax.over_replicas` with ``per_device > 1``) the micro-batch
  count is read unbatched (:func:`hdet_jax.axes.unbatched`), so the cond stays a cond under the map's
  ``vmap``.

  Args:
    optimizer: the wrapped transformation, e.g. ``hdet_jax.hdet(...)`` or ``optax.adamw(1e-3)``.
    every_k: k >= 1, the micro-batches per optimizer step (a fixed number; ``MultiSteps``' schedule of k
      and its ``should_skip_update_fn`` are not offered).
    use_grad_mean: if True (default) the accumulated gradient is the mean of the micro-batches'; else their sum.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an ``optax.MultiStepsState``.

  Example:
    >>> import jax.numpy as jnp, optax, hdet_jax
    >>> tx = hdet_jax.multi_steps(optax.sgd(1.0), every_k=2)
    >>> params = {'w': jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> for g in (1.0, 3.0):  # two micro-batches: one optimizer step on their mean gradient, 2
    ...   updates, state = tx.update({'w': jnp.full(2, g)}, state, params)
    ...   print(updates['w'].tolist(), int(state.mini_step), int(state.gradient_step))
    [0.0, 0.0] 1 0
    [-2.0, -2.0] 0 1
  """
  every_k = arguments.count(every_k, 'every_k', who='multi_steps', what=' (the micro-batches per optimizer step)')
  use_grad_mean = arguments.flag(use_grad_mean, 'use_grad_mean', who='multi_steps')
  if not (callable(getattr(optimizer, 'init', None)) and callable(getattr(optimizer, 'update', None))):
    raise ValueError(
      f'multi_steps: optimizer must be a built optax transformation (e.g. hdet_jax.hdet(...) or optax.adamw(1e-3)), '
      f'got {optimizer!r}.'
    )
  reference = optax.MultiSteps(optimizer, every_k, use_grad_mean=use_grad_mean)  # its init: the same state
  inner = optax.with_extra_args_support(optimizer)

  def update_fn(updates, state, params=None, **extra_args):
    return update(inner, every_k, use_grad_mean, updates, state, params, extra_args)

  return optax.GradientTransformationExtraArgs(reference.init, update_fn)


def update(
  inner: optax.GradientTransformationExtraArgs,
  every_k: int,
  use_grad_mean: bool,
  grads: Any,
  state: optax.MultiStepsState,
  params: Any,
  extra_args: dict[str, Any],
) -> tuple[Any, optax.MultiStepsState]:
  """One micro-batch of :func:`multi_steps`: accumulate, and on the k-th run ``inner`` on the accumulated gradient."""
  n = state.mini_step
  if use_grad_mean:  # Welford, as optax.MultiSteps: a + (g - a) / (n + 1)
    acc = jax.tree.map(lambda g, a: a + (g - a) / (n + 1), grads, state.acc_grads)
  else:
    acc = jax.tree.map(lambda g, a: g + a, grads, state.acc_grads)
  emit = n == every_k - 1

  def last(inner_state):
    out, new_state = inner.update(optax.tree.cast_like(acc, grads), inner_state, params, **extra_args)
    return out, _like(new_state, inner_state)

  def before_last(inner_state):
    shapes = jax.eval_shape(last, inner_state)[0]  # traced only: the update's shapes and dtypes
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), _like(inner_state, inner_state)

  # Under a checked shard_map both branches must vary over the same mesh axes: the inputs' (a mean only removes
  # axes), where the sync's pmean in one branch would leave a leaf invariant that the other returns varying.
  axes = frozenset().union(*(axes_lib.vma(x) for x in jax.tree.leaves((grads, state, params))))
  vary = lambda f: lambda s: _varying(f(s), axes)
  out, inner_state = lax.cond(axes_lib.unbatched(emit), vary(last), vary(before_last), state.inner_opt_state)
  return out, optax.MultiStepsState(
    mini_step=optax.safe_increment(n) % every_k,
    gradient_step=emit * optax.safe_increment(state.gradient_step) + (1 - emit) * state.gradient_step,
    inner_opt_state=inner_state,
    acc_grads=jax.tree.map(lambda a, old: jnp.astype((1 - emit) * a, old.dtype), acc, state.acc_grads),
    skip_state=state.skip_state,
  )


def _like(new: Any, old: Any) -> Any:
  """``new`` in ``old``'s dtypes, as ``optax.MultiSteps`` keeps its inner state (both branches then agree)."""
  return jax.tree.map(lambda x, o: jnp.astype(x, jnp.result_type(o)), new, old)


def _varying(tree: Any, axes: frozenset) -> Any:
  """Each leaf cast to vary over ``axes`` where it does not already (nothing to do outside shard_map)."""

  def cast(x):
    missing = tuple(sorted(axes - axes_lib.vma(x)))
    return lax.pcast(x, missing, to='varying') if missing else x

  return jax.tree.map(cast, tree)
