"""The pmap trainer's evaluation of the replicas' average, timed three ways (docs/pmap.md, issue 86).

    python -m benchmarks.pmap_eval [--width 16] [--repeats 20]

On 8 simulated CPU devices, examples/add_to_trainer/hdet_pmap.py's state after 7 steps (8 replicas, one per device,
one step past a sync: the replicas apart) and its pmapped eval step on one 64-row batch. Each way computes the
average, puts it where the eval step reads it and evaluates; the figure is the median wall time of ``--repeats``
calls after two warm-up calls, to the eval loss on the host:

* **unjitted average of the whole state**: ``hdet_jax.average_replicas(state)`` (every leaf of the TrainState:
  parameters, batch statistics, momentum, HDET's state; one small op per leaf, outside jit), then
  ``flax.jax_utils.replicate`` and the pmapped eval step: what the issue's port did (0.5 s there against 0.02 s);
* **unjitted average of params and batch_stats**: the same with only what the eval step reads;
* **pmap_average** (the example's): ``hdet_jax.pmap_average({'params': ..., 'batch_stats': ...})``, one compiled
  pmap, its output already one copy per device, then the pmapped eval step;
* **eval step alone**: the pmapped eval step on the state as it is (no average), the floor.

Prints a table; writes nothing. Wall times on a shared CPU vary run to run; compare within one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import statistics
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402

jax.config.update('jax_num_cpu_devices', 8)

from flax import jax_utils  # noqa: E402

import hdet_jax  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _example():
  path = ROOT / 'examples' / 'add_to_trainer' / 'hdet_pmap.py'
  spec = importlib.util.spec_from_file_location('add_to_trainer_hdet_pmap', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _median_seconds(fn, repeats: int) -> float:
  for _ in range(2):
    fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--width', type=int, default=16, help="the ResNet's channels (the example's: 16)")
  parser.add_argument('--repeats', type=int, default=20)
  args = parser.parse_args()
  ex = _example()
  ex.WIDTH = args.width
  state = hdet_jax.replicas_to_devices(ex.create_train_state(jax.random.key(0)))
  step = jax.pmap(ex.train_step, axis_name='batch')
  data = ex.batches(0)
  for _ in range(7):
    state, _ = step(state, ex.shard(next(data)))
  p_eval = jax.pmap(ex.eval_step, axis_name='batch')
  batch = ex.shard(next(ex.batches(1000)))
  evaluated = lambda s: float(p_eval(s, batch)['loss'][0])
  variables = lambda s: {'params': s.params, 'batch_stats': s.batch_stats}

  def whole_state():
    return evaluated(jax_utils.replicate(hdet_jax.average_replicas(state)))

  def params_and_stats():
    return evaluated(jax_utils.replicate(state.replace(**hdet_jax.average_replicas(variables(state)))))

  def pmap_average():
    return evaluated(state.replace(**hdet_jax.pmap_average(variables(state))))

  ways = [
    ('unjitted average_replicas of the whole TrainState', whole_state),
    ('unjitted average_replicas of params and batch_stats', params_and_stats),
    ('hdet_jax.pmap_average of params and batch_stats', pmap_average),
    ('eval step alone (no average)', lambda: evaluated(state)),
  ]
  losses = {name: fn() for name, fn in ways}
  leaves = len(jax.tree.leaves(state))
  print(f'hdet_pmap.py, WIDTH={args.width}: {leaves} leaves in the state, 8 replicas on {jax.device_count()} devices')
  print(f'| way | median ms per eval ({args.repeats} calls) | eval loss |')
  print('|---|---|---|')
  for name, fn in ways:
    print(f'| {name} | {1e3 * _median_seconds(fn, args.repeats):.2f} | {losses[name]:.6f} |')


if __name__ == '__main__':
  main()
