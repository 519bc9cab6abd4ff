"""research/workloads.py: each workload's --quick mode end to end, and its report against the records."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from research import autolr, records, workloads


@pytest.fixture(scope='module')
def quick(tmp_path_factory):
  root = str(tmp_path_factory.mktemp('workloads'))
  # The LM's quick mode is autolr.py's (research/tests/test_autolr.py); here the two workloads that only this
  # command runs.
  workloads.main(['--quick', '--workload', 'mnist1d,finetune', '--workdir', root])
  with open(os.path.join(root, 'workloads.json'), encoding='utf-8') as f:
    return root, json.load(f)


def test_quick_runs_every_workload_and_stage(quick):
  root, res = quick
  assert sorted(res) == ['finetune', 'mnist1d']
  for workload, by_steps in res.items():
    r = by_steps['16']['adamw']
    assert r['metric'] == ('val_loss' if workload == 'mnist1d' else 'val_bits_per_byte')
    assert set(r['grid']) == {'0.003', '0.03'} and set(r['hdet']) == {'high'} and set(r['peers']) == {'prodigy'}
    assert r['hdet']['high']['n'] == 1 and np.isfinite(r['hdet']['high']['value'])
  assert os.path.isdir(os.path.join(root, 'finetune', 'pretrain', 'checkpoints'))  # the kept checkpoint
  report = open(os.path.join(root, 'workloads.md'), encoding='utf-8').read()
  for workload in res:  # each workload's LR trajectories against the sweep's best, drawn and linked
    assert f'(figures/workloads_lr_{workload}_16_adamw.png)' in report
    assert os.path.getsize(os.path.join(root, 'figures', f'workloads_lr_{workload}_16_adamw.png')) > 1000
  assert '## Conclusion' in report


def test_report_values_are_the_records_primary_metric(quick):
  """grid_best is the lowest grid value, each value the record's final metric (mnist1d: test cross-entropy)."""
  root, res = quick
  for workload in ('mnist1d', 'finetune'):
    d = workloads.records_dir(workload, 16, True, root)
    recs = {
      lr: json.load(open(os.path.join(d, autolr.grid_name('adamw', lr, 0) + '.json')))
      for lr in autolr.QUICK_GRIDS['adamw']
    }
    r = res[workload]['16']['adamw']
    lr = min(recs, key=lambda k: recs[k]['val_bpb'])
    assert r['grid_best']['lr'] == lr and r['grid_best']['value'] == recs[lr]['val_bpb']
    from hdet_jax.trainer import process

    assert all(
      rec['machine']['cpu'] == process.cpu_model() and rec['machine']['jax'] == jax.__version__ for rec in recs.values()
    )  # each record names the machine it was trained on
    if workload == 'mnist1d':
      assert recs[lr]['metric'] == 'val_loss' and recs[lr]['val_bpb'] < np.log(10) + 0.1
      assert 0 <= r['grid_best']['accuracy'] <= 1
  ft = json.load(
    open(os.path.join(workloads.records_dir('finetune', 16, True, root), autolr.grid_name('adamw', 0.03, 0) + '.json'))
  )
  assert (
    ft['config']['init_from'].endswith(os.path.join('finetune', 'pretrain')) and ft['config']['data']['corpus'] == 'wyc'
  )
  assert ft['config']['warm_init']['nu'] == 0.0  # the sweep fine-tunes the checkpoint itself


def test_seeds_after_the_first_train_the_best_and_its_neighbours(tmp_path):
  """--seeds 0,1: seed 1 trains only the first seed's best grid point and its neighbours."""

  class Cache:
    dir = str(tmp_path)

  os.makedirs(os.path.join(tmp_path, 'adamw'))
  with open(os.path.join(tmp_path, 'adamw', 'anchor.json'), 'w') as f:
    json.dump({'lr': 0.03, 'val_bpb': 1.0, 'seed': 0}, f)
  lrs = autolr.GRIDS['adamw']
  assert workloads.neighbourhood(Cache(), 'adamw', lrs, 0) == [0.015, 0.03, 0.06]
  with open(os.path.join(tmp_path, 'adamw', 'anchor.json'), 'w') as f:
    json.dump({'lr': lrs[0], 'val_bpb': 1.0, 'seed': 0}, f)
  assert workloads.neighbourhood(Cache(), 'adamw', lrs, 0) == list(lrs[:2])


