"""The rollback's memory: what the guard's anchor costs per device, counted in bytes (no timing).

The default config rolls back (``hdet.rollback``, resolved by ``run_settings.guard``): it keeps the state the
last sync left, the anchor, to return to where the back-off fires. Every replica holds the same parameters after
a sync and the same wrapped optimizer state throughout, so the trainer keeps one copy of it per device
(``programs.make_anchor``); a copy per replica, the layout before, costs N / D times that on each of D devices.

For the main job's model and optimizer (configs/default.py, N = 8) on D = 1, 2 and 8 simulated devices it
counts, on device 0:

- the training state: the bytes of the stacked parameters and optimizer state the device holds;
- the anchor: the bytes of ``make_anchor``'s output there, and the bytes a copy per replica would hold (the
  device's share of the stacked parameters and wrapped optimizer state);
- the window end's compiled footprint (XLA ``memory_analysis``: arguments + outputs + temporaries - donated),
  with the rollback and with ``hdet.rollback=False``.

Usage: ``python -m benchmarks.anchor_memory`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault('JAX_NUM_CPU_DEVICES', '8')

import jax  # noqa: E402
import numpy as np  # noqa: E402

from hdet_jax.trainer import config_lib, mesh as mesh_lib  # noqa: E402
from hdet_jax.trainer.tasks import lm_input_pipeline as ip  # noqa: E402
from hdet_jax.trainer import run_settings
from hdet_jax.trainer import optimizer as optimizer_lib, programs as programs_lib  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def device_bytes(tree, device) -> int:
  """The bytes of ``tree``'s arrays that live on ``device``."""
  return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards if s.device == device)


def footprint(compiled) -> int:
  """Per device: arguments + outputs + temporaries - aliased (donated) bytes."""
  m = compiled.memory_analysis()
  return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def measure(config, devices: int) -> dict:
  run = run_settings.resolve(config)
  n, task, settings = run.mesh.num_replicas, run.task, run.task_settings
  mesh = mesh_lib.make_mesh(n, devices=devices)
  tx = optimizer_lib.make_optimizer(
    run.optimizer, n, seed=run.seed, rollback=True
  )  # the library's rollback, as the trainer's
  graphdef, _ = task.abstract_model(settings)
  params, opt_state = programs_lib.make_init(task, settings, tx, mesh, n)(jax.random.key(0))
  dev = mesh.devices.flat[0]
  anchor = programs_lib.make_anchor(mesh, tx)(params, opt_state)
  rng = np.random.default_rng(0)
  windows = ip.probe_windows(
    rng.integers(0, 256, 100_000, dtype=np.uint8), settings.data.seq_len, settings.probe_windows, run.seed, 0
  )
  common = mesh_lib.put_stacked(np.broadcast_to(windows, (n,) + windows.shape), mesh, batch_dim=1)
  end = lambda tx, programs, *rest: (
    programs_lib.make_window_end(tx, mesh, seed=run.seed, graphdef=graphdef, settings=programs)
    .lower(params, opt_state, common, *rest)
    .compile()
  )
  no_rollback = run_settings.resolve(
    config_lib.with_overrides(config.copy_and_resolve_references(), {'hdet.rollback': False})
  )
  return {
    'devices': devices,
    'per_device': n // devices,
    'state': device_bytes((params, opt_state), dev),
    'anchor': device_bytes(anchor, dev),
    'anchor_per_replica': device_bytes((params, opt_state.inner_state), dev),
    'window_end': footprint(end(tx, run.programs, anchor)),
    'window_end_no_rollback': footprint(
      end(optimizer_lib.make_optimizer(no_rollback.optimizer, n, seed=no_rollback.seed), no_rollback.programs)
    ),
  }


def table(rows) -> str:
  mb = lambda b: f'{b / 2**20:.2f}'
  lines = [
    '| devices (replicas each) | training state MiB | anchor MiB: one copy (now) | a copy per replica (before) '
    '| state + anchor, now / before | window end footprint MiB: rollback / none |',
    '|---|---|---|---|---|---|',
  ]
  for r in rows:
    now, before = r['state'] + r['anchor'], r['state'] + r['anchor_per_replica']
    lines.append(
      f'| {r["devices"]} ({r["per_device"]}) | {mb(r["state"])} | {mb(r["anchor"])} | '
      f'{mb(r["anchor_per_replica"])} | {now / r["state"]:.3f}x / {before / r["state"]:.3f}x | '
      f'{mb(r["window_end"])} / {mb(r["window_end_no_rollback"])} |'
    )
  return '\n'.join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default=os.path.join(REPO, 'configs', 'default.py'))
  parser.add_argument('--devices', default='1,2,8', help='comma-separated device counts (each divides N)')
  args = parser.parse_args(argv)
  config = config_lib.load_config_file(args.config)
  if not run_settings.resolve(config).guard.rollback:
    raise SystemExit(f'error: {args.config} does not roll back (hdet.rollback resolves to False): nothing to measure.')
  rows = [measure(config, int(d)) for d in args.devices.split(',')]
  for r in rows:
    print('anchor_memory', r)
  print(table(rows))
  return rows


if __name__ == '__main__':
  main()
