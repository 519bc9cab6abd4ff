"""research/climb_and_price.py: where the line search turns and the ensemble's price, from designed records."""

import json
import math
import os

import numpy as np

from research import autolr_report
from research.archive import climb_and_price as cp
from hdet_jax.trainer import config_lib
from research import records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
RHO = np.linspace(0.75, 1.25, 8)


def _config(**overrides):
  c = records.load_config(os.path.join(ROOT, 'configs', 'default.py'))
  config_lib.with_overrides(c, {'num_train_steps': 400, 'optim.schedule': 'constant', **overrides})
  return json.loads(c.to_json())


def _write(folder, name, rec):
  os.makedirs(os.path.join(folder, 'adamw'), exist_ok=True)
  with open(os.path.join(folder, 'adamw', name + '.json'), 'w', encoding='utf-8') as f:
    json.dump({'diverged_at': None, 'hyperparams': ['learning_rate'], **rec}, f)


def test_the_turn_is_where_the_asks_split_and_the_price_is_paired(tmp_path):
  """Six 'fit' runs at 0.1x ... 3.2x the sweep's best (constant) LR: those at or below 0.4x see losses fall with
  the LR offset (asking up), those above see them rise, at every sync, so the split is 0.4x-0.8x at each sync and
  typically sqrt(0.4 * 0.8). A T=25 run and a run of the paper's controller are left out, and a second variant's
  record of the same run counts once. The price is each seed's
  ensemble value against plain at the same LR and seed, and the distances are the records' own."""
  folder = str(tmp_path)
  best = 0.01
  for lr, value in ((0.005, 2.1), (best, 2.0), (0.02, 2.05)):
    for seed in (0, 1):
      _write(
        folder,
        f'grid_lr{lr}_s{seed}',
        {'config': _config(**{'optim.max_lr': lr, 'seed': seed}), 'val_bpb': value + 0.01 * seed},
      )
  fit = {'hdet.auto_lr': True, 'hdet.controller': 'fit', 'hdet.score': 'common', 'hdet.sync_every': 100}
  for i, multiple in enumerate((0.1, 0.2, 0.4, 0.8, 1.6, 3.2)):
    slope = -0.3 if multiple <= 0.4 else 0.2
    ctrl = [
      {'step': s, 'values': [list(best * multiple * RHO)], 'window_losses': list(1.0 + slope * (RHO - 1))}
      for s in (99, 199, 299, 399)
    ]
    _write(folder, f'hdet_fit_{i}_s0', {'config': _config(**fit), 'val_bpb': 2.0, 'controller': ctrl})
    if i == 0:  # another variant's record of the same run (its extra rule never fired): counted once
      _write(
        folder,
        f'hdet_fit_guarded_{i}_s0',
        {
          'config': _config(**fit, **{'hdet.backoff': True}),
          'val_bpb': 2.0,
          'controller': [{**c, 'train_loss': 1.0} for c in ctrl],
        },
      )
  for name, extra in (('t25', {'hdet.sync_every': 25}), ('paper', {'hdet.controller': 'paper'})):
    ctrl = [
      {'step': s, 'values': [list(100 * best * RHO)], 'window_losses': list(1.0 - 0.3 * (RHO - 1))}
      for s in (99, 199, 299, 399)
    ]
    _write(folder, f'hdet_{name}_s0', {'config': _config(**{**fit, **extra}), 'val_bpb': 2.0, 'controller': ctrl})
  climb = cp.climb_end(folder, 'adamw', min_runs=6)
  assert climb['sweep_best_lr'] == best and climb['runs'] == 6  # the runs it pools: not the paper's, nor T=25's
  assert [s['step'] for s in climb['splits']] == [99, 199, 299, 399]
  for s in climb['splits']:
    np.testing.assert_allclose([s['low'], s['high']], [0.4, 0.8], rtol=1e-6)
    assert s['misplaced'] == 0 and s['n'] == 6 and s['up'] == 3
  np.testing.assert_allclose(climb['typical_split'], math.sqrt(0.4 * 0.8), rtol=1e-6)
  # Asks with no order in the LR (one up and one down at the same LR): every split misplaces one.
  tie = autolr_report.ask_threshold([(1.0, True), (1.0, False)])
  assert (tie['low'], tie['high']) == (None, None) and cp._fmt_split(tie) == 'no split (1 of 2 misplaced)'

  ens = {'hdet.auto_lr': False, 'hdet.spread': 0.25, 'hdet.sync_every': 100, 'optim.max_lr': best}
  for seed, value, dist in ((0, 2.02, [0.03, 0.01]), (1, 2.0, [0.05, 0.02])):
    _write(
      folder,
      f'hdet_ensemble_a0p25_T100_best_s{seed}',
      {
        'config': _config(**{**ens, 'seed': seed}),
        'val_bpb': value,
        'distance': [{'step': 99, 'relative': dist[0]}, {'step': 199, 'relative': dist[1]}],
      },
    )
  got = cp.price(folder, 'adamw')['ensemble_a0p25_T100']
  want = [100 * (2.02 / 2.0 - 1), 100 * (2.0 / 2.01 - 1)]
  np.testing.assert_allclose(got['pct'], want, rtol=1e-9)
  np.testing.assert_allclose(got['mean_pct'], np.mean(want), rtol=1e-9)
  np.testing.assert_allclose(got['se_pct'], np.std(want, ddof=1) / math.sqrt(2), rtol=1e-9)
  assert (got['spread'], got['T'], got['seeds']) == (0.25, 100, [0, 1])
  np.testing.assert_allclose([got['distance_last'], got['distance_mean']], [0.015, 0.0275], rtol=1e-9)
  paths = cp.write_report(
    str(tmp_path / 'out'), {'lm': {'400': {'adamw': {'climb': climb, 'price': {'x': got}}}}}, False
  )
  report = open(paths[1], encoding='utf-8').read()
  assert '| lm | 400 | adamw | 0.01 | 6 | 100: 0.4-0.8 (n=6);' in report and '| 0.57x |' in report
  assert f'| lm | 400 | adamw | 0.25 | 100 | {np.mean(want):+.2f}% ±' in report
  # With the spread-0 control: each price less the control's, the standard errors added in quadrature.
  _write(
    folder,
    'hdet_ensemble_a0_T100_best_s0',
    {'config': _config(**{**ens, 'hdet.spread': 0.0, 'seed': 0}), 'val_bpb': 2.001, 'distance': []},
  )
  _write(
    folder,
    'hdet_ensemble_a0_T100_best_s1',
    {'config': _config(**{**ens, 'hdet.spread': 0.0, 'seed': 1}), 'val_bpb': 2.012, 'distance': []},
  )
  both = cp.price(folder, 'adamw')
  floor = [100 * (2.001 / 2.0 - 1), 100 * (2.012 / 2.01 - 1)]
  assert both['ensemble_a0_T100']['spread'] == 0.0 and both['ensemble_a0_T100']['distance_last'] is None
  report = open(
    cp.write_report(str(tmp_path / 'out2'), {'lm': {'400': {'adamw': {'climb': None, 'price': both}}}}, False)[1],
    encoding='utf-8',
  ).read()
  diff = np.subtract(want, floor)
  assert f'| 0.015 / 0.0275 | {diff.mean():+.2f}% ± {diff.std(ddof=1) / math.sqrt(2):.2f} (n=2) |' in report
  # Paired by seed: a control on seeds the price did not run is not used.
  np.testing.assert_allclose(
    cp.above_control({'seeds': [0, 1, 2], 'pct': [1.0, 2.0, 3.0]}, {'seeds': [1, 2, 5], 'pct': [0.5, -1.0, 9.0]}),
    [1.5, 4.0],
  )


