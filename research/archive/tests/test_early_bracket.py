"""research/early_bracket.py: an early-stopped bracket read from the sweep's records (nothing trained)."""

import json
import math
import os

import pytest

from research import autolr
from research.archive import early_bracket as exp
from research import workloads


def _run(lr, seed, losses, final, steps=100, diverged_at=None):
  """A sweep record: training-loss blocks of 10 steps (``losses[i]`` ends at step 10 i + 10) and its final."""
  return {
    'name': f'adamw/grid_lr{lr:g}_s{seed}',
    'config': {'num_train_steps': steps, 'seed': seed, 'optim': {'max_lr': lr}},
    'trajectory': [{'step': 10 * i + 9, 'loss': x} for i, x in enumerate(losses)],
    'val_bpb': final,
    'diverged_at': diverged_at,
  }


def test_loss_at_reads_the_last_block_ending_by_the_fraction():
  r = _run(0.1, 0, [5.0, 4.0, 3.0, float('nan')], 2.0)
  assert exp.loss_at(r, 0.05) is None  # no block ends by step 5
  assert exp.loss_at(r, 0.1) == 5.0 and exp.loss_at(r, 0.25) == 4.0 and exp.loss_at(r, 0.3) == 3.0
  assert exp.loss_at(r, 0.4) == math.inf  # a non-finite loss cannot win
  assert exp.loss_at(_run(0.1, 0, [5.0, 4.0], 2.0, diverged_at=15), 0.2) == math.inf


def test_bracket_keeps_the_lowest_losses_at_each_rung():
  # Early the highest LR leads; by 0.3 the middle one does; the lowest leads only at the end.
  runs = {
    0.01: _run(0.01, 0, [9, 8, 7, 6, 5], 1.0),
    0.1: _run(0.1, 0, [6, 5, 4, 3.5, 3], 2.0),
    1.0: _run(1.0, 0, [3, 3, 4.5, 5, 6], 9.0),
    0.3: _run(0.3, 0, [4, 4, 4.1, 4, 4], 3.0),
  }
  assert exp.pick(runs, 0.1) == 1.0 and exp.pick(runs, 0.3) == 0.1
  assert exp.bracket(runs, [(0.1, 2), (0.3, 1)]) == 0.3  # the two leaders at 0.1: 1.0 and 0.3; at 0.3, 0.3 leads
  assert exp.bracket(runs, [(0.1, 3), (0.3, 1)]) == 0.1
  assert exp.bracket(runs, [(0.05, 2)]) is None  # no block to compare yet
  tie = {0.2: _run(0.2, 0, [1.0], 1.0), 0.1: _run(0.1, 0, [1.0], 1.0)}
  assert exp.pick(tie, 0.1) == 0.1


def test_compute_counts_each_rungs_survivors_to_the_next():
  assert exp.compute_runs([(0.3, 1)]) == pytest.approx(8 * 0.3 + 0.7)
  assert exp.compute_runs([(0.1, 4), (0.3, 1)]) == pytest.approx(8 * 0.1 + 4 * 0.2 + 0.7)
  assert exp.compute_runs([(0.1, 4), (0.2, 2), (0.3, 1)]) == pytest.approx(0.8 + 0.4 + 0.2 + 0.7)
  assert exp.compute_runs([(1.0, 1)]) == pytest.approx(8.0)
  assert exp.compute_runs([(0.5, 2)]) == pytest.approx(8 * 0.5 + 2 * 0.5)  # two still running at the end


def _write(folder, rec):
  os.makedirs(os.path.join(folder, 'adamw'), exist_ok=True)
  with open(os.path.join(folder, rec['name'] + '.json'), 'w', encoding='utf-8') as f:
    json.dump(rec, f)


