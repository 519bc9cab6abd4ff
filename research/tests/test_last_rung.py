"""research/last_rung.py: the default bracket's last-rung runner-up, and what 3 seeds resolve."""

import json
import math
import os
import statistics

import pytest

from research import bracket_mode
from research import last_rung as exp
from research import records
from research import wider_rung


def test_paired_gap_is_the_ratio_of_means_with_the_per_seed_standard_error():
  values, reference = [1.1, 2.2, 2.9], [1.0, 2.0, 3.0]
  gap, se = records.paired_gap(values, reference)
  per_seed = [v / r - 1 for v, r in zip(values, reference)]  # 0.1, 0.1, -1/30
  assert gap == pytest.approx(6.2 / 6.0 - 1)
  assert se == pytest.approx(statistics.stdev(per_seed) / math.sqrt(3))
  assert records.paired_gap([1.0], [2.0]) == (pytest.approx(-0.5), None)  # (one seed: no standard error)
  assert records.paired_gap([1.0, None], [1.0, 1.0]) == (None, None)
  assert records.paired_gap([1.0, 1.0], [1.0]) == (None, None)


@pytest.mark.parametrize(
  'gap, se, expected',
  [
    (0.01, 0.5, 'within'),
    (-0.2, None, 'within'),
    (0.05, 0.019, 'miss'),
    (0.05, 0.021, 'not resolved'),
    (0.05, None, 'not resolved'),
  ],
)
def test_verdict_thresholds(gap, se, expected):
  assert exp.verdict({'gap': gap, 'se': se}) == expected


def test_committed_report_recomputes_from_the_raw_records():
  """Each committed row: its gaps recomputed with plain Python from the bracket's composition, the end records and
  the sweep's grid records at its best LR."""
  path = os.path.join(exp.REPO, 'results', 'last_rung.json')
  with open(path, encoding='utf-8') as f:
    rows = json.load(f)['rows']
  assert rows
  for cell, starts in rows.items():
    workload, steps, optim = bracket_mode.parse_cell(cell)
    lr = bracket_mode.sweep_cell(cell)['grid_best']['lr']
    sweep = []
    for s in bracket_mode.SEEDS:
      grid = os.path.join(
        exp.workloads.records_dir(workload, steps, False, ''), f'{exp.autolr.grid_name(optim, lr, s)}.json'
      )
      with open(grid, encoding='utf-8') as f:
        sweep.append(json.load(f)['val_bpb'])
    with open(os.path.join(exp.REPO, 'results', 'wider_rung.json'), encoding='utf-8') as f:
      composed = json.load(f)['rows'][cell]
    for start, r in starts.items():
      kept = [composed[start]['seeds'][i]['wider'][str(exp.K)] for i in range(3)]
      assert [g['kept_lr'] for g in r['seeds']] == [k['kept_lr'] for k in kept]
      finals = [g['final_metric'] for g in r['seeds']]
      assert r['kept']['gap'] == pytest.approx(sum(finals) / sum(sweep) - 1, rel=1e-9)
      per_seed = [f / s - 1 for f, s in zip(finals, sweep)]
      assert r['kept']['se'] == pytest.approx(statistics.stdev(per_seed) / math.sqrt(3), rel=1e-9)
      for g in r['seeds']:
        assert g['runner_up_lr'] != g['kept_lr']
        if g['reproduced'] and g['runner_up_final'] is not None:
          with open(wider_rung.end_path(cell, start, g['seed'], g['runner_up_lr'], False, ''), encoding='utf-8') as f:
            assert g['runner_up_final'] == json.load(f)['final_metric']


def test_the_eight_seed_rows_recompute_from_the_raw_records():
  """The committed 8-seed comparison: the sweep's best over the LRs recorded on all 8 seeds, and each start's
  bracket finals (seeds 0-2 the compositions', 3-7 the fresh brackets' records), recomputed with plain Python."""
  with open(os.path.join(exp.REPO, 'results', 'last_rung.json'), encoding='utf-8') as f:
    saved = json.load(f)
  eight = saved['eight_seeds']
  assert sorted(eight) == sorted(exp.EIGHT_SEED_CELLS)
  seeds = list(range(8))
  for cell, e in eight.items():
    workload, steps, optim = bracket_mode.parse_cell(cell)
    means = {}
    for lr in bracket_mode.sweep_cell(cell)['grid']:
      paths = [
        os.path.join(
          exp.workloads.records_dir(workload, steps, False, ''), f'{exp.autolr.grid_name(optim, float(lr), s)}.json'
        )
        for s in seeds
      ]
      if all(os.path.exists(p) for p in paths):
        means[float(lr)] = [json.load(open(p, encoding='utf-8'))['val_bpb'] for p in paths]
    best = min(means, key=lambda lr: sum(means[lr]))
    assert e['sweep_lr'] == best and e['sweep'] == means[best] and len(means) >= 3
    assert set(e['starts']) == {'low', 'best', 'high'}
    for start, r in e['starts'].items():
      first = [s['final_metric'] for s in saved['rows'][cell][start]['seeds']]
      fresh = []
      for s in seeds[3:]:
        with open(exp.fresh_path(cell, start, s), encoding='utf-8') as f:
          rec = json.load(f)
        assert rec['seed'] == s and rec['cell'] == cell and rec['start'] == start
        assert len(rec['lrs']) == 8 and len(rec['rungs'][0]['kept']) == 5  # the default bracket, 8-5-1
        fresh.append(rec['final_metric'])
      assert r['finals'] == first + fresh
      assert r['gap'] == pytest.approx(sum(r['finals']) / sum(means[best]) - 1, rel=1e-9)
      per_seed = [f / w - 1 for f, w in zip(r['finals'], means[best])]
      assert r['se'] == pytest.approx(statistics.stdev(per_seed) / math.sqrt(8), rel=1e-9)
      hdet = [
        json.load(
          open(
            os.path.join(
              exp.workloads.records_dir(workload, steps, False, ''),
              f'{exp.autolr.hdet_name(optim, exp.autolr.DEFAULT_VARIANT, start, s)}.json',
            ),
            encoding='utf-8',
          )
        )['val_bpb']
        for s in seeds
      ]
      assert r['hdet']['finals'] == hdet
      assert r['hdet']['gap'] == pytest.approx(sum(hdet) / sum(means[best]) - 1, rel=1e-9)
