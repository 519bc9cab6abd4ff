"""Replica groups (FSDP and tensor parallel inside): communication across and inside groups, and memory.

    python -m benchmarks.mesh2d [--time STEPS] [--out results/mesh2d.md]

On the trainer's default model and the trainer's own programs (``programs.make_train_step`` and
``make_window_end`` with the groups' layout), for the layouts 8x1 (the 1-D mesh), 4x2 and 2x4 (FSDP
inside a group), 4x1x2 (tensor parallel inside) and 2x2x2 (both) over 8 devices, each with the same
global batch (64 windows a step: data.batch_size = 64 / groups) and the main job's model at T = 25:

* bytes moved across the replica axis, per device, counted from the compiled HLO
  (``benchmarks/comm.py``): the step program (every step) and the window end (every T steps), for the
  shared-gradient mode, the low-communication mode, and the latter with ``average_opt_state``;
  per step = step + window end / T; and the bytes of the collectives inside a group (FSDP's gathers
  and scatters, tensor parallelism's activation all-reduces) in the step program;
* per-device bytes of parameters + optimizer state (read from the arrays' shards), against plain
  FSDP over all 8 devices (optax.adamw, one copy) and the rule (P + O) x groups / devices;
* HDET against plain FSDP data parallelism (optax.adamw on the all-reduced gradient, no HDET) on the
  same layout, counted rather than timed: XLA's cost analysis (flops, bytes accessed) of a T-step
  window, ``((T - 1) x non-sync + sync) / (T x plain)`` at T = 100 and 1000, and the extra kernels
  (fusions, copies) of the non-sync step program per device;
* with ``--time K``, the median wall time of K steps per layout and mode, and the HDET/plain step-time
  ratios (on this CPU the 8 simulated devices share the host's cores: a smoke figure, not a speed claim).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time

os.environ.setdefault('JAX_NUM_CPU_DEVICES', '8')

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

import hdet_jax as H  # noqa: E402
from benchmarks import comm  # noqa: E402
from hdet_jax.trainer import config_lib  # noqa: E402
from hdet_jax.trainer import run_settings
from hdet_jax.trainer.tasks import lm_model as model_lib  # noqa: E402
from hdet_jax.trainer import mesh as mesh_lib, optimizer as optimizer_lib, programs as programs_lib  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = 8
GLOBAL_WINDOWS = 64
LAYOUTS = ((8, 1, 1), (4, 2, 1), (2, 4, 1), (4, 1, 2), (2, 2, 2))  # (groups, fsdp, tensor)
MODES = {  # name -> config overrides
  'shared gradient': {},
  'low-communication': {'hdet.low_communication': True},
  'low-comm + avg opt state': {'hdet.low_communication': True, 'hdet.average_opt_state': True},
}


def config_for(groups: int, overrides: dict):
  """The default config on ``groups`` groups with ``overrides``, tuning fields too (record form: read it with
  ``run_settings.resolve_recorded``)."""
  config = run_settings.recorded_config(config_lib.load_config_file(os.path.join(REPO, 'configs', 'default.py')))
  return config_lib.with_overrides(
    config, {'data.batch_size': GLOBAL_WINDOWS // groups, 'hdet.sync_every': 25, **overrides}
  )


def label(groups: int, fsdp: int, tensor: int) -> str:
  return f'{groups}x{fsdp}' + (f'x{tensor}' if tensor > 1 else '')


def build(groups: int, fsdp: int, tensor: int, overrides: dict):
  """(config, mesh, params, opt_state, step, window_end, data, window end's further arguments): the trainer's
  programs, compiled."""
  config = config_for(groups, overrides)
  run = run_settings.resolve_recorded(config)
  mesh = mesh_lib.make_mesh(groups, fsdp, tensor)
  tx = optimizer_lib.make_optimizer(run.optimizer, groups, seed=run.seed)
  graphdef, _ = run.task.abstract_model(run.task_settings)
  params, opt_state = programs_lib.make_init(run.task, run.task_settings, tx, mesh, groups)(jax.random.key(0))
  layout = mesh_lib.layout(mesh, params, opt_state)
  d = run.task_settings.data
  windows = np.zeros((groups, d.batch_size, d.seq_len + 1), np.uint8)
  data = mesh_lib.put_stacked(windows, mesh, batch_dim=1)
  probe = mesh_lib.put_stacked(
    np.zeros((groups, run.task_settings.probe_windows, d.seq_len + 1), np.uint8), mesh, batch_dim=1
  )
  step = (
    programs_lib.make_train_step(graphdef, tx, mesh, sync=False, seed=run.seed, settings=run.programs, shardings=layout)
    .lower(params, opt_state, data)
    .compile()
  )
  # The window end's further arguments: the common batch, and the rollback's anchor where the config rolls back.
  shardings = mesh_lib.anchor_layout(mesh, params, opt_state.inner_state)
  anchor = [programs_lib.make_anchor(mesh, tx, shardings)(params, opt_state)] if run.guard.rollback else []
  window_end = (
    programs_lib.make_window_end(tx, mesh, graphdef=graphdef, seed=run.seed, settings=run.programs, shardings=layout)
    .lower(params, opt_state, probe, *anchor)
    .compile()
  )
  return config, mesh, params, opt_state, step, window_end, data, (probe, *anchor)


def replica_bytes(compiled, mesh) -> int:
  return comm.replica_axis_bytes(compiled.as_text(), tuple(mesh.devices.shape))


def group_bytes(compiled, mesh) -> int:
  """Per-device operand bytes of the collectives that stay inside one group."""
  return sum(
    c.operand_bytes for c in comm.collectives(compiled.as_text(), tuple(mesh.devices.shape)) if not c.crosses_replicas
  )


def device_bytes(tree) -> int:
  """Bytes of ``tree`` held on device 0 (every device holds the same amount here)."""
  dev = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == dev)


def plain_fsdp_bytes() -> tuple[int, int]:
  """(per-device bytes, total bytes) of params + AdamW state sharded over all 8 devices, one copy."""
  config = config_for(DEVICES, {})
  mesh = mesh_lib.make_mesh(1, DEVICES)
  _, params = model_lib.split_model(config.model, config.data.seq_len, jax.random.key(0))
  stacked = H.stack_replicas(params, 1)
  state = jax.vmap(optax.adamw(1e-3).init)(stacked)
  put = lambda t: jax.device_put(t, H.stacked_shardings(t, mesh_lib.AXIS, mesh=mesh, inner_axis=mesh_lib.INNER))
  tree = (put(stacked), put(state))
  return device_bytes(tree), sum(x.nbytes for x in jax.tree.leaves(tree))


def step_time(step, window_end, params, opt_state, data, probe, steps: int, sync_every: int) -> float:
  times = []
  for t in range(steps):
    t0 = time.perf_counter()
    params, opt_state, m = step(params, opt_state, data)
    if (t + 1) % sync_every == 0:
      params, opt_state, m = window_end(params, opt_state, *probe)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  return statistics.median(times[1:])


def run(time_steps: int) -> list[str]:
  lines = [
    '| layout | mode | step program (B/step) | window end (B/sync) | per step, T=25 | T=100 | T=1000 '
    '| inside a group, step program (B/step) |' + (' median step (s) |' if time_steps else ''),
    '|---|---|---|---|---|---|---|---|' + ('---|' if time_steps else ''),
  ]
  memory = {}
  for groups, fsdp, tensor in LAYOUTS:
    for mode, overrides in MODES.items():
      config, mesh, params, opt_state, step, window_end, data, probe = build(groups, fsdp, tensor, overrides)
      s, w = replica_bytes(step, mesh), replica_bytes(window_end, mesh)
      per = ' | '.join(f'{s + w / t:,.0f}' for t in (25, 100, 1000))
      if mode == 'shared gradient':  # (before timing, which donates the arrays)
        memory[label(groups, fsdp, tensor)] = (
          device_bytes((params, opt_state)),
          sum(x.nbytes for x in jax.tree.leaves((params, opt_state))) // groups,
        )
      timing = ''
      if time_steps:
        timing = f' {step_time(step, window_end, params, opt_state, data, probe, time_steps, 25):.4f} |'
      lines.append(
        f'| {label(groups, fsdp, tensor)} | {mode} | {s:,} | {w:,} | {per} | {group_bytes(step, mesh):,} |{timing}'
      )
  return lines + [''] + memory_table(memory)


def memory_table(memory: dict) -> list[str]:
  fsdp_dev, fsdp_total = plain_fsdp_bytes()
  lines = [
    '| layout | params + opt state per device (B) | one copy (P + O, B) | rule (P + O) x groups / 8 |',
    '|---|---|---|---|',
    f'| plain FSDP over 8 (adamw) | {fsdp_dev:,} | {fsdp_total:,} | {fsdp_total // DEVICES:,} |',
  ]
  for name, (dev, copy) in memory.items():
    groups = int(name.split('x')[0])
    lines.append(f'| HDET {name} | {dev:,} | {copy:,} | {copy * groups // DEVICES:,} |')
  return lines


def bare_step(graphdef, tx, hdet: bool, sync: bool):
  """One replica's step without the trainer's metrics: loss, all-reduced gradient, update."""

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: model_lib.loss_fn(graphdef, p, batch))(params)
    grads = lax.pmean(grads, mesh_lib.AXIS)
    if not hdet:
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss
    updates, opt_state = tx.update(grads, opt_state, params, value=loss, sync=sync)
    return H.apply_updates(params, updates, opt_state, replica_axis=mesh_lib.AXIS, sync=sync), opt_state, loss

  return step


def compiled_pair(groups: int, fsdp: int, tensor: int, sync_every: int):
  """{'plain', 'nosync', 'sync'}: (compiled program, args) of bare steps on the layout."""
  config = config_for(groups, {'hdet.sync_every': sync_every, 'hdet.score': 'window'})
  run = run_settings.resolve_recorded(config)
  mesh = mesh_lib.make_mesh(groups, fsdp, tensor)
  graphdef, _ = run.task.abstract_model(run.task_settings)
  o = run.optimizer
  txs = {
    'plain': optax.adamw(run.given['optim.max_lr'], b1=o.b1, b2=o.b2, weight_decay=o.weight_decay),
    'hdet': optimizer_lib.make_optimizer(o, groups, seed=run.seed),
  }
  params = programs_lib.make_init(run.task, run.task_settings, txs['hdet'], mesh, groups)(jax.random.key(0))[0]
  d = run.task_settings.data
  data = mesh_lib.put_stacked(np.zeros((groups, d.batch_size, d.seq_len + 1), np.uint8), mesh, 1)
  out = {}
  for name, hdet, sync in (('plain', False, False), ('nosync', True, False), ('sync', True, True)):
    tx = txs['hdet' if hdet else 'plain']
    state = jax.jit(jax.vmap(tx.init))(params)
    rules = mesh_lib.rules(mesh)
    shardings = (
      H.stacked_shardings(params, mesh_lib.AXIS, mesh=mesh, inner_axis=mesh_lib.INNER, **rules),
      H.stacked_shardings(state, mesh_lib.AXIS, mesh=mesh, inner_axis=mesh_lib.INNER, **rules)
      if hdet
      else H.stacked_shardings(state, mesh_lib.AXIS, mesh=mesh, inner_axis=mesh_lib.INNER, **rules),
    )
    args = (jax.device_put(params, shardings[0]), jax.device_put(state, shardings[1]), data)
    fn = jax.jit(
      H.shard_map_replicas(bare_step(graphdef, tx, hdet, sync), mesh, mesh_lib.AXIS),
      out_shardings=(*shardings, mesh_lib.replica_sharding(mesh)),
      donate_argnums=(0, 1),
    )
    out[name] = (fn.lower(*args).compile(), args)
  return out


def kernels(compiled) -> dict[str, int]:
  """Fusions and copies of the entry computation: on XLA:CPU one kernel launch each per device and step."""
  text = compiled.as_text()
  entry = text[text.index('ENTRY') :]
  entry = entry[: entry.index('\n}')]
  ops = re.findall(r'= \S+ ([a-z][\w-]*)\(', entry)
  return {k: ops.count(k) for k in ('fusion', 'copy')}


def cost_table(time_steps: int) -> list[str]:
  lines = [
    '| layout | XLA flops, T=100 / T=1000 | XLA bytes accessed, T=100 / T=1000 | non-sync extra kernels '
    '(fusions, copies) | HDET/plain step time, T=100 / T=1000 |',
    '|---|---|---|---|---|',
  ]
  for groups, fsdp, tensor in LAYOUTS:
    progs = compiled_pair(groups, fsdp, tensor, 1000)
    cost = {k: c.cost_analysis() for k, (c, _) in progs.items()}
    cost = {k: (v[0] if isinstance(v, (list, tuple)) else v) for k, v in cost.items()}
    window = lambda key, t: ((t - 1) * cost['nosync'][key] + cost['sync'][key]) / (t * cost['plain'][key])
    ratios = [' / '.join(f'{window(key, t):.5f}' for t in (100, 1000)) for key in ('flops', 'bytes accessed')]
    kp, kh = kernels(progs['plain'][0]), kernels(progs['nosync'][0])
    extra = f'{kh["fusion"] - kp["fusion"]:+d} of {kp["fusion"]}, {kh["copy"] - kp["copy"]:+d} of {kp["copy"]}'
    timed = ''
    if time_steps:
      t = {k: bare_time(c, args, time_steps) for k, (c, args) in progs.items()}
      timed = ' / '.join(f'{((n - 1) * t["nosync"] + t["sync"]) / (n * t["plain"]):.3f}' for n in (100, 1000))
    lines.append(f'| {label(groups, fsdp, tensor)} | {ratios[0]} | {ratios[1]} | {extra} | {timed} |')
  return lines


def bare_time(compiled, args, steps: int) -> float:
  params, state, data = jax.tree.map(lambda x: x.copy(), args[:2]) + (args[2],)
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    params, state, loss = compiled(params, state, data)
    jax.block_until_ready(loss)
    times.append(time.perf_counter() - t0)
  return statistics.median(times[1:])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--time', type=int, default=0, help='time this many steps per layout and mode (0: off)')
  parser.add_argument('--out', default='', help='also write the tables to this markdown file')
  args = parser.parse_args()
  lines = run(args.time) + [''] + cost_table(args.time)
  text = '\n'.join(lines)
  print(text)
  if args.out:
    with open(args.out, 'w', encoding='utf-8') as f:
      f.write(
        '# Replica groups: FSDP and tensor parallel inside '
        f'({jax.devices()[0].platform}, {jax.device_count()} devices)\n\n'
        f'`python -m benchmarks.mesh2d{" --time " + str(args.time) if args.time else ""}`\n\n{text}\n'
      )


if __name__ == '__main__':
  main()
