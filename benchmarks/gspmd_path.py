"""The jit-with-shardings path (``hdet_jax.over_replicas``) against the shard_map path, compiled side by side.

    python -m benchmarks.gspmd_path [--quick] [--write] [--rounds R] [--k K]

On 8 simulated CPU devices, 4 replicas x 2 FSDP devices (mesh ``('replica', 'data')``), one micro-batch step of
examples/add_to_trainer's flax-linen trainer (same model, same optimizer ``MultiSteps(hdet(chain(clip, masked
adamw)))``, same global micro-batch of 32 rows), four ways:

* **new path**: ``hdet_linen.make_trainer``'s own step: the global-batch ``train_step`` under ``over_replicas`` (a
  shard_map manual over 'replica' only), FSDP from ``nn.with_partitioning`` on 'data', the batch split by rows;
* **shard_map path**: docs/scaling.md's per-replica step under ``shard_map_replicas`` on the same mesh, the state
  unboxed and put with ``stacked_shardings(state, 'replica', mesh=mesh, inner_axis='data')``, the batch stacked
  ``[N, B/N, ...]`` on ``P('replica', 'data')``;
* **shard_map path, linen layout** (a control): the same, with the new path's layout (the linen annotations'
  shardings, unboxed) in place of ``stacked_shardings``': what differs between the first two rows because of the
  layout and not the path;
* **vmap variant**: the same global-batch ``train_step`` under ``jax.vmap(axis_name='replica',
  spmd_axis_name='replica')`` in a jit with the new path's shardings: the design ``over_replicas`` rejected;
* **plain**: plain_linen's step (no HDET) on a 1-D mesh of 8 devices.

For each: XLA's cost analysis (flops, bytes accessed; a conditional counts as its costliest branch), the
collectives of the compiled HLO (``benchmarks/comm.py``) by op, the per-device bytes of those that cross replicas,
split into those that run on every step and those inside a conditional's branch (HDET's window-end average), all
collective bytes, and the median step time over interleaved rounds (each round calls every program K times, in a
fresh random order), with its ratio to the shard_map path's. ``--write`` replaces (or appends) this benchmark's
section at the end of results/benchmarks.md; ``--quick`` takes fewer rounds and writes nothing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import pathlib
import platform
import re
import statistics
import sys
import time

import jax

try:  # before JAX's backend starts; under pytest, conftest.py has already set 8 devices
  jax.config.update('jax_num_cpu_devices', 8)
except RuntimeError:
  pass

import flax  # noqa: E402
import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import hdet_jax  # noqa: E402
from benchmarks import comm  # noqa: E402
from benchmarks import pages  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / 'examples' / 'add_to_trainer'
RESULTS = ROOT / 'results' / 'benchmarks.md'
HEADING = '## The jit-with-shardings path (over_replicas) against the shard_map path'
NAMES = ('new path', 'shard_map path', 'shard_map path, linen layout', 'vmap variant', 'plain')
CONTROL = 'shard_map path, linen layout'
BASE = 'shard_map path'
GROUPS, FSDP = 4, 2


def _load(name):
  spec = importlib.util.spec_from_file_location(f'gspmd_path_{name}', EXAMPLES / f'{name}.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# ------------------------------------------------------------------------------------------------
# The programs: (compiled, state, batch) each.
# ------------------------------------------------------------------------------------------------
def _error_line(e: BaseException) -> str:
  text = str(e).strip()
  return f'{type(e).__name__}: {text.splitlines()[0] if text else ""}'


def _micro_batch():
  """The trainer's first micro-batch: [BATCH / ACCUM, SEQ + 1] rows of its first global batch."""
  hdet = _load('hdet_linen')
  return np.split(next(hdet.batches(0)), hdet.ACCUM)[0]


def new_path(hdet, mesh, micro):
  """hdet_linen's own step: over_replicas(train_step) in its jit with shardings and donation."""
  init, step, _, split_batch = hdet.make_trainer(mesh)
  state, batch = init(jax.random.key(0)), jax.device_put(micro, split_batch)
  return step.lower(state, batch).compile(), state, batch