def test_cell_report_reads_complete_seeds_and_pairs_the_gap(tmp_path):
  lrs = (0.001, 0.002, 0.004, 0.008, 0.016)
  folder = str(tmp_path / 'cell')
  best = lrs[1]
  for seed in (0, 1, 3):
    for k, lr in enumerate(lrs):
      if seed == 1 and k > 1:
        continue  # seed 1's grid is not complete: it is not read
      # Early (block 1) the highest LR leads; at 0.3 (block 3) the best one leads. Finals: the best lowest.
      early = 10.0 - k
      at_peak = 5.0 + abs(k - 1)
      final = (2.0 + 0.01 * seed) * (1.0 + 0.1 * abs(k - 1))
      _write(folder, _run(lr, seed, [early, early, at_peak, at_peak], final))
  c = exp.cell_report(folder, 'adamw', lrs)
  assert c['seeds'] == [0, 3] and c['best_lr'] == best
  top = len(lrs) - 1
  at_01 = c['fractions']['0.1']
  assert at_01['kept_x'] == [lrs[top] / best] * 2
  assert at_01['gaps_pct'] == pytest.approx([100 * 0.1 * (top - 1)] * 2)  # paired: the same seed's best run
  assert at_01['kept_best'] == 0 and at_01['compute_runs'] == pytest.approx(1.7)
  at_03 = c['fractions']['0.3']
  assert at_03['kept_x'] == [1.0, 1.0] and at_03['gaps_pct'] == [0.0, 0.0] and at_03['kept_best'] == 2
  assert '0.05' not in c['fractions']  # no block by step 5
  # 8-4-1: the four leaders at 0.1 are the four highest LRs, the best among them; 8-2-1 keeps only the top two.
  assert c['halving']['8-4-1 at 0.1 / 0.3']['kept_x'] == [1.0, 1.0]
  assert c['halving']['8-2-1 at 0.1 / 0.3']['kept_x'] == [4.0, 4.0]
  assert c['halving']['8-2-1 at 0.1 / 0.3']['gaps_pct'] == pytest.approx([20.0, 20.0])
  # From each start, the points within sqrt(128) = 11.3x of it: 10x low (0.0002) spans up to 0.00226, 10x high
  # (0.02) down to 0.00177.
  assert [c['starts'][k]['points'] for k in ('10x low', 'best', '10x high')] == [[2, 2], [5, 5], [4, 4]]
  assert all(c['starts'][k]['kept_x'] == [1.0, 1.0] for k in exp.STARTS)


def test_the_report_runs_over_the_quick_folders(tmp_path):
  lrs = autolr.QUICK_GRIDS['adamw']
  w = 'lm'
  steps = workloads.lengths(w, True)[0]
  folder = workloads.records_dir(w, steps, True, str(tmp_path))
  for k, lr in enumerate(lrs):
    _write(folder, _run(lr, 0, [5.0 - k, 3.0 + k], 2.0 + k, steps=20))
  exp.main(['--quick', '--workdir', str(tmp_path)])
  with open(tmp_path / 'early_bracket.json', encoding='utf-8') as f:
    res = json.load(f)
  cell = res[w][str(steps)]['adamw']
  assert cell['fractions']['1']['kept_x'] == [1.0]  # the lowest LR leads at the end and is the best
  assert cell['fractions']['0.5']['kept_x'] == [lrs[-1] / lrs[0]]
  assert cell['fractions']['0.5']['gaps_pct'][0] == pytest.approx(100 * (len(lrs) - 1) / 2.0)
  md = (tmp_path / 'early_bracket.md').read_text()
  assert '| lm |' in md and 'within 1%' in md


def test_complete_grids_trains_only_the_points_the_sweep_lacks(tmp_path):
  w, optim = 'mnist1d', 'adamw'
  steps = workloads.lengths(w, True)[0]
  lrs = autolr.QUICK_GRIDS[optim]
  folder = workloads.records_dir(w, steps, True, str(tmp_path))
  have = _run(lrs[0], 0, [1.0], 1.0, steps=steps)
  have['name'] = autolr.grid_name(optim, lrs[0], 0)
  _write(folder, have)
  assert exp.complete_grids(w, steps, optim, [0], True, str(tmp_path)) == 1
  extra = exp.extra_dir(w, steps, True, str(tmp_path))
  trained = sorted(os.listdir(os.path.join(extra, optim)))
  assert trained == [os.path.basename(autolr.grid_name(optim, lrs[1], 0)) + '.json']
  with open(os.path.join(extra, optim, trained[0]), encoding='utf-8') as f:
    rec = json.load(f)
  assert rec['config']['optim']['max_lr'] == lrs[1] and rec['config']['seed'] == 0 and rec['config']['task'] == w
  # The sweep's plain run: no spread, no controller.
  assert rec['config']['hdet']['spread'] == 0.0 and rec['config']['hdet']['auto_lr'] is False
  # The seed's grid is complete now, across both folders.
  assert sorted(exp.full_grids(folder, optim, lrs, extra)[0]) == sorted(lrs)
  assert exp.full_grids(folder, optim, lrs) == {}
