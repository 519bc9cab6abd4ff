"""research/library_rollback.py: the cells it reruns are committed records of the default HDET, each rerun takes its
record's own config, and the report counts what is bit for bit equal and where the back-off fired."""

import copy

import pytest

from research import autolr
from research import library_rollback as L


def test_every_cell_is_a_committed_record_of_the_default_where_the_backoff_never_fired():
  assert len(L.CELLS) == 6 and len({L.run_name(w, v, st, s) for w, _, v, st, s in L.CELLS}) == 6
  for workload, steps, variant, start, seed in L.CELLS:
    assert variant == autolr.DEFAULT_VARIANT
    rec = L.committed(workload, steps, variant, start, seed)
    assert rec['config']['num_train_steps'] == steps and rec['config']['seed'] == seed
    assert rec['config']['hdet']['rollback'] in (True, None)  # the guard's rollback on (None: wherever it applies)
    assert L.backoffs(rec) == []  # why the move is checked where it fires in the side by side runs and the tests


def test_a_rerun_takes_its_records_config_and_only_the_warm_start_moves():
  from hdet_jax.trainer import config_lib, schema

  from research import records

  rec = L.committed('finetune', 300, autolr.DEFAULT_VARIANT, 'high', 1)
  config = L.config_of(rec, quick=False, init_from='/elsewhere/pretrain')
  # every field the record holds, and one added since at its legacy value (what that run trained with)
  got, want = config_lib.flatten(config), schema.complete(records.without_removed(config_lib.flatten(rec['config'])))
  assert got['init_from'] == '/elsewhere/pretrain'
  assert {k: v for k, v in got.items() if k != 'init_from'} == {k: v for k, v in want.items() if k != 'init_from'}


def _cell(old_bpb, new_bpb, fired=()):
  rec = {'val_bpb': old_bpb, 'controller': [{'step': s, 'backed_off': True} for s in fired] + [{'step': 1}]}
  new = None if new_bpb is None else {**copy.deepcopy(rec), 'val_bpb': new_bpb, 'machine': {'cpu': 'x'}}
  return {'workload': 'lm', 'steps': 1500, 'variant': 'v', 'start': 'high', 'seed': 0, 'trainer': rec, 'library': new}


def test_the_summary_counts_bit_for_bit_equal_runs_and_the_backoffs():
  cells = {'a': _cell(2.0, 2.0), 'b': _cell(2.1, 2.1 + 1e-12, fired=(99,)), 'c': _cell(1.9, None)}
  got = L.summarize(cells, quick=False)
  assert (got['trained'], got['equal'], got['with_backoff']) == (2, 1, 1)
  assert got['max_abs_diff'] == pytest.approx(1e-12, rel=1e-3)
  rows = {r['run']: r for r in got['runs']}
  assert rows['b']['backoffs_trainer'] == [99] and rows['b']['backoffs_library'] == [99]
  assert rows['c']['library_rollback'] is None and rows['c']['equal'] is None
  assert rows['a']['seed_std'] is None and rows['a']['within_noise'] is None  # (no committed seeds for variant 'v')


def test_within_noise_is_within_the_95_percent_band_of_two_runs_of_the_records_three_seeds():
  import numpy as np

  values = [L.committed('finetune', 300, autolr.DEFAULT_VARIANT, 'high', s)['val_bpb'] for s in L.SEEDS]
  spread = L.seed_spread('finetune', 300, autolr.DEFAULT_VARIANT, 'high')
  assert spread == pytest.approx(np.std(values, ddof=1), rel=1e-12) and spread > 0
  band = 2.0 * np.sqrt(2.0) * spread
  cell = {**_cell(values[0], values[0] + 0.99 * band), 'workload': 'finetune', 'steps': 300}
  cell['variant'] = autolr.DEFAULT_VARIANT
  far = {**cell, 'library': {**cell['library'], 'val_bpb': values[0] - 1.01 * band}}
  got = L.summarize({'near': cell, 'far': far}, quick=False)
  assert [r['within_noise'] for r in got['runs']] == [True, False] and got['within_noise'] == 1
