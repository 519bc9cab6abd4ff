"""How many replicas, with FSDP kept: the loss and the per-device memory of each layout on the same devices.

    python -m benchmarks.replicas_fsdp [--quick] [--write] [--seeds S] [--steps K]

examples/add_to_trainer/hdet_linen.py's trainer (its model, batches, loss, ``MultiSteps(hdet(chain(clip, masked
adamw)))`` with ``AutoLR(total_steps=STEPS)``, the same global batch of 64 rows in 2 micro-batches), its step
under ``over_replicas`` as the example wraps it, on 8 simulated CPU devices in these layouts:

* **8 x 1**: 8 replicas, one per device, each whole on its device (the FSDP axis ``'data'`` has size 1);
* **4 x 2 FSDP**: 4 replicas, each FSDP-sharded over a group of 2 devices (the example's own layout);
* **8 on 4 x 2 FSDP**: 8 replicas, 2 per group of 2 devices (``over_replicas(..., per_device=2)``), FSDP inside;
* **8 on 4 x 1**: 8 replicas, 2 per device, on 4 devices (``per_device=2``);
* **plain**: plain_linen.py, no HDET, FSDP over all 8 devices (one copy of the model).

For each layout and seed (the seed sets the initial parameters and the batch stream, as the example's ``train``):
the final training loss (the mean over the replicas and the last 5 steps), the evaluation loss of the replicas'
average on the example's eval batch, and HDET's learned factor on the optimizer's learning rate. Per device,
counted, not timed: the bytes of the training state (parameters and optimizer state) on device 0, and the compiled
micro-batch step's footprint (XLA ``memory_analysis``: arguments + outputs + temporaries - donated) and flops
(XLA's cost analysis). ``--write`` writes results/replicas_fsdp.md; ``--quick`` (1 seed, 6 steps) writes nothing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import pathlib
import platform
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

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / 'examples' / 'add_to_trainer'
RESULTS = ROOT / 'results' / 'replicas_fsdp.md'
# name -> (replicas, groups, devices per group (FSDP), replicas per group); plain: no HDET, FSDP over 8
LAYOUTS = {
  '8 x 1': (8, 8, 1, 1),
  '4 x 2 FSDP': (4, 4, 2, 1),
  '8 on 4 x 2 FSDP': (8, 4, 2, 2),
  '8 on 4 x 1': (8, 4, 1, 2),
  'plain': (1, 1, 8, 1),
}
LAST = 5  # the final training loss: the mean of the last LAST steps
EVAL_BATCHES = 8  # the evaluation loss: the mean over this many of the example's eval batches (512 rows)


def _load(name):
  """A fresh instance of an example module (its globals, N included, are this instance's own)."""
  spec = importlib.util.spec_from_file_location(f'replicas_fsdp_{name}', EXAMPLES / f'{name}.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def device_bytes(tree, device) -> int:
  """The bytes of ``tree``'s arrays that live on ``device``."""
  return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards if s.device == device)


def footprint(compiled) -> int:
  """Per device: arguments + outputs + temporaries - aliased (donated) bytes."""
  m = compiled.memory_analysis()
  return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def make_trainer(ex, mesh, per_device):
  """hdet_linen.make_trainer with ``per_device`` replicas per group (``ex.N`` replicas in all).

  On a mesh without the FSDP axis (the ``x 1`` layouts: a replica whole on a device) the state is unboxed and the
  step does not constrain its batch to ``'data'``: with a ``'data'`` axis of size 1, ``over_replicas`` makes that
  axis manual too, and the example's constraints to it (the step's and flax's ``with_partitioning``) are refused
  inside the map (``can only refer to Auto axes``). The computation is the same: nothing is sharded over a size-1
  axis.
  """
  fsdp = 'data' in mesh.axis_names
  create = ex.create_state if fsdp else lambda key: nn.meta.unbox(ex.create_state(key))
  abstract = jax.eval_shape(create, jax.random.key(0))
  if fsdp:
    one_replica, rows = nn.get_sharding(abstract, mesh), NamedSharding(mesh, P('data'))
  else:
    one_replica, rows = jax.tree.map(lambda _: NamedSharding(mesh, P()), abstract), NamedSharding(mesh, P())
  state_sharding = hdet_jax.stacked_shardings(one_replica, 'replica')
  batch_sharding = hdet_jax.batch_shardings(rows, 'replica')

  def train_step(state, batch):
    if fsdp:
      batch = jax.lax.with_sharding_constraint(batch, rows)
    loss, grads = jax.value_and_grad(ex.loss_fn)(state.params, state.apply_fn, batch)
    grads = hdet_jax.pmean_finite(grads, 'replica')
    return hdet_jax.apply_gradients(state, grads, value=loss), {'loss': loss}

  def eval_step(params, batch):
    return ex.loss_fn(params, ex.Model().apply, batch)

  step = jax.jit(
    hdet_jax.over_replicas(train_step, mesh, 'replica', per_device=per_device),
    in_shardings=(state_sharding, batch_sharding),
    out_shardings=(state_sharding, None),
    donate_argnames=('state',),
  )
  evaluate = jax.jit(hdet_jax.evaluate_over_replicas(eval_step, mesh, 'replica', per_device=per_device))
  init = jax.jit(create, out_shardings=state_sharding)
  return init, step, evaluate, batch_sharding


def run_layout(name, seeds, steps, log=lambda line: None):
  """One layout: its counted figures, and per seed the final training and evaluation losses and the LR factor."""
  n, groups, fsdp, per_device = LAYOUTS[name]
  devices = np.array(jax.devices()[: groups * fsdp])
  if name == 'plain':
    ex = _load('plain_linen')
    mesh = Mesh(devices, ('data',))
    init, step, evaluate, batch_sharding = ex.make_trainer(mesh)
  else:
    ex = _load('hdet_linen')
    ex.N = n  # this instance's replicas: make_optimizer and create_state read it
    mesh = Mesh(devices.reshape(groups, fsdp), ('replica', 'data')) if fsdp > 1 else Mesh(devices, ('replica',))
    init, step, evaluate, batch_sharding = make_trainer(ex, mesh, per_device)
  micro = jax.device_put(np.split(next(ex.batches(0)), ex.ACCUM)[0], batch_sharding)
  state = init(jax.random.key(0))
  compiled = step.lower(state, micro).compile()
  out = {
    'replicas': 0 if name == 'plain' else n,
    'devices': int(devices.size),
    'state B': device_bytes(state, devices.flat[0]),
    'footprint B': footprint(compiled),
    'flops': float(compiled.cost_analysis()['flops']),
    'seeds': {},
  }
  for seed in seeds:
    start = time.perf_counter()
    state, data, losses = init(jax.random.key(seed)), ex.batches(seed), []
    for _ in range(steps):
      for m in np.split(next(data), ex.ACCUM):
        state, metrics = step(state, jax.device_put(m, batch_sharding))
      losses.append(float(np.mean(metrics['loss'])))
    evals = ex.batches(seed + 1000)  # the example's eval stream: EVAL_BATCHES of it
    eval_loss = np.mean(
      [float(evaluate(state.params, jax.device_put(next(evals), batch_sharding))) for _ in range(EVAL_BATCHES)]
    )
    factor = 1.0
    if name != 'plain':
      factor = float(hdet_jax.hyperparams(state.opt_state.inner_opt_state)['base_lr_scale'])
    out['seeds'][seed] = {
      'train': float(np.mean(losses[-LAST:])),
      'eval': float(eval_loss),
      'factor': factor,
      'losses': losses,
    }
    log(f'{name} seed {seed}: eval {out["seeds"][seed]["eval"]:.4f} ({time.perf_counter() - start:.0f} s)')
  return out


def measure(seeds, steps, layouts=tuple(LAYOUTS), log=lambda line: None):
  return {name: run_layout(name, seeds, steps, log) for name in layouts}


def _mean_sd(values, digits=4):
  values = list(values)
  sd = statistics.stdev(values) if len(values) > 1 else 0.0
  return f'{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}'


def table(measured):
  base = measured.get('8 x 1', next(iter(measured.values())))
  rows = [
    '| layout | replicas | devices | state per device (B) | vs 8 x 1 | step footprint per device (B) | step flops per '
    'device | final train loss | eval loss | LR factor learned: median (range) |',
    '|---|---|---|---|---|---|---|---|---|---|',
  ]
  for name, m in measured.items():
    s = m['seeds'].values()
    f = sorted(v['factor'] for v in s)
    factors = 'none (plain)' if name == 'plain' else f'{statistics.median(f):.1f} ({f[0]:.1f} to {f[-1]:.1f})'
    rows.append(
      f'| {name} | {m["replicas"] or "plain"} | {m["devices"]} | {m["state B"]:,} | '
      f'{m["state B"] / base["state B"]:.2f}x | {m["footprint B"]:,} | {m["flops"]:,.0f} | '
      f'{_mean_sd(v["train"] for v in s)} | {_mean_sd(v["eval"] for v in s)} | {factors} |'
    )
  return rows


def per_seed(measured):
  """One row per seed: each layout's evaluation loss (its final training loss; its learned factor)."""
  names = list(measured)
  rows = ['| seed | ' + ' | '.join(f'{name}: eval (train; factor)' for name in names) + ' |']
  rows.append('|---|' + '---|' * len(names))
  for seed in next(iter(measured.values()))['seeds']:
    cells = [measured[name]['seeds'][seed] for name in names]
    cells = [f'{v["eval"]:.4f} ({v["train"]:.4f}; x{v["factor"]:.1f})' for v in cells]
    rows.append(f'| {seed} | ' + ' | '.join(cells) + ' |')
  return rows


def agreement(measured):
  """The largest relative difference of the 8-replica layouts' losses from the first's (8 x 1), over every step and
  seed."""
  eights = [name for name, m in measured.items() if m['replicas'] == 8]
  ref = measured[eights[0]]['seeds']
  worst = 0.0
  for name in eights[1:]:
    for seed, got in measured[name]['seeds'].items():
      a, b = np.asarray(got['losses']), np.asarray(ref[seed]['losses'])
      worst = max(worst, float(np.max(np.abs(a / b - 1))))
  return worst


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


def page(measured, command, steps):
  seeds = list(next(iter(measured.values()))['seeds'])
  return [
    '# How many replicas, with FSDP kept (cpu, 8 simulated devices)',
    '',
    f'`{command}` ({datetime.date.today().isoformat()}; {machine()}). The trainer of '
    'examples/add_to_trainer/hdet_linen.py (its model, batches and optimizer, `AutoLR(total_steps=STEPS)`), '
    f'{steps} optimizer steps of the same global batch (64 rows, 2 micro-batches) in every layout, seeds '
    f'{", ".join(map(str, seeds))} (the initial parameters and the batch stream). Layouts: replicas x FSDP group; '
    '"8 on 4 x 2" is 8 replicas, 2 per group of 2 devices (`over_replicas(..., per_device=2)`); plain is '
    'plain_linen.py, FSDP over all 8 devices. Bytes are on device 0: the training state (parameters and optimizer '
    "state) from its shards, the micro-batch step's footprint from XLA's `memory_analysis` (arguments + outputs + "
    "temporaries - donated); flops from XLA's cost analysis. Losses: mean ± standard deviation over the seeds; the "
    f'final training loss is the mean over the replicas and the last {LAST} steps, the evaluation loss the '
    f"replicas' average's over {EVAL_BATCHES} of the example's eval batches ({64 * EVAL_BATCHES} rows). The x 1 "
    "layouts hold each replica whole on a device, on a mesh without the `'data'` axis (the state unboxed, the "
    "step's constraint to `'data'` left out): with a `'data'` axis of size 1, `over_replicas` makes it manual and "
    'the constraints to it are refused inside the map.',
    '',
    *table(measured),
    '',
    *per_seed(measured),
    '',
    'Reading: per device, the training state is (P + O) x N / D for every HDET layout here: 8 replicas cost the '
    'same bytes on a device whether each device holds one (8 x 1) or a group of 2 holds 2 with FSDP (8 on 4 x 2); '
    'halving the replicas (4 x 2) halves them; 2 per device on 4 devices doubles them. The 8-replica layouts '
    'train the same model to float32 rounding (their losses within '
    f"{agreement(measured):.1e} relative of 8 x 1's at every step and seed): the layout sets the memory and the "
    'communication, the number of replicas sets the result.',
    '',
    *([reading(measured)] if {'8 x 1', '4 x 2 FSDP'} <= set(measured) else []),
    '',
  ]


def compare(measured, a='8 x 1', b='4 x 2 FSDP'):
  """a's losses against b's, per kind (train, eval): the mean over the seeds of a / b - 1, the seeds where a's is
  lower, the seeds, each layout's standard deviation over the seeds, and each one's worst (highest) seed."""
  sa, sb = measured[a]['seeds'], measured[b]['seeds']
  out = {}
  for key in ('train', 'eval'):
    va, vb = [sa[s][key] for s in sa], [sb[s][key] for s in sa]
    ratios = [x / y - 1 for x, y in zip(va, vb)]
    sd = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in (va, vb)]
    out[key] = {
      'mean': statistics.mean(ratios),
      'lower': sum(r < 0 for r in ratios),
      'seeds': len(ratios),
      'sd': sd,
      'worst': (max(va), max(vb)),
    }
  return out


