"""The public API's arguments audited by class (issue 84, item 7): counts, shapes, settings under which HDET is
only plain training, axis names, and ranges (flags among them).

Each bad argument is refused with one ``ValueError`` line naming the function and the argument, at build time or,
where only a traced shape shows it, at trace time (``jax.eval_shape``: nothing compiles or runs); a setting that
makes HDET plain training is one :class:`hdet_jax.arguments.PlainTrainingWarning`, once per build. The valid
neighbours of each refused value (numpy integers, a negative index) still give numpy's answers.
"""

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import hdet_jax as H
from hdet_jax import arguments

N = 4
AX = 'data'
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hdet(**kw):
  return H.hdet(optax.sgd, 0.1, **{'num_replicas': N, **kw})


def _mesh():
  return Mesh(np.array(jax.devices()[:N]), (AX,))


def _params():
  return H.stack_replicas({'w': jnp.ones(3)}, N)


def _traced_update(value=lambda g: g['w'][0], stacked_state=False, **kw):
  """``tx.update`` traced (not run) under ``vmap(axis_name='data')`` on N replicas, ``value=value(grads)``."""
  tx = _hdet(**kw)
  params = _params()
  state = jax.vmap(tx.init)(params)
  if stacked_state:  # the whole stacked state handed to every replica (the map forgotten for it)
    step = jax.vmap(lambda g, p: tx.update(g, state, p, value=value(g)), axis_name=AX)
    return jax.eval_shape(step, params, params)
  step = jax.vmap(lambda g, s, p: tx.update(g, s, p, value=value(g)), axis_name=AX)
  return jax.eval_shape(step, params, state, params)


def _refused(thunk, *words):
  """``thunk()`` raises one ValueError line holding every one of ``words``; returns the line."""
  with pytest.raises(ValueError) as e:
    thunk()
  line = str(e.value)
  assert '\n' not in line, line
  for w in words:
    assert w in line, (w, line)
  return line


# ---- counts: zero, negative, a bool, a float, a string ----
BAD_COUNTS = [0, -1, True, 2.0, '4']
COUNTS = [
  ('hdet', 'num_replicas', lambda v: _hdet(num_replicas=v), ('num_replicas',)),
  ('hdet', 'sync_every', lambda v: _hdet(sync_every=v), ('sync_every',)),
  ('hdet', 'sync_every[1]', lambda v: _hdet(sync_every=(5, v)), ('sync_every',)),
  ('AutoLR', 'total_steps', lambda v: _hdet(auto_lr=H.AutoLR(total_steps=v)), ('auto_lr.total_steps',)),
  ('stack_replicas', 'num_replicas', lambda v: H.stack_replicas(jnp.ones(2), v), ('stack_replicas', 'num_replicas')),
  ('stack_replicas', 'per_device', lambda v: H.stack_replicas(jnp.ones(2), 8, per_device=v), ('per_device',)),
  ('multi_steps', 'every_k', lambda v: H.multi_steps(optax.sgd(0.1), v), ('multi_steps', 'every_k')),
  ('one_cycle', 'total_steps', lambda v: H.one_cycle(1e-3, v), ('total_steps',)),
  (
    'shard_map_replicas',
    'per_device',
    lambda v: H.shard_map_replicas(lambda x: x, _mesh(), AX, per_device=v),
    ('shard_map_replicas', 'per_device'),
  ),
  (
    'over_replicas',
    'per_device',
    lambda v: H.over_replicas(lambda state, batch: state, _mesh(), AX, per_device=v),
    ('per_device',),
  ),
  (
    'evaluate_over_replicas',
    'per_device',
    lambda v: H.evaluate_over_replicas(lambda p, batch: 0.0, _mesh(), AX, per_device=v),
    ('evaluate_over_replicas', 'per_device'),
  ),
]


@pytest.mark.parametrize('bad', BAD_COUNTS, ids=repr)
@pytest.mark.parametrize('fn, name, build, says', COUNTS, ids=[f'{c[0]}.{c[1]}' for c in COUNTS])
def test_a_count_that_is_not_a_positive_integer_is_one_line_naming_it(fn, name, build, says, bad):
  _refused(lambda: build(bad), *says)


