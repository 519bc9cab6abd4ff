"""Config helpers: overrides, flattening, the fields that define a run, their differences, sibling files."""

import os

import ml_collections
import numpy as np
import pytest

from hdet_jax.trainer import config_lib
from hdet_jax.trainer import run_settings
from hdet_jax.trainer import optimizer as optimizer_lib

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs')


def _tiny():
  return config_lib.load_config_file(os.path.join(CONFIGS, 'tiny.py'))


def test_overrides_set_dotted_fields_and_flatten_reads_them_back():
  c = config_lib.with_overrides(_tiny(), {'hdet.spread': 0.2, 'seed': 3, 'model.d_model': 48})
  flat = config_lib.flatten(c)
  assert (flat['hdet.spread'], flat['seed'], flat['model.d_model']) == (0.2, 3, 48)
  assert flat['hdet.explore.dropout'] == 0.0  # nested two deep
  assert config_lib.flatten({'a': {'b': 1}, 'c': 2}) == {'a.b': 1, 'c': 2}


def test_training_fields_leave_out_what_only_steers_a_run():
  """A resumed run may change how it logs, evaluates and checkpoints, not what it trains; N is resolved."""
  a = config_lib.training_fields(_tiny(), 8)
  steer = {f: {'plots': False, 'log_every': 7, 'tensorboard': False, 'compilation_cache': '/x'}.get(f, 3)
           for f in ('plots', 'log_every', 'tensorboard', 'compilation_cache', 'eval_every', 'checkpoint_every')}
  assert config_lib.training_fields(config_lib.with_overrides(_tiny(), steer), 8) == a
  assert not set(a) & config_lib.RUN_FIELDS and a['hdet.num_replicas'] == 8
  b = config_lib.training_fields(config_lib.with_overrides(_tiny(), {'hdet.spread': 0.2, 'seed': 1}), 8)
  assert config_lib.differences(a, b) == 'hdet.spread: 0.25 -> 0.2, seed: 0 -> 1'
  assert 'and 1 more' in config_lib.differences(a, {**b, 'x': 1, 'y': 2, 'z': 3}, limit=4)


def test_sibling_loads_the_named_config_next_to_a_file():
  c = config_lib.sibling(os.path.join(CONFIGS, 'anything.py'), 'tiny')
  assert isinstance(c, ml_collections.ConfigDict) and c.num_train_steps == 40
  assert config_lib.sibling(os.path.join(CONFIGS, 'x.py'), 'default').num_train_steps == 1500


@pytest.mark.parametrize('source,says', [
    (None, 'no such file'),
    ('def get_config(:\n', 'is not Python source (invalid syntax at line 1)'),
    ('import hdet_no_such_module\n', "raised ModuleNotFoundError: No module named 'hdet_no_such_module' (line 1)"),
    ('X = 1\n', 'defines no get_config()'),
    ('def get_config():\n  return {}[0]\n', 'get_config() raised KeyError: 0 (line 2)'),
    ('def get_config():\n  return [1]\n', 'get_config() returned list [1], not an ml_collections.ConfigDict'),
    ('from hdet_jax.trainer.config_lib import sibling\ndef get_config():\n  return sibling(__file__, "gone")\n',
     'gone.py: no such file'),  # a config building on a missing one names that one
])
def test_a_config_file_that_gives_no_config_is_one_config_error(tmp_path, source, says):
  """train.py reads --config through load_config_file (its ConfigError is one error line, exit 2)."""
  path = tmp_path / 'mine.py'
  if source is not None:
    path.write_text(source)
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.load_config_file(str(path))
  assert says in str(e.value) and '\n' not in str(e.value)
  assert str(e.value).startswith(f'--config {tmp_path / ("gone.py" if "gone" in says else "mine.py")}')


def test_load_config_file_passes_get_config_its_argument(tmp_path):
  """--config FILE:ARG calls get_config(ARG), as ml_collections' config_flags does."""
  path = tmp_path / 'arg.py'
  path.write_text('import ml_collections\ndef get_config(size):\n  return ml_collections.ConfigDict({"size": size})\n')
  assert config_lib.load_config_file(str(path), 'big').size == 'big'


