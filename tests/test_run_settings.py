"""The config resolved once (run_settings.resolve): each part's settings, against the config's documented meaning."""

import json
import os

import ml_collections
import numpy as np
import optax
import pytest

import hdet_jax
from hdet_jax import settings
from hdet_jax.trainer import compat
from hdet_jax.trainer import config_lib
from hdet_jax.trainer import optimizer as optimizer_lib
from hdet_jax.trainer import run_settings
from hdet_jax.trainer import schema
import trainer_testing

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs')


def _config(name='default', **overrides):
  return trainer_testing.load(os.path.join(CONFIGS, f'{name}.py'), **overrides)


# Base optimizers given in Python (the product's optim.name names adamw, adam and sgd): research's LR-free peers.
PRODIGY = optimizer_lib.Base('prodigy', optax.contrib.prodigy)
SCHEDULE_FREE = optimizer_lib.Base('schedule_free_adamw', optax.contrib.schedule_free_adamw, schedule_free=True)
PLATEAU = optimizer_lib.Base(
  'adam_plateau', lambda lr: optax.chain(optax.adam(lr), optax.contrib.reduce_on_plateau()), plateau=True
)


def _tiny():
  return trainer_testing.tiny()


def _tiny_seed(seed):
  return config_lib.with_overrides(_tiny(), {'seed': seed})


def _completed(config):
  """``config``'s fields, flattened and completed from the schema: what the functions below resolve() read."""
  return schema.complete(config_lib.flatten(config))


def test_the_default_config_resolves_to_the_libraries_default_and_its_loop():
  run = trainer_testing.resolve(_config())
  steps = run.loop.num_train_steps
  # The library's default initial_scale, None, is 0.1 around a factory (the trainer's optimizer); the config says it.
  library_default = hdet_jax.AutoLR(total_steps=steps, initial_scale=settings.DEFAULT_INITIAL_SCALE)
  assert steps == 1500 and run.optimizer.auto_lr == library_default
  # The window: round(1500 / 15) = 100 steps, the cap; the guard on (it rolls back), the common batch scores.
  assert run.optimizer.windows == (100,)
  assert (run.guard.rollback, run.programs.rolls_back, run.programs.common_batch) == (True,) * 3
  assert run.controller == 'fit' and run.loop.lr_unit == 1.0 and run.programs.hyperparam_names == ('learning_rate',)
  assert run.loop.end == steps and not run.never_syncs
  # each fact two parts read is held by one of them (the windows the optimizer's, the rollback the guard's, ...)
  assert not {'windows', 'rolls_back', 'common_batch', 'hyperparam_names', 'controller'} & set(run.loop._fields)
  assert (run.mesh.num_replicas, run.mesh.fsdp, run.mesh.tensor, run.mesh.batch_size) == (8, 1, 1, 8)
  assert run.programs.shares_gradient and not (run.programs.plateau or run.programs.schedule_free)
  assert run.init_from is None and run.task.name == 'lm' and run.given['num_train_steps'] == steps


def test_the_loops_sync_steps_and_sync_index_follow_the_window():
  run = trainer_testing.resolve(_config('tiny', **{'hdet.sync_every': 8, 'stop_at_step': 30}))
  loop = run.loop
  want = [t for t in range(loop.num_train_steps) if (t + 1) % 8 == 0]  # the update of step t ends window (t+1)/8
  assert [t for t in range(loop.num_train_steps) if run.is_sync_step(t)] == want
  assert [run.sync_index(t) for t in want] == list(range(len(want)))
  assert loop.end == 30 and trainer_testing.resolve(_config('tiny', stop_at_step=500)).loop.end == loop.num_train_steps
  never = trainer_testing.resolve(_config('tiny', **{'hdet.sync_every': 0, 'hdet.num_syncs': 0}))
  assert never.never_syncs and not any(never.is_sync_step(t) for t in range(never.loop.num_train_steps))


