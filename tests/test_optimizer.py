"""The trainer's optimizer: ``optim.runtime_lr_scale`` (the LR's power of two applied at run time) against the plain
build, bit for bit, and the programs it lets runs a power of two apart share."""

import json
import math
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from hdet_jax.trainer import config_lib
from hdet_jax.trainer import run_settings
from hdet_jax.trainer import schema
from hdet_jax.trainer import optimizer as optimizer_lib
from trainer_testing import leaves, restore_raw, tiny
import trainer_testing

PLAIN = {
  'hdet.spread': 0.0,
  'hdet.sync_every': 0,
  'hdet.num_syncs': 0,
  'hdet.auto_lr': False,
  'hdet.param_groups': False,
  'plots': False,
  'eval_windows': 16,
  'checkpoint_every': 0,
  'num_train_steps': 12,
  'log_every': 4,
  'eval_every': 0,
}


def _fields(config):
  """A (partial) config's fields, flattened and completed from the schema: what run_settings' functions read."""
  return schema.complete(config_lib.flatten(config))


@pytest.mark.parametrize('max_lr', [0.03, 0.01, 1e-3, 0.5, 1.0, 3.0, 2.0**-7])
def test_lr_unit_is_the_power_of_two_whose_mantissa_is_in_half_to_one(max_lr):
  config = ml_collections.ConfigDict({'optim': {'max_lr': max_lr, 'runtime_lr_scale': True}})
  unit = run_settings.lr_unit(_fields(config))
  mantissa = max_lr / unit
  assert math.log2(unit) == int(math.log2(unit))  # a power of two
  assert 0.5 <= mantissa < 1.0 and mantissa * unit == max_lr  # exact
  config.optim.runtime_lr_scale = False
  assert run_settings.lr_unit(_fields(config)) == 1.0


@pytest.mark.parametrize('name', ['one_cycle', 'warmup_cosine', 'constant'])
def test_every_schedule_at_the_mantissa_times_the_unit_is_the_schedule_bit_for_bit(name):
  """What makes the run-time scale exact: each schedule is linear in its peak, computed so that a power of two
  passes through every float32 operation without rounding."""
  total = 300
  config = ml_collections.ConfigDict(
    {
      'num_train_steps': total,
      'optim': {
        'schedule': name,
        'max_lr': 0.03,
        'pct_start': 0.3,
        'div_factor': 25.0,
        'final_div_factor': 10.0,
        'runtime_lr_scale': True,
      },
    }
  )
  fields = _fields(config)
  unit = run_settings.lr_unit(fields)
  steps = jnp.arange(total + 3)
  plain = np.asarray(jax.jit(jax.vmap(run_settings.schedule(fields)))(steps))
  scaled = np.asarray(jax.jit(jax.vmap(run_settings.schedule(fields, 0.03 / unit)))(steps)) * np.float32(unit)
  assert plain.dtype == scaled.dtype == np.float32
  np.testing.assert_array_equal(scaled, plain)
  if name != 'constant':
    assert len(np.unique(plain)) > total // 2  # (a schedule's many values compared, not a few)


@pytest.mark.parametrize(
  'factory',
  [lambda lr: optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=0.1), lambda lr: optax.sgd(lr, momentum=0.9)],
  ids=['adamw', 'sgd'],
)
def test_the_wrapped_optimizer_at_scale_s_is_the_optimizer_at_lr_times_s(factory):
  """Bit for bit for a power of two s (a product with it is exact), to rounding for another s."""
  keys = jax.random.split(jax.random.key(0), 6)
  params = {'w': jax.random.normal(keys[0], (5, 3)), 'b': jax.random.normal(keys[1], (3,))}
  grads = [jax.tree.map(lambda p, k=k: jax.random.normal(k, p.shape), params) for k in keys[2:]]
  lr = jnp.float32(0.0123)

  def trajectory(tx, state):
    p, out = params, []
    for g in grads:
      u, state = tx.update(g, state, p)
      p = optax.apply_updates(p, u)
      out.append(p)
    return jax.tree.leaves(out)

  wrapped = optimizer_lib.with_runtime_lr_scale(factory)(lr)
  for scale, exact in ((8.0, True), (0.25, True), (3.0, False)):
    state = optimizer_lib.set_runtime_lr_scale(wrapped.init(params), jnp.float32(scale))
    assert float(state.scale) == scale
    got = leaves(jax.jit(lambda s: trajectory(wrapped, s))(state))
    want = leaves(jax.jit(lambda s: trajectory(factory(lr * jnp.float32(scale)), s))(factory(lr).init(params)))
    for a, b in zip(got, want):
      if exact:
        np.testing.assert_array_equal(a, b)
      else:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _misses(fn):
  """(what ``fn()`` returns, how many XLA programs it compiled: persistent-cache misses plus uncached compiles)."""
  count, active = [0], [True]

  def listener(event, **kwargs):
    del kwargs
    if active[0] and event == '/jax/compilation_cache/cache_misses':
      count[0] += 1

  jax.monitoring.register_event_listener(listener)
  try:
    return fn(), count[0]
  finally:
    active[0] = False


