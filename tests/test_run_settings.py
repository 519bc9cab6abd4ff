"""The config resolved once (run_settings.resolve): each part's settings, against the config's documented meaning."""

import os

import pytest

import hdet_jax
from hdet_jax.trainer import config_lib
from hdet_jax.trainer import run_settings

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs')


def _config(name='default', **overrides):
  return config_lib.with_overrides(config_lib.load_config_file(os.path.join(CONFIGS, f'{name}.py')), overrides)


def test_the_default_config_resolves_to_the_libraries_default_and_its_loop():
  run = run_settings.resolve(_config())
  steps = run.loop.num_train_steps
  assert steps == 1500 and run.optimizer.auto_lr == hdet_jax.AutoLR(total_steps=steps)
  # The window: round(1500 / 15) = 100 steps, the cap; the guard on (it rolls back), the common batch scores.
  assert run.loop.windows == run.optimizer.windows == (100,)
  assert (run.loop.rolls_back, run.programs.rolls_back, run.loop.common_batch, run.programs.common_batch) == (True,) * 4
  assert run.loop.controller == 'fit' and run.loop.lr_unit == 1.0 and run.loop.hyperparam_names == ('learning_rate',)
  assert run.loop.end == steps and not run.loop.never_syncs
  assert (run.mesh.num_replicas, run.mesh.fsdp, run.mesh.tensor, run.mesh.batch_size) == (8, 1, 1, 8)
  assert run.programs.shares_gradient and not (run.programs.plateau or run.programs.schedule_free)
  assert run.init_from is None and run.task.name == 'lm' and run.config.num_train_steps == steps


def test_the_loops_sync_steps_and_sync_index_follow_the_window():
  run = run_settings.resolve(_config('tiny', **{'hdet.sync_every': 8, 'stop_at_step': 30}))
  loop = run.loop
  want = [t for t in range(loop.num_train_steps) if (t + 1) % 8 == 0]  # the update of step t ends window (t+1)/8
  assert [t for t in range(loop.num_train_steps) if loop.is_sync_step(t)] == want
  assert [loop.sync_index(t) for t in want] == list(range(len(want)))
  assert loop.end == 30 and run_settings.resolve(_config('tiny', stop_at_step=500)).loop.end == loop.num_train_steps
  never = run_settings.resolve(_config('tiny', **{'hdet.sync_every': 0, 'hdet.num_syncs': 0})).loop
  assert never.never_syncs and not any(never.is_sync_step(t) for t in range(never.num_train_steps))


@pytest.mark.parametrize('overrides, rolls_back', [
    ({}, True),
    ({'optim.name': 'prodigy'}, False),  # LR-dependent state: no one copy to return to
    ({'hdet.low_communication': True}, False),  # each replica's own state
    ({'hdet.low_communication': True, 'hdet.average_opt_state': True}, True),
    ({'hdet.controller': 'paper'}, False),  # the guard is the 'fit' controller's
])
def test_the_guard_is_resolved_once_for_the_controller_the_loop_and_the_programs(overrides, rolls_back):
  config = _config(**overrides)
  run = run_settings.resolve(config)
  guard = config_lib.guard(config.hdet, config.optim.name)
  assert run.loop.rolls_back is run.programs.rolls_back is guard['rollback'] is rolls_back
  if config.hdet.controller == 'fit':
    a = run.optimizer.auto_lr
    assert (a.backoff, a.backoff_stderrs, a.backoff_fraction) == (guard['backoff'], guard['backoff_stderrs'],
                                                                 guard['backoff_fraction']) == (True, 2.0, 0.05)
  else:
    assert run.optimizer.auto_lr.controller == 'paper'
  assert run.programs.shares_gradient is not overrides.get('hdet.low_communication', False)


def test_regularization_and_optimizer_choices_reach_the_programs():
  run = run_settings.resolve(_config(**{'model.dropout': 0.1, 'optim.label_smoothing': 0.05, 'seed': 7,
                                        'optim.name': 'adam_plateau', 'hdet.auto_lr': False}))
  p = run.programs
  assert (p.dropout, p.label_smoothing, p.seed, p.plateau, p.schedule_free) == (0.1, 0.05, 7, True, False)
  assert run.loop.controller is None and run.optimizer.auto_lr is None and not run.loop.common_batch
  explored = run_settings.resolve(_config(**{'hdet.explore.dropout': 0.05, 'hdet.explore.weight_decay': 0.5}))
  assert explored.programs.hyperparam_names == explored.loop.hyperparam_names == (
      'learning_rate', 'weight_decay', 'dropout')
  assert run_settings.resolve(_config(**{'optim.name': 'schedule_free_adamw'})).programs.schedule_free


def test_the_lrs_power_of_two_is_resolved_for_the_schedule_and_the_loop():
  run = run_settings.resolve(_config(**{'optim.runtime_lr_scale': True, 'hdet.auto_lr': False,
                                        'optim.max_lr': 0.01}))
  assert run.loop.lr_unit == 2.0 ** -6  # 0.01 = 0.64 * 2**-6
  plain = run_settings.schedule(_config(**{'optim.max_lr': 0.01}))
  assert all(float(run.optimizer.schedule(t)) * run.loop.lr_unit == pytest.approx(float(plain(t)), rel=1e-6)
             for t in (0, 300, 1499))


@pytest.mark.parametrize('overrides, message', [
    ({'hdet.spread': 1.5}, r'hdet\.spread must be in \[0, 1\)'),  # a field's own rule (config_lib)
    ({'hdet.explore.weight_decay': 0.5, 'optim.name': 'sgd'}, r'^config: hdet\.explore\.weight_decay needs optim\.name=adamw'),
    ({'hdet.fan': 'geometric'}, r'hdet\.fan was removed in hdet-jax 1\.0'),
])
def test_a_bad_config_stops_in_resolve_with_one_line_naming_the_field(overrides, message):
  config = _config()
  with config.unlocked():
    config_lib.with_overrides(config, {k: v for k, v in overrides.items() if k != 'hdet.fan'})
    if 'hdet.fan' in overrides:
      config.hdet.fan = overrides['hdet.fan']
  with pytest.raises(config_lib.ConfigError, match=message) as e:
    run_settings.resolve(config)
  assert '\n' not in str(e.value)


def test_a_model_hyperparameter_the_task_lacks_stops_in_resolve():
  config = _config('mnist1d', **{'hdet.explore.attn_temperature': 0.1})
  with pytest.raises(config_lib.ConfigError, match=r"hdet\.explore\.attn_temperature: the mnist1d task's model has no attn_temperature"):
    run_settings.resolve(config)
