"""research/model_size.py: a larger LM on the held-out corpus (sweep, default HDET and the bracket)."""

import json
import os

import numpy as np
import pytest

from research.archive import model_size as exp


def _write(root, name, lr, final):
  os.makedirs(exp.record_dir(True, str(root)), exist_ok=True)
  rec = {
    'name': name,
    'lr': lr,
    'final_metric': final,
    'diverged_at': None,
    'wall_s': 1.0,
    'num_params': 10,
    'device': 'cpu x8',
  }
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
  assert any(line.startswith(f'| grid_lr{low:g} | {low:.4g} | 2.0000 | +33.3% |') for line in lines)


def test_the_full_sweep_extends_below_autolrs_grid():
  np.testing.assert_allclose(exp.GRID, [0.03 * 2.0**k for k in range(-5, 5)])
  assert exp.job_names(False)[1] == [
    f'{k}_{s}' for k in ('hdet', 'bracket', 'bracket851', 'bracket1591') for s in ('low', 'best', 'high')
  ]
  assert exp.BRACKETS['bracket1591']['bracket.points'] == 15 and exp.DEFAULT_BRACKET == 'bracket851'
  assert exp.BRACKETS['bracket851']['bracket.rungs'] == '0.1:5,0.3:1'  # the default bracket (configs/bracket.py)
  assert exp.BRACKETS['bracket']['bracket.rungs'] == '0.1:4,0.3:1'


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
  assert f"The sweep's best: {best:.4f} at {best_lr:g}." in md


def test_seed_summary_pairs_each_start_with_the_sweeps_best_lr_over_the_seeds(tmp_path):
  root = str(tmp_path)
  low, high = exp.grid_lrs(True)
  sweep = {low: [2.0, 2.2, 2.1], high: [1.9, 2.3, 2.2]}  # means 2.1 and 2.1333: low is the best LR
  for lr, finals in sweep.items():
    for seed, v in enumerate(finals):
      _write(root, f'grid_lr{lr:g}' + (f'_s{seed}' if seed else ''), lr, v)
  hdet = [2.2, 2.2, 2.4]
  for seed, v in enumerate(hdet):
    # (a start's LR is from seed 0's sweep best: high there, 1.9 against 2.0)
    _write(root, 'hdet_low' + (f'_s{seed}' if seed else ''), high * exp.STARTS['low'], v)
  assert exp.seed_summary(True, root, [1]) is None  # 2 seeds: no summary
  got = exp.seed_summary(True, root, [1, 2])
  assert got['best_lr'] == low and got['sweep'] == sweep[low] and list(got['runs']) == ['hdet_low']
  per_seed = np.array(hdet) / np.array(sweep[low]) - 1
  r = got['runs']['hdet_low']
  assert r['gap'] == pytest.approx(np.mean(hdet) / np.mean(sweep[low]) - 1)
  assert r['se'] == pytest.approx(np.std(per_seed, ddof=1) / np.sqrt(3)) and r['kept_x'] is None
  assert any(
    line.startswith('| hdet_low | 2.2000 / 2.2000 / 2.4000 | 2.2667 | +7.94 ± ') for line in exp.summary_lines(got)
  )


def test_the_committed_summary_is_the_records_own():
  """Every figure of results/model_size.json's 3-seed summary, recomputed from the committed records."""
  with open(os.path.join(exp.REPO, 'results', 'model_size.json'), encoding='utf-8') as f:
    committed = json.load(f)['seeds_summary']
  assert committed['seeds'] == [0, 1, 2] and committed['best_lr'] == 0.00375
  rec = lambda n: exp.load(n, False, '')
  assert committed['sweep'] == [rec('grid_lr0.00375')['final_metric']] + [
    rec(f'grid_lr0.00375_s{s}')['final_metric'] for s in (1, 2)
  ]
  for run, r in committed['runs'].items():
    finals = [rec(run)['final_metric']] + [rec(f'{run}_s{s}')['final_metric'] for s in (1, 2)]
    assert r['finals'] == finals
    assert r['gap'] == pytest.approx(np.mean(finals) / np.mean(committed['sweep']) - 1, abs=1e-12)
  # The finer grid holds the best LR itself: from the best it keeps it on every seed, and its kept run is the sweep's
  # plain run at that LR, bit for bit (trained on another H200, in another session).
  assert (
    [rec(n)['final_metric'] for n in ('bracket1591_best', 'bracket1591_best_s1', 'bracket1591_best_s2')]
    == committed['sweep']
    == committed['runs']['bracket1591_best']['finals']
  )
  # The default bracket (8-5-1) keeps what the 8-4-1 one kept wherever both ran: the same runs, bit for bit.
  for run in ('bracket_low', 'bracket_best', 'bracket_high', 'bracket_best_s1', 'bracket_best_s2'):
    old, new = rec(run), rec(run.replace('bracket', 'bracket851'))
    assert new['rungs'][0]['losses'] == old['rungs'][0]['losses'] and new['final_metric'] == old['final_metric']


def test_unknown_seed_starts_is_one_clear_error(tmp_path, capsys):
  with pytest.raises(SystemExit):
    exp.main(['--report-only', '--seed-starts', 'middle', '--workdir', str(tmp_path)])
  assert "--seed-starts: unknown ['middle']" in capsys.readouterr().err
