"""research/start_rule.py: the two start rules of the guarded climb, read from the records (issue 84)."""

import json
import math
import os

from research import autolr
from research import records
from research import start_rule as exp
from research import workloads
from hdet_jax.trainer import config_lib, run_settings, schema


def _flat(config) -> dict:
  return config_lib.flatten(json.loads(config.to_json()) if hasattr(config, 'to_json') else config)


def test_rule_one_from_ten_times_high_is_the_defaults_run_there_but_for_its_start():
  """The committed run under rule 1 from 10x high trains the workloads study's default run from 10x high (the same
  schedule peak, seed and controller) with only the climb's start changed, 0.1 -> 1."""
  for workload, steps, optim in (('mnist1d', 500, 'adamw'), ('mnist1d', 1000, 'sgd')):
    ours = exp.own_cache(workload, steps, False, '').get(autolr.hdet_name(optim, exp.RULE1_VARIANT, 'high', 0))
    theirs = exp.sweep_cache(workload, steps, False, '').get(autolr.hdet_name(optim, exp.VARIANT, 'high', 0))
    a = _flat(ours['config'])
    # (a record written before 1.0 holds the fields removed then, and lacks those added since: read as data, at the
    # values its run trained with; fields that steer logging only are left out, as workloads.alias_quiet_run does)
    b = workloads.with_quiet_defaults(records.without_removed(_flat(theirs['config'])), a)
    differ = {k for k in set(a) | set(b) if a.get(k) != b.get(k) and schema.defines_a_run(k)}
    windows = differ & {'hdet.sync_every', 'hdet.num_syncs', 'hdet.longest_window'}
    if windows and run_settings.sync_windows(schema.complete(a)) == run_settings.sync_windows(
      schema.complete({**a, **{k: b[k] for k in windows}})
    ):
      differ -= windows  # the same windows, written another way (workloads.record_variant)
    assert differ == {'hdet.initial_scale'}, sorted(differ)
    assert (a['hdet.initial_scale'], b['hdet.initial_scale']) == (1.0, 0.1)
    anchor = autolr.read_anchor(exp.sweep_cache(workload, steps, False, ''), optim)
    assert a['optim.max_lr'] == b['optim.max_lr'] == 10 * anchor
    # (and the config this module would train today is that record's)
    # (fields added since it was written at the value its run trained with)
    today = _flat(exp.rule1_high_config(workload, steps, optim, 0, anchor, False))
    assert today == workloads.with_quiet_defaults(a, today)


def test_rule_one_from_low_and_best_are_rule_tenths_runs_from_best_and_high():
  """Where both rules were trained from every guess (the schedule study's LM at 750 steps), rule 1 given a guess
  ends where rule 0.1 given 10x that guess does: the same start, the runs apart by rounding only."""
  cell, alias = exp.schedule_cell()
  assert alias['pairs'] == 6 and alias['max_rel_diff'] < 1e-3
  for guess, src in exp.RULE1_FROM_RULE01.items():
    a, b = cell['rule']['1'][guess]['value'], cell['rule']['0.1'][src]['value']
    assert math.isclose(a, b, rel_tol=1e-3), (guess, a, b)


def test_the_summary_counts_and_medians():
  """Two hand-made cells: gaps +0.5% / +3% and +10% / one diverged run."""

  def st(v):
    return {'value': v, 'n': 3, 'diverged': 0 if v is not None else 1}

  cells = [
    {
      'workload': 'lm',
      'steps': 1,
      'optim': 'adamw',
      'best': 2.0,
      'rule': {r: {g: st(2.01) for g in exp.GUESSES} for r in exp.RULES},
    },
    {
      'workload': 'mnist1d',
      'steps': 1,
      'optim': 'sgd',
      'best': 1.0,
      'rule': {r: {g: st(1.1) for g in exp.GUESSES} for r in exp.RULES},
    },
  ]
  cells[0]['rule']['1']['high'] = st(2.06)
  cells[1]['rule']['1']['high'] = st(None)
  s = exp.summary(cells)
  low = s['0.1/low']
  assert (low['cells'], low['within_1pct']) == (2, 1)
  assert math.isclose(low['median'], (0.5 + 10.0) / 2) and math.isclose(low['worst'], 10.0)
  assert len(low['text']) == 1 and math.isclose(low['text'][0], 0.5)
  high = s['1/high']
  assert high['worst'] is None and high['worst_cell'] == 'mnist1d 1 sgd' and math.isclose(high['median'], 3.0)


def test_quick_trains_rule_one_from_ten_times_high_and_reports_it(tmp_path):
  exp.main(['--quick', '--workdir', str(tmp_path)])
  name = autolr.hdet_name('adamw', exp.RULE1_VARIANT, 'high', 0)
  with open(os.path.join(exp.records_dir('lm', 16, True, str(tmp_path)), name + '.json'), encoding='utf-8') as f:
    rec = json.load(f)
  assert rec['config']['hdet']['initial_scale'] == 1.0
  assert rec['config']['optim']['max_lr'] == 10 * exp.QUICK_ANCHOR and math.isfinite(rec['val_bpb'])
  saved = json.load(open(tmp_path / 'start_rule.json', encoding='utf-8'))
  (cell,) = saved['cells']
  assert cell['rule']['1']['high'] == {'value': rec['val_bpb'], 'n': 1, 'diverged': 0}
  exp.main(['--quick', '--workdir', str(tmp_path)])  # cached: nothing trains again, the same report
  assert json.load(open(tmp_path / 'start_rule.json', encoding='utf-8')) == saved
