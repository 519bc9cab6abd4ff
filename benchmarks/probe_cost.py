"""What comparing replicas on a common batch costs: the window-end program with and without the probe.

    python -m benchmarks.probe_cost                 # default model, 16 probe windows, 30 rounds
    python -m benchmarks.probe_cost --rounds 60 --probe-windows 32

``hdet.score='common'`` makes every replica evaluate one common batch (``hdet.probe_windows`` windows,
no dropout) just before the sync's average. It runs in the window-end program, once per sync. This
prints, for the trainer's own programs (``hdet_jax.trainer.train_step``): XLA's counted flops and bytes
of the step and of both window-end programs, and their times (medians of interleaved rounds, each
call timed to completion), the extra cost per sync, and that cost amortised over a window of T steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault('JAX_NUM_CPU_DEVICES', '8')

import jax  # noqa: E402
import numpy as np  # noqa: E402


def _cost(compiled) -> tuple[float, float]:
  c = compiled.cost_analysis()
  c = c[0] if isinstance(c, (list, tuple)) else c
  return float(c.get('flops', float('nan'))), float(c.get('bytes accessed', float('nan')))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--rounds', type=int, default=30)
  parser.add_argument('--probe-windows', type=int, default=16)
  args = parser.parse_args(argv)

  from hdet_jax.trainer import config_lib, input_pipeline, model as model_lib, train_step as ts
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  config = config_lib.load_config_file(os.path.join(repo, 'configs', 'default.py'))
  config_lib.with_overrides(config, {'hdet.controller': 'fit', 'hdet.probe_windows': args.probe_windows})
  n = jax.device_count()
  mesh = ts.make_mesh(n)
  tx = ts.make_optimizer(config, n)
  graphdef, _ = model_lib.abstract_model(config.model, config.data.seq_len)
  params, opt_state = ts.make_init(config, tx, mesh, n)(jax.random.key(0))
  train = input_pipeline.split(input_pipeline.load_corpus(None), config.data.val_fraction)[0]
  batches = input_pipeline.TrainBatches(train, config.data.seq_len, config.data.batch_size, n, 0)
  data = ts.put_stacked(batches.chunk(0, 25), mesh)
  probe = input_pipeline.probe_windows(train, config.data.seq_len, args.probe_windows, 0, 0)
  probe = ts.put_stacked(np.broadcast_to(probe, (n,) + probe.shape), mesh)

  step = ts.make_train_step(graphdef, tx, mesh, sync=False, config=config, chunk_steps=25).lower(
      params, opt_state, data).compile()
  ends = {}
  for score in ('window', 'common'):
    c = config_lib.with_overrides(config_lib.load_config_file(os.path.join(repo, 'configs', 'default.py')),
                                  {'hdet.controller': 'fit', 'hdet.score': score,
                                   'hdet.probe_windows': args.probe_windows})
    fn = ts.make_window_end(tx, mesh, graphdef=graphdef, config=c)
    extra = [probe] if score == 'common' else []
    ends[score] = (fn.lower(params, opt_state, *extra).compile(), extra)

  # Donation consumes the inputs: keep one live state and thread it through every call.
  state = [params, opt_state]

  def run_step():
    state[0], state[1], m = step(state[0], state[1], data)
    jax.block_until_ready(m)

  def run_end(score):
    prog, extra = ends[score]
    state[0], state[1], m = prog(state[0], state[1], *extra)
    jax.block_until_ready(m)

  calls = {'step': run_step, 'window end (window score)': lambda: run_end('window'),
           'window end (common batch)': lambda: run_end('common')}
  for f in calls.values():  # warm up
    f()
  times = {k: [] for k in calls}
  rng = np.random.default_rng(0)
  for _ in range(args.rounds):
    for k in rng.permutation(list(calls)):
      t0 = time.perf_counter()
      calls[k]()
      times[k].append(time.perf_counter() - t0)
  med = {k: statistics.median(v) for k, v in times.items()}
  costs = {'step': _cost(step), 'window end (window score)': _cost(ends['window'][0]),
           'window end (common batch)': _cost(ends['common'][0])}
  print(f'# {n} replicas on {n} {jax.devices()[0].platform} devices; default model; '
        f'{args.probe_windows} probe windows x {config.data.seq_len + 1} bytes; {args.rounds} interleaved rounds')
  print('| program | XLA flops (per device) | XLA bytes | median time (ms) |')
  print('|---|---|---|---|')
  for k in calls:
    f, b = costs[k]
    print(f'| {k} | {f:,.0f} | {b:,.0f} | {1e3 * med[k]:.2f} |')
  extra_t = med['window end (common batch)'] - med['window end (window score)']
  extra_f = costs['window end (common batch)'][0] - costs['window end (window score)'][0]
  for t in (25, 100):
    print(f'Common batch, T={t}: +{1e3 * extra_t:.2f} ms per sync ({extra_t / med["step"]:.2f} steps), '
          f'{100 * extra_t / (t * med["step"]):.2f}% of a window\'s step time; counted: +{extra_f:,.0f} flops '
          f'per sync = {100 * extra_f / (t * costs["step"][0]):.2f}% of a window\'s step flops.')


if __name__ == '__main__':
  main()
