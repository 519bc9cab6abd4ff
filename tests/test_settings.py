"""The settings and the validated plan (hdet_jax.settings): every invalid argument combination raises a
ValueError naming the parameter (property-based), the plan's controller fields against closed forms, and the
1.0 API: AutoLR()'s defaults (the guarded climb), AutoLR.paper(), the default windows, the user API's names."""

import dataclasses
import importlib
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import hdet_jax as H
from hdet_jax import settings as settings_lib
from replica_testing import hdet_plan

SCHED = H.one_cycle(1e-3, 100)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)


def _problems(kw):
  """Which parameters of the combination are invalid, by the documented rules."""
  bad = set()
  if not (isinstance(kw['num_replicas'], int) and kw['num_replicas'] >= 1):
    bad.add('num_replicas')
  if not (0 <= kw['spread'] < 1):
    bad.add('spread')
  if not (isinstance(kw['sync_every'], int) and kw['sync_every'] >= 1):
    bad.add('sync_every')
  a = kw['auto_lr']
  if a is not None:
    if not (0 <= a.warmup_steps < a.total_steps):
      bad.add('warmup_steps')
    if not a.temperature > 0:
      bad.add('temperature')
    if not 0 <= a.momentum < 1:
      bad.add('momentum')
    if not a.lr_of_lr >= 0:
      bad.add('lr_of_lr')
    if kw['spread'] == 0:
      bad.add('spread')
    t = kw['sync_every']
    if not bad and isinstance(t, int) and t >= 1 and max(t, -(-a.warmup_steps // t) * t) >= a.total_steps - 1:
      bad.add('warmup_steps')  # no controller sync would happen before the end
  return bad


auto_lrs = st.one_of(
  st.none(),
  st.builds(
    H.AutoLR.paper,
    total_steps=st.just(100),
    warmup_steps=st.integers(-5, 120),
    temperature=floats,
    momentum=floats,
    lr_of_lr=floats,
  ),
)


@settings(max_examples=400, deadline=None)
@given(
  num_replicas=st.one_of(st.integers(-2, 9), st.sampled_from([0.5, 1.0, 2.0, 3.5])),
  spread=floats,
  sync_every=st.one_of(st.integers(-3, 120), st.just(2.0)),
  auto_lr=auto_lrs,
)
def test_factory_rejects_every_invalid_combination(num_replicas, spread, sync_every, auto_lr):
  kw = dict(num_replicas=num_replicas, spread=spread, sync_every=sync_every, auto_lr=auto_lr)
  bad = _problems(kw)
  try:
    H.hdet(optax.adam, SCHED, **kw)
  except ValueError as e:
    msg = str(e)
    assert bad, f'valid arguments rejected: {kw}: {msg}'
    assert any(name in msg for name in bad), (bad, msg)
    return
  # Anything accepted must be valid (controller-start checks may reject a few more, never fewer).
  assert not bad, f'invalid {bad} accepted: {kw}'
  assert math.isfinite(spread)


def _plan(learning_rate, **kw):
  return hdet_plan(optax.sgd, learning_rate, **{'num_replicas': 8, 'sync_every': 5, **kw})


def test_plan_order_start_decay_and_floors_closed_form():
  """The [G] order is hyperparam_names'; the controller starts at the first sync at or after the warmup;
  gamma reaches the schedule's last value after the remaining syncs, (1 - gamma)^K = end / start; the floor
  is a tenth of the last value, min_value for learning rates, the low end for additive values."""
  sched = H.one_cycle(1e-2, 100)
  explore = {
    'weight_decay': (optax.linear_schedule(1e-2, 1e-3, 100), 0.5),
    'dropout': H.Explore(0.1, 0.05, additive=True, low=0.0, high=0.5, to_optimizer=False),
  }
  groups = {'emb': '^emb', 'rest': '^(?!emb)'}
  plan = _plan(
    sched,
    auto_lr=H.AutoLR.paper(total_steps=100, warmup_steps=12, min_value=3e-5),
    explore=explore,
    param_groups=groups,
  )
  assert (
    plan.names
    == H.hyperparam_names(param_groups=groups, explore=explore)
    == ('learning_rate/emb', 'learning_rate/rest', 'weight_decay', 'dropout')
  )
  assert plan.controller_start == 15
  k = (99 - 15) / 5
  for g, (start, end) in enumerate(
    [(float(sched(15)), float(sched(99)))] * 2
    + [(float(explore['weight_decay'][0](15)), float(explore['weight_decay'][0](99)))]
  ):
    assert math.isclose((1 - plan.decay[g]) ** k, end / start, rel_tol=1e-5), g
    assert math.isclose(plan.start_values[g], start, rel_tol=1e-6)
  assert plan.decay[3] == 0.0
  assert plan.floors[:2] == (3e-5, 3e-5) and math.isclose(
    plan.floors[2], 0.1 * float(explore['weight_decay'][0](99)), rel_tol=1e-6
  )
  assert plan.floors[3] == 0.0
  np.testing.assert_allclose(plan.scale[0], H.multipliers.spread_multipliers(8, 0.25), rtol=1e-7)
  np.testing.assert_allclose(plan.offset[3], 0.05 * (np.arange(8) - 3.5) / 3.5, rtol=1e-6)
  assert np.all(plan.scale[3] == 1.0) and np.all(plan.offset[0] == 0.0)


# ---- Each eager check: the error names the parameter, the neighbouring valid value builds the plan. ----


def _make(**kw):
  """settings.make_plan with hdet's defaults (a constant LR: no schedule to evaluate), overridden by ``kw``."""
  return hdet_plan(**{'optimizer': optax.sgd, 'learning_rate': 1e-3, 'num_replicas': 8, 'sync_every': 5, **kw})


def _step_schedule(t):
  """0 until step 20, then 1e-3: positive at the end, 0 before step 20."""
  return jnp.where(jnp.asarray(t) < 20, 0.0, 1e-3)


# (bad arguments, their valid neighbour, the error (naming the parameter), what the neighbour's plan holds)
EAGER_CHECKS = {
  'optimizer': (
    dict(optimizer='adam'),
    dict(optimizer=optax.adam),
    r"optimizer must be a built optax transformation .* or an optax factory .*got 'adam'",
    lambda p: p.optimizer is optax.adam,
  ),
  'explore_spec': (
    dict(explore={'weight_decay': 0.1}),
    dict(explore={'weight_decay': (0.1, 0.5)}),
    r"explore\['weight_decay'\] must be an hdet_jax\.Explore or a \(value or schedule, spread\) pair, got 0\.1",
    lambda p: p.names == ('learning_rate', 'weight_decay') and p.spreads == (0.25, 0.5),
  ),
  'explore_three_tuple': (
    dict(explore={'weight_decay': (0.1, 0.5, True)}),
    dict(explore={'weight_decay': H.Explore(0.1, 0.5, True)}),
    r"explore\['weight_decay'\] must be an hdet_jax\.Explore",
    lambda p: p.additive == (False, True),
  ),
  'replica_axis_repeated': (
    dict(replica_axis=('data', 'data')),
    dict(replica_axis=('data', 'local')),
    r"replica_axis must be a mesh/map axis name, or a tuple of distinct ones .*\('data', 'data'\)",
    lambda p: p.replica_axis == ('data', 'local'),
  ),
  'replica_axis_empty': (
    dict(replica_axis=''),
    dict(replica_axis='d'),
    r"replica_axis must be .*got ''",
    lambda p: p.replica_axis == 'd',
  ),
  'replica_axis_not_a_name': (
    dict(replica_axis=('data', 3)),
    dict(replica_axis=('data', '3')),
    r"replica_axis .*got \('data', 3\)",
    lambda p: p.replica_axis == ('data', '3'),
  ),
  'explore_nan_value': (
    dict(explore={'eps': H.Explore(float('nan'), 0.5)}),
    dict(explore={'eps': H.Explore(1e-8, 0.5)}),
    r"explore\['eps'\]: the value nan is not finite",
    lambda p: p.schedules == (1e-3, 1e-8),
  ),
  'explore_inf_value': (
    dict(explore={'eps': H.Explore(math.inf, 0.5, additive=True)}),
    dict(explore={'eps': H.Explore(1e-8, 0.5, additive=True)}),
    r"explore\['eps'\]: the value inf is not finite",
    lambda p: p.additive == (False, True),
  ),
  'auto_lr_type': (
    dict(auto_lr='fit'),
    dict(auto_lr=H.AutoLR(total_steps=100)),
    r'auto_lr must be an hdet_jax\.AutoLR or None, got str',
    lambda p: p.auto_lr.controller == 'fit' and p.controller_start == 5,
  ),
  'total_steps_too_small': (
    dict(auto_lr=H.AutoLR(total_steps=1), sync_every=1),
    dict(auto_lr=H.AutoLR(total_steps=3), sync_every=1),
    r'auto_lr\.total_steps must be an integer >= 2, got 1',
    lambda p: p.controller_start == 1,
  ),  # the first sync, after step 1, comes before the last step (2)
  'total_steps_not_an_integer': (
    dict(auto_lr=H.AutoLR(total_steps=50.0)),
    dict(auto_lr=H.AutoLR(total_steps=50)),
    r'auto_lr\.total_steps must be an integer >= 2, got 50\.0',
    lambda p: p.auto_lr.total_steps == 50,
  ),
  'lr_of_lr': (
    dict(auto_lr=H.AutoLR.paper(total_steps=100, lr_of_lr=-0.1)),
    dict(auto_lr=H.AutoLR.paper(total_steps=100, lr_of_lr=0.0)),
    r'auto_lr\.lr_of_lr \(lambda\) must be >= 0, got -0\.1',
    lambda p: p.auto_lr.lr_of_lr == 0.0,
  ),
  'lr_of_lr_nan': (
    dict(auto_lr=H.AutoLR.paper(total_steps=100, lr_of_lr=float('nan'))),
    dict(auto_lr=H.AutoLR.paper(total_steps=100, lr_of_lr=2.0)),
    r'auto_lr\.lr_of_lr \(lambda\) must be >= 0, got nan',
    lambda p: p.auto_lr.lr_of_lr == 2.0,
  ),
  'step_growth': (
    dict(auto_lr=H.AutoLR(total_steps=100, step_growth=0.5)),
    dict(auto_lr=H.AutoLR(total_steps=100, step_growth=1.0)),
    r'auto_lr\.step_growth must be a number >= 1 \(1: no acceleration\), got 0\.5',
    lambda p: p.auto_lr.step_growth == 1.0,
  ),
  'max_gain': (
    dict(auto_lr=H.AutoLR(total_steps=100, max_gain=0.99)),
    dict(auto_lr=H.AutoLR(total_steps=100, max_gain=1.0)),
    r'auto_lr\.max_gain must be a number >= 1 \(1: no acceleration\), got 0\.99',
    lambda p: p.auto_lr.max_gain == 1.0,
  ),
  'max_gain_inf': (
    dict(auto_lr=H.AutoLR(total_steps=100, max_gain=math.inf)),
    dict(auto_lr=H.AutoLR(total_steps=100, max_gain=1e6)),
    r'auto_lr\.max_gain must be a number >= 1 .*got inf',
    lambda p: p.auto_lr.max_gain == 1e6,
  ),
  'warmup_past_the_last_sync': (
    dict(auto_lr=H.AutoLR.paper(total_steps=20, warmup_steps=15), sync_every=10),
    dict(auto_lr=H.AutoLR.paper(total_steps=20, warmup_steps=5), sync_every=10),
    r'auto_lr: the first sync at or after warmup_steps=15 is step 20, not before total_steps=20; lower '
    r'auto_lr\.warmup_steps or sync_every=10',
    lambda p: p.controller_start == 10,
  ),
  'decay': (
    dict(auto_lr=H.AutoLR.paper(total_steps=100, decay=1.0)),
    dict(auto_lr=H.AutoLR.paper(total_steps=100, decay=0.99)),
    r'auto_lr\.decay \(gamma\) must be < 1, got 1\.0',
    lambda p: p.decay == (0.99,),
  ),
  'schedule_not_positive_at_the_controller_start': (
    dict(learning_rate=_step_schedule, auto_lr=H.AutoLR.paper(total_steps=100, warmup_steps=10), sync_every=10),
    dict(learning_rate=_step_schedule, auto_lr=H.AutoLR.paper(total_steps=100, warmup_steps=20), sync_every=10),
    r'learning_rate: the learning_rate schedule is 0\.0 at step 10, when the controller starts; it must be > 0',
    lambda p: p.controller_start == 20 and math.isclose(p.start_values[0], 1e-3, rel_tol=1e-6),
  ),
  'explored_schedule_not_positive_at_the_controller_start': (
    dict(
      explore={'weight_decay': (_step_schedule, 0.5)},
      auto_lr=H.AutoLR.paper(total_steps=100, warmup_steps=10),
      sync_every=10,
    ),
    dict(
      explore={'weight_decay': (_step_schedule, 0.5)},
      auto_lr=H.AutoLR.paper(total_steps=100, warmup_steps=20),
      sync_every=10,
    ),
    r"explore\['weight_decay'\]: the weight_decay schedule is 0\.0 at step 10, when the controller starts",
    lambda p: p.controller_start == 20 and p.start_values == (1e-3, pytest.approx(1e-3, rel=1e-6)),
  ),
}


@pytest.mark.parametrize('case', list(EAGER_CHECKS))
def test_each_eager_check_names_its_parameter_and_accepts_the_valid_neighbour(case):
  bad, good, message, holds = EAGER_CHECKS[case]
  with pytest.raises(ValueError, match=message):
    _make(**bad)
  assert holds(_make(**good))


# ---- The 1.0 API. ----


def test_autolr_defaults_are_the_guarded_climb():
  """AutoLR(total_steps=S) is the measured 'fit' controller at its documented defaults (the paper's fields keep
  theirs, unread by 'fit')."""
  assert dataclasses.asdict(H.AutoLR(total_steps=1500)) == dict(
    total_steps=1500,
    controller='fit',
    warmup_steps=0,
    initial_scale=None,
    trust=1.0,
    memory=0.5,
    step_growth=2.0,
    max_gain=4.0,
    stop_steps=0,
    after_stop='rise',
    backoff=True,
    backoff_stderrs=2.0,
    backoff_fraction=0.05,
    settle=True,
    temperature=0.1,
    lr_of_lr=0.5,
    momentum=0.9,
    decay=None,
    min_value=None,
    smooth_decay=True,
    anneal_fraction=0.0,
    schedule=None,
  )
  # The removed knob is gone, not ignored.
  assert 'overshoot' not in {f.name for f in dataclasses.fields(H.AutoLR)}
  with pytest.raises(TypeError, match='overshoot'):
    H.AutoLR(total_steps=100, overshoot=1.5)
  # And the default passes hdet's validation, on a schedule and on a constant LR.
  H.hdet(optax.adam, SCHED, num_replicas=8, auto_lr=H.AutoLR(total_steps=100))
  H.hdet(optax.adam, 1e-3, num_replicas=8, auto_lr=H.AutoLR(total_steps=100))


def test_autolr_paper_is_the_papers_controller_with_the_fit_fields_neutral():
  """AutoLR.paper(...) sets controller='paper', its own fields as given, and every 'fit' field at the value
  that leaves a controller without it; hdet accepts it and plans the paper's decay."""
  paper = H.AutoLR.paper(
    total_steps=1500,
    warmup_steps=750,
    temperature=0.2,
    lr_of_lr=0.3,
    momentum=0.8,
    decay=0.01,
    min_value=1e-5,
    smooth_decay=False,
    stop_steps=1200,
  )
  assert dataclasses.asdict(paper) == dict(
    total_steps=1500,
    controller='paper',
    warmup_steps=750,
    initial_scale=1.0,
    trust=1.0,
    memory=0.5,
    step_growth=1.0,
    max_gain=4.0,
    stop_steps=1200,
    after_stop='hold',
    backoff=False,
    backoff_stderrs=0.0,
    backoff_fraction=0.0,
    settle=False,
    temperature=0.2,
    lr_of_lr=0.3,
    momentum=0.8,
    decay=0.01,
    min_value=1e-5,
    smooth_decay=False,
    anneal_fraction=0.0,
    schedule=None,
  )
  default = H.AutoLR.paper(total_steps=100)
  assert (
    default.controller,
    default.warmup_steps,
    default.stop_steps,
    default.temperature,
    default.lr_of_lr,
    default.momentum,
    default.decay,
    default.min_value,
    default.smooth_decay,
  ) == ('paper', 0, None, 0.1, 0.5, 0.9, None, None, True)
  H.hdet(optax.adam, SCHED, num_replicas=8, auto_lr=default)
  H.hdet(optax.adam, H.one_cycle(1e-3, 1500), num_replicas=8, auto_lr=paper)
  plan = _plan(SCHED, auto_lr=default)
  # The paper's controller starts at the first sync (5) and decays to the schedule's end value by step 99:
  # (1 - gamma)^((99 - 5) / 5) = sched(99) / sched(5).
  assert plan.controller_start == 5 and plan.initial_correction == (0.0,)
  assert math.isclose((1 - plan.decay[0]) ** ((99 - 5) / 5), float(SCHED(99)) / float(SCHED(5)), rel_tol=1e-5)


def test_autolr_with_controller_paper_and_the_fit_defaults_raises_naming_autolr_paper():
  """AutoLR(controller='paper') keeps the fit's defaults (initial_scale 0.1, a rise-only climb, the back-off, ...),
  which the paper's controller does not take: one error that names them and AutoLR.paper."""
  with pytest.raises(
    ValueError,
    match=r"controller='paper' takes none of the 'fit' settings, got "
    r"step_growth=2\.0, after_stop='rise', backoff=True, .*hdet_jax\.AutoLR\.paper",
  ):
    H.hdet(optax.adam, SCHED, num_replicas=8, auto_lr=H.AutoLR(total_steps=100, controller='paper'))


@pytest.mark.parametrize('total_steps, period', [(300, 20), (1500, 100), (3000, 100), (None, 100)])
def test_default_sync_windows(monkeypatch, total_steps, period):
  """hdet(sync_every=None), the default: windows of round(S / 15) steps, at most 100, with auto_lr's total_steps
  S (300 / 15 = 20; 1500 / 15 = 100; 3000 / 15 = 200, capped), and of 100 without auto_lr."""
  plans = []
  make_plan = settings_lib.make_plan
  monkeypatch.setattr(settings_lib, 'make_plan', lambda *a, **kw: plans.append(make_plan(*a, **kw)) or plans[-1])
  auto_lr = None if total_steps is None else H.AutoLR(total_steps=total_steps)
  H.hdet(optax.adam, 1e-3, num_replicas=8, auto_lr=auto_lr)
  H.hdet(optax.adam, 1e-3, num_replicas=8, auto_lr=auto_lr, sync_every=None)
  assert [p.sync_windows for p in plans] == [(period,), (period,)]
  if total_steps == 300:  # and the transform syncs after steps 20, 40, ... (its first sync starts the controller)
    assert plans[0].controller_start == 20
    tx = H.hdet(optax.sgd, 1e-3, num_replicas=8, replica_axis='data', auto_lr=auto_lr)
    state = jax.vmap(tx.init)({'w': jnp.zeros((8, 2))})
    step = jax.jit(
      jax.vmap(lambda s: tx.update({'w': jnp.zeros(2)}, s, {'w': jnp.zeros(2)}, value=1.0)[1], axis_name='data')
    )
    synced = []
    for _ in range(40):
      state = step(state)
      synced.append(bool(state.synced[0]))
    assert [t + 1 for t, s in enumerate(synced) if s] == [20, 40] and int(state.sync_count[0]) == 2


USER_API = [
  'AutoLR',
  'Explore',
  'HDETState',
  'apply_gradients',
  'apply_updates',
  'average_at_sync',
  'average_replicas',
  'batch_shardings',
  'dense_general_ok',
  'evaluate_over_replicas',
  'group_shardings',
  'hdet',
  'host_metrics',
  'hyperparam_names',
  'hyperparams',
  'is_sync_step',
  'multi_steps',
  'one_cycle',
  'over_replicas',
  'packed',
  'pmap_average',
  'pmean_finite',
  'replica',
  'replica_value',
  'replicas_to_devices',
  'replicas_to_host',
  'shard_map_replicas',
  'stack_replicas',
  'stacked_shardings',
  'state_shardings',
]
INTERNALS = {
  'hdet_jax.controller': [
    'ControllerState',
    'controller_update',
    'decay_for_schedule',
    'reference_decay',
    'softmax_weights',
    'fit_update',
    'accelerate',
    'penalize_nonfinite',
  ],
  'hdet_jax.multipliers': [
    'draw_permutations',
    'spread_multipliers',
    'unit_offsets',
    'identity_permutations',
    'replica_values',
  ],
  'hdet_jax.packing': ['PackedState', 'pack_state', 'unpack_state'],
  'hdet_jax.axes': ['all_gather', 'axis_index', 'finite_mean', 'pmean', 'psum', 'unbatched'],
  # 1.0's paths (CHANGELOG 1.0) to the collectives, now hdet_jax.axes', and the pages' to the rollback's anchor.
  'hdet_jax.replicas': ['all_gather', 'axis_index', 'finite_mean', 'pmean', 'psum', 'Anchor', 'share_anchors'],
  'hdet_jax.shardings': ['replica_sharding', 'rule_sharding', 'inner_spec', 'tensor_dim'],
  'hdet_jax.sync': ['Anchor', 'share_anchors', 'shared_anchor', 'default_period'],
  'hdet_jax.param_groups': ['group_labels'],
  'hdet_jax.settings': ['Plan', 'make_plan'],
}


def test_all_is_the_user_api_and_the_internals_stay_in_their_modules():
  assert sorted(H.__all__) == USER_API
  assert all(callable(getattr(H, name)) for name in H.__all__)
  for module, names in INTERNALS.items():
    m = importlib.import_module(module)
    missing = [name for name in names if not hasattr(m, name)]
    assert not missing, (module, missing)


def test_the_removed_knobs_are_gone():
  """The geometric fan, the noise-scale module, the overshoot and the plan's log offsets left the core in 1.0."""
  assert 'fan' not in inspect.signature(H.hdet).parameters
  with pytest.raises(ValueError, match=r'hdet: fan= was removed in hdet-jax 1\.0: .*drop the argument'):
    H.hdet(optax.adam, 1e-3, num_replicas=8, fan='geometric')  # one error line, not the optimizer's TypeError
  assert not hasattr(H.multipliers, 'geometric_multipliers')
  with pytest.raises(ImportError):
    importlib.import_module('hdet_jax.noise_scale')
  assert 'overshoot' not in inspect.signature(H.controller.fit_update).parameters
  assert 'log_offsets' not in settings_lib.Plan._fields


def _build_and_init(params):
  """hdet() and AutoLR built inside the function, with a schedule: what a trainer's jitted init does."""
  schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 10, 100)
  tx = H.hdet(optax.adamw, schedule, num_replicas=4, auto_lr=H.AutoLR(total_steps=100), weight_decay=0.1)
  return tx.init(params)


def test_hdet_and_autolr_build_under_jit_eval_shape_and_vmap():
  """The schedules are evaluated at build time even inside a trace (jax.ensure_compile_time_eval), so the state
  built under eval_shape, jit and vmap is the one built eagerly."""
  params = {'w': jnp.ones((3, 2)), 'b': jnp.zeros(2)}
  eager = _build_and_init(params)
  shapes = jax.eval_shape(_build_and_init, params)
  assert jax.tree.map(lambda s: (s.shape, s.dtype), shapes) == jax.tree.map(lambda a: (a.shape, a.dtype), eager)
  for a, b in zip(jax.tree.leaves(jax.jit(_build_and_init)(params)), jax.tree.leaves(eager)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  stacked = jax.vmap(_build_and_init)(H.stack_replicas(params, 4))
  for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(eager)):
    np.testing.assert_array_equal(np.asarray(a), np.broadcast_to(np.asarray(b), (4,) + np.shape(b)))


@pytest.mark.parametrize('traced', ['value', 'schedule'])
def test_a_traced_learning_rate_at_build_time_is_one_clear_error(traced):
  def build(params, lr):
    value = lr if traced == 'value' else optax.cosine_decay_schedule(lr, 100)
    return H.hdet(optax.adam, value, num_replicas=4, auto_lr=H.AutoLR(total_steps=100)).init(params)

  with pytest.raises(ValueError, match=r'^hdet: .*traced value.*build hdet\(\) outside the traced function') as e:
    jax.jit(build)({'w': jnp.ones(2)}, 1e-3)
  assert '\n' not in str(e.value)