@pytest.mark.parametrize(
  'overrides, rolls_back',
  [
    ({}, True),
    ({'optimizer': PRODIGY}, False),  # LR-dependent state: no one copy to return to
    ({'hdet.low_communication': True}, False),  # each replica's own state
    ({'hdet.low_communication': True, 'hdet.average_opt_state': True}, True),
    ({'hdet.controller': 'paper'}, False),  # the guard is the 'fit' controller's
  ],
)
def test_the_guard_is_resolved_once_for_the_controller_the_loop_and_the_programs(overrides, rolls_back):
  overrides = dict(overrides)
  base = overrides.pop('optimizer', None)
  config = _config(**overrides)
  run = trainer_testing.resolve(config, base)
  guard = run_settings.guard({**_completed(config), **({'optim.name': base.name} if base else {})})
  assert run.guard == guard
  assert run.programs.rolls_back is guard.rollback is rolls_back
  if config.hdet.controller == 'fit':
    a = run.optimizer.auto_lr
    assert (
      (a.backoff, a.backoff_stderrs, a.backoff_fraction)
      == (guard.backoff, guard.backoff_stderrs, guard.backoff_fraction)
      == (True, 2.0, 0.05)
    )
  else:
    assert run.optimizer.auto_lr.controller == 'paper'
  assert run.programs.shares_gradient is not overrides.get('hdet.low_communication', False)


def test_regularization_and_optimizer_choices_reach_the_programs():
  run = trainer_testing.resolve(
    _config(
      **{
        'model.dropout': 0.1,
        'optim.label_smoothing': 0.05,
        'seed': 7,
        'hdet.auto_lr': False,
      }
    ),
    PLATEAU,
  )
  p = run.programs
  assert (p.dropout, p.label_smoothing, run.seed, p.plateau, p.schedule_free) == (0.1, 0.05, 7, True, False)
  # the seed is said once, the run's: the parts take it as an argument (make_optimizer, the programs, Task.load)
  assert [t for t in (run, p, run.optimizer, run.task_settings, run.loop) if 'seed' in t._fields] == [run]
  assert run.controller is None and run.optimizer.auto_lr is None and not run.programs.common_batch
  explored = trainer_testing.resolve(_config(**{'hdet.explore.dropout': 0.05, 'hdet.explore.weight_decay': 0.5}))
  assert explored.programs.hyperparam_names == ('learning_rate', 'weight_decay', 'dropout')
  assert trainer_testing.resolve(_config(), SCHEDULE_FREE).programs.schedule_free


def test_the_lrs_power_of_two_is_resolved_for_the_schedule_and_the_loop():
  run = trainer_testing.resolve(
    _config(**{'optim.runtime_lr_scale': True, 'hdet.auto_lr': False, 'optim.max_lr': 0.01})
  )
  assert run.loop.lr_unit == 2.0**-6  # 0.01 = 0.64 * 2**-6
  plain = trainer_testing.resolve(_config(**{'optim.max_lr': 0.01})).optimizer.schedule
  assert all(
    float(run.optimizer.schedule(t)) * run.loop.lr_unit == pytest.approx(float(plain(t)), rel=1e-6)
    for t in (0, 300, 1499)
  )


@pytest.mark.parametrize(
  'overrides, message',
  [
    ({'hdet.spread': 1.5}, r'hdet\.spread must be in \[0, 1\)'),  # a field's own rule (config_lib)
    (
      {'hdet.explore.weight_decay': 0.5, 'optim.name': 'sgd'},
      r'^config: hdet\.explore\.weight_decay needs optim\.name=adamw',
    ),
    ({'hdet.fan': 'geometric'}, r'hdet\.fan was removed in hdet-jax 1\.0'),
  ],
)
def test_a_bad_config_stops_in_resolve_with_one_line_naming_the_field(overrides, message):
  config = _config()
  with config.unlocked():
    config_lib.with_overrides(config, {k: v for k, v in overrides.items() if k != 'hdet.fan'})
    if 'hdet.fan' in overrides:
      config.hdet.fan = overrides['hdet.fan']
  with pytest.raises(config_lib.ConfigError, match=message) as e:
    trainer_testing.resolve(config)
  assert '\n' not in str(e.value)


