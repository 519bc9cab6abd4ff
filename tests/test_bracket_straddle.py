"""experiments/bracket_straddle.py: the two bracket points nearest the sweep's best, trained as plain runs."""

import json
import math
import os

from experiments import bracket_straddle as exp
from hdet_jax.trainer import bracket


def test_the_neighbours_are_the_brackets_own_points_either_side_of_its_centre():
  got = exp.neighbour_lrs(0.06)
  assert math.isclose(got['below'], 0.06 / math.sqrt(2), rel_tol=1e-12)
  assert math.isclose(got['above'], 0.06 * math.sqrt(2), rel_tol=1e-12)
  points = bracket.point_lrs(0.06, 8, 2.0)
  assert got['below'] in points and got['above'] in points  # the same floats the bracket trains


def test_quick_trains_both_neighbours_and_reports_their_records(tmp_path):
  exp.main(['--quick', '--workdir', str(tmp_path)])
  recs = {}
  for side in exp.NEIGHBOURS:
    with open(os.path.join(exp.records_dir('lm:16:adamw', True, str(tmp_path)), f'{side}_s0.json'), encoding='utf-8') as f:
      recs[side] = json.load(f)
  want = exp.neighbour_lrs(0.01)  # the quick anchor
  for side, rec in recs.items():
    assert rec['config']['optim']['max_lr'] == want[side] and rec['config']['hdet']['spread'] == 0.0
    assert math.isfinite(rec['val_bpb'])
  saved = json.load(open(tmp_path / 'bracket_straddle.json', encoding='utf-8'))
  assert [r['neighbours'][s]['values'] for r in saved for s in exp.NEIGHBOURS] == [[recs['below']['val_bpb']],
                                                                                   [recs['above']['val_bpb']]]
  row = [l for l in open(tmp_path / 'bracket_straddle.md', encoding='utf-8') if l.startswith('| lm:16:adamw |')]
  assert row == [f'| lm:16:adamw | - | {recs["below"]["val_bpb"]:.4g} | - | {recs["above"]["val_bpb"]:.4g} | - | -, - |\n']
  exp.main(['--quick', '--workdir', str(tmp_path)])  # cached: nothing trains again, the same report
  assert json.load(open(tmp_path / 'bracket_straddle.json', encoding='utf-8')) == saved


def test_the_brackets_kept_runs_are_the_plain_runs_bit_for_bit():
  """The committed records: each mnist1d AdamW bracket from the best kept the point above it, trained in three calls
  (stopped at 0.1 and 0.3 of the run, resumed from checkpoints); its final metric is the plain run's at that LR, to
  the last bit (9 of 9 seeds and lengths)."""
  for cell in exp.CELLS:
    _, steps, _ = exp.bracket_mode.parse_cell(cell)
    for seed in exp.SEEDS:
      with open(exp.bracket_mode.record_path(cell, 'best', seed, False, ''), encoding='utf-8') as f:
        kept = json.load(f)
      with open(os.path.join(exp.records_dir(cell, False, ''), f'above_s{seed}.json'), encoding='utf-8') as f:
        plain = json.load(f)
      assert kept['kept_lr'] == plain['config']['optim']['max_lr'] == exp.neighbour_lrs(kept['anchor_lr'])['above']
      assert kept['final_metric'] == plain['val_bpb'], (cell, seed)