def shard_map_path(hdet, mesh, micro, notes=None, layout='group'):
  """docs/scaling.md's replica groups: one replica's step under shard_map_replicas, with ``stacked_shardings``'
  layout (``layout='group'``) or the new path's (``'linen'``: the linen annotations' shardings, unboxed).

  As the docs write it (``check_vma`` on), the trace fails here: MultiSteps' ``optax.tree.zeros_like`` of a
  replica-varying value trips an assertion in jax's ``lax.full_like`` inside a partly manual shard_map (jax 0.10.2;
  the docs' example has no MultiSteps, and a 1-D mesh is fully manual). The error goes to ``notes`` and the step
  is built with ``check_vma=False``, as ``over_replicas`` builds it.
  """

  def train_step(state, batch):  # one replica's view: [B/N, ...] rows, arrays sharded over 'data'
    loss, grads = jax.value_and_grad(hdet.loss_fn)(state.params, state.apply_fn, batch)
    grads = jax.lax.pmean(grads, 'replica')  # across groups
    upd, opt = state.tx.update(grads, state.opt_state, state.params, value=loss)
    state = state.replace(step=state.step + 1, opt_state=opt, params=optax.apply_updates(state.params, upd))
    return state, {'loss': loss}

  state = nn.meta.unbox(jax.jit(hdet.create_state)(jax.random.key(0)))
  if layout == 'group':
    shardings = hdet_jax.stacked_shardings(state, 'replica', mesh=mesh, inner_axis='data')
  else:
    abstract = jax.eval_shape(hdet.create_state, jax.random.key(0))
    shardings = nn.meta.unbox(hdet_jax.stacked_shardings(nn.get_sharding(abstract, mesh), 'replica'))
  state = jax.device_put(state, shardings)
  batch_sharding = NamedSharding(mesh, P('replica', 'data'))
  batch = jax.device_put(micro.reshape(hdet.N, -1, micro.shape[-1]), batch_sharding)

  def jitted(check_vma):
    return jax.jit(
      hdet_jax.shard_map_replicas(train_step, mesh, 'replica', check_vma=check_vma),
      in_shardings=(shardings, batch_sharding),
      out_shardings=(shardings, NamedSharding(mesh, P('replica'))),
      donate_argnums=(0,),
    )

  try:
    lowered = jitted(True).lower(state, batch)
  except AssertionError as e:
    if notes is not None:
      notes['shard_map path'] = _error_line(e)
    lowered = jitted(False).lower(state, batch)
  return lowered.compile(), state, batch


def vmap_variant(hdet, mesh, micro):
  """hdet_linen's global-batch train_step under vmap(spmd_axis_name='replica'), in the new path's jit."""
  init, step, _, _ = hdet.make_trainer(mesh)
  train_step = step.__wrapped__.__wrapped__  # jit(over_replicas(train_step)): both keep functools.wraps' link
  abstract = jax.eval_shape(hdet.create_state, jax.random.key(0))
  state_sharding = hdet_jax.stacked_shardings(nn.get_sharding(abstract, mesh), 'replica')
  batch_sharding = NamedSharding(mesh, P('replica', 'data'))
  mapped = jax.vmap(train_step, axis_name='replica', spmd_axis_name='replica')
  vstep = jax.jit(
    mapped, in_shardings=(state_sharding, batch_sharding), out_shardings=(state_sharding, None), donate_argnums=(0,)
  )
  state = init(jax.random.key(0))
  batch = jax.device_put(micro.reshape(hdet.N, -1, micro.shape[-1]), batch_sharding)
  return vstep.lower(state, batch).compile(), state, batch


def plain_path(plain, micro):
  """plain_linen's step (no HDET): FSDP and data parallelism over one 1-D mesh of the 8 devices."""
  mesh = Mesh(np.array(jax.devices()[: GROUPS * FSDP]), ('data',))
  init, step, _, batch_sharding = plain.make_trainer(mesh)
  state, batch = init(jax.random.key(0)), jax.device_put(micro, batch_sharding)
  return step.lower(state, batch).compile(), state, batch


# ------------------------------------------------------------------------------------------------
# Counting and timing.
# ------------------------------------------------------------------------------------------------
def param_bytes(params) -> int:
  """Bytes of the parameters held on one device (one replica's copy, its FSDP shard)."""
  dev = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards if s.device == dev)