def test_a_model_hyperparameter_the_task_lacks_stops_in_resolve():
  config = _config('mnist1d', **{'hdet.explore.attn_temperature': 0.1})
  with pytest.raises(
    config_lib.ConfigError, match=r"hdet\.explore\.attn_temperature: the mnist1d task's model has no attn_temperature"
  ):
    trainer_testing.resolve(config)


def test_training_fields_leave_out_what_only_steers_a_run():
  """A resumed run may change how it logs, evaluates and checkpoints, not what it trains; N is resolved."""
  a = trainer_testing.resolve(_tiny()).training_fields(8)
  steer = {
    f: {'plots': False, 'log_every': 7, 'tensorboard': False, 'compilation_cache': '/x'}.get(f, 3)
    for f in ('plots', 'log_every', 'tensorboard', 'compilation_cache', 'eval_every', 'checkpoint_every')
  }
  assert trainer_testing.resolve(config_lib.with_overrides(_tiny(), steer)).training_fields(8) == a
  assert not set(a) & schema.LOOP_FIELDS and a['hdet.num_replicas'] == 8
  b = trainer_testing.resolve(config_lib.with_overrides(_tiny(), {'hdet.spread': 0.2, 'seed': 1})).training_fields(8)
  assert schema.differences(a, b) == 'hdet.spread: 0.25 -> 0.2, seed: 0 -> 1'
  assert 'and 1 more' in schema.differences(a, {**b, 'x': 1, 'y': 2, 'z': 3}, limit=4)


@pytest.mark.parametrize(
  'field,value',
  [
    ('hdet.spread', 1.5),
    ('optim.max_lr', 0.0),
    ('data.batch_size', 0),
    ('hdet.warmup_steps', 40),
    ('optim.name', 'lion'),
    ('hdet.stop_fraction', -0.1),
    ('hdet.stop_fraction', 1.5),
    ('hdet.controller', 'climb'),
    ('hdet.spread', 1.0),
  ],
)
def test_resolve_names_the_field(field, value):
  trainer_testing.resolve(_tiny())  # the tiny config itself passes
  with pytest.raises(config_lib.ConfigError, match=field.replace('.', r'\.')) as e:
    trainer_testing.resolve(config_lib.with_overrides(_tiny(), {field: value}))
  assert '\n' not in str(e.value)


@pytest.mark.parametrize('fraction,stop_steps', [(0.0, 0), (0.3, 12), (1.0, None)])
def test_stop_fraction_zero_stops_before_the_first_sync(fraction, stop_steps):
  """0 is allowed: the controller is past its stop at every sync (with after_stop='rise': only raises)."""
  config = config_lib.with_overrides(_tiny(), {'hdet.stop_fraction': fraction})
  run = trainer_testing.resolve(config)
  assert config.num_train_steps == 40 and run.optimizer.auto_lr.stop_steps == stop_steps


@pytest.mark.parametrize(
  'steps,num_syncs,want',
  [(1500, 15, (100,)), (750, 15, (50,)), (300, 15, (20,)), (1000, 15, (67,)), (40, 0, (8,)), (40, 40, (1,))],
)
def test_num_syncs_counts_the_windows_per_run(steps, num_syncs, want):
  """With hdet.sync_every = 0, hdet.num_syncs = K > 0 makes T = round(steps / K); a sync_every > 0 wins (8 in
  the tiny config, with K = 0 here)."""
  config = config_lib.with_overrides(
    _tiny(), {'num_train_steps': steps, 'hdet.num_syncs': num_syncs, 'hdet.sync_every': 0 if num_syncs else 8}
  )
  assert trainer_testing.resolve(config).optimizer.windows == want


def test_more_syncs_than_steps_is_refused():
  """Where hdet.num_syncs sets T (sync_every = 0) it must fit in the run; beside a sync_every > 0 it is unused."""
  with pytest.raises(config_lib.ConfigError, match=r'hdet\.num_syncs=41 .*num_train_steps=40') as e:
    trainer_testing.resolve(config_lib.with_overrides(_tiny(), {'hdet.num_syncs': 41, 'hdet.sync_every': 0}))
  assert '\n' not in str(e.value)
  trainer_testing.resolve(config_lib.with_overrides(_tiny(), {'hdet.num_syncs': 41}))
  with pytest.raises(config_lib.ConfigError, match=r'hdet\.num_syncs'):
    trainer_testing.resolve(config_lib.with_overrides(_tiny(), {'hdet.num_syncs': -1}))