def test_bad_workload_is_a_usage_error(capsys):
  with pytest.raises(SystemExit) as e:
    workloads.parse_args(['--workload', 'imagenet'])
  assert e.value.code == 2 and "not among ['lm', 'mnist1d', 'finetune']" in capsys.readouterr().err


def test_conclusion_counts_cells_within_one_percent_and_against_the_peers():
  res = {
    'w': {
      '100': {
        'adamw': {
          'grid_best': {'lr': 0.1, 'value': 2.0, 'sd': None, 'n': 3},
          'hdet': {'low': {'value': 2.03, 'n': 3}, 'best': {'value': 2.01, 'n': 3}, 'high': {'value': None, 'n': 3}},
          'peers': {'p': {'value': 2.02, 'n': 3}},
        }
      }
    }
  }
  text = '\n'.join(workloads.conclusion(res))
  assert "within 1% of the sweep's best in 1 of 3 cells" in text
  assert 'w 100 steps adamw from high: diverged (n=3); w 100 steps adamw from low: +1.5% (n=3)' in text
  assert (
    'Ahead of every LR-free peer in 1 of 3 cells with peers; '
    'behind the best peer: w 100 steps from low, w 100 steps from high.' in text
  )


@pytest.mark.parametrize('workload', list(workloads.WORKLOADS))
def test_cache_keys_are_fields_the_runs_configs_hold(workload):
  """A record is reused only where its config holds every key of the task's overrides: each key must be a
  field of the workload's config at that value, at every run length (else every new process retrains)."""
  from hdet_jax.trainer import config_lib

  for steps in workloads.lengths(workload, False):
    flat = config_lib.flatten(workloads.base_config(workload, steps, False))
    for key, value in workloads.task_overrides(workload, steps).items():
      assert flat[key] == value, (workload, steps, key)


@pytest.mark.parametrize('workload', list(workloads.WORKLOADS))
def test_the_reported_variant_is_the_workloads_default_config(workload):
  """The HDET the report calls the default trains what the workload's config trains at every run length: the same
  sync windows, controller settings and comparison (so the tables describe `python train.py --config ...`)."""
  from hdet_jax.trainer import config_lib

  for steps in workloads.lengths(workload, False):
    config = workloads.base_config(workload, steps, False)
    variant = workloads.record_variant(workloads.DEFAULT_VARIANT, workload, steps)
    ran = config_lib.with_overrides(
      workloads.base_config(workload, steps, False),
      autolr.run_overrides('hdet', 'adamw', config.optim.max_lr, config.seed, steps, variant=variant),
    )
    run, default = records.resolve(ran), records.resolve(config)
    assert run.optimizer.windows == default.optimizer.windows, (workload, steps)
    first_sync = default.optimizer.windows[0]
    # A stop before the first sync makes the same decisions wherever it falls (rise-only from the first sync).
    same = lambda a: dataclasses.replace(
      a, stop_steps=-1 if a.stop_steps is not None and a.stop_steps < first_sync else a.stop_steps
    )
    assert same(run.optimizer.auto_lr) == same(default.optimizer.auto_lr), (workload, steps)
    # The back-off's guard, the rollback (a trainer setting, not the controller's) included.
    assert run.guard == default.guard, (workload, steps)
    for field in ('hdet.score', 'hdet.param_groups', 'hdet.spread', 'hdet.probe_windows'):
      assert config_lib.flatten(ran)[field] == config_lib.flatten(config)[field], (workload, steps, field)


