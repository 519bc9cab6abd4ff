"""The library's rollback (``hdet(..., rollback=True)``): what its anchor costs per device, counted in bytes.

The add-to-trainer example (examples/add_to_trainer/hdet_linen.py: 4 replicas x 2 FSDP devices, AdamW under
``multi_steps``) built with and without the rollback; on device 0 it counts the bytes of the whole training state
and of the anchor, and the anchor's shardings (FSDP inside each replica, as the parameters).

Then 8 replicas on one device under ``over_replicas(per_device=8)`` (a 3-layer MLP, AdamW): the state without the
rollback, with one anchor per replica, and with the anchor shared by the device's replicas
(``stack_replicas(state, N, per_device=k)``), and XLA's counted work of the compiled step (flops, bytes accessed,
temporary bytes) with and without the shared anchor.

Usage: ``python -m benchmarks.rollback_memory`` (seconds).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault('JAX_NUM_CPU_DEVICES', '8')

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import hdet_jax  # noqa: E402

sys.path.insert(
  0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'examples', 'add_to_trainer')
)
import hdet_linen as example  # noqa: E402


def state_bytes(rollback: bool) -> dict:
  """Device 0's bytes of the example's training state, built with ``rollback``."""
  build = hdet_jax.hdet
  example.hdet_jax.hdet = lambda *args, **kwargs: build(*args, rollback=rollback, **kwargs)
  try:
    mesh = Mesh(np.array(jax.devices()).reshape(example.N, -1), ('replica', 'data'))
    create = lambda key: example.create_state(key)  # a fresh function: jit's cache keys on it
    shardings = hdet_jax.stacked_shardings(nn.get_sharding(jax.eval_shape(create, jax.random.key(0)), mesh), 'replica')
    state = jax.jit(create, out_shardings=shardings)(jax.random.key(0))
  finally:
    example.hdet_jax.hdet = build
  device = jax.devices()[0]
  on_device = lambda tree: sum(
    s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device
  )
  anchor = state.opt_state.inner_opt_state.anchor
  return {
    'state': on_device(state),
    'params': on_device(state.params),
    'anchor': on_device(anchor),
    'specs': sorted({str(x.sharding.spec) for x in jax.tree.leaves(anchor)}),
  }


def per_device_bytes(per_device: int = 8) -> dict:
  """Device 0's state bytes with ``per_device`` replicas on it: no rollback, an anchor per replica, one shared; and
  the compiled step's counted work without the rollback and with the shared anchor."""
  import jax.numpy as jnp
  import optax

  n, mesh = per_device, Mesh(np.array(jax.devices()[:1]), ('replica',))
  sizes = (256, 512, 512, 10)
  keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
  params = {
    f'w{i}': jax.random.normal(k, (a, b)) / np.sqrt(a) for i, (k, a, b) in enumerate(zip(keys, sizes, sizes[1:]))
  }

  def build(rollback):
    auto_lr = hdet_jax.AutoLR(total_steps=1000)
    return hdet_jax.hdet(optax.adamw(1e-3), num_replicas=n, replica_axis='replica', auto_lr=auto_lr, rollback=rollback)

  def step_of(tx, sync):
    def step(state, batch):
      p, s = state
      loss, g = jax.value_and_grad(lambda p: jnp.mean((batch @ p['w0'] @ p['w1'] @ p['w2']) ** 2))(p)
      u, s = tx.update(hdet_jax.pmean_finite(g, 'replica'), s, p, value=loss, sync=sync)
      return (hdet_jax.apply_updates(p, u, s, replica_axis='replica', sync=sync), s), loss

    return jax.jit(hdet_jax.over_replicas(step, mesh, 'replica', per_device=n), donate_argnames='state')

  on_device = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
  out, batch = {}, jnp.ones((n * 4, sizes[0]))
  for label, rollback, share in (('none', False, 1), ('per_replica', True, 1), ('shared', True, n)):
    tx = build(rollback)
    state = hdet_jax.stack_replicas((params, tx.init(params)), n, per_device=share)
    out[label] = {'state': on_device(state), 'params': on_device(state[0])}
    for sync in (False, True):  # the step between syncs, and the sync step (each compiled on its own)
      compiled = step_of(tx, sync).lower(state, batch).compile()
      cost, memory = compiled.cost_analysis(), compiled.memory_analysis()
      cost = cost[0] if isinstance(cost, list) else cost
      out[label][sync] = {
        'flops': cost.get('flops'),
        'bytes_accessed': cost.get('bytes accessed'),
        'temp': memory.temp_size_in_bytes,
      }
  return out


def main() -> None:
  off, on = state_bytes(False), state_bytes(True)
  print(f'device 0, {jax.devices()[0].platform}, 4 replicas x 2 FSDP, AdamW under multi_steps:')
  print(f'  training state without the rollback: {off["state"]:,} B (parameters {off["params"]:,} B)')
  print(
    f'  with it: {on["state"]:,} B = {on["state"] / off["state"]:.3f}x; the anchor {on["anchor"]:,} B '
    f'= {on["anchor"] / off["params"]:.2f}x the parameters, laid out {", ".join(on["specs"])}'
  )

  d = per_device_bytes()
  print(f'device 0, {jax.devices()[0].platform}, 8 replicas on it (over_replicas per_device=8), an MLP, AdamW:')
  print(f'  training state without the rollback: {d["none"]["state"]:,} B (parameters {d["none"]["params"]:,} B)')
  for label, what in (('per_replica', 'an anchor per replica'), ('shared', 'one anchor, shared by the 8')):
    print(f'  {what}: {d[label]["state"]:,} B = {d[label]["state"] / d["none"]["state"]:.3f}x')
  for sync, which in ((False, 'between syncs'), (True, 'a sync step')):
    for key in ('flops', 'bytes_accessed', 'temp'):
      a, b = d['none'][sync][key], d['shared'][sync][key]
      print(f'  {which}, {key}: {a:,.0f} without the rollback, {b:,.0f} with the shared anchor ({b / a:.4f}x)')


if __name__ == '__main__':
  main()