def test_trainer_warmup_cosine_schedule_matches_its_closed_form():
  """optim.schedule='warmup_cosine': linear from max_lr / d to max_lr over round(pct_start S) steps, then a cosine
  down to max_lr / (d f) at the last step S - 1 (and held there)."""
  total, max_lr, pct, d, f = 200, 0.3, 0.05, 25.0, 10.0
  config = ml_collections.ConfigDict(
    {
      'num_train_steps': total,
      'optim': {
        'schedule': 'warmup_cosine',
        'max_lr': max_lr,
        'pct_start': pct,
        'div_factor': d,
        'final_div_factor': f,
      },
    }
  )
  sched = run_settings.schedule(schema.complete(config_lib.flatten(config)))
  lo, end, warm = max_lr / d, max_lr / (d * f), 10
  t = np.arange(total + 5, dtype=np.float64)
  up = lo + (max_lr - lo) * t / warm
  q = np.clip((t - warm) / (total - 1 - warm), 0.0, 1.0)
  down = end + (max_lr - end) * 0.5 * (1.0 + np.cos(np.pi * q))
  expected = np.where(t < warm, up, down)
  got = np.array([float(sched(int(k))) for k in t])
  np.testing.assert_allclose(got, expected, rtol=1e-5)  # float32
  assert got.argmax() == warm and got[total - 1] == pytest.approx(end, rel=1e-6)


@pytest.mark.parametrize(
  'schedule, pct, steps, ok',
  [
    ('warmup_cosine', 0.05, 40, True),
    ('warmup_cosine', 0.99, 40, False),
    ('warmup_cosine', 0.3, 2, False),
    ('warmup_cosine', 0.3, 3, True),
    ('warmup_cosine', 0.5, 3, False),
    ('one_cycle', 0.3, 40, True),
    ('one_cycle', 0.01, 40, False),
    ('one_cycle', 0.5, 2, False),
  ],
)
def test_a_warmup_that_leaves_no_decay_is_refused_before_any_work(schedule, pct, steps, ok):
  # warmup_cosine: round(0.99 * 40) = 40 warmup steps reach past the last step (39): no decay; one_cycle: its warmup
  # ends at step 0.01 * 40 - 1 < 0. Each one error naming the fields, before the schedule is built.
  config = config_lib.with_overrides(
    _tiny(),
    {
      'optim.schedule': schedule,
      'optim.pct_start': pct,
      'num_train_steps': steps,
      'hdet.num_syncs': 0,
      'hdet.sync_every': 0,
      'hdet.warmup_steps': 0,
    },
  )
  if ok:
    trainer_testing.resolve(config).optimizer.schedule(0)  # builds
    return
  with pytest.raises(
    config_lib.ConfigError,
    match=rf'optim\.pct_start={pct} with num_train_steps={steps} .*'
    rf"optim\.schedule='{schedule}'",
  ) as e:
    trainer_testing.resolve(config)
  assert '\n' not in str(e.value)


@pytest.mark.parametrize('other', [{'hdet.controller': 'paper'}, {'hdet.auto_lr': False}])
def test_backoff_needs_the_fit_controller(other):
  trainer_testing.resolve(config_lib.with_overrides(_tiny(), {'hdet.backoff': True}))
  with pytest.raises(config_lib.ConfigError, match=r"hdet\.backoff=True .*hdet\.controller='fit'") as e:
    trainer_testing.resolve(config_lib.with_overrides(_tiny(), {'hdet.backoff': True, **other}))
  assert '\n' not in str(e.value)