def counts(compiled, mesh_shape) -> dict:
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  hlo = compiled.as_text()
  always, inside = comm.collectives_by_place(hlo, mesh_shape)
  ops = {}
  for c in always + inside:
    ops[c.op] = ops.get(c.op, 0) + 1
  return {
    'flops': float(cost['flops']),
    'bytes accessed': float(cost['bytes accessed']),
    'ops': dict(sorted(ops.items())),
    'ops in branches': len(inside),
    'always across': [c for c in always if c.crosses_replicas],
    'inside across': [c for c in inside if c.crosses_replicas],
    'conditionals': len(re.findall(r' conditional\(', hlo)),
    'across always B': sum(c.operand_bytes for c in always if c.crosses_replicas),
    'across in branches B': sum(c.operand_bytes for c in inside if c.crosses_replicas),
    'all B': sum(c.operand_bytes for c in always + inside),
  }


class Timed:
  """A compiled step and its (donated) state: ``run(k)`` times k steps to completion."""

  def __init__(self, compiled, state, batch):
    self.compiled, self.state, self.batch = compiled, state, batch

  def run(self, k: int) -> float:
    jax.block_until_ready(self.state)
    start = time.perf_counter()
    for _ in range(k):
      self.state, metrics = self.compiled(self.state, self.batch)
    jax.block_until_ready((self.state, metrics))
    return (time.perf_counter() - start) / k


def interleave(timed: dict, rounds: int, k: int, seed: int = 0, log=None) -> dict:
  """Seconds per step of every program, one figure per round; a fresh random order every round."""
  rng = np.random.default_rng(seed)
  names = list(timed)
  for name in names:  # one untimed call each: the first call's allocations
    timed[name].run(1)
  times = {n: [] for n in names}
  for r in range(rounds):
    for i in rng.permutation(len(names)):
      times[names[i]].append(timed[names[i]].run(k))
    if log:
      log(f'round {r + 1}/{rounds}: ' + ' '.join(f'{n}={times[n][-1] * 1e3:.2f}ms' for n in names))
  return times


def measure(rounds: int = 21, k: int = 10, log=None) -> dict:
  """Every program's counts (or the error that stopped it) and step times; see the module docstring."""
  if len(jax.devices()) < GROUPS * FSDP:
    raise RuntimeError(f'gspmd_path: needs {GROUPS * FSDP} devices, found {len(jax.devices())}')
  hdet, plain = _load('hdet_linen'), _load('plain_linen')
  mesh = Mesh(np.array(jax.devices()[: GROUPS * FSDP]).reshape(GROUPS, FSDP), ('replica', 'data'))
  micro = _micro_batch()
  out, timed, errors, notes, compile_s = {}, {}, {}, {}, {}
  builders = {
    'new path': lambda: new_path(hdet, mesh, micro),
    'shard_map path': lambda: shard_map_path(hdet, mesh, micro, notes),
    CONTROL: lambda: shard_map_path(hdet, mesh, micro, None, layout='linen'),
    'vmap variant': lambda: vmap_variant(hdet, mesh, micro),
    'plain': lambda: plain_path(plain, micro),
  }
  for name, build in builders.items():
    start = time.perf_counter()
    try:
      compiled, state, batch = build()
    except Exception as e:  # the vmap variant may not trace or compile: record why
      errors[name] = _error_line(e)
      if log:
        log(f'{name}: {errors[name]}')
      continue
    compile_s[name] = time.perf_counter() - start
    shape = (GROUPS * FSDP,) if name == 'plain' else (GROUPS, FSDP)
    out[name] = counts(compiled, shape)
    out[name]['param B'] = param_bytes(state.params)
    timed[name] = Timed(compiled, state, batch)
    if log:
      log(f'{name}: built and compiled in {compile_s[name]:.1f} s')
  times = interleave(timed, rounds, k, log=log)
  for name, ts in times.items():
    out[name]['ms'] = statistics.median(ts) * 1e3
    out[name]['times'] = ts
  if BASE in times:
    for name, ts in times.items():  # per-round ratio to the shard_map path, then the median
      ratios = sorted(a / b for a, b in zip(ts, times[BASE]))
      out[name]['ratio'] = statistics.median(ratios)
      out[name]['ratio iqr'] = (
        tuple(statistics.quantiles(ratios, n=4, method='inclusive'))[::2]
        if len(ratios) >= 4
        else (ratios[0], ratios[-1])
      )
  return {'results': out, 'errors': errors, 'notes': notes, 'compile_s': compile_s, 'rounds': rounds, 'k': k}