def test_the_default_reads_the_records_of_the_variants_that_train_its_runs():
  """The default before settling (15 syncs of at most 100 steps) trains fit_K15's windows below 1500 steps and
  autolr.py's T=100 from 1500 on, so its report reads those records (and a variant that differs there reads its
  own); today's default (settling) trains its own runs at every length. One run of fit_K15 at the LM's 1500 steps
  (T=100 too) equals autolr.py's record bit for bit."""
  old_default = autolr.PREVIOUS_DEFAULT
  want = {
    ('lm', 750): 'fit_K15',
    ('lm', 1500): old_default,
    ('lm', 3000): old_default,
    ('mnist1d', 500): 'fit_K15',
    ('mnist1d', 1000): 'fit_K15',
    ('mnist1d', 2000): old_default,
    ('finetune', 150): 'fit_K15',
    ('finetune', 300): 'fit_K15',
    ('finetune', 600): 'fit_K15',
  }
  assert {k: workloads.record_variant(workloads.PREVIOUS_DEFAULT, *k) for k in want} == want
  assert {k: workloads.record_variant(workloads.DEFAULT_VARIANT, *k) for k in want} == dict.fromkeys(
    want, workloads.DEFAULT_VARIANT
  )
  assert workloads.record_variant('fit_backoff', 'lm', 1500) == 'fit_backoff'
  runs = os.path.join(autolr.REPO, 'results', 'autolr', 'runs', 'default', 'adamw')
  own = json.load(open(os.path.join(runs, 'hdet_fit_K15_best_s0.json'), encoding='utf-8'))
  old = json.load(open(os.path.join(runs, f'hdet_{old_default}_best_s0.json'), encoding='utf-8'))
  from hdet_jax.trainer import compat, config_lib, schema

  # (less the fields removed in 1.0, which both records hold at the values every run then had, or lack)
  mine, theirs = (records.without_removed(config_lib.flatten(r['config'])) for r in (own, old))
  # The same fields, but for those added since (at the values every earlier run had) and N written as 8 instead
  # of 0 (one replica per device, on 8 devices), and the run fields.
  assert theirs['hdet.num_replicas'] == 0 and mine['hdet.num_replicas'] == 8
  newer = {k for k in mine if k not in theirs}
  assert all(mine[k] == compat.QUIET_DEFAULTS[k] for k in newer if k not in schema.LOOP_FIELDS), newer
  assert {k: v for k, v in mine.items() if k in theirs and k != 'hdet.num_replicas'} == {
    k: v for k, v in theirs.items() if k != 'hdet.num_replicas'
  }
  for key in ('val_bpb', 'evals', 'trajectory'):
    assert own[key] == old[key], key
  assert [c['window_losses'] for c in own['controller']] == [c['window_losses'] for c in old['controller']]


def _lm750_cache(tmp_path, *names):
  """A RunCache in tmp_path holding copies of the LM 750-step records ``names`` (adamw)."""
  src = workloads.records_dir('lm', 750, False, str(tmp_path))
  cache = records.RunCache(str(tmp_path / 'records'), str(tmp_path / 'work'), workloads.make_record, autolr.describe)
  for name in names:
    cache.write(name, json.load(open(os.path.join(src, name + '.json'), encoding='utf-8')))
  return cache, src