@pytest.mark.parametrize('field,value', [('hdet.spread', 1.5), ('optim.max_lr', 0.0), ('data.batch_size', 0),
                                         ('hdet.warmup_steps', 40), ('optim.name', 'lion'),
                                         ('hdet.stop_fraction', -0.1), ('hdet.stop_fraction', 1.5),
                                         ('hdet.controller', 'climb'), ('hdet.spread', 1.0)])
def test_check_values_names_the_field(field, value):
  config_lib.check_values(_tiny())  # the tiny config itself passes
  with pytest.raises(config_lib.ConfigError, match=field.replace('.', r'\.')) as e:
    config_lib.check_values(config_lib.with_overrides(_tiny(), {field: value}))
  assert '\n' not in str(e.value)


@pytest.mark.parametrize('fraction,stop_steps', [(0.0, 0), (0.3, 12), (1.0, None)])
def test_stop_fraction_zero_stops_before_the_first_sync(fraction, stop_steps):
  """0 is allowed: the controller is past its stop at every sync (with after_stop='rise': only raises)."""
  from hdet_jax.trainer import optimizer as optimizer_lib
  config = config_lib.with_overrides(_tiny(), {'hdet.stop_fraction': fraction})
  config_lib.check_values(config)
  assert config.num_train_steps == 40 and run_settings.auto_lr_settings(config).stop_steps == stop_steps


@pytest.mark.parametrize('steps,num_syncs,want', [
    (1500, 15, (100,)), (750, 15, (50,)), (300, 15, (20,)), (1000, 15, (67,)), (40, 0, (8,)), (40, 40, (1,))])
def test_num_syncs_counts_the_windows_per_run(steps, num_syncs, want):
  """With hdet.sync_every = 0, hdet.num_syncs = K > 0 makes T = round(steps / K); a sync_every > 0 wins (8 in
  the tiny config, with K = 0 here)."""
  from hdet_jax.trainer import optimizer as optimizer_lib
  config = config_lib.with_overrides(_tiny(), {'num_train_steps': steps, 'hdet.num_syncs': num_syncs,
                                               'hdet.sync_every': 0 if num_syncs else 8})
  config_lib.check_values(config)
  assert run_settings.sync_windows(config) == want


def test_more_syncs_than_steps_is_refused():
  """Where hdet.num_syncs sets T (sync_every = 0) it must fit in the run; beside a sync_every > 0 it is unused."""
  with pytest.raises(config_lib.ConfigError, match=r'hdet\.num_syncs=41 .*num_train_steps=40') as e:
    config_lib.check_values(config_lib.with_overrides(_tiny(), {'hdet.num_syncs': 41, 'hdet.sync_every': 0}))
  assert '\n' not in str(e.value)
  config_lib.check_values(config_lib.with_overrides(_tiny(), {'hdet.num_syncs': 41}))
  with pytest.raises(config_lib.ConfigError, match=r'hdet\.num_syncs'):
    config_lib.check_values(config_lib.with_overrides(_tiny(), {'hdet.num_syncs': -1}))


def test_trainer_warmup_cosine_schedule_matches_its_closed_form():
  """optim.schedule='warmup_cosine': linear from max_lr / d to max_lr over round(pct_start S) steps, then a cosine
  down to max_lr / (d f) at the last step S - 1 (and held there)."""
  total, max_lr, pct, d, f = 200, 0.3, 0.05, 25.0, 10.0
  config = ml_collections.ConfigDict({'num_train_steps': total, 'optim': {
      'schedule': 'warmup_cosine', 'max_lr': max_lr, 'pct_start': pct, 'div_factor': d, 'final_div_factor': f}})
  sched = run_settings.schedule(config)
  lo, end, warm = max_lr / d, max_lr / (d * f), 10
  t = np.arange(total + 5, dtype=np.float64)
  up = lo + (max_lr - lo) * t / warm
  q = np.clip((t - warm) / (total - 1 - warm), 0.0, 1.0)
  down = end + (max_lr - end) * 0.5 * (1.0 + np.cos(np.pi * q))
  expected = np.where(t < warm, up, down)
  got = np.array([float(sched(int(k))) for k in t])
  np.testing.assert_allclose(got, expected, rtol=1e-5)  # float32
  assert got.argmax() == warm and got[total - 1] == pytest.approx(end, rel=1e-6)


