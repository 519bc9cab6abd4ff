"""research/archive/last_rung.py: the default bracket's last-rung runner-up, and what 3 seeds resolve; its quick run
builds on wider_rung's quick bracket (about 40 s)."""

import json
import math
import os
import statistics

import pytest

from research import bracket_mode
from research.archive import last_rung as exp
from research import wider_rung


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


@pytest.fixture(scope='module')
def quick(tmp_path_factory):
  """wider_rung's quick bracket, which last_rung's quick run builds on."""
  work = str(tmp_path_factory.mktemp('wider_rung'))
  wider_rung.main(['--quick', '--workdir', work])
  return work


def test_last_rung_quick_trains_the_runner_up_to_the_end(quick):
  """research.last_rung --quick on this quick bracket (cached: only the runner-up's end trains)."""
  work = quick
  exp.main(['--quick', '--workdir', work])
  cell = wider_rung.QUICK_CELL
  with open(bracket_mode.record_path(cell, 'best', 0, True, work), encoding='utf-8') as f:
    rec = json.load(f)
  # The default's last rung: the bracket's first-rung survivors and the first added point, ranked by their losses
  # there (the record's and the probe's); the runner-up is the lowest but the kept point.
  extra = wider_rung.extra_points(rec)[0]
  with open(wider_rung.probe_path(cell, 'best', 0, extra, True, work), encoding='utf-8') as f:
    last = {extra: json.load(f)['losses'][-1]}
  last.update({lr: rec['rungs'][-1]['losses'][f'{lr:.6g}'] for lr in rec['rungs'][0]['kept']})
  ranked = sorted(last, key=lambda lr: (last[lr], lr))
  saved = json.load(open(os.path.join(work, 'last_rung.json'), encoding='utf-8'))
  seed = saved['rows'][cell]['best']['seeds'][0]
  assert seed['kept_lr'] == ranked[0] and seed['runner_up_lr'] == ranked[1]
  with open(wider_rung.end_path(cell, 'best', 0, ranked[1], True, work), encoding='utf-8') as f:
    assert seed['runner_up_final'] == json.load(f)['final_metric']
  assert math.isfinite(seed['runner_up_final']) and seed['runner_up_final'] != seed['final_metric']
