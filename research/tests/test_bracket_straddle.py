"""research/bracket_straddle.py: the two bracket points nearest the sweep's best, trained as plain runs."""

import json
import math
import os

from research import bracket_straddle as exp
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
    with open(
      os.path.join(exp.records_dir('lm:16:adamw', True, str(tmp_path)), f'{side}_s0.json'), encoding='utf-8'
    ) as f:
      recs[side] = json.load(f)
  want = exp.neighbour_lrs(0.01)  # the quick anchor
  for side, rec in recs.items():
    assert rec['config']['optim']['max_lr'] == want[side] and rec['config']['hdet']['spread'] == 0.0
    assert math.isfinite(rec['val_bpb'])
  saved = json.load(open(tmp_path / 'bracket_straddle.json', encoding='utf-8'))
  assert [r['neighbours'][s]['values'] for r in saved['cells'] for s in exp.NEIGHBOURS] == [
    [recs['below']['val_bpb']],
    [recs['above']['val_bpb']],
  ]
  row = [
    line for line in open(tmp_path / 'bracket_straddle.md', encoding='utf-8') if line.startswith('| lm:16:adamw |')
  ]
  assert row == [
    f'| lm:16:adamw | - | {recs["below"]["val_bpb"]:.4g} | - | {recs["above"]["val_bpb"]:.4g} | - | -, - |\n'
  ]
  # The probe: the point below the centre under the quick bracket's config, to its one rung, and its loss there
  # recomputed from the run's own metrics by the bracket's statistic (a 3-step mean) in the probe's record.
  probe = json.load(open(exp.probe_path('lm:16:adamw', 0, True, str(tmp_path)), encoding='utf-8'))
  assert probe['lr'] == want['below'] and probe['rung_steps'] == [8] and len(probe['losses']) == 1
  assert math.isfinite(probe['losses'][0]) and saved['probes'][0]['losses'] == probe['losses']
  assert (
    f'| lm:16:adamw, best, 0 | - | - | {probe["losses"][0]:.4f} / - |' in open(tmp_path / 'bracket_straddle.md').read()
  )
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


def test_every_committed_bracket_is_counted_once_by_where_it_kept_among_the_first_rungs_survivors():
  counts = exp.edge_counts()
  files = {}
  for path in exp.glob.glob(os.path.join(exp.REPO, 'results', 'bracket_mode', 'runs', '*', '*', '*', '*.json')):
    start = os.path.basename(path).rsplit('_s', 1)[0]
    files[start] = files.get(start, 0) + 1
  assert {start: sum(c.values()) for start, c in counts.items()} == files
  # mnist1d with AdamW from the best: its first rung kept 1.41-11.3x and the last the lowest of them, 1.41x, with
  # 0.71x cut just below (9 seeds and lengths; the test above reads the same records).
  assert counts['best']['cut_below'] >= 9
  assert all(set(c) == set(exp.EDGES) for c in counts.values())


def test_the_probe_is_the_point_just_below_a_kept_lowest_survivor_and_nothing_else():
  """From the committed brackets: mnist1d AdamW at 1000 steps kept 1.41x, the lowest of 1.41-11.3x, so the probe is
  0.71x; the LM at 1500 steps, seed 0, kept an inner survivor (0.71x of 0.35-2.83x): no probe; seed 1 kept 0.71x, the
  lowest of 0.71-5.66x: the probe is 0.35x."""
  anchor = exp.bracket_mode.anchor_lr('mnist1d:1000:adamw', False)
  assert exp.probe_lr('mnist1d:1000:adamw', 0, False, '') == exp.neighbour_lrs(anchor)['below']
  assert exp.probe_lr('lm:1500:adamw', 0, False, '') is None
  lm = exp.bracket_mode.anchor_lr('lm:1500:adamw', False)
  assert math.isclose(exp.probe_lr('lm:1500:adamw', 1, False, ''), lm * 2.0**-1.5, rel_tol=1e-12)
  assert exp.probe_lr('lm:1500:adamw', 1, False, '') in bracket.point_lrs(lm, 8, 2.0)
  # From 10x high, mnist1d AdamW at 1000 steps kept its second-lowest point, the lowest survivor: the probe is the
  # bracket's lowest point; the LM at 1500 steps kept its lowest point itself: nothing below to probe.
  high = bracket.point_lrs(anchor * 10.0, 8, 2.0)
  assert exp.probe_lr('mnist1d:1000:adamw', 0, False, '', 'high') == high[0]
  assert exp.probe_lr('lm:1500:adamw', 0, False, '', 'high') is None