def test_a_strict_back_off_run_whose_loss_never_rose_stands_for_the_thresholded_and_rolled_back_one(tmp_path):
  """alias_quiet_run: the strict back-off's LM 750-step run (its window training loss fell at every sync) is
  written as rollback_se2's, config and all; a run whose loss rose once, or a sibling that differs in another
  field, is not. The one such run trained for real (best LR, seed 0) equals the strict run bit for bit."""
  from hdet_jax.trainer import config_lib

  variant = 'fit_K15_cap100_rollback_se2'
  sibling = workloads.record_variant(workloads.QUIET_BACKOFF_FROM[variant], 'lm', 750)
  assert sibling == 'fit_K15_backoff'
  strict = autolr.hdet_name('adamw', sibling, 'low', 1)
  cache, src = _lm750_cache(tmp_path, strict)
  rec = cache.get(strict)
  assert workloads.never_rose(rec)
  o = autolr.run_overrides('hdet', 'adamw', 0.015 * autolr.STARTS['low'], 1, 750, variant=variant)
  config = config_lib.with_overrides(workloads.base_config('lm', 750, False), o)
  name = autolr.hdet_name('adamw', variant, 'low', 1)
  assert workloads.alias_quiet_run(cache, name, config, strict)
  alias = cache.get(name, {**workloads.task_overrides('lm', 750), **o})  # what run_workload's cache then finds
  assert alias is not None and alias['same_run_as'] == strict and alias['val_bpb'] == rec['val_bpb']
  assert alias['config']['hdet']['rollback'] is True and alias['config']['hdet']['backoff_stderrs'] == 2.0
  assert not workloads.alias_quiet_run(cache, name, config, strict)  # never over an existing record
  rose = dict(rec, controller=[dict(c) for c in rec['controller']])
  rose['controller'][5]['train_loss'] = rose['controller'][4]['train_loss'] * 1.0001
  assert not workloads.never_rose(rose)
  cache.write('rose', rose)
  assert not workloads.alias_quiet_run(cache, 'other', config, 'rose')
  other = config_lib.with_overrides(
    config_lib.with_overrides(workloads.base_config('lm', 750, False), o), {'hdet.trust': 0.5}
  )
  with pytest.raises(ValueError, match=r'hdet\.trust'):
    workloads.alias_quiet_run(cache, 'other', other, strict)
  real = json.load(open(os.path.join(src, autolr.hdet_name('adamw', variant, 'best', 0) + '.json'), encoding='utf-8'))
  twin = json.load(open(os.path.join(src, autolr.hdet_name('adamw', sibling, 'best', 0) + '.json'), encoding='utf-8'))
  assert 'same_run_as' not in real
  for key in ('val_bpb', 'evals', 'trajectory'):
    assert real[key] == twin[key], key
  assert [c['window_losses'] for c in real['controller']] == [c['window_losses'] for c in twin['controller']]
  assert [c['train_loss'] for c in real['controller']] == [c['train_loss'] for c in twin['controller']]


def _selection(tmp_path, monkeypatch, anchored, **chosen):
  """run_workload on mnist1d (quick, 16 steps, the full grids) with training stubbed out: the names it would
  train, and the optimizers it reports."""
  monkeypatch.setattr(autolr, 'QUICK_GRIDS', autolr.GRIDS)
  trained = []
  monkeypatch.setattr(records.RunCache, 'run', lambda self, name, *a, **k: trained.append(name))
  d = workloads.records_dir('mnist1d', 16, True, str(tmp_path))
  for optim in ('adamw', 'sgd'):
    os.makedirs(os.path.join(d, optim))
  if anchored:
    with open(os.path.join(d, 'sgd', 'anchor.json'), 'w') as f:
      json.dump({'lr': 0.25, 'val_bpb': 1.0, 'seed': 0}, f)
  with open(os.path.join(d, autolr.grid_name('adamw', 0.06, 3) + '.json'), 'w') as f:  # an earlier AdamW run
    json.dump({'config': {}, 'val_bpb': 0.1, 'diverged_at': None}, f)
  args = dict(
    quick=True,
    stages=('grid',),
    optim=['sgd'],
    seeds=[3, 4],
    full_grid=False,
    variant=autolr.DEFAULT_VARIANT,
    starts=['high'],
    peers=[],
  )
  import argparse

  out = workloads.run_workload('mnist1d', 16, argparse.Namespace(**{**args, **chosen}), str(tmp_path))
  return trained, sorted(out)


def test_a_seed_subset_trains_around_the_fixed_anchor_and_the_report_keeps_every_optimizer(tmp_path, monkeypatch):
  """With the anchor fixed (seed 0's sweep: 0.25), --seeds 3,4 trains only the anchor and its two neighbours on
  each (no full grid for the first listed seed); --optim sgd still reports AdamW's records."""
  trained, reported = _selection(tmp_path, monkeypatch, anchored=True)
  assert trained == [autolr.grid_name('sgd', lr, s) for s in (3, 4) for lr in (0.125, 0.25, 0.5)]
  assert reported == ['adamw', 'sgd']


def test_without_an_anchor_the_first_listed_seed_trains_the_full_grid(tmp_path, monkeypatch):
  trained, _ = _selection(tmp_path, monkeypatch, anchored=False)
  assert trained == [autolr.grid_name('sgd', lr, 3) for lr in autolr.GRIDS['sgd']]  # seed 4 waits for the anchor
  trained, _ = _selection(tmp_path / 'full', monkeypatch, anchored=True, full_grid=True)
  assert trained == [autolr.grid_name('sgd', lr, s) for s in (3, 4) for lr in autolr.GRIDS['sgd']]