@pytest.mark.parametrize('other', [{'hdet.backoff': False}, {'hdet.backoff': False, 'hdet.auto_lr': False}])
def test_rollback_needs_the_back_off(other):
  trainer_testing.resolve(config_lib.with_overrides(_tiny(), {'hdet.backoff': True, 'hdet.rollback': True}))
  with pytest.raises(
    config_lib.ConfigError, match=r"hdet\.rollback=True .*needs the guard: the 'fit' controller with hdet\.backoff=True"
  ) as e:
    trainer_testing.resolve(config_lib.with_overrides(_tiny(), {'hdet.backoff': True, 'hdet.rollback': True, **other}))
  assert '\n' not in str(e.value)


@pytest.mark.parametrize('other', [{'hdet.after_stop': 'hold'}, {'hdet.controller': 'paper'}, {'hdet.auto_lr': False}])
def test_settle_needs_the_rise_only_fit(other):
  trainer_testing.resolve(config_lib.with_overrides(_tiny(), {'hdet.settle': True, 'hdet.after_stop': 'rise'}))
  with pytest.raises(config_lib.ConfigError, match=r"hdet\.settle=True .*hdet\.after_stop='rise'") as e:
    trainer_testing.resolve(
      config_lib.with_overrides(_tiny(), {'hdet.settle': True, 'hdet.after_stop': 'rise', **other})
    )
  assert '\n' not in str(e.value)


def test_the_anneal_rule_is_the_core_s_and_records_before_it_read_as_the_default():
  """hdet.anneal_fraction (issue 86), left at None: the default config's climb gets the core's AutoLR default
  (0: off, opt-in); where it does not apply (the paper's controller, no auto-LR) it is 0. None is what a config
  written before the field (a committed record's, a 1.0 workdir's) reads as, so it stays out of the training fields
  and those resume; the tiny test run keeps 1.0's controller, without the rule (0, in its training fields)."""
  run = trainer_testing.resolve(_config())
  assert run.optimizer.auto_lr.anneal_fraction == hdet_jax.AutoLR(total_steps=2).anneal_fraction == 0.0
  assert 'hdet.anneal_fraction' not in run.training_fields(8)
  for other in ({'hdet.controller': 'paper'}, {'hdet.auto_lr': False}):
    assert run_settings.anneals(_completed(config_lib.with_overrides(_config(), other))) == 0.0
  flat = config_lib.flatten(_config())
  del flat['hdet.anneal_fraction']
  assert schema.complete(flat)['hdet.anneal_fraction'] is None
  tiny = trainer_testing.resolve(_tiny())
  assert tiny.optimizer.auto_lr.anneal_fraction == 0.0 and tiny.training_fields(8)['hdet.anneal_fraction'] == 0.0


def test_settle_left_unset_is_on_wherever_it_applies():
  """configs/default.py leaves hdet.settle at None: on for its rise-only 'fit' climb, off under the paper's
  controller, without auto-LR or with after_stop='hold' (no error there, unlike settle=True); a set value wins.
  A run's training fields, which a resume and the research's caches compare, hold what it resolves to."""
  default = trainer_testing.load('default')
  assert default.hdet.settle is None and run_settings.settles(_completed(default))
  for other, on in [
    ({}, True),
    ({'hdet.controller': 'paper'}, False),
    ({'hdet.auto_lr': False}, False),
    ({'hdet.after_stop': 'hold'}, False),
    ({'hdet.settle': False}, False),
  ]:
    c = config_lib.with_overrides(trainer_testing.load('default'), other)
    run = trainer_testing.resolve(c)
    assert run_settings.settles(_completed(c)) is on, other
    auto_lr = run.optimizer.auto_lr
    assert (auto_lr.settle if auto_lr else False) is on, other
    assert run.training_fields(8).get('hdet.settle', False) is on, other  # off: a quiet default, left out
  assert (
    run_settings.resolved(
      {'hdet.settle': None, 'hdet.auto_lr': True, 'hdet.controller': 'fit', 'hdet.after_stop': 'rise'}
    )['hdet.settle']
    is True
  )
  assert run_settings.resolved({'hdet.settle': False, 'hdet.auto_lr': True})['hdet.settle'] is False
  assert not run_settings.settles(_completed(_tiny()))  # the tiny run holds after its stop: its recorded traces stand