def test_landings_class_the_defaults_runs_by_the_guard_and_the_peak_over_the_sweeps_best(tmp_path):
  """The default variant's runs (another variant's, e.g. its tail screen, left out) by where the climb went: a run
  whose guard fired is 'guard fired' whatever its peak; the others by peak base LR / the sweep's best LR (0.01,
  the grid point with the best mean); misses against that mean (2.0), a diverged run +inf; numpy's median."""
  from research import autolr

  folder, v = str(tmp_path), autolr.DEFAULT_VARIANT
  for lr, value in ((0.005, 2.1), (0.01, 2.0), (0.02, 2.05)):
    _write(folder, f'grid_lr{lr}_s0', {'config': _config(**{'optim.max_lr': lr}), 'val_bpb': value})
  runs = [
    ('low_s0', [0.001, 0.004], False, 2.2),
    ('low_s1', [0.002, 0.006], False, 2.1),  # 0.4x, 0.6x
    ('best_s0', [0.01, 0.015], False, 2.01),
    ('best_s1', [0.01, 0.03], True, 2.4),  # 1.5x; fired
    ('high_s0', [0.01, 0.025], False, None),
  ]  # 2.5x, diverged
  for name, bases, fired, value in runs:
    _write(
      folder,
      f'hdet_{v}_{name}',
      {
        'config': _config(),
        'val_bpb': value,
        'trajectory': [{'step': i, 'bases': [b]} for i, b in enumerate(bases)],
        'controller': [{'step': 1, 'backed_off': fired}],
      },
    )
  _write(
    folder,
    f'hdet_{v}_tail25_best_s0',
    {'config': _config(), 'val_bpb': 9.0, 'trajectory': [{'step': 0, 'bases': [1.0]}], 'controller': []},
  )
  # A run on a seed outside the sweep's (autolr.SEEDS) is fresh_seeds' to compare, not the landings'.
  _write(
    folder,
    f'hdet_{v}_best_s5',
    {'config': _config(**{'seed': 5}), 'val_bpb': 2.0, 'trajectory': [{'step': 0, 'bases': [0.01]}], 'controller': []},
  )
  got = cp.landings(folder, 'adamw')
  assert got['sweep_best_lr'] == 0.01 and got['runs'] == 5
  c = got['classes']
  assert {k: c[k]['n'] for k in c} == {'guard fired': 1, 'below 0.5x': 1, '0.5-2x': 2, 'above 2x': 1}
  np.testing.assert_allclose(c['0.5-2x']['misses'], [0.5, 5.0], rtol=1e-9)
  np.testing.assert_allclose(
    [c['0.5-2x']['median_pct'], c['guard fired']['median_pct'], c['below 0.5x']['median_pct']],
    [2.75, 20.0, 10.0],
    rtol=1e-9,
  )
  assert c['above 2x']['misses'] == [math.inf] and c['0.5-2x']['within_1pct'] == 1
  report = open(
    cp.write_report(
      str(tmp_path / 'out'), {'lm': {'400': {'adamw': {'climb': None, 'price': {}, 'landings': got}}}}, False
    )[1],
    encoding='utf-8',
  ).read()
  assert (
    '| lm | 400 | adamw | 5 | 1: +20.0%, 0 within 1% | 1: +10.0%, 0 within 1% | 2: +2.7%, 1 within 1% | 1: +inf%, 0 '
    'within 1% |' in report
  )


