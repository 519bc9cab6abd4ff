"""research/schedule_bracket.py: the bracket and the default HDET under a warmup-cosine schedule."""

import json
import math

import pytest

from research import autolr
from research import records
from research.archive import schedule_bracket as exp
from research import workloads


def _run(lr, seed, step_loss, final, diverged_at=None, name=None):
  return {
    'name': name or autolr.grid_name('adamw', lr, seed),
    'config': {
      'num_train_steps': len(step_loss),
      'seed': seed,
      'optim': {'max_lr': lr, 'div_factor': 25.0, 'final_div_factor': 10.0},
    },
    'step_loss': list(step_loss),
    'val_bpb': final,
    'diverged_at': diverged_at,
    'final_lr': lr / 250,
  }


def test_loss_before_is_the_mean_of_the_steps_completed_by_then():
  losses = [float(100 - k) for k in range(100)]  # step k's loss: 100 - k
  r = _run(0.1, 0, losses, 1.0)
  assert exp.loss_before(r, 0.005) is None  # no step completed by step 0.5
  assert exp.loss_before(r, 0.05) == pytest.approx(100 - 2.0)  # steps 0-4 (only 5 by then): mean of 100..96
  assert exp.loss_before(r, 0.3) == pytest.approx(100 - 24.5)  # the 10 steps 20-29
  assert exp.loss_before(r, 1.0) == pytest.approx(100 - 94.5)
  bad = _run(0.1, 0, losses[:25] + [None] + losses[26:], 1.0)
  assert exp.loss_before(bad, 0.2) == pytest.approx(100 - 14.5) and exp.loss_before(bad, 0.3) == math.inf
  assert exp.loss_before(_run(0.1, 0, losses, 1.0, diverged_at=28), 0.3) == math.inf
  assert exp.loss_before(_run(0.1, 0, losses, 1.0, diverged_at=30), 0.3) == pytest.approx(100 - 24.5)
  stopped = {**_run(0.1, 0, losses[:13], 1.0, diverged_at=12), 'config': r['config']}  # the trainer stopped there
  assert exp.loss_before(stopped, 0.3) == math.inf and exp.loss_before(stopped, 0.1) == pytest.approx(100 - 4.5)
  assert exp.loss_before(_run(0.1, 0, losses[:20], 1.0), 0.3) is not None  # its own length: 0.3 of 20 steps


def test_cell_report_picks_at_each_fraction_pairs_the_gap_and_reads_hdet(tmp_path):
  lrs = (0.001, 0.002, 0.004, 0.008)
  cache = records.RunCache(str(tmp_path / 'records'), str(tmp_path / 'work'), None, None)
  for seed in (0, 1, 2):
    for k, lr in enumerate(lrs):
      if seed == 2 and k == 3:
        continue  # seed 2's grid is incomplete: not read
      # Up to step 10 the highest LR leads, after it the second lowest (the best final) does.
      steps = [10.0 - k if t < 10 else 5.0 + abs(k - 1) for t in range(100)]
      cache.write(autolr.grid_name('adamw', lr, seed), _run(lr, seed, steps, (2.0 + seed) * (1 + 0.1 * abs(k - 1))))
  for start, gap in (('low', 0.03), ('best', 0.0), ('high', math.inf)):
    for seed in (0, 1):
      name = autolr.hdet_name('adamw', workloads.DEFAULT_VARIANT, start, seed)
      cache.write(
        name,
        _run(
          0.004,
          seed,
          [1.0] * 100,
          (2.0 + seed) * (1 + gap),  # ends on the schedule of 0.004
          diverged_at=5 if math.isinf(gap) else None,
          name=name,
        ),
      )
  control = exp.hdet_run_name('adamw', 'start1', 'best', 0)
  assert control == autolr.hdet_name('adamw', workloads.DEFAULT_VARIANT + '_start1', 'best', 0)
  cache.write(control, _run(0.001, 0, [1.0] * 100, 2.0 * 1.05, name=control))
  c = exp.cell_report(cache, 'adamw', lrs, (0, 1, 2), None)
  assert set(c['controls']) == {'start1'} and set(c['controls']['start1']) == {'best'}
  assert c['controls']['start1']['best']['gap_pct'] == pytest.approx(100 * (2.1 / 2.5 - 1))  # one seed, its mean
  assert c['controls']['start1']['best']['scale_x'] == pytest.approx([0.5])
  assert c['seeds'] == [0, 1] and c['best_lr'] == 0.002 and c['best'] == pytest.approx(2.5)
  assert c['fractions']['0.05']['kept_x'] == [4.0, 4.0]  # step 5: the highest LR leads
  assert c['fractions']['0.05']['gaps_pct'] == pytest.approx([20.0, 20.0])  # 0.008 ends 1.2x the seed's best
  assert c['fractions']['0.3']['kept_x'] == [1.0, 1.0] and c['fractions']['0.3']['gaps_pct'] == [0.0, 0.0]
  assert c['points'] == 4 and c['fractions']['0.05']['compute_runs'] == pytest.approx(1 + 3 * 0.05)  # 4 points
  assert c['fractions']['0.2']['kept_x'] == [1.0, 1.0]  # steps 10-19: the best leads
  assert c['halving']['8-4-1 at 0.05 / 0.1']['kept_x'] == [4.0, 4.0]  # all four go on; steps 0-9: the highest leads
  assert c['halving']['8-4-1 at 0.1 / 0.3']['kept_x'] == [1.0, 1.0]
  # HDET: the mean of its seeds against the sweep's best (3-seed... here 2-seed) mean; a diverged run is +inf.
  assert c['hdet']['low']['gap_pct'] == pytest.approx(3.0) and c['hdet']['best']['gap_pct'] == pytest.approx(0.0)
  assert c['hdet']['high']['gap_pct'] is None and c['hdet']['low']['n'] == 2
  assert c['hdet']['low']['scale_x'] == pytest.approx([2.0, 2.0])  # its last LR 0.004 / 250, x 250 / the best 0.002