def test_the_guard_left_unset_is_on_wherever_the_back_off_applies():
  """configs/default.py leaves the back-off's four fields at None: the 'fit' controller with auto-LR backs off on a
  rise beyond 2 se and 5% and rolls back; the paper's controller and a run without auto-LR have it off (no error,
  unlike backoff=True there); backoff=False turns all four off; a set field wins. A run's training fields hold what
  they resolve to."""
  default = trainer_testing.load('default')
  assert all(default.hdet[f] is None for f in ('backoff', 'rollback', 'backoff_stderrs', 'backoff_fraction'))
  on = {'backoff': True, 'rollback': True, 'backoff_stderrs': 2.0, 'backoff_fraction': 0.05}
  off = {'backoff': False, 'rollback': False, 'backoff_stderrs': 0.0, 'backoff_fraction': 0.0}
  for other, want in [
    ({}, on),
    ({'hdet.controller': 'paper'}, off),
    ({'hdet.auto_lr': False}, off),
    ({'hdet.backoff': False}, off),
    ({'hdet.rollback': False}, {**on, 'rollback': False}),
    ({'hdet.backoff_fraction': 0.1}, {**on, 'backoff_fraction': 0.1}),
    ({'hdet.backoff': True, 'hdet.backoff_stderrs': 0.0}, {**on, 'backoff_stderrs': 0.0}),
    # the rollback's one copy of the optimizer state needs the replicas to share it
    ({'hdet.low_communication': True}, {**on, 'rollback': False}),
    ({'hdet.low_communication': True, 'hdet.average_opt_state': True}, on),
    ({'optimizer': PRODIGY}, {**on, 'rollback': False}),
    ({'optim.name': 'sgd'}, on),
  ]:
    other = dict(other)
    base = other.pop('optimizer', None)
    c = config_lib.with_overrides(trainer_testing.load('default'), other)
    run = trainer_testing.resolve(c, base)
    assert run.guard._asdict() == want, other
    assert run.guard.rollback is want['rollback'], other
    auto_lr = run.optimizer.auto_lr
    if auto_lr is not None:
      assert (auto_lr.backoff, auto_lr.backoff_stderrs, auto_lr.backoff_fraction) == (
        want['backoff'],
        want['backoff_stderrs'],
        want['backoff_fraction'],
      ), other
    fields = run.training_fields(8)
    assert {k: fields.get(f'hdet.{k}', off[k]) for k in on} == want, other  # off: quiet defaults, left out
  # A field set where the back-off is off is an error naming it, as before.
  for bad, name in [
    ({'hdet.controller': 'paper', 'hdet.rollback': True}, 'rollback'),
    ({'hdet.backoff': False, 'hdet.backoff_fraction': 0.05}, 'backoff_fraction'),
    ({'hdet.low_communication': True, 'hdet.rollback': True}, r'rollback=True .*average_opt_state=True'),
    ({'optimizer': SCHEDULE_FREE, 'hdet.rollback': True}, r"rollback=True .*optim.name='schedule_free_adamw'"),
  ]:
    bad = dict(bad)
    base = bad.pop('optimizer', None)
    with pytest.raises(config_lib.ConfigError, match=rf'hdet\.{name}'):
      trainer_testing.resolve(config_lib.with_overrides(trainer_testing.load('default'), bad), base)
  # A record written before the fields existed reads as off.
  assert run_settings.guard(schema.complete({'hdet.auto_lr': True, 'hdet.controller': 'fit'}))._asdict() == off


def test_backoff_fraction_needs_the_back_off_and_is_below_one():
  """The core's rule (hdet_jax.settings.check_auto_lr), in its words, naming the config's fields."""
  trainer_testing.resolve(config_lib.with_overrides(_tiny(), {'hdet.backoff': True, 'hdet.backoff_fraction': 0.05}))
  says = r'^hdet\.backoff_fraction must be a number in \[0, 1\), and > 0 only with hdet\.backoff=True; got 0\.05\.$'
  with pytest.raises(config_lib.ConfigError, match=says) as e:
    trainer_testing.resolve(config_lib.with_overrides(_tiny(), {'hdet.backoff': False, 'hdet.backoff_fraction': 0.05}))
  assert '\n' not in str(e.value)
  with pytest.raises(config_lib.ConfigError, match=r'hdet\.backoff_fraction'):
    trainer_testing.resolve(config_lib.with_overrides(_tiny(), {'hdet.backoff': True, 'hdet.backoff_fraction': 1.5}))