@pytest.mark.parametrize('schedule, pct, steps, ok', [
    ('warmup_cosine', 0.05, 40, True), ('warmup_cosine', 0.99, 40, False), ('warmup_cosine', 0.3, 2, False),
    ('warmup_cosine', 0.3, 3, True), ('warmup_cosine', 0.5, 3, False), ('one_cycle', 0.3, 40, True), ('one_cycle', 0.01, 40, False),
    ('one_cycle', 0.5, 2, False)])
def test_a_warmup_that_leaves_no_decay_is_refused_before_any_work(schedule, pct, steps, ok):
  # warmup_cosine: round(0.99 * 40) = 40 warmup steps reach past the last step (39): no decay; one_cycle: its warmup
  # ends at step 0.01 * 40 - 1 < 0. Each one error naming the fields, before the schedule is built.
  config = config_lib.with_overrides(_tiny(), {'optim.schedule': schedule, 'optim.pct_start': pct,
                                               'num_train_steps': steps, 'hdet.num_syncs': 0, 'hdet.sync_every': 0,
                                               'hdet.warmup_steps': 0})
  if ok:
    config_lib.check_values(config)
    run_settings.schedule(config)(0)  # builds
    return
  with pytest.raises(config_lib.ConfigError, match=rf"optim\.pct_start={pct} with num_train_steps={steps} .*"
                                                   rf"optim\.schedule='{schedule}'") as e:
    config_lib.check_values(config)
  assert '\n' not in str(e.value)


@pytest.mark.parametrize('other', [{'hdet.controller': 'paper'}, {'hdet.auto_lr': False}])
def test_backoff_needs_the_fit_controller(other):
  config_lib.check_values(config_lib.with_overrides(_tiny(), {'hdet.backoff': True}))
  with pytest.raises(config_lib.ConfigError, match=r"hdet\.backoff=True .*hdet\.controller='fit'") as e:
    config_lib.check_values(config_lib.with_overrides(_tiny(), {'hdet.backoff': True, **other}))
  assert '\n' not in str(e.value)


@pytest.mark.parametrize('other', [{'hdet.backoff': False}, {'hdet.backoff': False, 'hdet.auto_lr': False}])
def test_rollback_needs_the_back_off(other):
  config_lib.check_values(config_lib.with_overrides(_tiny(), {'hdet.backoff': True, 'hdet.rollback': True}))
  with pytest.raises(config_lib.ConfigError, match=r"hdet\.rollback=.*needs hdet\.backoff=True") as e:
    config_lib.check_values(config_lib.with_overrides(_tiny(), {'hdet.backoff': True, 'hdet.rollback': True, **other}))
  assert '\n' not in str(e.value)


@pytest.mark.parametrize('other', [{'hdet.after_stop': 'hold'}, {'hdet.controller': 'paper'}, {'hdet.auto_lr': False}])
def test_settle_needs_the_rise_only_fit(other):
  config_lib.check_values(config_lib.with_overrides(_tiny(), {'hdet.settle': True, 'hdet.after_stop': 'rise'}))
  with pytest.raises(config_lib.ConfigError, match=r"hdet\.settle=True .*hdet\.after_stop='rise'") as e:
    config_lib.check_values(config_lib.with_overrides(_tiny(), {'hdet.settle': True, 'hdet.after_stop': 'rise', **other}))
  assert '\n' not in str(e.value)


def test_settle_left_unset_is_on_wherever_it_applies():
  """configs/default.py leaves hdet.settle at None: on for its rise-only 'fit' climb, off under the paper's
  controller, without auto-LR or with after_stop='hold' (no error there, unlike settle=True); a set value wins.
  A run's training fields, which a resume and the research's caches compare, hold what it resolves to."""
  from hdet_jax.trainer import optimizer as optimizer_lib
  default = config_lib.load_config_file(os.path.join(CONFIGS, 'default.py'))
  assert default.hdet.settle is None and config_lib.settles(default.hdet)
  for other, on in [({}, True), ({'hdet.controller': 'paper'}, False), ({'hdet.auto_lr': False}, False),
                    ({'hdet.after_stop': 'hold'}, False), ({'hdet.settle': False}, False)]:
    c = config_lib.with_overrides(config_lib.load_config_file(os.path.join(CONFIGS, 'default.py')), other)
    config_lib.check_values(c)
    assert config_lib.settles(c.hdet) is on, other
    auto_lr = run_settings.auto_lr_settings(c)
    assert (auto_lr.settle if auto_lr else False) is on, other
    assert config_lib.training_fields(c, 8).get('hdet.settle', False) is on, other  # off: a quiet default, left out
  assert config_lib.resolved({'hdet.settle': None, 'hdet.auto_lr': True, 'hdet.controller': 'fit',
                              'hdet.after_stop': 'rise'})['hdet.settle'] is True
  assert config_lib.resolved({'hdet.settle': False, 'hdet.auto_lr': True})['hdet.settle'] is False
  assert not config_lib.settles(_tiny().hdet)  # the tiny run holds after its stop: its recorded traces stand