def reading(measured):
  c = compare(measured)
  tr, ev = c['train'], c['eval']
  return (
    f'8 replicas against 4 (8 x 1 against 4 x 2 FSDP, twice the state per device), over {tr["seeds"]} seeds: the '
    f'final training loss {tr["mean"]:+.1%} on average (lower on {tr["lower"]}), its spread over the seeds '
    f'±{tr["sd"][0]:.4f} against ±{tr["sd"][1]:.4f} and its worst seed {tr["worst"][0]:.4f} against '
    f'{tr["worst"][1]:.4f} ({tr["worst"][0] / tr["worst"][1] - 1:+.1%}); the evaluation loss {ev["mean"]:+.1%} '
    f'(lower on {ev["lower"]}), ±{ev["sd"][0]:.4f} against ±{ev["sd"][1]:.4f}, worst {ev["worst"][0]:.4f} '
    f'against {ev["worst"][1]:.4f}.'
  )


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--quick', action='store_true', help='1 seed of 6 steps; writes nothing')
  p.add_argument('--seeds', type=int, default=None, help='seeds 0 .. S-1 (default 10; --quick 1)')
  p.add_argument('--steps', type=int, default=None, help="optimizer steps per run (default: the example's 40)")
  p.add_argument('--write', action='store_true', help=f'write {RESULTS.relative_to(ROOT)}')
  args = p.parse_args(argv)
  seeds = range(args.seeds or (1 if args.quick else 10))
  steps = args.steps or (6 if args.quick else _load('hdet_linen').STEPS)
  start = time.perf_counter()
  measured = measure(seeds, steps, log=lambda line: print('# ' + line, file=sys.stderr, flush=True))
  print('\n'.join(table(measured)))
  print()
  print('\n'.join(per_seed(measured)))
  if {'8 x 1', '4 x 2 FSDP'} <= set(measured):
    print(reading(measured))
  print(
    f'# 8-replica layouts against 8 x 1: {agreement(measured):.1e} relative; {time.perf_counter() - start:.0f} s',
    file=sys.stderr,
  )
  if args.write and not args.quick:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = 'python -m benchmarks.replicas_fsdp' + (' ' + ' '.join(argv) if argv else '')
    RESULTS.write_text('\n'.join(page(measured, command, steps)).rstrip('\n') + '\n')
    print(f'# wrote {RESULTS.relative_to(ROOT)}', file=sys.stderr)
  return measured


if __name__ == '__main__':
  main()