def test_the_sweeps_best_is_chosen_on_its_own_seeds_and_rerun_on_fresh_ones(tmp_path):
  """The sweep's best (LR and mean) comes from seeds 0-2 only, though seeds 3-4 ran too (and are better at 0.005,
  which would move the choice); the fresh seeds' means per LR around it, the rerun's difference against the sweep's
  best, and the fresh seeds' own best LR. The landing table's and the price's references stay on seeds 0-2."""
  folder = str(tmp_path)
  table = {
    0.005: ([2.10, 2.12, 2.11], [1.90, 1.92]),
    0.01: ([2.00, 2.01, 1.99], [2.05, 2.07]),
    0.02: ([2.05, 2.06, 2.04], [2.02, 2.04]),
  }
  for lr, (sweep, fresh) in table.items():
    for seed, value in enumerate(sweep + fresh):
      _write(
        folder, f'grid_lr{lr}_s{seed}', {'config': _config(**{'optim.max_lr': lr, 'seed': seed}), 'val_bpb': value}
      )
  from research import autolr

  # The default's runs (another variant's not): 'low' on seeds 0-1 only, 'best' on 0-1 and on the fresh 3-4.
  for start, values in (('low', {0: 2.2, 1: 2.3}), ('best', {0: 2.06, 1: 2.10, 3: 2.0, 4: 2.16})):
    for seed, value in values.items():
      _write(
        folder,
        f'hdet_{autolr.DEFAULT_VARIANT}_{start}_s{seed}',
        {'config': _config(**{'seed': seed}), 'val_bpb': value},
      )
  _write(folder, f'hdet_{autolr.DEFAULT_VARIANT}_tail25_best_s0', {'config': _config(), 'val_bpb': 9.0})
  got = cp.fresh_seeds(folder, 'adamw')
  assert (got['sweep_best_lr'], got['n_sweep'], got['fresh_best_lr']) == (0.01, 3, 0.005)
  np.testing.assert_allclose(got['sweep_best'], 2.0, rtol=1e-12)
  np.testing.assert_allclose(
    [got['fresh'][k]['mean'] for k in ('0.005', '0.01', '0.02')], [1.91, 2.06, 2.03], rtol=1e-12
  )
  assert got['fresh']['0.01']['seeds'] == [3, 4]
  np.testing.assert_allclose(got['rerun_pct'], 100 * (2.06 / 2.0 - 1), rtol=1e-9)
  assert sorted(int(r['config']['seed']) for r in cp._grid(folder, 'adamw')[0.005]) == [0, 1, 2]
  assert set(got['hdet']) == {'low', 'best'}
  assert (got['hdet']['low']['n_fresh'], got['hdet']['low']['vs_rerun_pct']) == (0, None)
  assert (got['hdet']['best']['n'], got['hdet']['best']['n_fresh']) == (2, 2)
  np.testing.assert_allclose(
    [got['hdet']['low']['vs_sweep_pct'], got['hdet']['best']['vs_sweep_pct'], got['hdet']['best']['vs_rerun_pct']],
    [100 * (2.25 / 2.0 - 1), 100 * (2.08 / 2.0 - 1), 100 * (2.08 / 2.06 - 1)],
    rtol=1e-9,
  )
  report = open(
    cp.write_report(
      str(tmp_path / 'out'),
      {'lm': {'400': {'adamw': {'climb': None, 'price': {}, 'landings': None, 'fresh': got}}}},
      False,
    )[1],
    encoding='utf-8',
  ).read()
  assert (
    '| lm | 400 | adamw | 2 at 0.01 (n=3) | 0.005: 1.91 (n=2); 0.01: 2.06 (n=2); 0.02: 2.03 (n=2) | +3.0% | 0.005 '
    '| +12.5% (n=2) / +4.0% (n=2) / - | - / +1.0% (n=2) / - |'
  ) in report


