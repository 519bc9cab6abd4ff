"""HDET in a flax trainer of your own: :func:`apply_gradients` for a ``TrainState`` step, :func:`dense_general_ok`
for linen's ``nn.DenseGeneral`` under a mesh.

Both need only the core (``pip install hdet-jax``) and flax itself, not the trainer extra (orbax,
ml_collections): :func:`apply_gradients` reads the state's fields and never imports flax, and :func:`dense_general_ok`
imports flax's two partitioning boxes when it is called, so ``import hdet_jax`` stays free of flax.

``nn.DenseGeneral`` initializes its kernel flattened to 2-D, calls ``unbox()`` on the box the annotated initializer
returns, then reshapes (flax issue 3676, https://github.com/google/flax/issues/3676, open). While a mesh is set
(``jax.set_mesh``, or inside ``jax.shard_map``, as under :func:`hdet_jax.over_replicas`) ``unbox()`` constrains the
value to the box's partition spec, and a spec of 3 names does not fit a 2-D value: ``ValueError: ...
spec=P('data', None, None) is only valid for values of rank at least 3, but was applied to a value of rank 2``.
flax runs that initializer on every ``apply`` too (its parameter shape check, under ``jax.eval_shape``), so the
step fails even with the parameters given. Outside a mesh (a plain ``jax.jit`` with shardings) flax applies no
constraints and the model runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any, Callable

import jax.numpy as jnp
import optax

# dense_general_ok patches class attributes of flax's boxes: one patch at a time, across threads.
_LOCK = threading.RLock()


def apply_gradients(state: Any, grads: Any, **extra_args: Any) -> Any:
  """A flax ``TrainState``'s ``apply_gradients(grads=grads)`` that passes ``value=`` (and any other extra
  argument) on to ``state.tx.update``.

  .. math::

    (u, s') = \\mathrm{tx.update}(g, s, p, \\mathrm{value}=L), \\qquad
    \\mathrm{state}' = \\mathrm{state.replace}(\\mathrm{step}=\\mathrm{step} + 1, \\mathrm{params}=p + u,
    \\mathrm{opt\\_state}=s')

  flax's ``TrainState.apply_gradients(grads=..., **kwargs)`` gives its keyword arguments to ``replace``, not to
  the optimizer, so HDET's ``value=loss`` cannot reach :func:`hdet_jax.hdet` through it; this is the same update
  with the arguments forwarded, one changed line in the step. It reads ``state.tx``, ``state.opt_state``,
  ``state.params`` and ``state.step`` and returns ``state.replace(...)``: any ``TrainState`` subclass works, and
  flax is not imported. (flax's ``overwrite_with_gradient`` collection, for fp8 training, is not handled: there
  use ``state.tx.update`` and ``state.replace`` as flax's method does.)

  Args:
    state: a flax ``TrainState`` (or anything with ``tx``, ``opt_state``, ``params``, ``step`` and ``replace``).
    grads: the gradients, a tree like ``state.params`` (for HDET, already all-reduced across replicas with
      :func:`hdet_jax.pmean_finite`).
    **extra_args: passed to ``state.tx.update``, e.g. ``value=loss`` (HDET's, required with ``auto_lr``); those
      that name a field of the state, such as a ``TrainState`` subclass's ``batch_stats=``, are set on the new state
      instead, as flax's own ``apply_gradients(grads=..., **kwargs)`` does (``step=``, ``params=``,
      ``opt_state=`` and ``tx=`` are refused: the update sets them).

  Returns:
    The state after one update, its ``step`` one higher.

  Example:
    >>> import jax, jax.numpy as jnp, optax, hdet_jax
    >>> from flax.training.train_state import TrainState
    >>> tx = hdet_jax.hdet(optax.sgd(0.1), num_replicas=4, replica_axis='replica', auto_lr=hdet_jax.AutoLR(100))
    >>> def train_step(state, x):  # one replica's view
    ...   loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p['w']) ** 2))(state.params)
    ...   grads = hdet_jax.pmean_finite(grads, 'replica')
    ...   return hdet_jax.apply_gradients(state, grads, value=loss)  # not state.apply_gradients(grads=grads)
    >>> state = jax.vmap(lambda p: TrainState.create(apply_fn=None, params=p, tx=tx))(
    ...   hdet_jax.stack_replicas({'w': jnp.ones(2)}, 4))
    >>> state = jax.vmap(train_step, axis_name='replica')(state, jnp.ones((4, 8, 2)))
    >>> state.step.tolist(), [round(w, 3) for w in state.params['w'][:, 0].tolist()]  # 1 - 0.1 c rho_r 4, c = 0.1
    ([1, 1, 1, 1], [0.97, 0.963, 0.957, 0.95])
  """
  missing = [name for name in ('tx', 'opt_state', 'params', 'step', 'replace') if not hasattr(state, name)]
  if missing:
    raise TypeError(
      f'apply_gradients: state has no {missing[0]!r}; pass a flax TrainState (or a state with tx, opt_state, '
      f'params, step and replace), not a {type(state).__name__}.'
    )
  fields = _fields(state)
  replaced = {k: v for k, v in extra_args.items() if k in fields}  # flax's apply_gradients(**kwargs) -> replace
  owned = sorted(_UPDATE_SETS & set(replaced))
  if owned:
    name = owned[0]
    raise TypeError(f'apply_gradients: {name}= is what the update itself sets; drop it (use state.replace after).')
  update_args = {k: v for k, v in extra_args.items() if k not in fields}
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params, **update_args)
  params = optax.apply_updates(state.params, updates)
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state, **replaced)


# The fields the update itself writes: a keyword naming one would be overwritten, so it is refused.
_UPDATE_SETS = frozenset({'step', 'params', 'opt_state', 'tx'})


def _fields(state: Any) -> frozenset[str]:
  """The names of ``state``'s dataclass fields (a flax ``TrainState``'s, with a subclass's own such as
  ``batch_stats``); none where it is not a dataclass."""
  return frozenset(f.name for f in dataclasses.fields(state)) if dataclasses.is_dataclass(state) else frozenset()


def _boxes() -> tuple[type, ...]:
  """flax's two partitioning boxes, imported only when :func:`dense_general_ok` is used."""
  from flax.core import meta
  from flax.linen import spmd

  return meta.Partitioned, spmd.LogicallyPartitioned


