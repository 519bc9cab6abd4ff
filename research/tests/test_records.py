"""research.records: the run cache shared by several worker processes."""

import fcntl
import json
import math
import multiprocessing
import os
import statistics

import pytest

from research import records


def _cache(tmp_path, log=None):
  return records.RunCache(
    str(tmp_path / 'records'),
    str(tmp_path / 'work'),
    make_record=lambda *a: {},
    describe=lambda rec: '',
    log=log or (lambda *a, **k: None),
  )


def _hold_lock(path, ready, release):
  """Another process holding a run's lock, as a second worker training it does."""
  with open(path, 'a') as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    ready.set()
    release.wait(30)


@pytest.fixture
def busy_run(tmp_path):
  """A run named 'adamw/grid_lr0.03_s0' that another process is training."""
  name = 'adamw/grid_lr0.03_s0'
  lock = tmp_path / 'work' / (name + '.lock')
  lock.parent.mkdir(parents=True)
  ctx = multiprocessing.get_context('spawn')
  ready, release = ctx.Event(), ctx.Event()
  proc = ctx.Process(target=_hold_lock, args=(str(lock), ready, release))
  proc.start()
  assert ready.wait(30)
  yield name
  release.set()
  proc.join(30)


def test_a_run_another_worker_trains_is_skipped_not_trained_twice(tmp_path, busy_run):
  said = []
  cache = _cache(tmp_path, log=lambda *a, **k: said.append(a[0]))
  # config=None: reaching the trainer would fail, so returning None proves nothing was trained.
  assert cache.run(busy_run, None, skip_busy=True) is None
  assert said == [f'  {busy_run}: training in another process; skipped here.']
  assert not os.path.exists(cache.workdir(busy_run))


def test_without_skip_busy_a_busy_run_is_an_error_naming_it(tmp_path, busy_run):
  with pytest.raises(RuntimeError, match=r"run 'adamw/grid_lr0.03_s0' is training in another process"):
    _cache(tmp_path).run(busy_run, None)


def test_a_finished_record_is_returned_even_while_its_lock_is_held(tmp_path, busy_run):
  cache = _cache(tmp_path)
  os.makedirs(os.path.dirname(cache.path(busy_run)))
  with open(cache.path(busy_run), 'w') as f:
    json.dump({'name': busy_run, 'config': {}, 'val_bpb': 2.05}, f)
  assert cache.run(busy_run, None, skip_busy=True)['val_bpb'] == 2.05


def test_the_lock_is_released_after_a_claim(tmp_path):
  cache = _cache(tmp_path)
  with cache._claim('sgd/run') as claimed:
    assert claimed
    with cache._claim('sgd/run') as again:  # a second open file: flock conflicts even in one process
      assert not again
  with cache._claim('sgd/run') as claimed:
    assert claimed


def test_no_lock_file_is_left_behind(tmp_path):
  cache = _cache(tmp_path)
  with cache._claim('adamw/run'):
    pass
  assert os.listdir(tmp_path / 'work' / 'adamw') == []


def test_a_record_matches_on_its_fields_with_added_ones_at_their_quiet_defaults_and_none_resolved(tmp_path):
  """A record written before a field existed matches that field's quiet default; one that left hdet.settle at None
  matches what None resolves to (on for the rise-only 'fit' climb, off without auto-LR), not None itself."""
  cache = _cache(tmp_path)
  fit = {'auto_lr': True, 'controller': 'fit', 'after_stop': 'rise'}
  cache.write('old', {'config': {'hdet': {'spread': 0.25}}})
  cache.write('auto', {'config': {'hdet': {**fit, 'settle': None}}})
  cache.write('plain', {'config': {'hdet': {**fit, 'auto_lr': False, 'settle': None}}})
  assert cache.get('old', {'hdet.spread': 0.25, 'hdet.settle': False}) is not None
  assert cache.get('old', {'hdet.settle': True}) is None
  assert cache.get('auto', {'hdet.settle': True}) is not None and cache.get('auto', {'hdet.settle': False}) is None
  assert cache.get('plain', {'hdet.settle': False}) is not None and cache.get('plain', {'hdet.settle': True}) is None


def test_best_lr_is_the_lowest_mean_a_diverged_seed_inf_ties_first():
  grid = {0.1: [2.0, 2.2], 0.2: [1.9, None], 0.4: [2.1, 2.1]}  # means 2.1, inf, 2.1: a tie, the first wins
  assert records.best_lr(grid) == 0.1
  assert records.best_lr({**grid, 0.05: [2.0, 2.0]}) == 0.05


def test_cpu_model_is_the_first_model_name_of_cpuinfo_else_the_platforms(tmp_path, monkeypatch):
  """Records name the machine they were trained on (XLA's rounding differs by CPU model)."""
  import platform
  from hdet_jax.trainer import process

  info = tmp_path / 'cpuinfo'
  info.write_text(
    'processor\t: 0\nvendor_id\t: X\nmodel name\t: Some CPU @ 2.10GHz\n\nprocessor\t: 1\nmodel name\t: Another CPU\n'
  )
  assert process.cpu_model(str(info)) == 'Some CPU @ 2.10GHz'
  monkeypatch.setattr(platform, 'processor', lambda: '')
  monkeypatch.setattr(platform, 'machine', lambda: 'riscv64')
  assert process.cpu_model(str(tmp_path / 'missing')) == 'riscv64'
  info.write_text('processor\t: 0\nmodel name\t:   \n')  # empty: the fallback, not ''
  assert process.cpu_model(str(info)) == 'riscv64'


def test_the_machine_names_xla_flags_but_no_path(monkeypatch):
  """A record is committed: XLA_FLAGS that change the numbers are kept, a flag naming a path is dropped."""
  from hdet_jax.trainer import process

  monkeypatch.setenv(
    'XLA_FLAGS', '--xla_force_host_platform_device_count=8 --xla_dump_to=dumps/xla --xla_backend_optimization_level=0'
  )
  assert process.machine()['xla_flags'] == '--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0'


def test_a_record_made_before_1_0_reads_without_the_fields_removed_then_at_their_old_defaults():
  """A removed field at the value every run then trained with is dropped (today's trainer trains that run); at another
  value it stays, so the record matches no config of today's trainer. log_noise_scale only steered logging."""
  from hdet_jax.trainer import compat

  flat = {
    'hdet.overshoot': 1.0,
    'hdet.fan': 'linear',
    'log_noise_scale': True,
    'hdet.score_tail': 0.5,
    'bracket.anneal': 0.0,
    'hdet.spread': 0.25,
  }
  assert records.without_removed(flat) == {'hdet.score_tail': 0.5, 'hdet.spread': 0.25}
  assert set(records.REMOVED_DEFAULTS) | records.REMOVED_RUN_FIELDS == set(compat.REMOVED)


def test_paired_gap_is_the_ratio_of_means_with_the_per_seed_standard_error():
  values, reference = [1.1, 2.2, 2.9], [1.0, 2.0, 3.0]
  gap, se = records.paired_gap(values, reference)
  per_seed = [v / r - 1 for v, r in zip(values, reference)]  # 0.1, 0.1, -1/30
  assert gap == pytest.approx(6.2 / 6.0 - 1)
  assert se == pytest.approx(statistics.stdev(per_seed) / math.sqrt(3))
  assert records.paired_gap([1.0], [2.0]) == (pytest.approx(-0.5), None)  # (one seed: no standard error)
  assert records.paired_gap([1.0, None], [1.0, 1.0]) == (None, None)
  assert records.paired_gap([1.0, 1.0], [1.0]) == (None, None)