def test_grid_extends_past_the_edge_where_the_first_seeds_best_sits(tmp_path, monkeypatch):
  monkeypatch.setattr(exp.autolr, 'GRIDS', {'adamw': (0.01, 0.02, 0.04)})
  cache = records.RunCache(str(tmp_path / 'records'), str(tmp_path / 'work'), None, None)
  final = {0.0025: 1.5, 0.005: 1.2, 0.01: 1.3, 0.02: 1.4, 0.04: 1.6}  # the best 2 points below the grid

  def have(*lrs, seed=0):
    for lr in lrs:
      cache.write(autolr.grid_name('adamw', lr, seed), _run(lr, seed, [1.0], final[lr]))

  have(0.01, 0.02)
  assert exp.grid_lrs(cache, 'adamw', False, 0) == ([0.01, 0.02, 0.04], False)  # incomplete: not settled
  have(0.04)
  assert exp.grid_lrs(cache, 'adamw', False, 0) == ([0.005, 0.01, 0.02, 0.04], False)  # best at the low edge
  have(0.005)
  assert exp.grid_lrs(cache, 'adamw', False, 0) == ([0.0025, 0.005, 0.01, 0.02, 0.04], False)
  have(0.0025)
  assert exp.grid_lrs(cache, 'adamw', False, 0) == ([0.0025, 0.005, 0.01, 0.02, 0.04], True)  # inside now
  assert exp.grid_lrs(cache, 'adamw', False, 1) == ([0.01, 0.02, 0.04], False)  # per seed asked
  final.update({0.0025: 1.0})  # best at the new edge: the extension (MAX_EXTEND = 2) is used up
  have(0.0025)
  assert exp.grid_lrs(cache, 'adamw', False, 0) == ([0.0025, 0.005, 0.01, 0.02, 0.04], True)
  final.update({0.04: 0.5})
  cache2 = records.RunCache(str(tmp_path / 'records2'), str(tmp_path / 'work2'), None, None)
  for lr in (0.01, 0.02, 0.04):
    cache2.write(autolr.grid_name('adamw', lr, 0), _run(lr, 0, [1.0], final[lr]))
  assert exp.grid_lrs(cache2, 'adamw', False, 0) == ([0.01, 0.02, 0.04, 0.08], False)  # and past the top


def test_quick_run_trains_the_cosine_sweep_and_reports(tmp_path):
  exp.main(['--quick', '--workdir', str(tmp_path)])
  res = json.loads((tmp_path / 'schedule_bracket.json').read_text())
  cell = res['lm']['16']['adamw']
  assert exp.grid_lrs(exp.cache_for('lm', 16, True, str(tmp_path)), 'adamw', True, 0)[1]  # not extended when quick
  assert cell['seeds'] == [0] and set(cell['grid']) == {f'{lr:.4g}' for lr in autolr.QUICK_GRIDS['adamw']}
  cache = exp.cache_for('lm', 16, True, str(tmp_path))
  rec = cache.get(autolr.grid_name('adamw', cell['best_lr'], 0))
  assert rec['config']['optim']['schedule'] == 'warmup_cosine' and rec['config']['optim']['pct_start'] == exp.PEAK
  assert len(rec['step_loss']) == 16 and all(math.isfinite(x) for x in rec['step_loss'])
  assert rec['config']['hdet']['spread'] == 0.0  # the sweep's plain run
  h = cache.get(autolr.hdet_name('adamw', workloads.DEFAULT_VARIANT, 'best', 0))
  assert h['config']['optim']['schedule'] == 'warmup_cosine' and h['config']['hdet']['controller'] == 'fit'
  assert cell['hdet']['best']['gap_pct'] == pytest.approx(100 * (h['val_bpb'] / cell['best'] - 1))
  assert '| lm | 16 | adamw |' in (tmp_path / 'schedule_bracket.md').read_text()
