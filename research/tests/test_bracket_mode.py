"""research/bracket_mode.py: the LR bracket mode against the sweep and the default HDET."""

import json
import os

import numpy as np
import pytest

from research import bracket_mode as exp
from research import records


def _rec(start, seed, kept_x, final, anchor=0.015):
  return {
    'start': start,
    'seed': seed,
    'kept_lr': kept_x * anchor,
    'anchor_lr': anchor,
    'final_metric': final,
    'wall_s': 100.0 + seed,
  }


def test_rows_compare_the_three_seed_mean_with_the_sweep_and_hdet():
  with open(os.path.join(exp.REPO, 'results', 'workloads.json')) as f:
    cell = json.load(f)['lm']['750']['adamw']
  best = cell['grid_best']['value']
  recs = {('low', s): _rec('low', s, 1.13, best * (1 + 0.01 * s)) for s in (0, 1, 2)}
  recs.update({('high', s): _rec('high', s, 0.88, None if s == 2 else best) for s in (0, 1, 2)})  # one diverged
  recs[('best', 0)] = _rec('best', 0, 0.5, best * 0.99)
  rows = exp.cell_rows('lm:750:adamw', recs, quick=False)
  assert rows['low']['gap'] == pytest.approx(0.01)  # mean of +0 / +1 / +2%
  assert rows['low']['hdet_gap'] == pytest.approx(cell['hdet']['low']['value'] / best - 1)
  assert rows['low']['kept_x'] == pytest.approx([1.13] * 3) and rows['low']['n'] == 3
  assert rows['high']['gap'] == float('inf')  # a diverged bracket counts as lost
  assert rows['best']['n'] == 1 and rows['best']['gap'] == pytest.approx(-0.01)


def test_tally_counts_only_complete_cells_within_one_percent(tmp_path):
  rows = {
    'lm:750:adamw': {
      'low': {
        'n': 3,
        'value': 1.0,
        'finals': [1.0] * 3,
        'kept_x': [1.0] * 3,
        'wall_s': 1.0,
        'gap': 0.009,
        'hdet_gap': 0.02,
      },
      'best': {
        'n': 3,
        'value': 1.0,
        'finals': [1.0] * 3,
        'kept_x': [1.0] * 3,
        'wall_s': 1.0,
        'gap': 0.011,
        'hdet_gap': 0.005,
      },
      'high': {
        'n': 2,
        'value': 1.0,
        'finals': [1.0] * 2,
        'kept_x': [1.0] * 2,
        'wall_s': 1.0,
        'gap': 0.0,
        'hdet_gap': 0.0,
      },
    }
  }
  exp.write_report(str(tmp_path), rows, quick=False)
  lines = open(tmp_path / 'bracket_mode.md').read().splitlines()
  assert lines[-1].endswith('the bracket in 1 of 2 cell-starts, the default HDET in 1 of the same 2.')
  saved = json.load(open(tmp_path / 'bracket_mode.json'))
  assert saved['_tally'] == {'within': 1, 'hdet_within': 1, 'total': 2}


def test_quick_trains_a_bracket_and_reports_it(tmp_path):
  exp.main(['--quick', '--workdir', str(tmp_path)])
  path = exp.record_path('lm:16:adamw', 'best', 0, True, str(tmp_path))
  rec = json.load(open(path))
  np.testing.assert_allclose(rec['lrs'], [0.01 / 4, 0.01, 0.04], rtol=1e-12)
  assert rec['kept_lr'] in rec['lrs'] and rec['rungs'][0]['step'] == 8 and rec['rungs'][0]['kept'] == [rec['kept_lr']]
  losses = {float(k): v for k, v in rec['rungs'][0]['losses'].items()}
  assert min(losses, key=losses.get) == pytest.approx(rec['kept_lr'], rel=1e-5)
  assert rec['compute_runs'] == pytest.approx((3 * 8 + 8) / 16)
  assert np.isfinite(rec['final_metric'])
  import jax
  import jaxlib
  from hdet_jax.trainer import process

  assert rec['machine'] == {
    'cpu': process.cpu_model(),
    'platform': 'cpu',
    'device_kind': 'cpu',
    'jax': jax.__version__,
    'jaxlib': jaxlib.__version__,
    'xla_flags': os.environ['XLA_FLAGS'],
  }
  assert not os.path.exists(os.path.join(str(tmp_path), 'bracket_mode', 'lm', 'steps16', 'adamw_best_s0'))
  rows = [line for line in open(tmp_path / 'bracket_mode.md').read().splitlines() if line.startswith('| lm:16:adamw |')]
  assert len(rows) == 1 and '| best |' in rows[0] and f'| {rec["final_metric"]:.4g} |' in rows[0]