@pytest.mark.parametrize(
  'build, says',
  [
    (lambda: _hdet(seed=1.5), ('hdet', 'seed')),
    (lambda: _hdet(seed='0'), ('hdet', 'seed')),
    (lambda: _hdet(auto_lr=H.AutoLR(total_steps=100, warmup_steps=-1)), ('auto_lr.warmup_steps',)),
    (lambda: _hdet(auto_lr=H.AutoLR(total_steps=100, warmup_steps=2.5)), ('auto_lr.warmup_steps',)),
    (lambda: _hdet(auto_lr=H.AutoLR(total_steps=100, stop_steps=-1)), ('auto_lr.stop_steps',)),
    (lambda: _hdet(auto_lr=H.AutoLR(total_steps=100, stop_steps=True)), ('auto_lr.stop_steps',)),
    (lambda: H.is_sync_step(10, -1), ('is_sync_step', 'step')),
    (lambda: H.is_sync_step(10, 1.5), ('is_sync_step', 'step')),
    (lambda: H.is_sync_step(0, 3), ('sync_every',)),
    (lambda: H.stack_replicas(jnp.ones(2), 8, per_device=3), ('stack_replicas', 'per_device=3', 'num_replicas=8')),
  ],
)
def test_the_other_counts_are_one_line_naming_them(build, says):
  _refused(build, *says)


def test_numpy_integers_are_counts_and_give_the_same_build():
  """The shared checker takes numpy's integers where Python's are taken, with the same result."""
  a = H.stack_replicas({'w': jnp.arange(3.0)}, np.int64(4), per_device=np.int32(2))
  np.testing.assert_array_equal(np.asarray(a['w']), np.tile(np.arange(3.0), (4, 1)))
  assert H.is_sync_step(np.int64(10), np.int64(9)) is True and H.is_sync_step(10, 8) is False
  tx = _hdet(num_replicas=np.int64(N), sync_every=np.int64(7), seed=np.int64(3))
  assert int(jax.vmap(tx.init)(_params()).values.shape[-1]) == N
  assert float(H.one_cycle(1e-3, np.int64(100))(0)) == pytest.approx(1e-3 / 25, rel=1e-6)


# ---- shapes: a loss that is not a scalar per replica, a tree or state that is not stacked ----
SHAPES = [
  ('value [3]', lambda: _traced_update(value=lambda g: g['w']), ('hdet', 'value', 'shape (3,)', 'scalar')),
  ('value [1]', lambda: _traced_update(value=lambda g: g['w'][:1]), ('value', 'shape (1,)')),
  ('value (loss, aux)', lambda: _traced_update(value=lambda g: (g['w'][0], g['w'][1])), ('value', 'got tuple')),
  ('value dict', lambda: _traced_update(value=lambda g: {'loss': g['w'][0]}), ('value', 'got dict')),
  ('value str', lambda: _traced_update(value=lambda g: 'loss'), ('value', 'got str')),
  ('stacked state unmapped', lambda: _traced_update(stacked_state=True), ('hdet', 'state', f'(1, {N})', f'({N}, 1,')),
  (
    'average_replicas scalar leaf',
    lambda: H.average_replicas({'w': jnp.ones(N), 'step': jnp.ones(())}),
    ('average_replicas', 'stacked', "'step'"),
  ),
  (
    'average_replicas leading axes',
    lambda: H.average_replicas({'w': jnp.ones(N), 'b': jnp.ones((3, 2))}),
    ('average_replicas', 'stacked', '[3, 4]'),
  ),
  ('replica scalar leaf', lambda: H.replica({'w': jnp.ones(())}, 0), ('replica', 'stacked')),
  (
    'shard_map_replicas unstacked',
    lambda: H.shard_map_replicas(lambda x: 2 * x, _mesh(), AX)(jnp.ones((2 * N, 3))),
    ('shard_map_replicas', f'N={2 * N}', f'D={N}', 'per_device=2'),
  ),
  (
    'over_replicas empty batch',
    lambda: H.over_replicas(lambda state, batch: state, _mesh(), AX)(jnp.ones((N, 2)), jnp.ones((0, 2))),
    ('over_replicas', "batch 'batch'", '0 rows'),
  ),
  (
    'apply_updates stacked state',
    lambda: H.apply_updates(_params(), _params(), jax.vmap(_hdet().init)(_params())),
    ('apply_updates', 'state'),
  ),
  ('packed around a plain optimizer', lambda: H.packed(optax.sgd(0.1)).init(jnp.ones(3)), ('packed', 'tx')),
  ('multi_steps of a factory', lambda: H.multi_steps(optax.sgd, 2), ('multi_steps', 'optimizer')),
]


