"""Shared helpers of the core tests: replicas on the 8 simulated devices, a quadratic problem, and hdet's plan."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import hdet_jax as H
from hdet_jax import settings

N = 8
AX = 'data'


def make_mesh():
  return Mesh(np.array(jax.devices()[:N]), (AX,))


def put(mesh, tree):
  return jax.device_put(tree, NamedSharding(mesh, P(AX)))


def quad_problem(dim=5, seed=0):
  """Per-replica targets c_r; l(theta; B_r) = 0.5 |theta - c_r|^2."""
  c = jax.random.normal(jax.random.key(seed), (N, dim))
  return {'w': jnp.zeros((dim,))}, c


def hdet_plan(*args, **kwargs) -> settings.Plan:
  """The plan ``hdet(*args, **kwargs)`` builds, hdet's defaults for what is left out."""
  bound = inspect.signature(H.hdet).bind(*args, **kwargs)
  bound.apply_defaults()
  return settings.make_plan(bound.arguments)


def one_in_flight(f):
  """``f`` that waits for its results. XLA:CPU's in-process all-reduce can wait forever for a participant when several
  multi-device programs are queued (CONTRIBUTING.md, "Known XLA:CPU limit"), so loops over them keep one in flight."""
  return lambda *args: jax.block_until_ready(f(*args))


def quad_step(tx, sync=None, pmean_grads=True, exact=False):
  def step(p, s, c):
    loss, g = jax.value_and_grad(lambda p: 0.5 * jnp.sum((p['w'] - c) ** 2))(p)
    if pmean_grads:
      g = lax.pmean(g, AX)
    u, s = tx.update(g, s, p, value=loss, sync=sync)
    p = H.apply_updates(p, u, s, replica_axis=AX, sync=sync) if exact else optax.apply_updates(p, u)
    return p, s, loss

  return step


def run(mesh, tx, steps, params, data, backend='shard_map', exact=False, record=False, sync=None):
  sp = H.stack_replicas(params, N)
  ss = jax.jit(jax.vmap(tx.init))(sp)
  step = quad_step(tx, exact=exact, sync=sync)
  if backend == 'shard_map':
    f = jax.jit(H.shard_map_replicas(step, mesh, AX))
    sp, ss, data = put(mesh, (sp, ss, data))
  elif backend == 'pmap':
    f = jax.pmap(step, axis_name=AX)
  else:
    f = jax.jit(jax.vmap(step, axis_name=AX))
  trace, call = [], one_in_flight(f)
  for _ in range(steps):
    sp, ss, loss = call(sp, ss, data)
    if record:
      trace.append((np.asarray(sp['w']), jax.tree.map(np.asarray, ss)))
  return sp, ss, trace, f


def signal_step(tx, lr_index=0):
  """:func:`signal_run`'s step of the N replicas under vmap, ``(params, state) -> (params, state)``: zero gradients,
  each replica's loss 1 + 3 (lr / 1e-2 - 1)^2 of its LR."""

  def step(p, s):
    my_lr = s.values[lr_index, lax.axis_index(AX)]
    u, s = tx.update(jax.tree.map(jnp.zeros_like, p), s, p, value=1.0 + 3.0 * (my_lr / 1e-2 - 1.0) ** 2)
    return optax.apply_updates(p, u), s

  return jax.vmap(step, axis_name=AX)


def signal_start():
  """:func:`signal_run`'s stacked parameters (zeros)."""
  return H.stack_replicas({'w': jnp.zeros(3)}, N)


def signal_run(tx, steps, lr_index=0):
  """Zero gradients; each replica's loss is 1 + 3 (lr / 1e-2 - 1)^2 of its LR: a bowl at LR 1e-2.
  Returns per sync: the state before the sync's window (perm, base, velocity, ...) and after it."""
  sp = signal_start()
  ss = jax.vmap(tx.init)(sp)
  f = jax.jit(signal_step(tx, lr_index))
  states = [jax.tree.map(lambda x: np.asarray(x[0]), ss)]
  for _ in range(steps):
    sp, ss = f(sp, ss)
    states.append(jax.tree.map(lambda x: np.asarray(x[0]), ss))
  return states