def test_window_turns_find_the_first_ask_down_per_window_length_and_start(tmp_path):
  """Per (T, start): the first sync whose ask is negative (1-based), its base LR and the run's peak over the sweep's
  best LR (0.01; geometric means over runs), the mean miss against the sweep's mean (2.0); T is the first sync's
  step + 1. A run that never turned counts in 'runs' but not in 'turned'; another variant's records (the tail
  screen) and a duplicate of a run (the same compared losses) are left out."""
  from research import autolr

  folder, v = str(tmp_path), autolr.DEFAULT_VARIANT
  _write(folder, 'grid_lr0.01_s0', {'config': _config(**{'optim.max_lr': 0.01}), 'val_bpb': 2.0})

  def run(asks, bases, value, T):
    ctl = [
      {
        'step': T * (i + 1) - 1,
        'asks': [a],
        'base_lr': b,
        'window_losses': [float(i), a, b],
        **({'settled': [True]} if i and asks[i - 1] < 0 and a <= 0 else {}),
      }
      for i, (a, b) in enumerate(zip(asks, bases))
    ]
    return {
      'config': _config(),
      'val_bpb': value,
      'controller': ctl,
      'trajectory': [{'step': c['step'], 'bases': [c['base_lr']]} for c in ctl],
    }

  _write(folder, f'hdet_{v}_low_s0', run([0.5, 0.3, -0.1, -0.2], [0.001, 0.002, 0.004, 0.008], 2.02, 100))
  _write(folder, f'hdet_{v}_low_s1', run([0.5, 0.3, 0.2, -0.3], [0.001, 0.003, 0.009, 0.009], 2.04, 100))
  _write(
    folder, f'hdet_{v}_low_s2', run([0.5, 0.3, -0.1, -0.2], [0.001, 0.002, 0.004, 0.008], 2.02, 100)
  )  # the same run again under another name
  _write(folder, f'hdet_{v}_T50_best_s0', run([0.4, 0.1, 0.2], [0.01, 0.02, 0.05], 2.5, 50))  # never turned
  _write(folder, f'hdet_{v}_tail25_best_s0', run([-1.0], [1.0], 9.0, 100))
  annealed = run([0.5, 0.3, 0.2, -0.3], [0.001, 0.003, 0.009, 0.0091], 2.04, 100)
  annealed['config']['hdet']['score_anneal'] = 0.2  # low_s1's run scored after an anneal: a cell of its own
  _write(folder, f'hdet_{v}_anneal20_low_s1', annealed)
  got = cp.window_turns(folder, 'adamw')
  assert got['sweep_best_lr'] == 0.01
  (a100,) = [c for c in got['cells'] if c['anneal'] == 0.2]
  assert (a100['T'], a100['start'], a100['n'], a100['turn_sync']) == (100, 'low', 1, [4, 4])
  (t50,), (t100,) = [[c for c in got['cells'] if c['T'] == t and not c['anneal']] for t in (50, 100)]
  assert (t100['start'], t100['n'], t100['turned'], t100['turn_sync']) == ('low', 2, 2, [3, 4])
  np.testing.assert_allclose(
    [t100['turn_lr_x'], t100['peak_lr_x'], t100['miss_pct']],
    [math.sqrt(0.4 * 0.9), math.sqrt(0.8 * 0.9), 1.5],
    rtol=1e-9,
  )
  assert (t50['start'], t50['n'], t50['turned'], t50['turn_sync'], t50['turn_lr_x']) == ('best', 1, 0, None, None)
  np.testing.assert_allclose([t50['peak_lr_x'], t50['miss_pct']], [5.0, 25.0], rtol=1e-9)
  assert cp.climb_turn(json.load(open(os.path.join(folder, 'adamw', f'hdet_{v}_low_s0.json'))))['settle_step'] == 400
  report = open(
    cp.write_report(
      str(tmp_path / 'out'), {'lm': {'400': {'adamw': {'climb': None, 'price': {}, 'turns': got}}}}, False
    )[1],
    encoding='utf-8',
  ).read()
  assert '| lm | 400 | adamw | last | 100 | low | 2 | 3-4 | 0.6x | 0.85x | +1.5% |' in report
  assert '| lm | 400 | adamw | last | 50 | best | 1 (0 turned) | - | - | 5x | +25.0% |' in report
  assert '| lm | 400 | adamw | anneal 0.2 | 100 | low | 1 | 4 | 0.91x | 0.91x | +2.0% |' in report