@pytest.mark.parametrize('build, says', [c[1:] for c in SHAPES], ids=[c[0] for c in SHAPES])
def test_a_shape_that_is_not_one_replicas_or_not_stacked_is_one_line_naming_it(build, says):
  _refused(build, *says)


def test_the_shapes_that_are_right_still_pass_with_numpys_answers():
  x = jnp.arange(12.0).reshape(N, 3)
  np.testing.assert_array_equal(np.asarray(H.replica({'w': x}, -1)['w']), np.arange(12.0).reshape(N, 3)[-1])
  np.testing.assert_allclose(np.asarray(H.average_replicas({'w': x})['w']), np.arange(12.0).reshape(N, 3).mean(0))
  out = _traced_update(value=lambda g: jnp.mean(g['w']))  # a scalar loss: traced without a word
  assert out[1].values.shape == (N, 1, N)


@pytest.mark.parametrize('index', [N, -N - 1, 1.0, '0'], ids=repr)
def test_an_index_past_the_replicas_is_refused_where_jax_would_clamp_it(index):
  x = jnp.arange(float(N))
  assert float(x[N + 3]) == N - 1  # what jax does with it: the last replica, without a word
  _refused(lambda: H.replica(x, index), 'replica', 'index', f'[0, {N})')


def test_replica_value_refuses_an_index_past_the_hyperparameters():
  tx = _hdet(explore={'wd': H.Explore(0.1, 0.5, to_optimizer=False)})
  state = jax.vmap(tx.init)(_params())
  read = lambda i: jax.eval_shape(jax.vmap(lambda s: H.replica_value(s, i), axis_name=AX), state)
  assert read(1).shape == (N,)
  _refused(lambda: read(2), 'replica_value', 'index', '[0, 2)')
  _refused(lambda: H.replica_value(state, 0), 'replica_value', 'state', f'({N}, 2, {N})')


# ---- settings under which HDET is only plain training: one warning per build ----
PLAIN = [
  ('one replica', dict(num_replicas=1), 'num_replicas=1'),
  ('one replica, no spread', dict(num_replicas=1, spread=0.0), 'num_replicas=1'),
  ('no spread, no controller', dict(spread=0.0), 'spread=0'),
  ('no spread, zero explored spread', dict(spread=0.0, explore={'weight_decay': (0.1, 0.0)}), 'spread=0'),
]


@pytest.mark.parametrize('kw, says', [c[1:] for c in PLAIN], ids=[c[0] for c in PLAIN])
def test_a_build_that_is_plain_training_says_so_once(kw, says):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    H.hdet(optax.adamw, 1e-3, **{'num_replicas': N, **kw})
  plain = [w for w in caught if issubclass(w.category, arguments.PlainTrainingWarning)]
  assert len(plain) == 1, [str(w.message) for w in caught]
  line = str(plain[0].message)
  assert says in line and 'plain data-parallel training' in line and '\n' not in line, line
  assert plain[0].filename == __file__  # it points at the caller's hdet() line


@pytest.mark.parametrize(
  'kw',
  [
    dict(),
    dict(spread=0.0, explore={'weight_decay': (0.1, 0.5)}),
    dict(auto_lr=H.AutoLR(total_steps=100)),
    dict(num_replicas=2, spread=0.1),
  ],
  ids=['default', 'explored spread', 'controller', 'two replicas'],
)
def test_a_build_that_is_hdet_says_nothing(kw):
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    H.hdet(optax.adamw, 1e-3, **{'num_replicas': N, **kw})


