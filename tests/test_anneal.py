"""A schedule's anneal stays an anneal (issue 86): from the step a decaying schedule falls below
``AutoLR.anneal_fraction`` of its peak, the 'fit' controller's learning-rate factor no longer rises.

The oracle is the closed-form warmup + cosine schedule, computed here in numpy: its peak, the step it falls below
half of it, and the learning rate each step trains at is the schedule times the factor, ``lr_t = s(t) f_t``. The
problem pulls the climb up while the schedule decays: each replica's loss is a bowl in its learning rate, lowest at
10x the schedule's peak, so late in the decay a larger factor always looks better (the climb would cancel the
decay: without the rule the factor goes from 18x at the anneal's start to 238x at the end).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hdet_jax as H
from hdet_jax import schedules
from replica_testing import hdet_plan

N, AX = 4, 'data'
S, T, WARMUP, PEAK, END = 120, 10, 20, 1e-2, 1e-4
BOWL = 10 * PEAK  # the learning rate every replica's loss is lowest at: the schedule is 10x low
ON = 0.5  # the rule, opt-in (AutoLR's default, 0, leaves it off)


def schedule():
  return optax.warmup_cosine_decay_schedule(0.0, PEAK, WARMUP, S, end_value=END)


def numpy_schedule(t):
  """The closed form of ``schedule()``: linear warmup from 0 to the peak, then a cosine to END at step S."""
  t = np.asarray(t, np.float64)
  warm = PEAK * t / WARMUP
  cos = END + (PEAK - END) * 0.5 * (1 + np.cos(np.pi * np.clip(t - WARMUP, 0, S - WARMUP) / (S - WARMUP)))
  return np.where(t < WARMUP, warm, cos)


def numpy_anneal_start(fraction):
  """The first step after the peak (WARMUP) below ``fraction`` of it: (1 + cos(pi x)) / 2 = (f P - E) / (P - E)."""
  x = np.arccos(2 * (fraction * PEAK - END) / (PEAK - END) - 1) / np.pi
  return int(np.floor(WARMUP + x * (S - WARMUP))) + 1


def climb(tx, built):
  """S steps of SGD (gradient 1 on each weight), every replica's loss ``5 (1 - t / S) + 0.3 (lr / BOWL - 1)^2`` at
  the learning rate it trains at (around a built optimizer: its factor times the schedule): a falling trend, as
  training's, under a bowl in the learning rate. Every state after each step."""
  sp = H.stack_replicas({'w': jnp.zeros(3)}, N)

  def step(p, s, t):
    value = s.values[0, jax.lax.axis_index(AX)]
    lr = value * schedule()(t) / 10 if built else value
    value = 5.0 * (1.0 - t / S) + 0.3 * (lr / BOWL - 1.0) ** 2  # (the trend, common to all, keeps the guard quiet)
    u, s = tx.update(jax.tree.map(jnp.ones_like, p), s, p, value=value)
    return optax.apply_updates(p, u), s

  def body(carry, t):
    p, s = jax.vmap(step, axis_name=AX, in_axes=(0, 0, None))(*carry, t)
    return (p, s), jax.tree.map(lambda x: x[0], s)

  @jax.jit
  def train(p):
    return jax.lax.scan(body, (p, jax.vmap(tx.init)(p)), jnp.arange(S))[1]

  return train(sp)


def factory(**auto):
  return H.hdet(
    optax.sgd,
    schedule(),
    num_replicas=N,
    sync_every=T,
    replica_axis=AX,
    auto_lr=H.AutoLR(S, **{'anneal_fraction': ON, **auto}),
  )


def built(**auto):
  """The factory's run as a built optimizer: at a tenth of the schedule, where the factory's climb starts."""
  sgd = optax.sgd(lambda t: schedule()(t) / 10)
  return H.hdet(
    sgd, num_replicas=N, sync_every=T, replica_axis=AX, auto_lr=H.AutoLR(S, **{'anneal_fraction': ON, **auto})
  )


def factors(states, is_built):
  """[S] the factor f_t each step t + 1 trains at (the state after step t): the schedule's multiplier, checked against
  the closed form: the factory's base is s(t) f_t, the built optimizer's is f_t (a factor on its own LR)."""
  f = np.exp(np.asarray(states.controller.correction[:, 0], np.float64))
  want = f if is_built else numpy_schedule(np.arange(1, S + 1)) * f
  np.testing.assert_allclose(states.base[:, 0], want, rtol=2e-6)
  return f


@pytest.mark.parametrize('fraction', [0.5, 0.25, 0.9])
def test_anneal_start_is_the_closed_forms(fraction):
  assert schedules.anneal_start(schedule(), S, fraction) == numpy_anneal_start(fraction)
  assert schedules.anneal_start(optax.constant_schedule(PEAK), S, fraction) is None  # nothing decays
  assert schedules.anneal_start(PEAK, S, fraction) is None
  assert schedules.anneal_start(schedule(), S, 0.0) is None


def test_anneal_start_of_a_schedule_with_python_control_flow():
  """A schedule that branches on the step in Python (no vmap) is read one step at a time, to the same step."""
  stepwise = lambda t: PEAK if t < 50 else PEAK / 4  # noqa: E731
  assert schedules.anneal_start(stepwise, S, 0.5) == 50