def test_compares_after_reads_the_window_the_run_trained():
  """A fixed hdet.sync_every, or windows counted per run (round(steps / num_syncs), at most longest_window)."""
  fixed = {'config': _config(**{'hdet.sync_every': 100, 'hdet.score': 'common'})}
  per_run = {
    'config': _config(
      **{
        'num_train_steps': 1500,
        'hdet.sync_every': 0,
        'hdet.num_syncs': 15,
        'hdet.longest_window': 100,
        'hdet.score': 'common',
      }
    )
  }
  capped = {
    'config': _config(
      **{
        'num_train_steps': 3000,
        'hdet.sync_every': 0,
        'hdet.num_syncs': 15,
        'hdet.longest_window': 100,
        'hdet.score': 'common',
      }
    )
  }
  short = {
    'config': _config(
      **{
        'num_train_steps': 750,
        'hdet.sync_every': 0,
        'hdet.num_syncs': 15,
        'hdet.longest_window': 100,
        'hdet.score': 'common',
      }
    )
  }
  window = {'config': _config(**{'hdet.sync_every': 100, 'hdet.score': 'window'})}
  annealed = {'config': _config(**{'hdet.sync_every': 100, 'hdet.score': 'common'})}
  annealed['config']['hdet']['score_anneal'] = 0.2  # (a record made before 1.0 removed the field, read as data)
  early = {'config': _config(**{'hdet.sync_every': 100, 'hdet.score': 'common'})}
  early['config']['hdet'].update(early_sync_every=25, early_sync_steps=100)  # (likewise: its first windows were 25)
  own = {'config': _config(**{'hdet.sync_every': 100, 'hdet.score': 'common', 'hdet.low_communication': True})}
  assert [
    autolr_report.compares_after(r, 100) for r in (fixed, per_run, capped, short, window, annealed, early, own)
  ] == [True, True, True, False, False, False, False, False]
  assert autolr_report.compares_after(short, 50)


