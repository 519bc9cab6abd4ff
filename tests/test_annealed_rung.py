"""experiments/annealed_rung.py: the bracket with an annealed last rung against the default bracket and the sweep."""

import json
import os

import numpy as np
import pytest

from experiments import annealed_rung as exp


def _rec(start, seed, kept_x, final, anchor=0.06):
  return {'start': start, 'seed': seed, 'kept_lr': kept_x * anchor, 'anchor_lr': anchor, 'final_metric': final}


def test_rows_pair_the_annealed_bracket_with_the_default_seed_by_seed():
  best = 0.05
  recs = {('best', s): _rec('best', s, 1.0, f) for s, f in enumerate([0.050, 0.052, 0.051])}
  recs.update({('low', s): _rec('low', s, 0.5, 0.06) for s in (0, 1)})  # a start missing a seed: left out
  default = {('best', s): {'final_metric': f} for s, f in enumerate([0.055, 0.052, 0.049])}
  rows = exp.cell_rows(recs, default, best)
  assert set(rows) == {'best'}
  row = rows['best']
  assert row['gap'] == pytest.approx(np.mean([0.050, 0.052, 0.051]) / best - 1)
  assert row['default_gap'] == pytest.approx(np.mean([0.055, 0.052, 0.049]) / best - 1)
  per_seed = np.array([0.050 / 0.055, 0.052 / 0.052, 0.051 / 0.049]) - 1
  assert row['vs_default'] == pytest.approx(np.mean([0.050, 0.052, 0.051]) / np.mean([0.055, 0.052, 0.049]) - 1)
  assert row['vs_default_se'] == pytest.approx(np.std(per_seed, ddof=1) / np.sqrt(3))
  assert row['kept_x'] == pytest.approx([1.0] * 3)
  line = [l for l in exp.workload_lines({'c:1:a': {'best': best, 'starts': rows}}) if l.startswith('| c:1:a')][0]
  assert f"{100 * row['vs_default']:+.1f} ± {100 * row['vs_default_se']:.1f}%" in line


def test_the_default_brackets_are_wider_rungs_8_5_1_records():
  """The workload rows' default is the 8-5-1 bracket: wider_rung's first-rung-keeps-one-more composition."""
  got = exp.default_brackets('mnist1d:1000:adamw')
  assert sorted(got) == sorted((start, s) for start in ('low', 'best', 'high') for s in (0, 1, 2))
  best = exp.bracket_mode.sweep_cell('mnist1d:1000:adamw')['grid_best']['value']
  mean = np.mean([got[('best', s)]['final_metric'] for s in (0, 1, 2)])
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
  assert len(losses) == 3 and min(losses, key=losses.get) == pytest.approx(rec['kept_lr'], rel=1e-5)
  assert np.isfinite(rec['final_metric'])
  assert not os.path.exists(os.path.join(str(tmp_path), 'annealed_rung', 'lm_16_adamw', 'best_s0'))
  rows = [l for l in open(tmp_path / 'annealed_rung.md').read().splitlines() if l.startswith('| lm:16:adamw |')]
  assert len(rows) == 1 and '| best |' in rows[0]
