"""Replica groups on 2-D meshes: communication across the replica axis and per-device memory.

    python -m benchmarks.mesh2d [--time STEPS] [--out results/mesh2d.md]

On the trainer's default model and the trainer's own programs (``train_step.make_train_step`` and
``make_window_end`` with the 2-D layout), for the layouts 8x1 (the 1-D mesh), 4x2 and 2x4 over 8
devices, each with the same global batch (64 windows a step: data.batch_size = 64 / groups):

* bytes moved across the replica axis, per device, counted from the compiled HLO
  (``hdet_jax.comm``): the step program (every step) and the window end (every T steps), for the
  shared-gradient mode, the low-communication mode, and the latter with ``average_opt_state``;
  per step = step + window end / T;
* per-device bytes of parameters + optimizer state (read from the arrays' shards), against plain
  FSDP over all 8 devices (optax.adamw, one copy) and the rule (P + O) x groups / devices;
* with ``--time K``, the median wall time of K steps per layout and mode (on this CPU the 8
  simulated devices share the host's cores: a smoke figure, not a speed claim).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault('JAX_NUM_CPU_DEVICES', '8')

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import hdet_jax as H  # noqa: E402
from hdet_jax import comm  # noqa: E402
from hdet_jax.trainer import config_lib  # noqa: E402
from hdet_jax.trainer import model as model_lib  # noqa: E402
from hdet_jax.trainer import train_step as ts  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = 8
GLOBAL_WINDOWS = 64
LAYOUTS = ((8, 1), (4, 2), (2, 4))
MODES = {  # name -> config overrides
    'shared gradient': {},
    'low-communication': {'hdet.low_communication': True},
    'low-comm + avg opt state': {'hdet.low_communication': True, 'hdet.average_opt_state': True},
}


def config_for(groups: int, overrides: dict):
  config = config_lib.load_config_file(os.path.join(REPO, 'configs', 'default.py'))
  return config_lib.with_overrides(config, {'data.batch_size': GLOBAL_WINDOWS // groups, **overrides})


def build(groups: int, fsdp: int, overrides: dict):
  """(config, mesh, params, opt_state, step, window_end, data, probe): the trainer's programs, compiled."""
  config = config_for(groups, overrides)
  mesh = ts.make_mesh(groups, fsdp)
  tx = ts.make_optimizer(config, groups)
  graphdef, _ = model_lib.abstract_model(config.model, config.data.seq_len)
  params, opt_state = ts.make_init(config, tx, mesh, groups)(jax.random.key(0))
  layout = ts.layout(mesh, params, opt_state)
  windows = np.zeros((groups, config.data.batch_size, config.data.seq_len + 1), np.uint8)
  data = ts.put_stacked(windows, mesh, batch_dim=1)
  probe = ts.put_stacked(np.zeros((groups, config.hdet.probe_windows, config.data.seq_len + 1), np.uint8),
                         mesh, batch_dim=1)
  step = ts.make_train_step(graphdef, tx, mesh, sync=False, config=config, shardings=layout).lower(
      params, opt_state, data).compile()
  window_end = ts.make_window_end(tx, mesh, graphdef=graphdef, config=config, shardings=layout).lower(
      params, opt_state, probe).compile()
  return config, mesh, params, opt_state, step, window_end, data, probe


def replica_bytes(compiled, mesh) -> int:
  return comm.replica_axis_bytes(compiled.as_text(), tuple(mesh.devices.shape))


def device_bytes(tree) -> int:
  """Bytes of ``tree`` held on device 0 (every device holds the same amount here)."""
  dev = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == dev)


def plain_fsdp_bytes() -> tuple[int, int]:
  """(per-device bytes, total bytes) of params + AdamW state sharded over all 8 devices, one copy."""
  config = config_for(DEVICES, {})
  mesh = ts.make_mesh(1, DEVICES)
  _, params = model_lib.split_model(config.model, config.data.seq_len, jax.random.key(0))
  stacked = H.stack_replicas(params, 1)
  state = jax.vmap(optax.adamw(1e-3).init)(stacked)
  put = lambda t: jax.device_put(t, H.group_shardings(t, mesh, ts.AXIS, ts.INNER))
  tree = (put(stacked), put(state))
  return device_bytes(tree), sum(x.nbytes for x in jax.tree.leaves(tree))


def step_time(step, window_end, params, opt_state, data, probe, steps: int, sync_every: int) -> float:
  times = []
  for t in range(steps):
    t0 = time.perf_counter()
    params, opt_state, m = step(params, opt_state, data)
    if (t + 1) % sync_every == 0:
      params, opt_state, m = window_end(params, opt_state, probe)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  return statistics.median(times[1:])


def run(time_steps: int) -> list[str]:
  lines = ['| layout | mode | step program (B/step) | window end (B/sync) | per step, T=25 | T=100 | T=1000 |'
           + (' median step (s) |' if time_steps else ''),
           '|---|---|---|---|---|---|---|' + ('---|' if time_steps else '')]
  memory = {}
  for groups, fsdp in LAYOUTS:
    for mode, overrides in MODES.items():
      config, mesh, params, opt_state, step, window_end, data, probe = build(groups, fsdp, overrides)
      s, w = replica_bytes(step, mesh), replica_bytes(window_end, mesh)
      per = ' | '.join(f'{s + w / t:,.0f}' for t in (25, 100, 1000))
      timing = ''
      if time_steps:
        timing = f' {step_time(step, window_end, params, opt_state, data, probe, time_steps, 25):.4f} |'
      lines.append(f'| {groups}x{fsdp} | {mode} | {s:,} | {w:,} | {per} |{timing}')
      if mode == 'shared gradient':
        memory[(groups, fsdp)] = (device_bytes((params, opt_state)), sum(x.nbytes for x in jax.tree.leaves(
            (params, opt_state))) // groups)
  return lines + [''] + memory_table(memory)


def memory_table(memory: dict) -> list[str]:
  fsdp_dev, fsdp_total = plain_fsdp_bytes()
  lines = ['| layout | params + opt state per device (B) | one copy (P + O, B) | rule (P + O) x groups / 8 |',
           '|---|---|---|---|',
           f'| plain FSDP over 8 (adamw) | {fsdp_dev:,} | {fsdp_total:,} | {fsdp_total // DEVICES:,} |']
  for (groups, fsdp), (dev, copy) in memory.items():
    lines.append(f'| HDET {groups}x{fsdp} | {dev:,} | {copy:,} | {copy * groups // DEVICES:,} |')
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--time', type=int, default=0, help='time this many steps per layout and mode (0: off)')
  parser.add_argument('--out', default='', help='also write the tables to this markdown file')
  args = parser.parse_args()
  lines = run(args.time)
  text = '\n'.join(lines)
  print(text)
  if args.out:
    with open(args.out, 'w', encoding='utf-8') as f:
      f.write(f'# Replica groups on 2-D meshes ({jax.devices()[0].platform}, {jax.device_count()} devices)\n\n'
              f'`python -m benchmarks.mesh2d{" --time " + str(args.time) if args.time else ""}`\n\n{text}\n')


if __name__ == '__main__':
  main()