def test_backoff_stderrs_needs_the_back_off():
  trainer_testing.resolve(config_lib.with_overrides(_tiny(), {'hdet.backoff': True, 'hdet.backoff_stderrs': 2.0}))
  with pytest.raises(
    config_lib.ConfigError, match=r'^hdet\.backoff_stderrs must be .*> 0 only with hdet\.backoff=True; got 2\.0\.$'
  ):
    trainer_testing.resolve(config_lib.with_overrides(_tiny(), {'hdet.backoff': False, 'hdet.backoff_stderrs': 2.0}))
  with pytest.raises(config_lib.ConfigError, match=r'hdet\.backoff_stderrs'):
    trainer_testing.resolve(config_lib.with_overrides(_tiny(), {'hdet.backoff': True, 'hdet.backoff_stderrs': -1.0}))


def test_sync_every_wins_over_num_syncs_and_both_zero_never_syncs():
  config = config_lib.with_overrides(_tiny(), {'hdet.num_syncs': 4})
  assert config.hdet.sync_every == 8 and trainer_testing.resolve(config).optimizer.windows == (8,)
  config = config_lib.with_overrides(_tiny(), {'hdet.num_syncs': 0, 'hdet.sync_every': 0})
  run = trainer_testing.resolve(config)
  assert run.never_syncs and run.optimizer.windows == (41,)


@pytest.mark.parametrize('steps,want', [(300, 20), (750, 50), (1500, 100), (3000, 100), (1000, 67)])
def test_longest_window_caps_the_windows_counted_per_run(steps, want):
  """The default's 15 windows per run are at most hdet.longest_window = 100 steps; 0 lifts the cap; an explicit
  hdet.sync_every is not capped."""
  default = trainer_testing.load('default')
  config = config_lib.with_overrides(default, {'num_train_steps': steps})
  assert (config.hdet.sync_every, config.hdet.num_syncs, config.hdet.longest_window) == (0, 15, 100)
  assert trainer_testing.resolve(config).optimizer.windows == (want,)
  uncapped = config_lib.with_overrides(config, {'hdet.longest_window': 0})
  assert trainer_testing.resolve(uncapped).optimizer.windows == (round(steps / 15),)
  assert trainer_testing.resolve(config_lib.with_overrides(config, {'hdet.sync_every': 250})).optimizer.windows == (
    250,
  )


def test_a_workdir_written_before_fields_at_their_legacy_value_still_resumes(tmp_path):
  """A config written before fields that train, at their legacy value, as it did (hdet.after_stop='hold', as the tiny
  config sets it; mesh.fsdp=1; optim.runtime_lr_scale=False; ...) has the training fields of today's config, which
  leaves them out; so today's run resumes the workdir that config wrote, and a different config is still refused."""
  from hdet_jax.trainer import checks

  config = _tiny()
  fields = trainer_testing.resolve(config).training_fields(8)
  given = config_lib.flatten(json.loads(config.to_json()))
  at_legacy = [
    k for k, v in run_settings.resolved(given).items() if k in compat.QUIET_DEFAULTS and v == compat.QUIET_DEFAULTS[k]
  ]
  assert {'hdet.after_stop', 'mesh.fsdp', 'optim.runtime_lr_scale'} <= set(at_legacy)
  assert config.hdet.after_stop == 'hold' and not set(at_legacy) & set(fields)  # already left out
  older = _tiny()
  with older.unlocked():
    for name in at_legacy:
      *path, last = name.split('.')
      node = older
      for part in path:
        node = node[part]
      del node[last]
  older_given = config_lib.flatten(json.loads(older.to_json()))
  assert not set(at_legacy) & set(older_given)
  old_fields = trainer_testing.resolve(older).training_fields(8)
  assert old_fields == fields
  (tmp_path / 'config.json').write_text(
    json.dumps({'training_fields': old_fields, 'config': config_lib.unflatten(older_given)})
  )
  assert checks.check_workdir(str(tmp_path), fields) is False  # (no checkpoints: nothing to resume yet)
  with pytest.raises(config_lib.ConfigError, match=r'different config \(seed: 0 -> 1\)'):
    checks.check_workdir(str(tmp_path), trainer_testing.resolve(_tiny_seed(1)).training_fields(8))


