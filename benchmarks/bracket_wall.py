"""What an LR bracket costs in wall time: the bracket against one plain run at the peak LR it keeps.

Each run is ``python train.py`` in a fresh process with an empty persistent compilation cache, the wall time a
user waits for on a first run: the bracket (``bracket.points`` plain runs, halved at its rungs; by default 8, 5
kept at 0.1 of the run, 1 at 0.3: 2.5 runs of compute), then twice a plain run at the LR it kept (two, to show
the machine's noise beside the ratio). Its compute in runs is exact; its wall is that plus each of its 14 trainer
calls' setup (data, model, programs; 13 keeping 4), which its runs share where they can (the data once per process, the
programs through ``optim.runtime_lr_scale``, ``benchmarks/bracket_compiles.py``).

    python -m benchmarks.bracket_wall                          # mnist1d at 1000 steps, the LM at 750
    python -m benchmarks.bracket_wall --cases lm750 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name: (config file, steps, the bracket's centre: the workload's sweep's best peak LR, AdamW)
CASES = {
  'mnist1d1000': ('configs/mnist1d.py', 1000, 0.06),
  'lm750': ('configs/default.py', 750, 0.015),
  'lm1500': ('configs/default.py', 1500, 0.015),
}
PLAIN = ('hdet.spread=0', 'hdet.sync_every=0', 'hdet.num_syncs=0', 'hdet.auto_lr=False', 'plots=False')


def _train(config: str, overrides: list[str], workdir: str) -> tuple[float, dict]:
  """``train.py`` in a fresh process with an empty compilation cache: its wall seconds and its record (a run's
  ``summary.json``, a bracket's ``bracket.json``)."""
  with tempfile.TemporaryDirectory() as cache:
    args = [
      sys.executable,
      'train.py',
      '--config',
      config,
      '--workdir',
      workdir,
      *[f'--config.{o}' for o in (*PLAIN, f'compilation_cache={cache}', *overrides)],
    ]
    t0 = time.perf_counter()
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
  if out.returncode != 0:
    raise RuntimeError(f'{" ".join(args)} failed:\n{out.stderr[-3000:]}')
  record = 'bracket.json' if os.path.exists(os.path.join(workdir, 'bracket.json')) else 'summary.json'
  with open(os.path.join(workdir, record), encoding='utf-8') as f:
    return wall, json.load(f)


def measure(case: str, repeats: int, rungs: str | None, root: str) -> dict:
  """The bracket and two plain runs at its kept LR, ``repeats`` times in that order."""
  config, steps, centre = CASES[case]
  common = [f'num_train_steps={steps}']
  out = {'case': case, 'bracket': [], 'plain': []}
  for i in range(repeats):
    bracket_over = [*common, f'optim.max_lr={centre}', 'bracket.points=8'] + (
      [f'bracket.rungs={rungs}'] if rungs else []
    )
    wall, state = _train(config, bracket_over, os.path.join(root, f'{case}_bracket{i}'))
    out['bracket'].append(wall)
    out.update(
      kept_lr=state['winner']['lr'],
      compute_runs=state['compute_runs'],
      final=state['winner']['final_metric'],
      rungs=rungs or 'default',
    )
    for j in range(2):
      wall, plain = _train(
        config, [*common, f'optim.max_lr={state["winner"]["lr"]!r}'], os.path.join(root, f'{case}_plain{i}_{j}')
      )
      out['plain'].append(wall)
      out['plain_final'] = plain['final_metric']  # (the kept run's, bit for bit: the same run, built the same)
  return out


def report(rows: list[dict]) -> str:
  lines = [
    '| case | rungs | compute (runs) | kept LR | final metric: bracket / plain run | bracket wall s (median) | '
    'plain run wall s (each) | bracket / plain (medians) |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for r in rows:
    b, p = statistics.median(r['bracket']), statistics.median(r['plain'])
    lines.append(
      f'| {r["case"]} | {r["rungs"]} | {r["compute_runs"]:.2f} | {r["kept_lr"]:.4g} | '
      f'{r["final"]:.10g} / {r["plain_final"]:.10g} | {b:.1f} | '
      f'{", ".join(f"{w:.1f}" for w in r["plain"])} | {b / p:.2f}x |'
    )
  return '\n'.join(lines)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--cases', default='mnist1d1000,lm750', help=f'comma-separated, of {", ".join(CASES)}')
  p.add_argument('--repeats', type=int, default=1, help='brackets per case (each followed by two plain runs)')
  p.add_argument('--rungs', default='', help="the bracket's rungs, e.g. '0.1:4,0.3:1' (default: configs/default.py's)")
  a = p.parse_args(argv)
  cases = [c for c in a.cases.split(',') if c]
  if not cases or set(cases) - set(CASES):
    p.error(f'--cases must name some of {", ".join(CASES)}, got {a.cases!r}')
  if a.repeats < 1:
    p.error('--repeats must be >= 1')
  with tempfile.TemporaryDirectory() as root:
    rows = [measure(c, a.repeats, a.rungs or None, root) for c in cases]
  print(report(rows))


if __name__ == '__main__':
  main()