def test_the_guard_left_unset_is_on_wherever_the_back_off_applies():
  """configs/default.py leaves the back-off's four fields at None: the 'fit' controller with auto-LR backs off on a
  rise beyond 2 se and 5% and rolls back; the paper's controller and a run without auto-LR have it off (no error,
  unlike backoff=True there); backoff=False turns all four off; a set field wins. A run's training fields hold what
  they resolve to."""
  from hdet_jax.trainer import optimizer as optimizer_lib
  default = config_lib.load_config_file(os.path.join(CONFIGS, 'default.py'))
  assert all(default.hdet[f] is None for f in ('backoff', 'rollback', 'backoff_stderrs', 'backoff_fraction'))
  on = {'backoff': True, 'rollback': True, 'backoff_stderrs': 2.0, 'backoff_fraction': 0.05}
  off = {'backoff': False, 'rollback': False, 'backoff_stderrs': 0.0, 'backoff_fraction': 0.0}
  for other, want in [({}, on), ({'hdet.controller': 'paper'}, off), ({'hdet.auto_lr': False}, off),
                      ({'hdet.backoff': False}, off), ({'hdet.rollback': False}, {**on, 'rollback': False}),
                      ({'hdet.backoff_fraction': 0.1}, {**on, 'backoff_fraction': 0.1}),
                      ({'hdet.backoff': True, 'hdet.backoff_stderrs': 0.0}, {**on, 'backoff_stderrs': 0.0}),
                      # the rollback's one copy of the optimizer state needs the replicas to share it
                      ({'hdet.low_communication': True}, {**on, 'rollback': False}),
                      ({'hdet.low_communication': True, 'hdet.average_opt_state': True}, on),
                      ({'optim.name': 'prodigy'}, {**on, 'rollback': False}), ({'optim.name': 'sgd'}, on)]:
    c = config_lib.with_overrides(config_lib.load_config_file(os.path.join(CONFIGS, 'default.py')), other)
    config_lib.check_values(c)
    assert config_lib.guard(c.hdet, c.optim.name) == want, other
    assert run_settings.resolve(c).loop.rolls_back is want['rollback'], other
    auto_lr = run_settings.auto_lr_settings(c)
    if auto_lr is not None:
      assert (auto_lr.backoff, auto_lr.backoff_stderrs, auto_lr.backoff_fraction) == (
          want['backoff'], want['backoff_stderrs'], want['backoff_fraction']), other
    fields = config_lib.training_fields(c, 8)
    assert {k: fields.get(f'hdet.{k}', off[k]) for k in on} == want, other  # off: quiet defaults, left out
  # A field set where the back-off is off is an error naming it, as before.
  for bad, name in [({'hdet.controller': 'paper', 'hdet.rollback': True}, 'rollback'),
                    ({'hdet.backoff': False, 'hdet.backoff_fraction': 0.05}, 'backoff_fraction'),
                    ({'hdet.low_communication': True, 'hdet.rollback': True}, r'rollback=True .*average_opt_state=True'),
                    ({'optim.name': 'schedule_free_adamw', 'hdet.rollback': True}, r"rollback=True .*optim.name='schedule_free_adamw'")]:
    with pytest.raises(config_lib.ConfigError, match=rf'hdet\.{name}'):
      config_lib.check_values(config_lib.with_overrides(
          config_lib.load_config_file(os.path.join(CONFIGS, 'default.py')), bad))
  # A record written before the fields existed reads as off.
  assert config_lib.guard({'auto_lr': True, 'controller': 'fit'}) == off