@pytest.mark.parametrize(
  'path,make,auto',
  [
    ('factory', factory, {}),  # the core reads the schedule
    ('built, schedule given', built, {'schedule': schedule()}),
    ('built, none given', built, {}),  # a cosine from warmup_steps (0) to S assumed: from S / 2
  ],
)
def test_the_factor_stops_rising_once_the_schedule_anneals(path, make, auto):
  """From a schedule 10x low (the factory starts at a tenth of it, the built optimizer is that tenth), the climb is
  still rising when the decay starts. From the first sync at or after the anneal's start
  the factor never rises: lr_t / s(t) is non-increasing and the final LR is at most the schedule's end times the
  factor at the anneal's start. Without the rule (``anneal_fraction=0``) the factor keeps rising through the decay."""
  is_built = make is built
  start = numpy_anneal_start(0.5) if 'schedule' in auto or not is_built else S // 2
  first_sync = -(-start // T) * T
  with_rule, without = climb(make(**auto), is_built), climb(make(anneal_fraction=0.0), is_built)
  f, f_off = factors(with_rule, is_built), factors(without, is_built)
  at = first_sync - 1  # the state after the sync at step first_sync (what the steps after it train at)
  assert f[at - 1] > 5 * f[0]  # the climb was active up to the anneal: it rose 5x from its start ...
  assert f_off[-1] > 1.5 * f_off[at - 1]  # ... and without the rule it goes on rising through the decay
  assert np.all(np.diff(f[at - 1 :]) <= 0), f[at - 1 :]  # with it, lr_t / s(t) never rises from there
  assert f[-1] * numpy_schedule(S) <= f[at - 1] * numpy_schedule(S) * (1 + 1e-6)  # the final LR's bound
  # The same run up to the sync where the rule first applies, bit for bit.
  chex.assert_trees_all_equal(jax.tree.map(lambda x: x[:at], with_rule), jax.tree.map(lambda x: x[:at], without))


def test_the_rule_does_nothing_where_the_climb_does_not_rise_in_the_anneal():
  """Started above the bowl (the factory at a tenth of 100x the peak: 10x high) the climb never asks to rise, so
  the run with the rule is the run without it bit for bit, every state of it, though the rule's op is in it."""
  high = lambda **a: H.hdet(  # noqa: E731
    optax.sgd,
    lambda t: 100 * schedule()(t),
    num_replicas=N,
    sync_every=T,
    replica_axis=AX,
    auto_lr=H.AutoLR(S, **{'anneal_fraction': ON, **a}),
  )
  chex.assert_trees_all_equal(climb(high(), False), climb(high(anneal_fraction=0.0), False))


def test_a_run_that_ends_before_the_decay_is_unchanged():
  """A run of 60 steps under a schedule that peaks at step 100 never anneals (anneal_from None): bit for bit the run
  without the rule."""
  rising = optax.warmup_cosine_decay_schedule(0.0, PEAK, 100, 400)
  make = lambda **a: H.hdet(  # noqa: E731
    optax.sgd,
    rising,
    num_replicas=N,
    sync_every=T,
    replica_axis=AX,
    auto_lr=H.AutoLR(60, **{'anneal_fraction': ON, **a}),
  )
  plan = hdet_plan(
    optax.sgd, rising, num_replicas=N, sync_every=T, replica_axis=AX, auto_lr=H.AutoLR(60, anneal_fraction=ON)
  )
  assert plan.anneal_from is None
  global S
  saved, S = S, 60
  try:
    chex.assert_trees_all_equal(climb(make(), False), climb(make(anneal_fraction=0.0), False))
  finally:
    S = saved


@pytest.mark.parametrize(
  'auto,match',
  [
    ({'anneal_fraction': 1.0}, r'auto_lr.anneal_fraction must be a number in \[0, 1\)'),
    ({'anneal_fraction': -0.1}, r'auto_lr.anneal_fraction must be a number in \[0, 1\)'),
    ({'anneal_fraction': True}, r'auto_lr.anneal_fraction must be a number in \[0, 1\)'),
    ({'schedule': 3.0}, r"auto_lr.schedule must be None or the built optimizer's learning-rate schedule"),
  ],
)
def test_bad_anneal_settings_are_one_clear_error(auto, match):
  with pytest.raises(ValueError, match=match):
    built(**auto)


def test_a_schedule_given_with_a_factory_is_refused():
  with pytest.raises(ValueError, match=r'auto_lr.schedule is for a built optimizer.*drop auto_lr.schedule'):
    factory(schedule=schedule())


# AutoLR(controller='paper') with every other 'fit' setting off (the anneal's given: ON).
PAPER_OFF = dict(
  initial_scale=1.0,
  step_growth=1.0,
  after_stop='hold',
  backoff=False,
  backoff_stderrs=0.0,
  backoff_fraction=0.0,
  settle=False,
)


def test_the_paper_controller_takes_no_anneal_setting():
  with pytest.raises(ValueError, match=r"controller='paper' takes none of the 'fit' settings, got anneal_fraction"):
    H.hdet(
      optax.sgd,
      schedule(),
      num_replicas=N,
      replica_axis=AX,
      auto_lr=H.AutoLR(S, controller='paper', **PAPER_OFF, anneal_fraction=ON),
    )


def test_the_rule_is_off_by_default():
  """AutoLR's default leaves the climb free to the end (measured: where the rule bound it cost): the plan has no
  anneal step, and the default run is the run at anneal_fraction=0 bit for bit."""
  assert H.AutoLR(S).anneal_fraction == 0.0
  default = H.hdet(optax.sgd, schedule(), num_replicas=N, sync_every=T, replica_axis=AX, auto_lr=H.AutoLR(S))
  chex.assert_trees_all_equal(climb(default, False), climb(factory(anneal_fraction=0.0), False))