def test_open_turns_find_two_confident_asks_down_in_a_row(tmp_path):
  """The turn is the first of two syncs in a row whose slope exceeds 2 standard errors (a single confident ask down,
  or two beyond 1.5 standard errors only, is not one); per (T, start) its step range, fraction of the run and base LR
  over the sweep's best (0.01; geometric mean). A run that never turned counts in 'runs' only."""
  folder = str(tmp_path)
  _write(folder, 'grid_lr0.01_s0', {'config': _config(**{'optim.max_lr': 0.01}), 'val_bpb': 2.0})

  def run(t_stats, bases, T, steps=400):
    ctl = [
      {'step': T * (i + 1) - 1, 'velocities': [0.1 * t], 'stderrs': [0.1], 'base_lr': b, 'window_losses': [t]}
      for i, (t, b) in enumerate(zip(t_stats, bases))
    ]
    return {'config': _config(num_train_steps=steps), 'val_bpb': 2.1, 'controller': ctl}

  lrs = [0.001, 0.002, 0.004, 0.008]
  _write(folder, 'hdet_open_T100_best_s0', run([-5.0, 3.0, -1.0, 2.5], lrs, 100))  # no two in a row: no turn
  _write(folder, 'hdet_open_T100_best_s1', run([-5.0, 2.1, 2.2, 9.0], lrs, 100))  # turns at step 200
  _write(folder, 'hdet_open_T100_best_s2', run([-5.0, -1.0, 2.1, 2.2], lrs, 100))  # turns at step 300
  _write(folder, 'hdet_open_T100_low_s0', run([1.5, 1.9, 1.9, 1.9], lrs, 100))  # never beyond 2: no turn
  _write(folder, 'hdet_open_K15_low_s0', run([3.0, 3.0], [0.0005, 0.001], 50, steps=750))  # turns at its first sync
  _write(folder, 'hdet_fit_K15_best_s0', run([3.0, 3.0], lrs, 100))  # not the probe: left out
  _write(folder, 'hdet_open_K15_best_s2', run([-5.0, -1.0, 2.1, 2.2], lrs, 100))  # best_s2's run again: counted once
  assert cp.open_turn(json.load(open(os.path.join(folder, 'adamw', 'hdet_open_T100_best_s1.json')))) == {
    'T': 100,
    'down_step': 200,
    'down_lr': 0.002,
    'up_step': 100,
    'up_lr': 0.001,
  }
  got = cp.open_turns(folder, 'adamw')
  assert got['sweep_best_lr'] == 0.01
  (t50,), (t100_low,), (t100_best,) = [
    [c for c in got['cells'] if (c['T'], c['start']) == k] for k in ((50, 'low'), (100, 'low'), (100, 'best'))
  ]
  assert (t100_best['n'], t100_best['turned'], t100_best['down_step']) == (3, 2, [200, 300])
  np.testing.assert_allclose(t100_best['down_fraction'], [0.5, 0.75])
  np.testing.assert_allclose(t100_best['down_lr_x'], math.sqrt(0.2 * 0.4), rtol=1e-9)
  assert (t100_low['n'], t100_low['turned'], t100_low['down_step'], t100_low['down_lr_x']) == (1, 0, None, None)
  assert (t50['turned'], t50['down_step']) == (1, [50, 50])
  np.testing.assert_allclose([t50['down_fraction'][0], t50['down_lr_x']], [50 / 750, 0.05], rtol=1e-9)
  report = open(
    cp.write_report(
      str(tmp_path / 'out'), {'lm': {'400': {'adamw': {'climb': None, 'price': {}, 'open': got}}}}, False
    )[1],
    encoding='utf-8',
  ).read()
  assert '| lm | 400 | adamw | 100 | best | 3 (2 turned) | 200-300 | 0.50-0.75 | 0.28x |' in report
  assert '| lm | 400 | adamw | 50 | low | 1 | 50 | 0.07 | 0.05x |' in report


def test_sweep_leaders_rank_the_plain_runs_at_every_evaluation(tmp_path):
  """At each evaluation step, the LR with the lowest mean over the sweep's 3 seeds (a non-finite value loses), among
  the LRs trained on all 3; the final best is the last step's; an LR with fewer seeds is left out even where it
  would lead."""
  folder = str(tmp_path)
  curves = {0.005: [3.0, float('nan'), 2.2], 0.01: [2.9, 2.6, 2.0], 0.02: [2.8, 2.7, 2.1]}
  for lr, curve in curves.items():
    for seed in (0, 1, 2):
      evals = [{'step': 100 * (i + 1), 'val_bpb': v + 0.01 * seed} for i, v in enumerate(curve)]
      _write(
        folder,
        f'grid_lr{lr}_s{seed}',
        {'config': _config(**{'optim.max_lr': lr, 'seed': seed}), 'val_bpb': evals[-1]['val_bpb'], 'evals': evals},
      )
  for seed in (0, 1):  # two seeds only: not ranked, though it leads everywhere
    _write(
      folder,
      f'grid_lr0.04_s{seed}',
      {
        'config': _config(**{'optim.max_lr': 0.04, 'seed': seed}),
        'val_bpb': 1.0,
        'evals': [{'step': 100 * (i + 1), 'val_bpb': 1.0} for i in range(3)],
      },
    )
  got = cp.sweep_leaders(folder, 'adamw')
  assert got['lrs'] == [0.005, 0.01, 0.02] and got['final_lr'] == 0.01
  assert [(leader['step'], leader['lr']) for leader in got['leaders']] == [(100, 0.02), (200, 0.01), (300, 0.01)]
  report = open(
    cp.write_report(
      str(tmp_path / 'out'), {'lm': {'300': {'adamw': {'climb': None, 'price': {}, 'leaders': got}}}}, False
    )[1],
    encoding='utf-8',
  ).read()
  assert '| lm | 300 | adamw | 3 (0.005-0.02) | 0.01 | 100: 2x, 200: 1x, 300: 1x |' in report


