"""The library's rollback (``hdet(..., rollback=True)``): what its anchor costs per device, counted in bytes.

The add-to-trainer example (examples/add_to_trainer/hdet_linen.py: 4 replicas x 2 FSDP devices, AdamW under
``multi_steps``) built with and without the rollback; on device 0 it counts the bytes of the whole training state
and of the anchor, and the anchor's shardings (FSDP inside each replica, as the parameters).

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


def main() -> None:
  off, on = state_bytes(False), state_bytes(True)
  print(f'device 0, {jax.devices()[0].platform}, 4 replicas x 2 FSDP, AdamW under multi_steps:')
  print(f'  training state without the rollback: {off["state"]:,} B (parameters {off["params"]:,} B)')
  print(
    f'  with it: {on["state"]:,} B = {on["state"] / off["state"]:.3f}x; the anchor {on["anchor"]:,} B '
    f'= {on["anchor"] / off["params"]:.2f}x the parameters, laid out {", ".join(on["specs"])}'
  )


if __name__ == '__main__':
  main()
