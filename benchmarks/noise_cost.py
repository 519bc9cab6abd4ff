"""What logging the gradient noise scale costs: the training step with and without ``log_noise_scale``.

    python -m benchmarks.noise_cost               # default model, 30 interleaved rounds
    python -m benchmarks.noise_cost --rounds 60

``log_noise_scale`` adds, per step, the squared norms of each replica's own and the all-reduced gradient (and, with
Adam, of both divided by its second moment's root) and one scalar all-reduce per sum
(``hdet_jax.trainer.programs._noise_sums``). This prints XLA's counted flops, bytes, fusions (kernels) and all-reduces of the trainer's step program
(25 steps' batches uploaded at once, as the trainer does) with and without it, and their times (medians of
interleaved rounds, each call timed to completion).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault('JAX_NUM_CPU_DEVICES', '8')

import jax  # noqa: E402

from benchmarks.common import hlo_counts  # noqa: E402
from benchmarks.probe_cost import _cost, _default_config, _median_times  # noqa: E402


def _programs():
  """({name: compiled step}, {name: a call running it once to completion}), without and with the logging."""
  from hdet_jax.trainer import input_pipeline, model as model_lib, mesh as mesh_lib, optimizer as optimizer_lib, programs as programs_lib
  n = 8  # replicas: one per device on 8 (CPU) devices, all 8 under vmap on one GPU (the trainer's per-device mode)
  devices = min(n, jax.device_count())
  mesh = mesh_lib.make_mesh(n, devices=devices)
  programs, states, data = {}, {}, None
  for flag in (False, True):
    config = _default_config(log_noise_scale=flag)
    tx = optimizer_lib.make_optimizer(config, n, devices)
    graphdef, _ = model_lib.abstract_model(config.model, config.data.seq_len)
    params, opt_state = programs_lib.make_init(config, tx, mesh, n)(jax.random.key(0))
    if data is None:
      train = input_pipeline.split(input_pipeline.load_corpus(None), config.data.val_fraction)[0]
      batches = input_pipeline.TrainBatches(train, config.data.seq_len, config.data.batch_size, n, 0)
      data = mesh_lib.put_stacked(batches.chunk(0, 25), mesh)
    name = 'step, noise sums logged' if flag else 'step'
    programs[name] = programs_lib.make_train_step(graphdef, tx, mesh, sync=False, config=config,
                                                  chunk_steps=25).lower(params, opt_state, data).compile()
    states[name] = [params, opt_state]  # donation consumes the inputs: each program threads its own state

  def call(name):
    def run():
      s = states[name]
      s[0], s[1], m = programs[name](s[0], s[1], data)
      jax.block_until_ready(m)
    return run
  return programs, {name: call(name) for name in programs}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--rounds', type=int, default=30)
  args = parser.parse_args(argv)
  programs, calls = _programs()
  med = _median_times(calls, args.rounds)
  costs = {k: _cost(p) for k, p in programs.items()}
  d = min(8, jax.device_count())
  print(f'# 8 replicas on {d} {jax.devices()[0].platform} device(s) ({jax.devices()[0].device_kind}); default model '
        f'(AdamW); {args.rounds} interleaved rounds')
  kernels = {k: hlo_counts(p) for k, p in programs.items()}
  print('| program | XLA flops (per device) | XLA bytes | fusions | all-reduces | median time (ms) |')
  print('|---|---|---|---|---|---|')
  for k, (f, b) in costs.items():
    c = kernels[k]
    print(f'| {k} | {f:,.0f} | {b:,.0f} | {c.get("fusion", 0)} | {c.get("all-reduce", 0) + c.get("all-reduce-start", 0)} '
          f'| {1e3 * med[k]:.2f} |')
  (f0, b0), (f1, b1) = costs['step'], costs['step, noise sums logged']
  print(f'Logging: {100 * (f1 / f0 - 1):+.2f}% counted flops, {100 * (b1 / b0 - 1):+.2f}% bytes, '
        f'{100 * (med["step, noise sums logged"] / med["step"] - 1):+.1f}% median step time.')


if __name__ == '__main__':
  main()