def test_first_asks_read_the_first_sync_of_the_stretched_probe(tmp_path):
  """Per start: the first sync's step and fitted step (mean), the asked LR (start x e^ask) over the sweep's best (0.01;
  geometric mean) and slope / se (mean); later syncs and other variants are not read."""
  folder = str(tmp_path)
  _write(folder, 'grid_lr0.01_s0', {'config': _config(**{'optim.max_lr': 0.01}), 'val_bpb': 2.0})

  def run(start_lr, asks, slopes, seed):
    ctl = [
      {'step': 120 * (i + 1) - 1, 'asks': [a], 'velocities': [b], 'stderrs': [0.5]}
      for i, (a, b) in enumerate(zip(asks, slopes))
    ]
    return {'config': _config(**{'optim.max_lr': start_lr, 'seed': seed}), 'val_bpb': 2.1, 'controller': ctl}

  _write(folder, 'hdet_open_first30_best_s0', run(0.01, [-0.2, 3.0], [1.0, -9.0], 0))
  _write(folder, 'hdet_open_first30_best_s1', run(0.01, [0.1, -3.0], [-2.0, 9.0], 1))
  _write(folder, 'hdet_open_first30_low_s0', run(0.001, [0.5], [-4.0], 0))
  _write(folder, 'hdet_open_K15_high_s0', run(0.1, [-1.0], [4.0], 0))
  got = cp.first_asks(folder, 'adamw')
  assert [(c['start'], c['n'], c['step']) for c in got['cells']] == [('low', 1, 120), ('best', 2, 120)]
  low, best = got['cells']
  np.testing.assert_allclose([best['ask'], best['asked_lr_x'], best['t']], [-0.05, math.exp(-0.05), -1.0], rtol=1e-9)
  np.testing.assert_allclose([low['ask'], low['asked_lr_x'], low['t']], [0.5, 0.1 * math.exp(0.5), -8.0], rtol=1e-9)
  report = open(
    cp.write_report(
      str(tmp_path / 'out'), {'lm': {'400': {'adamw': {'climb': None, 'price': {}, 'first': got}}}}, False
    )[1],
    encoding='utf-8',
  ).read()
  assert '| lm | 400 | adamw | best | 2 | 120 | -0.05 | 0.95x | -1.0 |' in report