@contextlib.contextmanager
def _flat_values_unconstrained(boxes: tuple[type, ...]):
  """While active, a partitioning box whose names outnumber its value's dimensions unboxes without a constraint
  (where flax would raise); every other box unboxes as flax does."""
  with _LOCK:
    saved = {cls: cls.__dict__['unbox'] for cls in boxes}

    def patched(original):
      def unbox(self, apply_constraint=True):
        return original(self, apply_constraint and len(self.names) <= jnp.ndim(self.value))

      return unbox

    try:
      for cls, original in saved.items():
        cls.unbox = patched(original)
      yield
    finally:
      for cls, original in saved.items():
        cls.unbox = original


def dense_general_ok(train_step: Callable[..., Any]) -> Callable[..., Any]:
  """``train_step`` with flax's flattened ``nn.DenseGeneral`` kernels left unconstrained while it is traced.

  A workaround for flax issue 3676 (https://github.com/google/flax/issues/3676): under a mesh, a 3-D
  ``nn.DenseGeneral`` kernel annotated with ``nn.with_partitioning`` (or ``nn.with_logical_partitioning``) is
  constrained to its 3 names while flax still holds it flattened to 2-D, which is an error. The step, its
  signature (``donate_argnames``, ``static_argnames``) and every other sharding constraint stay as they are;
  only the constraint on a box whose names outnumber its value's dimensions,

  .. math::

    \\mathrm{len}(\\mathrm{names}) > \\mathrm{ndim}(\\mathrm{value}),

  exactly the case where flax would raise, is skipped. The parameters themselves (3-D) are still constrained to
  their annotations when unboxed. It costs nothing at run time (it acts while the step is traced: the compiled
  program is the one flax would build without the error) and takes flax's two boxes' ``unbox`` for the length of
  each trace, under a lock. It needs the core and flax only (not orbax or ml_collections); remove it once
  flax constrains the kernel after its reshape.

  Args:
    train_step: the step (or any function that applies a linen model) to map.

  Returns:
    The step, with its signature (``functools.wraps``).

  Example:
    Wrap the step where it is mapped, ``hdet_jax.over_replicas(hdet_jax.dense_general_ok(train_step), mesh,
    'replica')``; it works under ``jax.set_mesh`` alone as well:

    >>> import jax, jax.numpy as jnp, numpy as np, flax.linen as nn, hdet_jax
    >>> from jax.sharding import Mesh
    >>> init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, None, 'data'))
    >>> layer = nn.DenseGeneral((2, 8), kernel_init=init)  # a [6, 2, 8] kernel, its last axis over 'data'
    >>> x = jnp.ones((8, 6))
    >>> with jax.set_mesh(Mesh(np.array(jax.devices()), ('data',))):
    ...   params = jax.jit(hdet_jax.dense_general_ok(layer.init))(jax.random.key(0), x)
    ...   y = jax.jit(hdet_jax.dense_general_ok(layer.apply))(params, x)
    >>> y.shape
    (8, 2, 8)
  """
  boxes = _boxes()

  @functools.wraps(train_step)
  def step(*args, **kwargs):
    with _flat_values_unconstrained(boxes):
      return train_step(*args, **kwargs)

  return step
