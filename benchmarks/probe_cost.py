"""What comparing replicas on a common batch costs: the window-end program with and without the probe.

    python -m benchmarks.probe_cost                 # default model, 16 probe windows, 30 rounds
    python -m benchmarks.probe_cost --rounds 60 --probe-windows 32

``hdet.score='common'`` makes every replica evaluate one common batch (``hdet.probe_windows`` windows,
no dropout) just before the sync's average. It runs in the window-end program, once per sync. This
prints, for the trainer's own programs (``hdet_jax.trainer.programs``): XLA's counted flops and bytes
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
  config, programs, calls = _programs(args.probe_windows)
  med = _median_times(calls, args.rounds)
  costs = {k: _cost(prog) for k, prog in programs.items()}
  n = jax.device_count()
  print(
    f'# {n} replicas on {n} {jax.devices()[0].platform} devices; default model; '
    f'{args.probe_windows} probe windows x {config.data.seq_len + 1} bytes; {args.rounds} interleaved rounds'
  )
  _print_table(costs, med)


def _default_config(**overrides):
  from hdet_jax.trainer import config_lib

  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  from hdet_jax.trainer import run_settings

  config = run_settings.recorded_config(config_lib.load_config_file(os.path.join(repo, 'configs', 'default.py')))
  return config_lib.with_overrides(config, {'hdet.controller': 'fit', **overrides})


def _programs(probe_windows: int):
  """(config, {name: compiled program}, {name: a call running it once to completion}) for the step and the
  window end with each score."""
  from hdet_jax.trainer import mesh as mesh_lib, optimizer as optimizer_lib, programs as programs_lib, run_settings
  from hdet_jax.trainer.tasks import lm_input_pipeline as input_pipeline

  config = _default_config(**{'hdet.probe_windows': probe_windows})
  run = run_settings.resolve_recorded(config)
  d = run.task_settings.data
  n = jax.device_count()
  mesh = mesh_lib.make_mesh(n)
  tx = optimizer_lib.make_optimizer(run.optimizer, n, seed=run.seed)
  graphdef, _ = run.task.abstract_model(run.task_settings)
  params, opt_state = programs_lib.make_init(run.task, run.task_settings, tx, mesh, n)(jax.random.key(0))
  train = input_pipeline.split(input_pipeline.load_corpus(None), d.val_fraction)[0]
  batches = input_pipeline.TrainBatches(train, d.seq_len, d.batch_size, n, 0)
  data = mesh_lib.put_stacked(batches.chunk(0, 25), mesh)
  probe = input_pipeline.probe_windows(train, d.seq_len, probe_windows, 0, 0)
  probe = mesh_lib.put_stacked(np.broadcast_to(probe, (n,) + probe.shape), mesh)
  programs = {
    'step': programs_lib.make_train_step(
      graphdef, tx, mesh, sync=False, seed=run.seed, settings=run.programs, chunk_steps=25
    )
    .lower(params, opt_state, data)
    .compile()
  }
  inputs = {'step': [data]}
  for score, extra in (('window', []), ('common', [probe])):
    r = run_settings.resolve_recorded(_default_config(**{'hdet.score': score, 'hdet.probe_windows': probe_windows}))
    name = f'window end ({"window score" if score == "window" else "common batch"})'
    extra = extra + ([programs_lib.make_anchor(mesh, tx)(params, opt_state)] if r.guard.rollback else [])
    programs[name] = (
      programs_lib.make_window_end(tx, mesh, graphdef=graphdef, seed=r.seed, settings=r.programs)
      .lower(params, opt_state, *extra)
      .compile()
    )
    inputs[name] = extra  # (the common batch, and the rollback's anchor where the config rolls back)
  state = [params, opt_state]  # donation consumes the inputs: one live state threads through every call

  def call(name):
    def run():
      state[0], state[1], m = programs[name](state[0], state[1], *inputs[name])
      jax.block_until_ready(m)

    return run

  return config, programs, {name: call(name) for name in programs}


def _median_times(calls: dict, rounds: int) -> dict[str, float]:
  """Median seconds per call, over ``rounds`` rounds that run every call once in a random order."""
  for f in calls.values():  # warm up
    f()
  times = {k: [] for k in calls}
  rng = np.random.default_rng(0)
  for _ in range(rounds):
    for k in rng.permutation(list(calls)):
      t0 = time.perf_counter()
      calls[k]()
      times[k].append(time.perf_counter() - t0)
  return {k: statistics.median(v) for k, v in times.items()}


def _print_table(costs: dict, med: dict) -> None:
  print('| program | XLA flops (per device) | XLA bytes | median time (ms) |')
  print('|---|---|---|---|')
  for k in costs:
    f, b = costs[k]
    print(f'| {k} | {f:,.0f} | {b:,.0f} | {1e3 * med[k]:.2f} |')
  extra_t = med['window end (common batch)'] - med['window end (window score)']
  extra_f = costs['window end (common batch)'][0] - costs['window end (window score)'][0]
  for t in (25, 100):
    print(
      f'Common batch, T={t}: +{1e3 * extra_t:.2f} ms per sync ({extra_t / med["step"]:.2f} steps), '
      f"{100 * extra_t / (t * med['step']):.2f}% of a window's step time; counted: +{extra_f:,.0f} flops "
      f"per sync = {100 * extra_f / (t * costs['step'][0]):.2f}% of a window's step flops."
    )


if __name__ == '__main__':
  main()
