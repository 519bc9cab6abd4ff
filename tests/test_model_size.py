"""experiments/model_size.py: a larger LM on the held-out corpus (sweep, default HDET and the bracket)."""

import json
import os

import numpy as np
import pytest

from experiments import model_size as exp


def _write(root, name, lr, final):
  os.makedirs(exp.record_dir(True, str(root)), exist_ok=True)
  rec = {'name': name, 'lr': lr, 'final_metric': final, 'diverged_at': None, 'wall_s': 1.0, 'num_params': 10,
         'device': 'cpu x8'}
  with open(os.path.join(exp.record_dir(True, str(root)), name + '.json'), 'w') as f:
    json.dump(rec, f)


def test_a_starts_run_from_another_sweep_best_is_not_read(tmp_path):
  (low, high), (hdet_best, _) = exp.grid_lrs(True), exp.job_names(True)[1]
  _write(tmp_path, exp.job_names(True)[0][0], low, 2.0)
  assert exp.sweep_best(True, str(tmp_path)) is None  # the sweep is incomplete
  _write(tmp_path, exp.job_names(True)[0][1], high, None)  # diverged: loses
  assert exp.sweep_best(True, str(tmp_path)) == (low, 2.0)
  _write(tmp_path, hdet_best, low, 1.9)
  assert exp.load(hdet_best, True, str(tmp_path))['final_metric'] == 1.9
  _write(tmp_path, exp.job_names(True)[0][1], high, 1.5)  # the sweep's best moves: the start's run is stale
  assert exp.load(hdet_best, True, str(tmp_path)) is None
  lines = exp.report(True, str(tmp_path))
  assert f'| {hdet_best} | | not trained | | | |' in lines
  assert any(l.startswith(f'| grid_lr{low:g} | {low:.4g} | 2.0000 | +33.3% |') for l in lines)


def test_the_full_sweep_extends_below_autolrs_grid():
  np.testing.assert_allclose(exp.GRID, [0.03 * 2.0 ** k for k in range(-5, 5)])
  assert exp.job_names(False)[1] == [f'{k}_{s}' for k in ('hdet', 'bracket') for s in ('low', 'best', 'high')]


def test_quick_trains_the_sweep_then_hdet_and_the_bracket_from_its_best(tmp_path):
  exp.main(['--quick', '--workdir', str(tmp_path)])
  best_lr, best = exp.sweep_best(True, str(tmp_path))
  grid = {n: exp.load(n, True, str(tmp_path)) for n in exp.job_names(True)[0]}
  assert best == min(r['final_metric'] for r in grid.values())
  hdet, bracket = (exp.load(n, True, str(tmp_path)) for n in exp.job_names(True)[1])
  assert hdet['lr'] == best_lr and bracket['lr'] == best_lr and np.isfinite(hdet['final_metric'])
  losses = {float(k): v for k, v in bracket['rungs'][0]['losses'].items()}
  np.testing.assert_allclose(sorted(losses), [best_lr / 4, best_lr, best_lr * 4], rtol=1e-5)
  assert min(losses, key=losses.get) == pytest.approx(bracket['kept_lr'], rel=1e-5)
  if bracket['kept_lr'] == pytest.approx(best_lr):  # the same plain run as the sweep's point: the same number
    assert bracket['final_metric'] == best
  md = open(tmp_path / 'model_size.md').read()
  assert f'The sweep\'s best: {best:.4f} at {best_lr:g}.' in md
