"""The hyperparameter values of a step (hdet_jax.values) against numpy: clip(base rho[perm] + offset[perm])."""

import jax.numpy as jnp
import numpy as np
import optax

import hdet_jax as H
from hdet_jax import controller as ctrl
from hdet_jax import values
from replica_testing import hdet_plan

N = 8


def _plan(**kw):
  return hdet_plan(optax.sgd, kw.pop('learning_rate', 1e-2), **{'num_replicas': N, 'sync_every': 4, **kw})


def test_replica_values_against_numpy():
  """Multiplicative LR, an additive dropout clipped to [0, 0.2], a multiplicative wd: each row is
  clip(base * rho[perm] + offset[perm], low, high) with its own permutation."""
  plan = _plan(
    explore={
      'dropout': H.Explore(0.1, 0.05, additive=True, low=0.0, high=0.2, to_optimizer=False),
      'weight_decay': (1e-3, 0.5),
    }
  )
  rng = np.random.default_rng(0)
  perm = np.stack([rng.permutation(N) for _ in range(3)])
  base = np.array([2e-2, 0.19, 1e-3], np.float32)  # the controller may move a base near an edge
  got = np.asarray(values.replica_values(plan, jnp.asarray(base), jnp.asarray(perm)))
  u = (np.arange(N) - (N - 1) / 2) / ((N - 1) / 2)
  want = np.stack(
    [
      base[0] * (1 + 0.25 * u)[perm[0]],
      np.clip(base[1] + 0.05 * u[perm[1]], 0.0, 0.2),
      base[2] * (1 + 0.5 * u)[perm[2]],
    ]
  )
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert got[1].max() == np.float32(0.2)  # the clip is live


def test_base_values_schedule_then_smooth_controller_path():
  """Before the controller's first sync: the schedule. After: base_k (1 - gamma)^(i/T - 1) at step i of the
  window (smooth), or base_k (held); 'fit': the schedule times exp(correction)."""
  sched = optax.linear_schedule(1e-2, 1e-3, 40)
  for smooth in (True, False):
    plan = _plan(learning_rate=sched, auto_lr=H.AutoLR.paper(total_steps=40, warmup_steps=6, smooth_decay=smooth))
    assert plan.controller_start == 8
    c = ctrl.init_controller_state(jnp.asarray([5e-3]), N, jnp.zeros(2, jnp.uint32))
    gamma = plan.decay[0]
    for t in range(20):
      got = float(values.base_values(plan, jnp.asarray(t), c)[0])
      want = float(sched(t)) if t < 8 else 5e-3 * ((1 - gamma) ** ((t % 4) / 4 - 1) if smooth else 1.0)
      np.testing.assert_allclose(got, want, rtol=1e-6)
  plan = _plan(learning_rate=sched, auto_lr=H.AutoLR(total_steps=40))  # the default: 'fit'
  c = c._replace(correction=jnp.asarray([0.7]))
  for t in (0, 9, 30):
    np.testing.assert_allclose(
      float(values.base_values(plan, jnp.asarray(t), c)[0]), float(sched(t)) * np.exp(0.7), rtol=1e-6
    )
