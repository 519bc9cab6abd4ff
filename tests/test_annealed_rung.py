"""experiments/annealed_rung.py: the bracket with an annealed last rung against the default bracket and the sweep."""

import json
import os

import numpy as np
import pytest

from experiments import annealed_rung as exp


def _rec(start, seed, kept, final, run_losses=None, lrs=(0.01, 0.02, 0.04), anchor=0.02):
  last = {'step': 30, 'losses': {}, 'kept': [kept]}
  if run_losses is not None:
    last['run_losses'] = {f'{lr:.6g}': v for lr, v in zip(lrs, run_losses)}
  return {'start': start, 'seed': seed, 'kept_lr': kept, 'anchor_lr': anchor, 'final_metric': final,
          'lrs': list(lrs), 'rungs': [last]}


def test_a_start_row_pairs_both_brackets_with_the_reference_and_each_other():
  annealed, default, ref = [0.050, 0.052, 0.051], [0.055, 0.052, 0.049], [0.048, 0.05, 0.05]
  row = exp.start_row(annealed, default, ref, [1.0, 1.0, 0.5], 2)
  for key, values, base in (('annealed', annealed, ref), ('default', default, ref), ('vs_default', annealed, default)):
    v, r = np.array(values), np.array(base)
    assert row[key]['gap'] == pytest.approx(v.mean() / r.mean() - 1)
    assert row[key]['se'] == pytest.approx(np.std(v / r - 1, ddof=1) / np.sqrt(3))
  assert row['picks_differ'] == 2 and row['kept_x'] == [1.0, 1.0, 0.5]
  line = exp.workload_lines({'c:1:a': {'best': 0.05, 'starts': {'best': {**row, 'recorded_default': 0.02,
                                                                       'seeds': [0, 1, 2]}}}})[-1]
  assert line.startswith('| c:1:a | best | 3 | 0.05 | +2.0% |')
  assert f"{100 * row['vs_default']['gap']:+.1f} ± {100 * row['vs_default']['se']:.1f}%" in line


def test_the_default_pick_ranks_the_runs_own_losses_ties_to_the_lower_lr():
  assert exp.default_pick(_rec('best', 0, 0.04, 1.0, [2.0, 1.5, 1.6])) == 0.02
  assert exp.default_pick(_rec('best', 0, 0.04, 1.0, [1.5, 1.5, float('nan')])) == 0.01
  assert exp.default_pick(_rec('best', 0, 0.04, 1.0)) is None  # (a record made before run_losses)


def test_the_default_final_is_the_annealed_run_where_the_picks_agree_else_its_own_end(tmp_path):
  root = str(tmp_path)
  same = _rec('best', 0, 0.02, 0.7, [2.0, 1.5, 1.6])
  assert exp.default_final('lm:16:adamw', same, 'best', 0, True, root, train=False) == 0.7  # the same run
  differ = _rec('best', 1, 0.04, 0.7, [2.0, 1.5, 1.6])
  assert exp.default_final('lm:16:adamw', differ, 'best', 1, True, root, train=False) is None  # not trained
  path = exp.end_path('lm:16:adamw', 'best', 1, 0.02, True, root)
  os.makedirs(os.path.dirname(path))
  with open(path, 'w') as f:
    json.dump({'final_metric': 0.65}, f)
  assert exp.default_final('lm:16:adamw', differ, 'best', 1, True, root, train=False) == 0.65
  assert exp.end_path('narrow', 'low', 3, 0.02, False, root).endswith(
      os.path.join('annealed_rung', 'runs', 'heldout', 'narrow', 'low_s3_end_lr0.02.json'))


def test_the_recorded_defaults_are_wider_rungs_8_5_1_brackets():
  got = exp.recorded_defaults('mnist1d:1000:adamw')
  assert sorted(got) == sorted((start, s) for start in ('low', 'best', 'high') for s in (0, 1, 2))
  best = exp.bracket_mode.sweep_cell('mnist1d:1000:adamw')['grid_best']['value']
  mean = np.mean([got[('best', s)] for s in (0, 1, 2)])
  assert mean / best - 1 == pytest.approx(0.073, abs=0.0005)  # results/wider_rung.md: the 8-5-1 gap, +7.3%


def test_the_bracket_is_the_default_with_its_last_rung_annealed():
  from hdet_jax.trainer import config_lib
  from trainer_testing import ROOT
  config = config_lib.load_config_file(os.path.join(ROOT, 'configs', 'default.py'))
  default = {f'bracket.{k}': v for k, v in config.bracket.to_dict().items() if k not in ('points', 'anneal')}
  assert {k: v for k, v in exp.BRACKET.items() if k in default} == default and config.bracket.anneal == 0.0
  assert exp.BRACKET['bracket.anneal'] == 0.1


def test_quick_trains_an_annealed_bracket_and_reports_it(tmp_path):
  exp.main(['--quick', '--workdir', str(tmp_path)])
  rec = json.load(open(exp.record_path('lm:16:adamw', 'best', 0, True, str(tmp_path))))
  (rung,) = rec['rungs']
  assert rung['step'] == 8 and rung['annealed_to'] == 12 and rung['kept'] == [rec['kept_lr']]
  losses = {float(k): v for k, v in rung['losses'].items()}
  assert len(losses) == 3 == len(rung['run_losses']) and min(losses, key=losses.get) == pytest.approx(rec['kept_lr'])
  assert np.isfinite(rec['final_metric'])
  assert not os.path.exists(os.path.join(str(tmp_path), 'annealed_rung', 'lm_16_adamw', 'best_s0'))
  # The default bracket from the same bracket: its pick's end trained where it differs.
  pick = exp.default_pick(rec)
  end = exp.end_path('lm:16:adamw', 'best', 0, pick, True, str(tmp_path))
  assert os.path.exists(end) == (pick != rec['kept_lr'])
  rows = [l for l in open(tmp_path / 'annealed_rung.md').read().splitlines() if l.startswith('| lm:16:adamw |')]
  assert len(rows) == 1 and '| best |' in rows[0] and f'| {int(pick != rec["kept_lr"])} |' in rows[0]
