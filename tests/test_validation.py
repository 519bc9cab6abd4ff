"""Property-based: every invalid argument combination raises a ValueError naming the parameter."""

import math

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
