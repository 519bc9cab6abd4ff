"""Exploring hyperparameters beyond one learning rate: per-group LRs, optimizer and model values."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import hdet_jax as H
from hdet_jax.param_groups import group_labels

N, AX = 8, 'data'
# The 'fit' controller as AutoLR(controller='fit') was before 1.0, the guarded climb's parts off (a start at the
# schedule, trust 0.25, no acceleration, no stop, no back-off, no settling).
PLAIN_FIT = dict(
  controller='fit',
  initial_scale=1.0,
  trust=0.25,
  step_growth=1.0,
  stop_steps=None,
  after_stop='hold',
  backoff=False,
  backoff_stderrs=0.0,
  backoff_fraction=0.0,
  settle=False,
)
# Every controller variant must move each hyperparameter to its own optimum.
CONTROLLERS = {
  'paper': dict(temperature=0.02, lr_of_lr=0.5, momentum=0.5),
  'fit': dict(PLAIN_FIT, trust=0.25, memory=0.5),
  # The main job's fit: steps amplified (Rprop) while they keep one direction, per hyperparameter.
  'fit_accel': dict(PLAIN_FIT, trust=0.25, memory=0.5, step_growth=2.0, max_gain=4.0),
}


def auto_lr(controller, total_steps, temperature=None):
  """``CONTROLLERS[controller]`` for a run of ``total_steps``, its controller starting at once (``temperature``:
  the paper's, in place of its entry's)."""
  settings = dict(CONTROLLERS[controller], warmup_steps=0)
  if controller == 'paper':
    return H.AutoLR.paper(total_steps=total_steps, **dict(settings, temperature=temperature or settings['temperature']))
  return H.AutoLR(total_steps=total_steps, **settings)


def _vmap_run(tx, params, loss_of_values, steps):
  """Runs with zero gradients and a loss that depends only on each replica's hyperparameters."""
  sp = H.stack_replicas(params, N)
  ss = jax.vmap(tx.init)(sp)

  def step(p, s):
    values = s.values[:, lax.axis_index(AX)]  # what this replica uses for this step
    loss = loss_of_values(values)
    u, s = tx.update(jax.tree.map(jnp.zeros_like, p), s, p, value=loss)
    return optax.apply_updates(p, u), s

  f = jax.jit(jax.vmap(step, axis_name=AX))
  history = []
  for _ in range(steps):
    sp, ss = f(sp, ss)
    history.append(np.asarray(ss.base[0]))
  return np.stack(history), ss


@pytest.mark.parametrize('controller', CONTROLLERS)
def test_three_hyperparameters_each_move_to_their_own_optimum(controller):
  explore = {
    'weight_decay': H.Explore(1e-2, 0.5),  # multiplicative; optimum 4e-3
    'dropout': H.Explore(0.1, 0.05, additive=True, low=0.0, high=0.9, to_optimizer=False),  # optimum 0.3
  }
  assert H.hyperparam_names(explore=explore) == ('learning_rate', 'weight_decay', 'dropout')
  tx = H.hdet(
    optax.adamw,
    1e-3,
    num_replicas=N,
    spread=0.25,
    sync_every=5,
    replica_axis=AX,
    explore=explore,
    auto_lr=auto_lr(controller, 5000),
  )

  def loss(v):  # independent bowls: log-LR optimum 3e-3, log-wd optimum 4e-3, dropout optimum 0.3
    return jnp.log(v[0] / 3e-3) ** 2 + jnp.log(v[1] / 4e-3) ** 2 + 10.0 * (v[2] - 0.3) ** 2

  hist, st = _vmap_run(tx, {'w': jnp.zeros(3)}, loss, 1500)
  start, end = hist[0], hist[-1]
  targets = np.array([3e-3, 4e-3, 0.3])
  for g in range(3):
    assert abs(end[g] - targets[g]) < 0.35 * abs(start[g] - targets[g]), (g, start[g], end[g])
  # Values are clipped to their ranges; dropout is spread additively around its base.
  d = np.asarray(st.values[0, 2])
  np.testing.assert_allclose(np.sort(d) - np.mean(d), 0.05 * H.multipliers.unit_offsets(N), atol=1e-6)


