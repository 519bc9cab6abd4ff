"""Does the low-communication mode cost quality? Shared gradient against DiLoCo-like groups (issue 14).

    python -m research.lowcomm                  # 3 seeds x 3 modes on 4x2, 1500 steps each (hours on 2 cores)
    python -m research.lowcomm --seeds 0        # one seed
    python -m research.lowcomm --quick          # a smoke run: the tiny config, 16 steps, one seed

Every run is the trainer's own ``train_and_evaluate`` on ``configs/default.py`` with 4 replica groups of 2
devices (``mesh.replicas=4``, ``mesh.fsdp=2``) and ``data.batch_size=16``, so every mode sees the default
8x1 job's 64 windows a step: the same compute and tokens. The modes:

* ``shared``: the gradient is all-reduced across groups every step (the paper);
* ``lowcomm``: ``hdet.low_communication``: each group steps on its own gradient between syncs;
* ``lowcomm_avg_opt``: the same, and each sync averages the optimizer state too.

A finished run's summary is ``WORKDIR/summary.json``; a run cut short resumes from its checkpoint on the
next call. The table (validation bits/byte of the averaged model, mean and per seed) is printed and
written to ``results/lowcomm.md`` (not with ``--quick``).

The committed ``results/lowcomm.md`` is not regenerable: its nine runs' summaries stayed in their workdirs and
were never committed, so there is nothing to redraw it from (``--report-only`` says so); a full run trains them
anew and writes the table over it.
"""

from __future__ import annotations

import argparse
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {
  'shared': {},
  'lowcomm': {'hdet.low_communication': True},
  'lowcomm_avg_opt': {'hdet.low_communication': True, 'hdet.average_opt_state': True},
}
LAYOUT = {'mesh.replicas': 4, 'mesh.fsdp': 2, 'data.batch_size': 16}  # 4 x 16 = the default's 8 x 8 windows
# The main job's settings when this was measured (T=25, its controller then: fit_lr), pinned so the
# records stay the runs they describe.
MAIN_JOB_THEN = {
  'hdet.sync_every': 25,
  'hdet.trust': 0.25,
  'hdet.initial_scale': 1.0,
  'hdet.after_stop': 'hold',
  'hdet.step_growth': 1.0,
  'optim.max_lr': 3e-3,
}


def run_one(mode: str, seed: int, work_root: str, quick: bool) -> dict:
  """The summary of one run, from its workdir when it already finished."""
  from hdet_jax.trainer import config_lib, train_and_evaluate

  workdir = os.path.join(work_root, f'{mode}_seed{seed}')
  done = os.path.join(workdir, 'summary.json')
  if os.path.exists(done):
    with open(done, encoding='utf-8') as f:
      summary = json.load(f)
    if not summary.get('stopped_early'):
      return summary
  config = config_lib.load_config_file(os.path.join(REPO, 'configs', 'tiny.py' if quick else 'default.py'))
  overrides = {
    **LAYOUT,
    **({} if quick else MAIN_JOB_THEN),
    **MODES[mode],
    'seed': seed,
    'plots': False,
    'progress_bar': False,
  }
  if quick:  # the tiny model's 4-window batch: 2 per device, and a run of two sync windows
    overrides.update({'data.batch_size': 4, 'num_train_steps': 16, 'hdet.warmup_steps': 4})
  return train_and_evaluate(config_lib.with_overrides(config, overrides), workdir)


def table(results: dict) -> str:
  seeds = sorted({s for per_mode in results.values() for s in per_mode})
  lines = [
    '| mode | val bits/byte, mean | ' + ' | '.join(f'seed {s}' for s in seeds) + ' |',
    '|---|---|' + '---|' * len(seeds),
  ]
  for mode, per_seed in results.items():
    vals = [per_seed[s] for s in seeds if s in per_seed]
    lines.append(
      f'| {mode} | {sum(vals) / len(vals):.4f} | '
      + ' | '.join(f'{per_seed[s]:.4f}' if s in per_seed else '' for s in seeds)
      + ' |'
    )
  return '\n'.join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--seeds', default='0,1,2', help='comma-separated seeds')
  parser.add_argument('--modes', default=','.join(MODES), help=f'comma-separated, of {", ".join(MODES)}')
  parser.add_argument('--quick', action='store_true', help='the tiny config, 16 steps, seed 0')
  parser.add_argument('--work-root', default='', help='where the workdirs go (default: workdirs/lowcomm[_quick])')
  parser.add_argument('--report-only', action='store_true', help='(not regenerable: says why and exits)')
  args = parser.parse_args(argv)
  if args.report_only:
    raise SystemExit(
      "error: --report-only: results/lowcomm.md is not regenerable: its runs' summaries were never "
      'committed (research/README.md); python -m research.lowcomm trains them anew.'
    )
  from hdet_jax import trainer
  from hdet_jax.trainer import config_lib

  # Before any JAX call: 8 simulated CPU devices (the config's num_cpu_devices), and the compilation
  # cache of the full runs (tiny.py, for --quick, turns it off: a smoke run leaves nothing behind).
  name = 'tiny.py' if args.quick else 'default.py'
  trainer.setup_jax(config_lib.load_config_file(os.path.join(REPO, 'configs', name)))
  seeds = [0] if args.quick else [int(s) for s in args.seeds.split(',')]
  root = args.work_root or os.path.join(REPO, 'workdirs', 'lowcomm_quick' if args.quick else 'lowcomm')
  results = {
    m: {s: run_one(m, s, root, args.quick)['final_val_bits_per_byte'] for s in seeds} for m in args.modes.split(',')
  }
  text = table(results)
  print(text)
  if not args.quick:
    with open(os.path.join(REPO, 'results', 'lowcomm.md'), 'w', encoding='utf-8') as f:
      f.write(
        f'# Low-communication mode against the shared gradient (4x2, same tokens)\n\n'
        f'`python -m research.lowcomm --seeds {args.seeds}`\n\n{text}\n'
      )
  return results


if __name__ == '__main__':
  main()
