"""What an LR bracket's first rung compiles: its points' programs with the peak LR baked in, against
``optim.runtime_lr_scale`` (the LR's power of two applied at run time, what the bracket's points now use), with
each run building its programs anew or taking the last run's (``hdet_jax/trainer/program_cache.py``, the default).

The first rung of an LR bracket starts ``points`` plain runs at peak LRs a factor 2 apart (its later rungs resume
runs at LRs already compiled, which the persistent compilation cache serves in either build). For each build, one
fresh process trains those runs one after another through ``train_and_evaluate``, with a fresh persistent cache,
and counts from JAX's monitoring events per run: the programs XLA compiled, the programs loaded from the cache
instead, XLA's seconds for both, the run's wall seconds, and whether it took the last run's programs (and so
traced, lowered and compiled nothing). Counted work (the compiles) is what decides; the wall
seconds are one noisy machine's.

    python -m benchmarks.bracket_compiles                     # the main job's LM, 8 points, 40 steps each
    python -m benchmarks.bracket_compiles --config configs/mnist1d.py --points 4
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train_points(config_path: str, points: int, steps: int, runtime: bool, keep: bool = True) -> list[dict]:
  """In this process (fresh): ``points`` plain runs a factor 2 apart; per run its counts and seconds. ``keep``
  False: each run builds its programs itself (the kept programs are dropped before it)."""
  import jax
  from jax import monitoring
  from hdet_jax.trainer import bracket, config_lib, train_and_evaluate
  from hdet_jax.trainer import program_cache, setup
  from hdet_jax.trainer.process import setup_jax

  counts, seconds = collections.Counter(), collections.Counter()
  monitoring.register_event_listener(lambda event, **kw: counts.update([event]))

  def timed(event, duration, **kw):
    counts.update([event])
    seconds.update({event: duration})

  monitoring.register_event_duration_secs_listener(timed)
  base = config_lib.with_overrides(
    config_lib.load_config_file(config_path),
    {
      'hdet.spread': 0.0,
      'hdet.sync_every': 0,
      'hdet.num_syncs': 0,
      'hdet.auto_lr': False,
      'bracket.points': 0,
      'num_train_steps': steps,
      'plots': False,
      'tensorboard': False,
      'progress_bar': False,
      'checkpoint_every': 0,
      'eval_every': 0,
      'compilation_cache': os.environ['JAX_COMPILATION_CACHE_DIR'],
    },
  )
  setup_jax(base)  # as train.py does: the persistent cache keeps every program, however short its compile
  compile_programs, build_programs, step_costs, built = setup.compile_programs, setup.build_programs, [], []

  def build_and_count(*args, **kwargs):
    built.append(True)
    return build_programs(*args, **kwargs)

  def compile_and_count(*args, **kwargs):  # XLA's count of the step program's work, per run
    programs = compile_programs(*args, **kwargs)
    cost = programs.train_step.cost_analysis()
    step_costs.append(cost[0] if isinstance(cost, list) else cost)
    return programs

  setup.compile_programs, setup.build_programs = compile_and_count, build_and_count
  rows = []
  with tempfile.TemporaryDirectory() as work:
    for k, lr in enumerate(bracket.point_lrs(base.optim.max_lr, points, 2.0)):
      counts.clear()
      seconds.clear()
      built.clear()
      if not keep:
        program_cache.clear()
      t = time.perf_counter()
      train_and_evaluate(
        config_lib.with_overrides(base, {'optim.max_lr': lr}),
        os.path.join(work, f'point{k}'),
        tuning={'optim.runtime_lr_scale': runtime},
      )
      jax.effects_barrier()
      rows.append(
        {
          'lr': lr,
          'wall_s': time.perf_counter() - t,
          # (a program loaded from the cache is timed as a compile too)
          'compiled': counts['/jax/core/compile/backend_compile_duration']
          - counts['/jax/compilation_cache/cache_hits'],
          'loaded': counts['/jax/compilation_cache/cache_hits'],
          'compile_s': seconds['/jax/core/compile/backend_compile_duration'],
          'kept': not built,
          'step_flops': step_costs[-1].get('flops'),
          'step_bytes': step_costs[-1].get('bytes accessed'),
        }
      )
  return rows


def _in_fresh_process(config_path: str, points: int, steps: int, runtime: bool, keep: bool = True) -> list[dict]:
  with tempfile.TemporaryDirectory() as cache:
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache)
    code = (
      f'import json, sys; from benchmarks.bracket_compiles import _train_points; '
      f'print("ROWS", json.dumps(_train_points({config_path!r}, {points}, {steps}, {runtime}, {keep})))'
    )
    out = subprocess.run([sys.executable, '-c', code], cwd=REPO, env=env, capture_output=True, text=True)
    if out.returncode != 0:
      raise RuntimeError(f'the {"run-time" if runtime else "baked"} build failed:\n{out.stderr[-3000:]}')
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith('ROWS '))[5:])


def report(builds: dict, config_path: str, points: int, steps: int) -> str:
  lines = [
    f'## {os.path.relpath(config_path, REPO)}: {points} plain runs a factor 2 apart, {steps} steps each',
    '',
    "| build | programs compiled | loaded from the cache | XLA compile s | runs that took the last run's "
    'programs | wall s | first run wall s | later runs, median wall s |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for name, rows in builds.items():
    later = sorted(r['wall_s'] for r in rows[1:])
    lines.append(
      f'| {name} | {sum(r["compiled"] for r in rows)} | {sum(r["loaded"] for r in rows)} | '
      f'{sum(r["compile_s"] for r in rows):.1f} | {sum(r.get("kept", False) for r in rows)} | '
      f'{sum(r["wall_s"] for r in rows):.1f} | '
      f'{rows[0]["wall_s"]:.1f} | {later[len(later) // 2]:.1f} |'
    )
  lines += [
    '',
    "The step program, XLA's cost analysis of the compiled step (per run; listed once where every run of the "
    'build has the same):',
    '',
  ]
  for name, rows in builds.items():
    costs = sorted({(r['step_flops'], r['step_bytes']) for r in rows})
    lines.append(f'- {name}: ' + '; '.join(f'{f:,.0f} flops, {b:,.0f} bytes accessed' for f, b in costs))
  lines += ['', 'Per run (LR: programs compiled / loaded, wall s):', '']
  for name, rows in builds.items():
    lines.append(
      f'- {name}: ' + ', '.join(f'{r["lr"]:.3g}: {r["compiled"]}/{r["loaded"]}, {r["wall_s"]:.1f}' for r in rows)
    )
  return '\n'.join(lines)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--config', default=os.path.join(REPO, 'configs', 'default.py'), help="the runs' config file")
  p.add_argument('--points', type=int, default=8, help="runs, a factor 2 apart (the bracket's first rung)")
  p.add_argument('--steps', type=int, default=40, help='training steps per run')
  a = p.parse_args(argv)
  if a.points < 2 or a.steps < 1:
    p.error('--points must be >= 2 and --steps >= 1')
  config_path = os.path.abspath(a.config)
  builds = {
    'baked (runtime_lr_scale=False)': _in_fresh_process(config_path, a.points, a.steps, False),
    'run-time, each run builds its programs': _in_fresh_process(config_path, a.points, a.steps, True, False),
    "run-time, a run takes the last run's programs (default)": _in_fresh_process(
      config_path, a.points, a.steps, True, True
    ),
  }
  print(report(builds, config_path, a.points, a.steps))


if __name__ == '__main__':
  main()
