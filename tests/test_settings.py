"""The settings and the validated plan (hdet_jax.settings): every invalid argument combination raises a
ValueError naming the parameter (property-based), and the plan's controller fields against closed forms."""

import math

import numpy as np
import optax
from hypothesis import given, settings, strategies as st

import hdet_jax as H

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


auto_lrs = st.one_of(st.none(), st.builds(
    H.AutoLR, total_steps=st.just(100), warmup_steps=st.integers(-5, 120), temperature=floats,
    momentum=floats, lr_of_lr=floats))


@settings(max_examples=400, deadline=None)
@given(num_replicas=st.one_of(st.integers(-2, 9), st.sampled_from([0.5, 1.0, 2.0, 3.5])), spread=floats,
       sync_every=st.one_of(st.integers(-3, 120), st.just(2.0)), auto_lr=auto_lrs)
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
  from hdet_jax import settings as S
  args = dict(num_replicas=8, spread=0.25, sync_every=5, replica_axis='data', auto_lr=None, exact_sync=False,
              seed=0, explore=None, param_groups=None, guard_nonfinite=True, optimizer_kwargs={})
  args.update(kw)
  return S.make_plan(optax.sgd, learning_rate, **args)


def test_plan_order_start_decay_and_floors_closed_form():
  """The [G] order is hyperparam_names'; the controller starts at the first sync at or after the warmup;
  gamma reaches the schedule's last value after the remaining syncs, (1 - gamma)^K = end / start; the floor
  is a tenth of the last value, min_value for learning rates, the low end for additive values."""
  sched = H.one_cycle(1e-2, 100)
  explore = {'weight_decay': (optax.linear_schedule(1e-2, 1e-3, 100), 0.5),
             'dropout': H.Explore(0.1, 0.05, additive=True, low=0.0, high=0.5, to_optimizer=False)}
  groups = {'emb': '^emb', 'rest': '^(?!emb)'}
  plan = _plan(sched, auto_lr=H.AutoLR(total_steps=100, warmup_steps=12, min_value=3e-5), explore=explore,
               param_groups=groups)
  assert plan.names == H.hyperparam_names(param_groups=groups, explore=explore) == (
      'learning_rate/emb', 'learning_rate/rest', 'weight_decay', 'dropout')
  assert plan.controller_start == 15
  k = (99 - 15) / 5
  for g, (start, end) in enumerate([(float(sched(15)), float(sched(99)))] * 2 + [
      (float(explore['weight_decay'][0](15)), float(explore['weight_decay'][0](99)))]):
    assert math.isclose((1 - plan.decay[g]) ** k, end / start, rel_tol=1e-5), g
    assert math.isclose(plan.start_values[g], start, rel_tol=1e-6)
  assert plan.decay[3] == 0.0
  assert plan.floors[:2] == (3e-5, 3e-5) and math.isclose(plan.floors[2], 0.1 * float(explore['weight_decay'][0](99)),
                                                          rel_tol=1e-6)
  assert plan.floors[3] == 0.0
  np.testing.assert_allclose(plan.scale[0], H.spread_multipliers(8, 0.25), rtol=1e-7)
  np.testing.assert_allclose(plan.offset[3], 0.05 * (np.arange(8) - 3.5) / 3.5, rtol=1e-6)
  assert np.all(plan.scale[3] == 1.0) and np.all(plan.offset[0] == 0.0)