def test_backoff_fraction_needs_the_back_off_and_is_below_one():
  config_lib.check_values(config_lib.with_overrides(_tiny(), {'hdet.backoff': True, 'hdet.backoff_fraction': 0.05}))
  with pytest.raises(config_lib.ConfigError, match=r"hdet\.backoff_fraction=0\.05 .*needs hdet\.backoff=True") as e:
    config_lib.check_values(config_lib.with_overrides(_tiny(), {'hdet.backoff': False, 'hdet.backoff_fraction': 0.05}))
  assert '\n' not in str(e.value)
  with pytest.raises(config_lib.ConfigError, match=r'hdet\.backoff_fraction'):
    config_lib.check_values(config_lib.with_overrides(_tiny(), {'hdet.backoff': True, 'hdet.backoff_fraction': 1.5}))


def test_backoff_stderrs_needs_the_back_off():
  config_lib.check_values(config_lib.with_overrides(_tiny(), {'hdet.backoff': True, 'hdet.backoff_stderrs': 2.0}))
  with pytest.raises(config_lib.ConfigError, match=r"hdet\.backoff_stderrs=2\.0 .*needs hdet\.backoff=True"):
    config_lib.check_values(config_lib.with_overrides(_tiny(), {'hdet.backoff': False, 'hdet.backoff_stderrs': 2.0}))
  with pytest.raises(config_lib.ConfigError, match=r'hdet\.backoff_stderrs'):
    config_lib.check_values(config_lib.with_overrides(_tiny(), {'hdet.backoff': True, 'hdet.backoff_stderrs': -1.0}))


def test_sync_every_wins_over_num_syncs_and_both_zero_never_syncs():
  from hdet_jax.trainer import optimizer as optimizer_lib
  config = config_lib.with_overrides(_tiny(), {'hdet.num_syncs': 4})
  assert config.hdet.sync_every == 8 and run_settings.sync_windows(config) == (8,)
  config = config_lib.with_overrides(_tiny(), {'hdet.num_syncs': 0, 'hdet.sync_every': 0})
  assert run_settings.resolve(config).loop.never_syncs and run_settings.sync_windows(config) == (41,)


@pytest.mark.parametrize('steps,want', [(300, 20), (750, 50), (1500, 100), (3000, 100), (1000, 67)])
def test_longest_window_caps_the_windows_counted_per_run(steps, want):
  """The default's 15 windows per run are at most hdet.longest_window = 100 steps; 0 lifts the cap; an explicit
  hdet.sync_every is not capped."""
  from hdet_jax.trainer import optimizer as optimizer_lib
  default = config_lib.load_config_file(os.path.join(CONFIGS, 'default.py'))
  config = config_lib.with_overrides(default, {'num_train_steps': steps})
  assert (config.hdet.sync_every, config.hdet.num_syncs, config.hdet.longest_window) == (0, 15, 100)
  assert run_settings.sync_windows(config) == (want,)
  uncapped = config_lib.with_overrides(config, {'hdet.longest_window': 0})
  assert run_settings.sync_windows(uncapped) == (round(steps / 15),)
  assert run_settings.sync_windows(config_lib.with_overrides(config, {'hdet.sync_every': 250})) == (250,)



REMOVED_1_0 = ['hdet.fan', 'hdet.score_tail', 'hdet.score_anneal', 'hdet.early_sync_every', 'hdet.early_sync_steps',
               'hdet.overshoot', 'optim.anneal_at_step', 'optim.anneal_steps', 'bracket.anneal', 'log_noise_scale']


def test_the_fields_removed_in_1_0_are_listed_and_gone_from_every_config():
  """The knobs measured and not adopted left the product in 1.0: no shipped config has one, and each is listed with
  what to use instead."""
  assert sorted(config_lib.REMOVED) == sorted(REMOVED_1_0)
  for name in sorted(os.listdir(CONFIGS)):
    if name.endswith('.py'):
      flat = config_lib.flatten(config_lib.load_config_file(os.path.join(CONFIGS, name)))
      assert not set(flat) & set(REMOVED_1_0), name


@pytest.mark.parametrize('field', REMOVED_1_0)
def test_a_config_naming_a_removed_field_stops_with_one_line_saying_so(field):
  """A config of an older version (a user's copy of default.py) that still sets a removed field: one line, naming
  the field, the version and what to use instead, before anything runs."""
  config = _tiny()
  node, *path = [config] + field.split('.')[:-1]
  for part in path:
    node = node[part]
  with config.unlocked():
    node[field.split('.')[-1]] = 0
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.check_values(config)
  message = str(e.value)
  assert message.startswith(f'{field} was removed in hdet-jax 1.0: ') and 'remove the field' in message
  assert '\n' not in message