@pytest.mark.parametrize('controller', CONTROLLERS)
def test_param_groups_by_regex_get_their_own_lr_and_controller(controller):
  params = {
    'embed': {'table': jnp.zeros((4, 2))},
    'blocks': {'attn': {'kernel': jnp.zeros((2, 2)), 'bias': jnp.zeros(2)}},
    'norm': {'scale': jnp.zeros(2)},
  }
  groups = {'embedding': r'^embed/', 'no_decay': r'(bias|scale)$', 'weights': r'kernel$'}
  labels = group_labels(params, groups)
  assert labels == {
    'embed': {'table': 'embedding'},
    'blocks': {'attn': {'kernel': 'weights', 'bias': 'no_decay'}},
    'norm': {'scale': 'no_decay'},
  }
  tx = H.hdet(
    optax.sgd,
    1e-2,
    num_replicas=N,
    spread=0.25,
    sync_every=4,
    replica_axis=AX,
    param_groups=groups,
    auto_lr=auto_lr(controller, 3000, temperature=0.01),
  )
  names = H.hyperparam_names(param_groups=groups)
  assert names == ('learning_rate/embedding', 'learning_rate/no_decay', 'learning_rate/weights')
  # SGD's update of each leaf is -lr_group * grad, with lr_group this replica's value for its group.
  sp = H.stack_replicas(params, N)
  ss = jax.vmap(tx.init)(sp)
  ones = jax.tree.map(jnp.ones_like, sp)
  u, s1 = jax.vmap(lambda g, s, p: tx.update(g, s, p, value=1.0), axis_name=AX)(ones, ss, sp)
  v = np.asarray(ss.values[0])  # [G, N]: the values the update used
  np.testing.assert_allclose(np.asarray(u['embed']['table'])[:, 0, 0], -v[0], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(u['blocks']['attn']['bias'])[:, 0], -v[1], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(u['norm']['scale'])[:, 0], -v[1], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(u['blocks']['attn']['kernel'])[:, 0, 0], -v[2], rtol=1e-6)
  # Groups pulled in different directions: embedding wants a higher LR, weights a lower one.
  hist, _ = _vmap_run(tx, params, lambda v: jnp.log(v[0] / 3e-2) ** 2 + jnp.log(v[2] / 3e-3) ** 2, 600)
  np.testing.assert_allclose(hist[-1][[0, 2]], [3e-2, 3e-3], rtol=0.15)
  # no_decay carries no signal of its own: it only random-walks (the weights are shared across
  # groups, and its permutation is independent of theirs), and stays positive.
  assert 0 < hist[-1][1] < 3e-2


@pytest.mark.parametrize(
  'explore, match',
  [
    ({'dropout': H.Explore(0.05, 0.1, additive=True, low=0.0, high=1.0)}, 'leaves the valid range'),
    ({'weight_decay': H.Explore(0.1, 1.2)}, 'spread'),
    ({'b1': H.Explore(0.95, 0.1, additive=True, low=0.0, high=1.0)}, 'leaves the valid range'),
    ({'dropout': H.Explore(0.1, 0.05, additive=True, low=0.5, high=0.2)}, 'low'),
    ({'learning_rate': (1e-3, 0.1)}, 'already set'),
  ],
)
def test_bad_explore(explore, match):
  with pytest.raises(ValueError, match=match):
    H.hdet(optax.adamw, 1e-3, num_replicas=N, spread=0.25, sync_every=4, explore=explore)


def test_settle_is_per_hyperparameter():
  """Two rise-only climbs toward independent bowls, the LR starting 3x below its optimum and the weight decay
  300x below its own: the LR settles first and holds its correction while the weight decay goes on climbing
  and spreading (the LR's replicas all at its base), until it settles too, just past its optimum."""
  explore = {'weight_decay': H.Explore(4e-6, 0.25)}
  T, S = 5, 400
  tx = H.hdet(
    optax.adamw,
    1e-3,
    num_replicas=N,
    spread=0.25,
    sync_every=T,
    replica_axis=AX,
    explore=explore,
    auto_lr=H.AutoLR(
      total_steps=S,
      **dict(
        PLAIN_FIT, trust=0.5, memory=0.5, stop_steps=0, after_stop='rise', step_growth=2.0, max_gain=4.0, settle=True
      ),
    ),
  )
  sp = H.stack_replicas({'w': jnp.zeros(3)}, N)
  ss = jax.vmap(tx.init)(sp)

  def step(p, s):
    v = s.values[:, lax.axis_index(AX)]
    u, s = tx.update(
      jax.tree.map(jnp.zeros_like, p), s, p, value=jnp.log(v[0] / 3e-3) ** 2 + jnp.log(v[1] / 1.2e-3) ** 2
    )
    return optax.apply_updates(p, u), s

  f = jax.jit(jax.vmap(step, axis_name=AX))
  settled, corrections, spreads = [], [], []
  for t in range(S):
    sp, ss = f(sp, ss)
    if (t + 1) % T == 0:
      settled.append(np.asarray(ss.controller.settled[0]))
      corrections.append(np.asarray(ss.controller.correction[0]))
      spreads.append(np.ptp(np.asarray(ss.values[0]), axis=1))
  settled, corrections, spreads = map(np.stack, (settled, corrections, spreads))
  lr_at, wd_at = (int(np.argmax(settled[:, g])) for g in range(2))
  assert settled[-1].all() and 0 < lr_at < wd_at - 3
  assert np.all(settled[lr_at:, 0]) and np.all(settled[wd_at:, 1]) and not settled[:lr_at].any()
  assert np.all(corrections[lr_at:, 0] == corrections[lr_at, 0])  # the LR held while the weight decay climbed
  assert np.all(spreads[lr_at:, 0] == 0) and np.all(spreads[lr_at:wd_at, 1] > 0) and np.all(spreads[wd_at:, 1] == 0)
  assert np.all(np.diff(corrections[lr_at : wd_at + 1, 1]) >= 0) and corrections[wd_at, 1] > corrections[lr_at, 1] + 3
  lr, wd = 1e-3 * np.exp(corrections[-1, 0]), 4e-6 * np.exp(corrections[-1, 1])
  # Each settles past its optimum (the ask turns down only once a window trained above it), within two trust
  # steps (e^(2 x 0.5)): the loss is quadratic in the log of each value, the fit in its offset, so an ask can
  # still point up one step past the optimum.
  assert 3e-3 < lr < 3e-3 * np.e and 1.2e-3 < wd < 1.2e-3 * np.e
