"""``hdet`` around an optimizer the user already built: its updates scaled per replica (issue 73).

The oracle is the factory path, an independent code path (the optimizer rebuilt at each replica's learning
rate): for an optimizer linear in its learning rate, ``hdet(make(lr), auto_lr=a)`` equals ``hdet(make, lr,
auto_lr=a)``: one start rule (issue 84), the climb at a tenth of the learning rate passed either way. The two
differ only in where the learning rate multiplies: the built path rounds ``lr(t) u`` and then
``c rho (lr u)``, the factory path ``(c rho lr) u``: a few float32 roundings apart per step (2**-24
relative). The controller's quadratic fit to
near-equal replica losses amplifies them. Bounds after 60 steps and 4 controller updates: the parameters
within 1e-4 of each leaf's largest value, every loss within 1e-4 relative, the controller's factor within
5e-5 (measured, fast-compile flags: at most 3.5e-5 (Lion, whose sign() turns a last-bit difference of a
near-zero moment into a whole step), 4.2e-5 (inject_hyperparams AdamW) and 7.5e-6 (Lion)).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hdet_jax as H

N, DIM, STEPS, T = 4, 6, 60, 12
AX = 'data'


def _schedule():
  return optax.warmup_cosine_decay_schedule(0.0, 0.05, 6, STEPS, end_value=0.005)


def _mask(params):
  return jax.tree.map(lambda p: p.ndim > 1, params)


# name: a factory of the learning rate (the oracle) whose call with a schedule is the optimizer as users build it.
LINEAR = {
  'sgd': lambda learning_rate: optax.sgd(learning_rate),
  'momentum_nesterov': lambda learning_rate: optax.sgd(learning_rate, momentum=0.9, nesterov=True),
  'adam': lambda learning_rate: optax.adam(learning_rate),
  'clip_masked_adamw': lambda learning_rate: optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(learning_rate, weight_decay=0.1, mask=_mask)
  ),
  'lion': lambda learning_rate: optax.lion(learning_rate, weight_decay=0.01),
  'adafactor': lambda learning_rate: optax.adafactor(learning_rate),
  'layerwise_scales': lambda learning_rate: optax.chain(
    optax.adam(learning_rate), optax.multi_transform({'x2': optax.scale(2.0), 'x1': optax.identity()}, _labels)
  ),
}
# Built as users build them, each beside its oracle factory where the two differ: inject_hyperparams keeps a
# number it is given in its state at init, so it cannot be a factory's body (the factory would train at the
# learning rate of step 0); the built optimizer reads its schedule at every step.
BUILT_ONLY = {
  'inject_hyperparams': (
    lambda schedule: optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=0.1),
    lambda learning_rate: optax.adamw(learning_rate, weight_decay=0.1),
  ),
}


def _labels(params):
  return {'w': 'x2', 'b': 'x1'}


def _problem():
  k1, k2 = jax.random.split(jax.random.key(0))
  x = jax.random.normal(k1, (STEPS, N, 16, DIM))
  y = x @ jax.random.normal(k2, (DIM, 2)) + 0.1 * jnp.sin(x[..., :2])
  return {'w': jnp.zeros((DIM, 2)), 'b': jnp.zeros((2,))}, x, y


def _trainer(tx, steps=STEPS):
  """``steps`` HDET steps of N replicas under ``jax.vmap`` (one scan), a function of the stacked params and the
  data: the params, losses, base and state."""

  def step(p, s, xb, yb):
    loss, g = jax.value_and_grad(lambda p: jnp.mean((xb @ p['w'] + p['b'] - yb) ** 2))(p)
    u, s = tx.update(jax.lax.pmean(g, AX), s, p, value=loss)
    return optax.apply_updates(p, u), s, loss

  def body(carry, batch):
    p, s, loss = jax.vmap(step, axis_name=AX)(*carry, *batch)
    return (p, s), (loss, s.base[0, 0])

  def train(p, x, y):
    (p, s), (losses, bases) = jax.lax.scan(body, (p, jax.vmap(tx.init)(p)), (x[:steps], y[:steps]))
    return p, losses, bases, s

  return train


def _train_all(runs):
  """Each ``{key: (tx, steps)}`` trained by _trainer, all in one compiled program: XLA:CPU compiles the kernels
  that the runs' programs share (hdet's own: the sync, the controller) once per program, so one program of all the
  runs compiles in about a fifth of the CPU time of one program per run. The runs are independent computations in
  it: ``{key: (params, losses, bases, state)}``."""
  params, x, y = _problem()
  trains = {key: _trainer(tx, steps) for key, (tx, steps) in runs.items()}
  out = jax.jit(lambda p, x, y: {key: train(p, x, y) for key, train in trains.items()})(
    H.stack_replicas(params, N), x, y
  )
  return {key: (p, np.asarray(losses), np.asarray(bases), s) for key, (p, losses, bases, s) in out.items()}


# Without the anneal rule (tests/test_anneal.py has it on both paths): Adafactor's climb rises only at the syncs
# after step 35, where this cosine is below half its peak.
AUTO = H.AutoLR(total_steps=STEPS, warmup_steps=12, anneal_fraction=0.0)


CASES = sorted(LINEAR) + sorted(BUILT_ONLY)
GROUPS = {'kernel': r'^w$', 'bias': r'^b$'}


@pytest.fixture(scope='module')
def trained():
  """Every case's built and factory runs (test_built_equals_factory_at_the_same_learning_rate), and the param groups'
  (test_param_groups_scale_each_group, 36 steps), trained in one program (_train_all)."""
  runs = {}
  for name in CASES:
    build, make = BUILT_ONLY.get(name, (LINEAR.get(name), LINEAR.get(name)))
    runs[name, 'built'] = H.hdet(build(_schedule()), num_replicas=N, sync_every=T, replica_axis=AX, auto_lr=AUTO), STEPS
    runs[name, 'factory'] = (
      H.hdet(make, _schedule(), num_replicas=N, sync_every=T, replica_axis=AX, auto_lr=AUTO),
      STEPS,
    )
  kw = dict(num_replicas=N, sync_every=T, replica_axis=AX, auto_lr=AUTO, param_groups=GROUPS)
  runs['groups', 'built'] = H.hdet(optax.adam(_schedule()), **kw), 36
  runs['groups', 'factory'] = H.hdet(optax.adam, _schedule(), **kw), 36
  return _train_all(runs)


@pytest.mark.parametrize('name', CASES)
def test_built_equals_factory_at_the_same_learning_rate(trained, name):
  pb, lb, bb, sb = trained[name, 'built']
  pf, lf, bf, sf = trained[name, 'factory']
  assert np.all(np.isfinite(lb))
  for a, b in zip(jax.tree.leaves(pb), jax.tree.leaves(pf)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * float(np.max(np.abs(b))))
  np.testing.assert_allclose(lb, lf, rtol=1e-4)
  # The built base is the factor c(t) on the optimizer's own LR; the factory's base is lr(t) c(t): the same
  # controller, read in two units.
  factor = bf / np.asarray([float(_schedule()(t + 1)) for t in range(STEPS)])
  np.testing.assert_allclose(bb, factor, rtol=5e-5)
  # Both start at a tenth of the user's LR (AutoLR's initial_scale=None), and the climb moved them.
  assert bb[0] == pytest.approx(0.1, rel=1e-6) and bb.max() > 0.105
  assert H.hyperparams(sb)['lr_scale'].shape == (N,)


def test_without_controller_the_factor_is_the_spread():
  """No auto_lr: replica r's update is rho_r times the built optimizer's own update, exactly (one multiply)."""
  params, x, y = _problem()
  tx = H.hdet(optax.sgd(0.1), num_replicas=N, spread=0.5, replica_axis=AX)
  rho = 1 + 0.5 * (np.arange(N) - (N - 1) / 2) / ((N - 1) / 2)
  g = jax.tree.map(lambda p: jnp.ones_like(p), params)

  def step(p, s):
    return tx.update(g, s, p)[0]

  # (jitted: run op by op the update compiles each of its many small operations on its own)
  u = jax.jit(lambda p: jax.vmap(step, axis_name=AX)(p, jax.vmap(tx.init)(p)))(H.stack_replicas(params, N))
  np.testing.assert_array_equal(np.asarray(u['w'])[:, 0, 0], np.float32(-0.1) * rho.astype(np.float32))


def test_param_groups_scale_each_group(trained):
  """Per-group factors around a built optimizer equal the factory's per-group learning rates."""
  pb, *_, sb = trained['groups', 'built']
  pf, *_ = trained['groups', 'factory']
  for a, b in zip(jax.tree.leaves(pb), jax.tree.leaves(pf)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  assert set(H.hyperparams(sb, H.hyperparam_names(param_groups=GROUPS, built=True))) == {
    'lr_scale/kernel',
    'lr_scale/bias',
    'base_lr_scale/kernel',
    'base_lr_scale/bias',
  }


@pytest.mark.parametrize(
  'make, kind',
  [
    (lambda: optax.contrib.prodigy(1.0), 'ProdigyState'),
    (lambda: optax.contrib.schedule_free_adamw(1e-3), 'ScheduleFreeState'),
    (lambda: optax.contrib.mechanize(optax.adam(1e-3)), 'MechanicState'),
    (lambda: optax.contrib.dadapt_adamw(1.0), 'DAdaptAdamWState'),
    (lambda: optax.lookahead(optax.adam(1e-3), 5, 0.5), 'LookaheadState'),
  ],
)
def test_not_linear_in_lr_is_refused_at_init(make, kind):
  tx = H.hdet(make(), num_replicas=2)
  with pytest.raises(ValueError, match=f'hdet: the built optimizer holds a optax.*{kind}.*factory'):
    tx.init({'w': jnp.ones(3)})


@pytest.mark.parametrize(
  'kwargs, match',
  [
    (dict(learning_rate=1e-3), 'already built and carries its own learning rate'),
    (dict(weight_decay=0.1), r'weight_decay= goes to an optimizer factory'),
    (dict(explore={'b1': (0.9, 0.01)}), r"explore\['b1'\] is passed to the optimizer"),
    (dict(auto_lr=H.AutoLR.paper(100, warmup_steps=10)), 'AutoLR.paper replaces the schedule'),
  ],
)
def test_built_optimizer_bad_input(kwargs, match):
  lr = kwargs.pop('learning_rate', None)
  with pytest.raises(ValueError, match=match):
    H.hdet(optax.adam(1e-3), lr, num_replicas=2, **kwargs)


def test_factory_needs_a_learning_rate():
  with pytest.raises(ValueError, match='learning_rate is required with an optimizer factory'):
    H.hdet(optax.adam, num_replicas=2)


def test_explore_read_by_the_step_is_allowed():
  tx = H.hdet(
    optax.adam(1e-3), num_replicas=2, explore={'dropout': H.Explore(0.1, 0.05, additive=True, to_optimizer=False)}
  )
  s = jax.vmap(tx.init)(H.stack_replicas({'w': jnp.ones(3)}, 2))
  hp = H.hyperparams(s, H.hyperparam_names(explore={'dropout': None}, built=True))
  np.testing.assert_allclose(hp['dropout'], [0.05, 0.15], rtol=1e-6)
  np.testing.assert_allclose(hp['lr_scale'], [0.75, 1.25], rtol=1e-6)