def test_the_trainer_whose_config_says_plain_training_gets_no_warning():
  from hdet_jax.trainer import config_lib
  from hdet_jax.trainer import optimizer as optimizer_lib
  import trainer_testing

  run = trainer_testing.resolve(config_lib.load_config_file(os.path.join(ROOT, 'configs', 'bracket.py')))
  assert run.optimizer.spread == 0.0 and run.optimizer.auto_lr is None  # a bracket's runs: plain, as meant
  with warnings.catch_warnings():
    warnings.simplefilter('error', arguments.PlainTrainingWarning)
    optimizer_lib.make_optimizer(run.optimizer, 8, seed=run.seed)


# ---- axis names ----
BAD_AXES = ['', 3, ['data'], ('data', 'data'), ()]
AXES = [
  ('hdet', lambda a: _hdet(replica_axis=a), ('replica_axis',)),
  (
    'shard_map_replicas',
    lambda a: H.shard_map_replicas(lambda x: x, _mesh(), a),
    ('shard_map_replicas', 'replica_axis'),
  ),
  (
    'over_replicas',
    lambda a: H.over_replicas(lambda state, batch: state, _mesh(), a),
    ('over_replicas', 'replica_axis'),
  ),
  ('stacked_shardings', lambda a: H.stacked_shardings({}, a), ('stacked_shardings', 'replica_axis')),
  ('batch_shardings', lambda a: H.batch_shardings({}, a), ('batch_shardings', 'replica_axis')),
  (
    'apply_updates',
    lambda a: H.apply_updates(jnp.ones(3), jnp.ones(3), _hdet().init(jnp.ones(3)), replica_axis=a),
    ('apply_updates', 'replica_axis'),
  ),
  (
    'pmean_finite',
    lambda a: jax.eval_shape(jax.vmap(lambda x: H.pmean_finite(x, a), axis_name=AX), jnp.ones(N)),
    ('pmean_finite', 'axis_name'),
  ),
  (
    'replica_value',
    lambda a: H.replica_value(_hdet().init(jnp.ones(3)), 0, replica_axis=a),
    ('replica_value', 'replica_axis'),
  ),
  (
    'average_at_sync',
    lambda a: H.average_at_sync(jnp.ones(2), _hdet().init(jnp.ones(3)), a),
    ('average_at_sync', 'axis_name'),
  ),
]


@pytest.mark.parametrize('bad', BAD_AXES, ids=repr)
@pytest.mark.parametrize('build, says', [c[1:] for c in AXES], ids=[c[0] for c in AXES])
def test_an_axis_name_that_is_not_one_is_one_line_naming_it(build, says, bad):
  _refused(lambda: build(bad), *says)


@pytest.mark.parametrize(
  'build, says',
  [
    (lambda: H.shard_map_replicas(lambda x: x, _mesh(), 'replica'), ("no axis 'replica'", 'replica_axis')),
    (lambda: H.shard_map_replicas(lambda x: x, _mesh(), AX, local_axis=AX), ('shard_map_replicas', 'local_axis')),
    (
      lambda: jax.eval_shape(jax.vmap(lambda x: H.pmean_finite(x, 'replica'), axis_name=AX), jnp.ones(N)),
      ('pmean_finite', "axis_name='replica'", 'not bound'),
    ),
    (lambda: _traced_update(replica_axis='replica'), ("replica_axis='replica'", 'not bound')),
  ],
  ids=['mesh without it', 'local axis a mesh axis', 'pmean_finite unbound', 'update unbound'],
)
def test_an_axis_that_is_not_there_is_one_line_naming_it(build, says):
  _refused(build, *says)


