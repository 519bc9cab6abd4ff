"""experiments/heldout_task.py: the sweep, the default HDET and the default bracket on a CNN size and data draw
no default was chosen on; the narrower bracket read from the same runs."""

import json
import os

import numpy as np
import pytest

from experiments import heldout_task as exp


def test_the_pinned_bracket_is_the_default_one():
  from hdet_jax.trainer import config_lib
  default = config_lib.load_config_file(os.path.join(exp.REPO, 'configs', 'default.py'))
  assert {f'bracket.{k}': v for k, v in default.bracket.to_dict().items() if k != 'points'} == \
      {k: v for k, v in exp.BRACKET.items() if k != 'bracket.points'}
  assert exp.BRACKET['bracket.points'] == 8


def test_the_narrower_bracket_ranks_the_first_rungs_best_again_at_the_last():
  rec = {'kept_lr': 0.4, 'rungs': [
      {'losses': {'0.1': 3.0, '0.2': 1.0, '0.4': 2.0, '0.8': 1.5, '1.6': 9.0}, 'kept': [0.2, 0.4, 0.8]},
      {'losses': {'0.2': 0.9, '0.4': 0.5, '0.8': 0.7}, 'kept': [0.4]}]}
  assert exp.narrower_kept(rec) == 0.8  # 0.4 (third at the first rung) is out; of 0.2 and 0.8, 0.8 leads at the last
  rec['rungs'][1]['losses']['0.2'] = 0.6
  assert exp.narrower_kept(rec) == 0.2


def test_quick_trains_the_sweep_hdet_and_the_bracket_and_reads_the_narrower_one(tmp_path):
  work = str(tmp_path)
  exp.main(['--quick', '--workdir', work])
  grid = {lr: exp.load(exp.grid_name(lr, 0), True, work)['final_metric'] for lr in exp.plan(True)['grid']}
  best_lr = min(grid, key=grid.get)
  assert exp.anchor_lr(True, work) == best_lr
  b = exp.load('bracket_best_s0', True, work)
  np.testing.assert_allclose(b['lrs'], [best_lr * 2.0 ** (k - 2) for k in range(5)], rtol=1e-12)
  # The narrower bracket: numpy's ranking of the first rung's losses, its best one fewer than kept, argmin at the last.
  first, last = b['rungs'][0], b['rungs'][1]
  order = sorted(b['lrs'], key=lambda lr: (first['losses'][f'{lr:.6g}'], lr))
  assert sorted(order[:2]) == first['kept']
  want = min(order[:1], key=lambda lr: (last['losses'][f'{lr:.6g}'], lr))
  assert exp.narrower_kept(b) == want
  with open(tmp_path / 'heldout_task.json', encoding='utf-8') as f:
    r = json.load(f)
  row = r['starts']['best']
  assert r['best'] == min(grid.values()) and row['bracket'] == b['final_metric']
  assert row['bracket_gap'] == pytest.approx(b['final_metric'] / r['best'] - 1, rel=1e-12)
  hdet = exp.load('hdet_best_s0', True, work)
  assert row['hdet_gap'] == pytest.approx(hdet['final_metric'] / r['best'] - 1, rel=1e-12)
  if want == b['kept_lr']:
    assert row['narrower'] == b['final_metric']
  else:  # its kept run, trained to the end as the bracket's own point would be
    ends = [n for n in os.listdir(os.path.join(work, 'records')) if n.startswith('end_')]
    assert len(ends) == 1 and row['narrower'] == exp.load(ends[0][:-5], True, work)['final_metric']
  # Cached: a rerun trains nothing and reports the same.
  before = sorted(os.listdir(os.path.join(work, 'records')))
  exp.main(['--quick', '--workdir', work])
  assert sorted(os.listdir(os.path.join(work, 'records'))) == before
  with open(tmp_path / 'heldout_task.json', encoding='utf-8') as f:
    assert json.load(f) == r