# ---- Research's tuning fields, given in Python (issue 75). ----


def test_a_tuning_field_given_in_python_trains_and_is_recorded_as_before():
  """tuning={'hdet.trust': 0.5} reaches the controller and the run's recorded fields under the name records have;
  the same run written as a record-form config (research's) and split resolves to the same fields."""
  plain = run_settings.resolve(config_lib.load_config_file(os.path.join(CONFIGS, 'default.py')))
  tuned = run_settings.resolve(
    config_lib.load_config_file(os.path.join(CONFIGS, 'default.py')), tuning={'hdet.trust': 0.5}
  )
  assert plain.optimizer.auto_lr.trust == 1.0 and tuned.optimizer.auto_lr.trust == 0.5
  assert plain.training_fields(8)['hdet.trust'] == 1.0 and tuned.training_fields(8)['hdet.trust'] == 0.5
  record = run_settings.recorded_config(config_lib.load_config_file(os.path.join(CONFIGS, 'default.py')))
  assert record.hdet.trust == 1.0 and record.hdet.score == 'common' and record.stop_at_step == 0
  record.hdet.trust = 0.5
  config, tuning = run_settings.split(record)
  assert 'trust' not in config.hdet and tuning['hdet.trust'] == 0.5 and len(tuning) == 22
  assert run_settings.resolve(config, tuning=tuning).training_fields(8) == tuned.training_fields(8)


def test_a_tuning_field_in_the_config_or_a_config_field_in_tuning_is_one_line_naming_it():
  config = config_lib.load_config_file(os.path.join(CONFIGS, 'default.py'))
  config.hdet.trust = 0.5  # (a config written before 1.1, or a study's passed as it is)
  with pytest.raises(
    config_lib.ConfigError, match=r"hdet\.trust is no longer a config field .*tuning=\{'hdet\.trust': 0\.5\}"
  ):
    run_settings.resolve(config)
  with pytest.raises(config_lib.ConfigError, match=r"tuning: 'hdet\.spread' is not a tuning field .*in the config"):
    run_settings.resolve(config_lib.load_config_file(os.path.join(CONFIGS, 'default.py')), tuning={'hdet.spread': 0.1})
  with pytest.raises(
    config_lib.ConfigError, match=r'hdet\.trust must be > 0 \(the largest log-step per sync\), got -1'
  ):
    run_settings.resolve(config_lib.load_config_file(os.path.join(CONFIGS, 'default.py')), tuning={'hdet.trust': -1})


def test_the_paper_controller_alone_is_the_papers_method_at_its_values():
  """--config.hdet.controller=paper, nothing else: hdet_jax.AutoLR.paper's values (acting to the end, its
  temperature, lr_of_lr and momentum), the replicas scored on their window losses; research's tuning still wins."""
  config = config_lib.with_overrides(
    config_lib.load_config_file(os.path.join(CONFIGS, 'default.py')), {'hdet.controller': 'paper'}
  )
  run = run_settings.resolve(config)
  a, want = run.optimizer.auto_lr, hdet_jax.AutoLR.paper(total_steps=1500)
  assert (a.controller, a.stop_steps, a.warmup_steps, a.temperature, a.lr_of_lr, a.momentum) == (
    'paper',
    None,
    want.warmup_steps,
    want.temperature,
    want.lr_of_lr,
    want.momentum,
  )
  assert not run.programs.common_batch and run.training_fields(8)['hdet.score'] == 'window'
  common = run_settings.resolve(config, tuning={'hdet.score': 'common', 'hdet.stop_fraction': 0.5})
  assert common.programs.common_batch and common.optimizer.auto_lr.stop_steps == 750