def test_wide_fan_reads_the_best_replica_of_the_first_sync(tmp_path):
  """Per gradient and start, over open_first30_wide runs (own gradients: the _lowcomm ones): the best replica's peak LR
  (start x its multiplier, the multiplier being its LR over the fan's geometric centre) over the sweep's best (0.01),
  the replica nearest 0.01 scored against the best (%), the non-finite scores; the narrow probe's runs are not read."""
  folder = str(tmp_path)
  _write(folder, 'grid_lr0.01_s0', {'config': _config(**{'optim.max_lr': 0.01}), 'val_bpb': 2.0})
  rho = 2.0 ** (np.arange(8) - 3.5)

  def run(start_lr, scores, seed, base=0.5):  # base: the schedule at the sync (the fan's centre), any value
    ctl = [
      {'step': 119, 'values': [list(base * start_lr * rho)], 'window_losses': scores},
      {'step': 239, 'values': [list(rho)], 'window_losses': [0.0] * 8},
    ]
    return {'config': _config(**{'optim.max_lr': start_lr, 'seed': seed}), 'val_bpb': 2.1, 'controller': ctl}

  low = [3.0, 2.5, 2.2, 2.1, 2.0, 2.05, 2.3, float('nan')]  # best: replica 4 (x 2**0.5); nearest 0.01: replica 7
  _write(folder, 'hdet_open_first30_wide_low_s0', run(0.001, low, 0))
  _write(folder, 'hdet_open_first30_wide_low_s1', run(0.001, [3.0, 2.5, 2.2, 2.0, 2.1, 2.2, 2.3, 2.4], 1, base=7.0))
  _write(folder, 'hdet_open_first30_wide_best_s0', run(0.012, [2.5, 2.4, 2.3, 2.2, 2.0, 2.1, 2.2, 2.3], 0))
  _write(folder, 'hdet_open_first30_best_s0', run(0.01, [1.0] * 8, 0))
  _write(folder, 'hdet_open_first30_wide_lowcomm_low_s0', run(0.001, [3.0, 2.9, 2.8, 2.7, 2.6, 2.5, 2.4, 2.3], 0))
  for lr, val in ((0.02, 2.2), (0.04, 2.6)):
    _write(folder, f'grid_lr{lr}_s0', {'config': _config(**{'optim.max_lr': lr}), 'val_bpb': val})
  got = cp.wide_fan(folder, 'adamw')
  assert [(c['gradients'], c['start'], c['n'], c['step']) for c in got['cells']] == [
    ('shared', 'low', 2, 120),
    ('shared', 'best', 1, 120),
    ('own', 'low', 1, 120),
  ]
  lo, best, own = got['cells']
  np.testing.assert_allclose([own['best_lr_x'], own['gap_pct']], [0.1 * 2**3.5, 0.0], rtol=1e-9)
  # Own gradients: the winner (1.13x) times sqrt(8) is 3.2x = 0.032, 0.678 of the way (in log LR) from 0.02 (2.2) to
  # 0.04 (2.6): the sweep there 2.471, +23.6% against its best (2.0). The shared rows carry no such estimate.
  w = math.log(1.6) / math.log(2.0)
  np.testing.assert_allclose(
    [own['scaled_lr_x'], own['sweep_at_scaled_pct']],
    [0.1 * 2**3.5 * math.sqrt(8), 100 * ((2.2 + 0.4 * w) / 2.0 - 1)],
    rtol=1e-9,
  )
  assert 'scaled_lr_x' not in lo and 'scaled_lr_x' not in best
  # low: best replicas at 0.1 x 2**0.5 and 0.1 x 2**-0.5, geometric mean 0.1; the replica nearest the sweep's best
  # (0.1 x 2**3.5 = 1.13x) is NaN in s0 (gap inf) and scored 2.4 against 2.0 in s1.
  np.testing.assert_allclose([lo['best_lr_x'], lo['best_rho']], [0.1, 1.0], rtol=1e-9)
  np.testing.assert_allclose(lo['best_lr_x_range'], [0.1 * 2**-0.5, 0.1 * 2**0.5], rtol=1e-9)
  assert lo['gap_pct'] == math.inf and lo['nonfinite'] == 1
  # best (started at 1.2x): replica 4 (x 2**0.5) best; nearest 1x is replica 3 (0.85x), 2.2 against 2.0.
  np.testing.assert_allclose([best['best_lr_x'], best['gap_pct']], [1.2 * 2**0.5, 10.0], rtol=1e-9)
  report = open(
    cp.write_report(
      str(tmp_path / 'out'), {'lm': {'400': {'adamw': {'climb': None, 'price': {}, 'wide': got}}}}, False
    )[1],
    encoding='utf-8',
  ).read()
  assert '| lm | 400 | adamw | shared | best | 1 | 120 | 1.7x (1.7-1.7) | 1.4 | +10.0% | 0 |' in report


def test_sweep_at_interpolates_the_seed_means_in_log_lr():
  """Each grid point's seed mean, linear in log LR between neighbours; exact at a point; None off the grid; inf next to
  a diverged point; the batch rule is sqrt(N) for Adam, N for SGD."""
  rec = lambda v: {'val_bpb': v, 'diverged_at': None}
  grid = {0.01: [rec(2.0), rec(2.2)], 0.02: [rec(1.8)], 0.04: [rec(float('inf'))]}
  assert cp.sweep_at(grid, 0.01) == 2.1 and cp.sweep_at(grid, 0.02) == 1.8
  np.testing.assert_allclose(cp.sweep_at(grid, 0.01 * 2**0.25), 2.1 - 0.25 * 0.3, rtol=1e-12)
  assert cp.sweep_at(grid, 0.005) is None and cp.sweep_at(grid, 0.05) is None
  assert cp.sweep_at(grid, 0.03) == math.inf
  assert (cp.batch_rule('adamw', 8), cp.batch_rule('sgd', 8)) == (math.sqrt(8), 8.0)