# ---- ranges, flags among them ----
RANGES = [
  ('hdet spread -0.1', lambda: _hdet(spread=-0.1), ('spread',)),
  ('hdet spread 1', lambda: _hdet(spread=1.0), ('spread',)),
  ('hdet spread nan', lambda: _hdet(spread=float('nan')), ('spread',)),
  ('hdet spread False', lambda: _hdet(spread=False), ('spread',)),
  ('Explore spread -1', lambda: _hdet(explore={'wd': H.Explore(0.1, -1.0, to_optimizer=False)}), ("explore['wd']",)),
  (
    'Explore spread True',
    lambda: _hdet(explore={'wd': H.Explore(0.1, True, additive=True, to_optimizer=False)}),
    ("explore['wd']", 'spread'),
  ),
  ('AutoLR trust 0', lambda: _hdet(auto_lr=H.AutoLR(total_steps=100, trust=0.0)), ('auto_lr.trust',)),
  ('AutoLR memory 1', lambda: _hdet(auto_lr=H.AutoLR(total_steps=100, memory=1.0)), ('auto_lr.memory',)),
  (
    'AutoLR anneal_fraction 1',
    lambda: _hdet(auto_lr=H.AutoLR(total_steps=100, anneal_fraction=1.0)),
    ('auto_lr.anneal_fraction',),
  ),
  ('AutoLR schedule a number', lambda: _hdet(auto_lr=H.AutoLR(total_steps=100, schedule=1e-3)), ('auto_lr.schedule',)),
  ('AutoLR momentum 1', lambda: _hdet(auto_lr=H.AutoLR.paper(total_steps=100, momentum=1.0)), ('auto_lr.momentum',)),
  ('one_cycle max_lr 0', lambda: H.one_cycle(0.0, 100), ('max_lr',)),
  ('one_cycle pct_start 1', lambda: H.one_cycle(1e-3, 100, pct_start=1.0), ('pct_start',)),
  ('param_groups a list', lambda: _hdet(param_groups=['embed']), ('param_groups',)),
  ('hdet learning_rate str', lambda: H.hdet(optax.sgd, '1e-3', num_replicas=N), ('learning_rate', "'1e-3'")),
  ('hdet learning_rate nan', lambda: H.hdet(optax.sgd, float('nan'), num_replicas=N), ('learning_rate', 'finite')),
  (
    'Explore value str',
    lambda: _hdet(explore={'wd': H.Explore('0.1', 0.5, to_optimizer=False)}),
    ("explore['wd']", 'value'),
  ),
  (
    'hyperparam_names param_groups',
    lambda: H.hyperparam_names(param_groups=['embed']),
    ('hyperparam_names', 'param_groups'),
  ),
  ('hdet exact_sync', lambda: _hdet(exact_sync='no'), ('exact_sync',)),
  ('hdet guard_nonfinite', lambda: _hdet(guard_nonfinite=1), ('guard_nonfinite',)),
  ('hdet average_opt_state', lambda: _hdet(average_opt_state='yes'), ('average_opt_state',)),
  ('hdet rollback', lambda: _hdet(rollback=1), ('rollback',)),
  ('multi_steps use_grad_mean', lambda: H.multi_steps(optax.sgd(0.1), 2, use_grad_mean='yes'), ('use_grad_mean',)),
  ('one_cycle three_phase', lambda: H.one_cycle(1e-3, 100, three_phase='no'), ('three_phase',)),
  (
    'shard_map_replicas check_vma',
    lambda: H.shard_map_replicas(lambda x: x, _mesh(), AX, check_vma='no'),
    ('check_vma',),
  ),
  (
    'shard_map_replicas stacked_argnums',
    lambda: H.shard_map_replicas(lambda x: x, _mesh(), AX, stacked_argnums=(-1,)),
    ('stacked_argnums',),
  ),
  (
    'apply_updates sync',
    lambda: H.apply_updates(jnp.ones(3), jnp.ones(3), _hdet().init(jnp.ones(3)), sync=1),
    ('apply_updates', 'sync'),
  ),
  (
    'apply_updates guard_nonfinite',
    lambda: H.apply_updates(jnp.ones(3), jnp.ones(3), _hdet().init(jnp.ones(3)), guard_nonfinite='no'),
    ('apply_updates', 'guard_nonfinite'),
  ),
  ('shard_map_replicas fn', lambda: H.shard_map_replicas(None, _mesh(), AX), ('shard_map_replicas', 'fn')),
  ('over_replicas mesh', lambda: H.over_replicas(lambda state, batch: state, None, AX), ('over_replicas', 'mesh')),
]


@pytest.mark.parametrize('build, says', [c[1:] for c in RANGES], ids=[c[0] for c in RANGES])
def test_a_value_out_of_its_range_is_one_line_naming_it(build, says):
  _refused(build, *says)