# ------------------------------------------------------------------------------------------------
# Report.
# ------------------------------------------------------------------------------------------------
def table(measured: dict) -> list[str]:
  res, errors = measured['results'], measured['errors']
  lines = [
    '| program | XLA flops | XLA bytes accessed | collectives by op (of which in branches) | '
    'cross-replica B/device, every step | cross-replica B/device, in branches | all collectives B/device | '
    'median step (ms) | / shard_map path (IQR over rounds) |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  for name in NAMES:
    if name in errors:
      lines.append(f'| {name} | failed: `{errors[name]}` | | | | | | | |')
      continue
    r = res[name]
    ops = ', '.join(f'{op} {n}' for op, n in r['ops'].items()) + f' ({r["ops in branches"]})'
    across = '(no replicas)' if name == 'plain' else f'{r["across always B"]:,}'
    inside = '(no replicas)' if name == 'plain' else f'{r["across in branches B"]:,}'
    ratio = f'{r["ratio"]:.2f} ({r["ratio iqr"][0]:.2f}-{r["ratio iqr"][1]:.2f})' if 'ratio' in r else ''
    lines.append(
      f'| {name} | {r["flops"]:,.0f} | {r["bytes accessed"]:,.0f} | {ops} | {across} | {inside} | '
      f'{r["all B"]:,} | {r["ms"]:.2f} | {ratio} |'
    )
  return lines


def reading(measured: dict) -> list[str]:
  """3-5 sentences read off the figures (each claim checked against them before it is written)."""
  res, errors = measured['results'], measured['errors']
  new, ref, ctl, vm = (res.get(n) for n in NAMES[:4])
  kinds = lambda cs: ', '.join(sorted({c.op for c in cs})) or 'nothing'
  out = []
  if new and ref:
    a, b = new['across always B'], ref['across always B']
    c, d = new['across in branches B'], ref['across in branches B']
    same = kinds(new['always across']) == kinds(ref['always across']) and a == b and c == d
    out.append(
      (
        'Across replicas the new path sends what the shard_map path sends'
        if same
        else 'Across replicas the new path and the shard_map path differ'
      )
      + f": on every step only the gradient's {kinds(new['always across'])}, "
      + (f'{a:,} B per device in both' if a == b else f'{a:,} B per device against {b:,} B')
      + f" (the parameters: {new['param B']:,} B per device), and the window's average, "
      + (f'{c:,} B in both' if c == d else f'{c:,} B against {d:,} B')
      + ', only inside the sync branch.'
    )
    by_layout = (
      ctl is not None
      and new['flops'] <= ctl['flops'] * 1.001
      and new['bytes accessed'] <= ctl['bytes accessed'] * 1.001
      and new['all B'] <= ctl['all B']
    )
    out.append(
      ('Inside a group they differ by layout, not by path' if by_layout else 'Inside a group they differ')
      + ": `group_shardings` shards each leaf's largest dimension (and the biases) where `nn.with_partitioning` "
      f"shards the kernels' output dimension, so the partitioner places other gathers ({new['all B']:,} B "
      f'against {ref["all B"]:,} B of collectives per device, {new["bytes accessed"] / ref["bytes accessed"]:.2f}x '
      'the bytes accessed)'
      + (
        '.'
        if ctl is None
        else f"; on the new path's layout the shard_map path (the control row) moves {ctl['all B']:,} B, and the new "
        f'path counts {new["flops"] / ctl["flops"]:.3f}x its flops and '
        f'{new["bytes accessed"] / ctl["bytes accessed"]:.3f}x its bytes accessed.'
      )
    )
  if 'vmap variant' in errors:
    out.append(f'The vmap variant did not build: `{errors["vmap variant"]}`.')
  elif vm and new:
    extra = vm['across always B'] - new['across always B']
    sync = max((x.operand_bytes for x in new['inside across'] if x.op == 'all-reduce'), default=0)
    every_step = sync and any(x.op == 'all-reduce' and x.operand_bytes >= sync for x in vm['always across'])
    out.append(
      f'The vmap variant compiles to {vm["conditionals"]} conditionals (the new path to {new["conditionals"]}): '
      "hdet's sync `lax.cond` on the batched step count became a select, so "
      + (
        f"the window's parameter all-reduce ({sync:,} B) runs on every step beside the gradient's"
        if every_step
        else "no all-reduce of the parameters' size runs on every step"
      )
      + f", and with the batched layout's all-to-alls and permutes it sends {vm['across always B']:,} B across "
      f'replicas per step, {extra:,} B ({extra / new["param B"]:.2f}x the parameters) more than the new path; '
      f"XLA's flops barely move ({vm['flops'] / new['flops']:.2f}x) because its cost analysis charges the new "
      "path's conditional at its costliest branch."
    )
  if new and ref and 'ratio' in new:
    ratios = [f'{n} {res[n]["ratio"]:.2f}' for n in NAMES if n != BASE and n in res and 'ratio' in res[n]]
    out.append(
      f"Step time / the shard_map path's (median over {measured['rounds']} interleaved rounds of "
      f'{measured["k"]} steps): {"; ".join(ratios)}; on a shared 2-core CPU running 8 simulated devices these are '
      'indicative only, and the counted work is the evidence.'
    )
  return out


def machine() -> str:
  cpu = platform.processor() or 'unknown CPU'
  try:
    with open('/proc/cpuinfo') as f:
      cpu = next(line.split(':', 1)[1].strip() for line in f if line.startswith('model name'))
  except (OSError, StopIteration):
    pass
  return (
    f'{cpu}, {os.cpu_count()} cores; XLA:CPU, 8 simulated devices; Python {platform.python_version()}, '
    f'jax {jax.__version__}, flax {flax.__version__}, optax {optax.__version__}'
  )


NOTE = (
  "Note: the docs' shard_map path as written (`check_vma=True`) does not trace on this mesh (`{}`, raised "
  "in jax's `lax.full_like` under MultiSteps' `optax.tree.zeros_like`, inside a shard_map manual over "
  "'replica' only); it is built with `check_vma=False`, as `over_replicas` builds the new path."
)


def section(measured: dict, command: str) -> list[str]:
  return (
    [
      HEADING,
      '',
      f'`{command}` ({datetime.date.today().isoformat()}; {machine()}). 4 replicas x 2 FSDP devices (mesh '
      "`('replica', 'data')`), one micro-batch step (32 rows) of examples/add_to_trainer's linen trainer: the new "
      "path is hdet_linen's step (`over_replicas`); the shard_map path the docs' per-replica step under "
      '`shard_map_replicas` with `group_shardings`; the vmap variant the global-batch step under '
      "`jax.vmap(spmd_axis_name='replica')` with the new path's shardings; plain is plain_linen on a 1-D mesh "
      "of 8; the control row is the shard_map path on the new path's layout (the linen annotations' "
      'shardings, unboxed, in place of `group_shardings`). Bytes are per device, from the compiled HLO '
      '(`benchmarks/comm.py`); "in branches" = inside a conditional\'s branch '
      '(runs only when its predicate says so); '
      "XLA's cost analysis counts a conditional as its costliest branch.",
      '',
    ]
    + table(measured)
    + ['']
    + [' '.join(reading(measured)), '']
    + [NOTE.format(note) for note in measured['notes'].values()]
    + ([''] if measured['notes'] else [])
  )


def write(measured: dict, command: str, path=RESULTS) -> None:
  """Replaces this benchmark's section of ``path``, or appends it at the end."""
  pages.replace_section(path, HEADING, section(measured, command))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--quick', action='store_true', help='3 rounds of 5 steps; writes nothing')
  p.add_argument('--rounds', type=int, default=None, help='interleaved rounds (default 21; --quick 3)')
  p.add_argument('--k', type=int, default=None, help='steps per program per round (default 10; --quick 5)')
  p.add_argument('--write', action='store_true', help=f'replace or append the section in {RESULTS.relative_to(ROOT)}')
  args = p.parse_args(argv)
  rounds = args.rounds or (3 if args.quick else 21)
  k = args.k or (5 if args.quick else 10)
  start = time.perf_counter()
  measured = measure(rounds, k, log=lambda line: print('# ' + line, file=sys.stderr, flush=True))
  print('\n'.join(table(measured)))
  print()
  print(' '.join(reading(measured)))
  for note in measured['notes'].values():
    print(NOTE.format(note))
  print(f'# {time.perf_counter() - start:.0f} s', file=sys.stderr)
  if args.write and not args.quick:
    argv = sys.argv[1:] if argv is None else list(argv)
    write(measured, 'python -m benchmarks.gspmd_path' + (' ' + ' '.join(argv) if argv else ''))
    print(f'# wrote {RESULTS.relative_to(ROOT)}', file=sys.stderr)
  return measured


if __name__ == '__main__':
  main()