def test_the_lm_cell_from_the_best_is_configs_bracket_py():
  """The report's LM row at 1500 steps from the best is what ``python train.py --config configs/bracket.py`` trains:
  the same runs; the default rungs keep 5 at 0.1 where the report's kept 4, and on that cell the fifth point changed
  no seed's kept run (results/wider_rung.json), so the same kept LR and final metric."""

  mine = records.load_config(os.path.join(exp.REPO, 'configs', 'bracket.py'))
  theirs = exp.config_for('lm:1500:adamw', 'best', 0, False, '/unused')
  assert records.resolve(theirs).training_fields(8) == records.resolve(mine).training_fields(8)
  assert mine.optim.max_lr == exp.anchor_lr('lm:1500:adamw', False)
  assert {**theirs.bracket.to_dict(), 'rungs': '0.1:5,0.3:1'} == mine.bracket.to_dict()
  assert theirs.bracket.rungs == '0.1:4,0.3:1'
  with open(os.path.join(exp.REPO, 'results', 'wider_rung.json'), encoding='utf-8') as f:
    seeds = json.load(f)['rows']['lm:1500:adamw']['best']['seeds']
  assert len(seeds) == 3 and all(s['wider']['1']['kept_lr'] == s['kept_lr'] for s in seeds)
  assert all(s['wider']['1']['final_metric'] == s['final_metric'] for s in seeds)


def test_heldout_cells_read_the_heldout_sweep_and_default_hdet():
  with open(os.path.join(exp.REPO, 'results', 'heldout', 'autolr.json')) as f:
    h = json.load(f)['sgd']
  cell = exp.sweep_cell('pystdlib:1500:sgd')
  assert cell['grid_best'] == {'value': h['grid_best']['val_bpb'], 'lr': 1.0}
  default = h['variants']['fit_K15_cap100_rollback_se2_f5_settle']
  assert {s: r['value'] for s, r in cell['hdet'].items()} == {s: default[s]['val_bpb'] for s in ('low', 'best', 'high')}
  assert exp.anchor_lr('pystdlib:1500:sgd', quick=False) == 0.5  # the first seed's best, as HDET's starts
  recs = {('low', s): _rec('low', s, 1.0, h['grid_best']['val_bpb'] * 1.02, anchor=0.5) for s in (0, 1, 2)}
  row = exp.cell_rows('pystdlib:1500:sgd', recs, quick=False)['low']
  assert row['gap'] == pytest.approx(0.02) and row['kept_x'] == pytest.approx([0.5] * 3)  # x the 3-seed best, 1.0


def test_heldout_corpus_refuses_another_file(tmp_path, monkeypatch):
  fake = tmp_path / 'pystdlib.txt'
  monkeypatch.setitem(exp.HELDOUT, 'pystdlib', str(fake))
  with pytest.raises(SystemExit, match='is missing'):
    exp.heldout_corpus('pystdlib')
  fake.write_text('print(1)\n')
  with pytest.raises(SystemExit, match='not the corpus the sweep was run on'):
    exp.heldout_corpus('pystdlib')


def test_heldout_cells_are_tallied_apart(tmp_path):
  row = lambda gap: {
    'n': 3,
    'value': 1.0,
    'finals': [1.0] * 3,
    'kept_x': [1.0] * 3,
    'wall_s': 1.0,
    'gap': gap,
    'hdet_gap': 0.03,
  }
  exp.write_report(
    str(tmp_path),
    {'lm:750:adamw': {'low': row(0.005)}, 'pystdlib:1500:adamw': {'low': row(0.002), 'best': row(0.02)}},
    quick=False,
  )
  saved = json.load(open(tmp_path / 'bracket_mode.json'))
  assert saved['_tally'] == {
    'within': 1,
    'hdet_within': 0,
    'total': 1,
    'heldout': {'within': 1, 'hdet_within': 0, 'total': 2},
  }
  md = open(tmp_path / 'bracket_mode.md').read()
  assert md.index('| lm:750:adamw |') < md.index('## On a corpus') < md.index('| pystdlib:1500:adamw |')