@pytest.mark.own_programs
def test_a_run_scaled_at_run_time_is_the_plain_run_bit_for_bit_and_shares_its_programs(tmp_path):
  """runtime_lr_scale=True at max_lr 0.02 ends as the plain build at 0.02 (final metric, logged LRs, parameters);
  a second run at 0.08 (4x) compiles nothing: every program is the first run's (the test session's persistent
  cache, tests/conftest.py). The plain build at 0.08 would compile its step anew (its LR is baked in)."""
  from trainer_testing import train_and_evaluate
  from hdet_jax.trainer.metrics import read_metrics

  assert jax.config.jax_compilation_cache_dir  # (conftest's; the trainer's tiny config sets none)

  def run(name, lr, scaled):
    config = tiny(**PLAIN, **{'optim.max_lr': lr, 'optim.runtime_lr_scale': scaled})
    return _misses(lambda: train_and_evaluate(config, str(tmp_path / name)))

  (plain, _), (scaled, _) = run('plain', 0.02, False), run('scaled', 0.02, True)
  assert scaled['final_metric'] == plain['final_metric']
  logged = {k: read_metrics(os.path.join(tmp_path, k, 'metrics.jsonl'))['train'] for k in ('plain', 'scaled')}
  for key in ('lr', 'base_lr', 'values', 'bases'):
    assert [r[key] for r in logged['scaled']] == [r[key] for r in logged['plain']], key
  last = logged['plain'][-1]  # (the run's own LR, 2x the tiny config's 0.01 schedule, not the mantissa's)
  assert last['lr'][0] == pytest.approx(
    float(trainer_testing.resolve(tiny(**PLAIN)).optimizer.schedule(last['step'])) * 2, rel=1e-6
  )
  (scaled_state, _, _), (plain_state, _, _) = (restore_raw(str(tmp_path / k), 12) for k in ('scaled', 'plain'))
  for a, b in zip(leaves(scaled_state['params']), leaves(plain_state['params']), strict=True):
    np.testing.assert_array_equal(a, b)
  four, compiled = run('scaled4', 0.08, True)
  assert compiled == 0 and np.isfinite(four['final_metric']) and four['final_metric'] != scaled['final_metric']
  config = json.load(open(tmp_path / 'scaled4' / 'config.json'))['training_fields']
  assert config['optim.runtime_lr_scale'] is True and config['optim.max_lr'] == 0.08


def test_runtime_lr_scale_is_refused_under_the_controller_and_must_be_a_bool():
  with pytest.raises(config_lib.ConfigError, match=r'optim\.runtime_lr_scale=True .* hdet\.auto_lr=False'):
    trainer_testing.resolve(tiny(**{'hdet.auto_lr': True, 'optim.runtime_lr_scale': True}))
  config = tiny(**PLAIN)  # (overrides keep the default's type; a config file written from scratch need not)
  config.optim = ml_collections.ConfigDict({**config.optim.to_dict(), 'runtime_lr_scale': 1})
  with pytest.raises(config_lib.ConfigError, match=r'optim\.runtime_lr_scale must be True or False, got 1'):
    trainer_testing.resolve(config)
  trainer_testing.resolve(tiny(**PLAIN, **{'optim.runtime_lr_scale': True}))
  assert 'optim.runtime_lr_scale' not in trainer_testing.resolve(tiny()).training_fields(
    8
  )  # off: no record's fields change


def test_a_workdir_is_not_resumed_with_the_flag_flipped(tmp_path):
  """The flag changes the optimizer state's structure (its factor), so the checkpoint of one build cannot resume in
  the other: the workdir check names the field before any work, and the workdir is left as it was."""
  from trainer_testing import train_and_evaluate

  over = {**PLAIN, 'optim.max_lr': 0.02, 'stop_at_step': 4}
  train_and_evaluate(tiny(**over, **{'optim.runtime_lr_scale': True}), str(tmp_path / 'w'))
  before = sorted(p.name for p in (tmp_path / 'w').rglob('*'))
  with pytest.raises(config_lib.ConfigError, match=r'optim\.runtime_lr_scale'):
    train_and_evaluate(tiny(**over, **{'optim.runtime_lr_scale': False}), str(tmp_path / 'w'))
  assert sorted(p.name for p in (tmp_path / 'w').rglob('*')) == before


@pytest.mark.parametrize('fsdp', [1, 2])
def test_setting_the_factor_keeps_every_leaf_and_its_layout(fsdp):
  """The trainer's setter on a fresh state, one replica per device and in groups of 2 devices (FSDP): the factor
  leaves, one per replica, take the value; every other leaf keeps its bits; every leaf keeps its sharding."""
  from hdet_jax.trainer import mesh as mesh_lib, programs as programs_lib, setup

  n = 8 // fsdp
  config = tiny(**PLAIN, **{'optim.runtime_lr_scale': True, 'mesh.fsdp': fsdp})
  mesh = mesh_lib.make_mesh(n, fsdp)
  run = trainer_testing.resolve(config)
  _, opt_state = programs_lib.make_init(
    run.task, run.task_settings, optimizer_lib.make_optimizer(run.optimizer, n, seed=run.seed), mesh, n
  )(jax.random.key(0))
  is_scaled = lambda x: isinstance(x, optimizer_lib.RuntimeScaleState)
  before = [(np.array(x), x.sharding) for x in jax.tree.leaves(opt_state)]  # (copies: the setter donates)
  factors = [x.scale for x in jax.tree.leaves(opt_state, is_leaf=is_scaled) if is_scaled(x)]
  assert len(factors) == 1 and factors[0].shape == (n,) and np.all(np.asarray(factors[0]) == 1.0)
  after = setup.set_lr_scale(f'test fsdp {fsdp}', opt_state, 0.25)
  new_factors = [x.scale for x in jax.tree.leaves(after, is_leaf=is_scaled) if is_scaled(x)]
  np.testing.assert_array_equal(np.asarray(new_factors[0]), np.full(n, 0.25, np.float32))
  changed = 0
  for (old, sharding), leaf in zip(before, jax.tree.leaves(after), strict=True):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    changed += not np.array_equal(np.asarray(leaf), old, equal_nan=True)
  assert changed == 1  # the factor alone
