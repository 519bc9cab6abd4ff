"""hdet_jax.hyperparams (hdet_jax.views): every replica's and the base values, the way optax users look for them."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hdet_jax as H
from test_optax_conventions import AX, LR, N, _run


def test_hyperparams_reads_every_replica_and_the_base_for_the_coming_step():
  tx = H.hdet(
    optax.adam, H.one_cycle(max_lr=0.1, total_steps=50), num_replicas=N, spread=0.25, sync_every=3, replica_axis=AX
  )
  _, state = _run(tx, steps=4)  # one sync after step 3 reshuffled the multipliers
  hp = H.hyperparams(state)
  assert set(hp) == {'learning_rate', 'base_learning_rate'}
  chex.assert_shape(hp['learning_rate'], (N,))
  chex.assert_shape(hp['base_learning_rate'], ())
  # The coming step is step 4: base = the schedule at 4, replica r = base * rho[perm[r]].
  base = float(H.one_cycle(max_lr=0.1, total_steps=50)(4))
  perm = np.asarray(state.controller.perm[0, 0])
  assert sorted(perm.tolist()) == list(range(N)) and perm.tolist() != list(range(N))  # reshuffled
  np.testing.assert_allclose(hp['base_learning_rate'], base, rtol=1e-6)
  np.testing.assert_allclose(hp['learning_rate'], base * H.multipliers.spread_multipliers(N, 0.25)[perm], rtol=1e-6)
  # The same view as the state's own fields, and the same from one replica's state inside the step.
  np.testing.assert_array_equal(hp['learning_rate'], np.asarray(state.learning_rates[0]))
  inside = jax.vmap(lambda s: H.hyperparams(s)['learning_rate'], axis_name=AX)(state)
  np.testing.assert_array_equal(np.asarray(inside), np.broadcast_to(hp['learning_rate'], (N, N)))


def test_hyperparams_with_groups_and_explored_values_inside_a_chain():
  groups = {'kernel': r'w$', 'bias': r'b$'}
  explore = {'weight_decay': (1e-2, 0.5)}
  names = H.hyperparam_names(param_groups=groups, explore=explore)
  assert names == ('learning_rate/kernel', 'learning_rate/bias', 'weight_decay')
  hdet = H.hdet(
    optax.adamw, 0.1, num_replicas=N, spread=0.2, sync_every=10, replica_axis=AX, param_groups=groups, explore=explore
  )
  tx = optax.chain(optax.clip_by_global_norm(1.0), hdet)
  params = H.stack_replicas({'w': jnp.zeros(3), 'b': jnp.zeros(1)}, N)
  state = jax.vmap(tx.init)(params)
  hp = H.hyperparams(state, names)  # found inside the chain's state
  assert list(hp) == list(names) + [f'base_{n}' for n in names]
  rho_lr, rho_wd = H.multipliers.spread_multipliers(N, 0.2), H.multipliers.spread_multipliers(N, 0.5)
  for group in groups:
    np.testing.assert_allclose(hp[f'learning_rate/{group}'], 0.1 * rho_lr, rtol=1e-6)
    np.testing.assert_allclose(hp[f'base_learning_rate/{group}'], 0.1, rtol=1e-6)
  np.testing.assert_allclose(hp['weight_decay'], 1e-2 * rho_wd, rtol=1e-6)
  np.testing.assert_allclose(hp['base_weight_decay'], 1e-2, rtol=1e-6)
  with pytest.raises(ValueError, match='hyperparam_names'):
    H.hyperparams(state)  # three rows, no names
  with pytest.raises(ValueError, match='2 names'):
    H.hyperparams(state, names[:2])


def test_why_the_usual_optax_lookups_do_not_apply():
  """What views.py's docstring says: tree_get finds no learning rate and two 'base' fields."""
  tx = H.hdet(optax.adam, LR, num_replicas=N, sync_every=5, replica_axis=AX)
  state = jax.vmap(tx.init)(H.stack_replicas({'w': jnp.zeros(3)}, N))
  assert optax.tree_utils.tree_get(state, 'learning_rate') is None
  with pytest.raises(KeyError, match='multiple'):
    optax.tree_utils.tree_get(state, 'base')
  np.testing.assert_allclose(
    H.hyperparams(state)['learning_rate'], LR * H.multipliers.spread_multipliers(N, 0.25), rtol=1e-6
  )


def test_find_state_needs_exactly_one_hdet_state():
  tx = H.hdet(optax.adam, LR, num_replicas=N, sync_every=5, replica_axis=AX)
  state = jax.eval_shape(tx.init, {'w': jnp.zeros(3)})  # shapes only: find_state reads no values
  assert H.views.find_state(state) is state
  assert H.views.find_state((optax.EmptyState(), {'opt': state})) is state
  with pytest.raises(ValueError, match='expected one HDETState in the optimizer state, found 0'):
    H.hyperparams((optax.EmptyState(), {'w': jnp.zeros(3)}))
  with pytest.raises(ValueError, match='expected one HDETState in the optimizer state, found 2'):
    H.hyperparams((state, state))


def test_hyperparams_finds_the_state_under_multisteps_and_names_a_built_optimizers_rows():
  """Around a built optimizer the rows are factors on its own LR ('lr_scale'); found under MultiSteps, in a chain."""
  built = H.hdet(optax.adam(1e-3), num_replicas=4, spread=0.5)
  factory = H.hdet(optax.adam, 1e-3, num_replicas=4, spread=0.5)
  for tx, name, base in ((built, 'lr_scale', 1.0), (factory, 'learning_rate', 1e-3)):
    outer = optax.MultiSteps(optax.chain(optax.clip(1.0), tx), 2)
    state = jax.vmap(outer.init)(H.stack_replicas({'w': jnp.zeros(2)}, 4))
    hp = H.hyperparams(state)
    assert set(hp) == {name, f'base_{name}'}
    np.testing.assert_allclose(hp[name], base * np.array([0.5, 5 / 6, 7 / 6, 1.5]), rtol=1e-6)


def test_host_metrics_turns_per_replica_metrics_into_floats_to_log():
  """[N] per-replica metrics against numpy: the mean over replicas (a mean over each replica's rows: the global
  batch's), the sum (a token count), the replicas' population standard deviation, each replica's row, and a global
  [] metric as it is; every value a Python float."""
  loss = np.array([2.0, 2.5, 1.0, 4.0, 3.0, 3.5, 2.0, 1.5], np.float32)
  tokens = np.array([30, 32, 29, 31, 33, 28, 30, 35], np.int32)
  metrics = {'loss': jnp.asarray(loss), 'aux': {'tokens': jnp.asarray(tokens)}, 'grad_norm': jnp.float32(0.75)}
  logs = H.host_metrics(metrics, reduce={'loss': 'mean', 'aux': 'sum', 'grad_norm': 'mean'}, per_replica=True)
  assert all(type(v) is float for v in logs.values())
  assert logs['loss'] == 19.5 / 8 and logs['aux/tokens'] == 248.0 and logs['grad_norm'] == 0.75
  np.testing.assert_allclose(
    logs['loss/spread'], np.sqrt(np.mean((loss.astype(np.float64) - 19.5 / 8) ** 2)), rtol=1e-12
  )
  np.testing.assert_allclose(logs['aux/tokens/spread'], np.sqrt(np.mean((tokens - 31.0) ** 2)), rtol=1e-12)
  assert [logs[f'loss/{r}'] for r in range(N)] == loss.tolist()
  assert set(logs) == (
    {'loss', 'loss/spread', 'aux/tokens', 'aux/tokens/spread', 'grad_norm'}
    | {f'{k}/{r}' for k in ('loss', 'aux/tokens') for r in range(N)}
  )
  assert H.host_metrics(metrics)['aux/tokens'] == 31.0  # the default mean: one replica's count, not the batch's


def test_host_metrics_gives_the_learning_rate_in_use_with_a_factory_and_a_built_optimizer():
  """After 4 updates (a sync after 3 reshuffled the replicas) the learning rates for the coming step are
  schedule(4) * rho[perm[r]] (rho: 1 - 0.25 ... 1 + 0.25, spread_multipliers); around a built optimizer the rows
  are factors, and optimizer_lr= turns them into the same learning rates."""
  schedule = optax.linear_schedule(0.1, 0.0, 40)
  factory = H.hdet(optax.sgd, schedule, num_replicas=N, spread=0.25, sync_every=3, replica_axis=AX)
  built = H.hdet(optax.sgd(schedule), num_replicas=N, spread=0.25, sync_every=3, replica_axis=AX)
  _, state = _run(factory, steps=4)
  _, built_state = _run(built, steps=4)
  rho = 1.0 + 0.25 * np.linspace(-1.0, 1.0, N)  # eq. 1's multipliers, closed form
  want = 0.1 * (1 - 4 / 40) * rho
  logs = H.host_metrics(opt_state=state, per_replica=True)
  perm = np.asarray(state.controller.perm[0, 0])
  np.testing.assert_allclose([logs[f'learning_rate/{r}'] for r in range(N)], want[perm], rtol=1e-6)
  np.testing.assert_allclose(
    [logs['base_learning_rate'], logs['learning_rate/min'], logs['learning_rate/max']],
    [0.09, want.min(), want.max()],
    rtol=1e-6,
  )
  assert logs['sync_count'] == 1.0 and logs['finite_replicas'] == N
  factors = H.host_metrics(opt_state=built_state)
  np.testing.assert_allclose(
    [factors['lr_scale/min'], factors['lr_scale/max'], factors['base_lr_scale']], [0.75, 1.25, 1]
  )
  in_use = H.host_metrics(opt_state=built_state, optimizer_lr=schedule, per_replica=True)
  for key in [k for k in logs if 'learning_rate' in k]:
    np.testing.assert_allclose(in_use[key], logs[key], rtol=1e-6, err_msg=key)


@pytest.mark.parametrize(
  'kwargs, message',
  [
    (dict(reduce='avg'), "host_metrics: reduce='avg' is not a reduction; pass reduce='mean'"),
    (dict(reduce={'loss': 'total'}), "host_metrics: reduce='total' is not a reduction"),
    (dict(reduce={'tokens': 'sum'}), "host_metrics: reduce={'tokens': 'sum'} does not match the metrics"),
    (dict(metrics={'loss': jnp.zeros((N, 3))}), "host_metrics: metric 'loss' has shape (8, 3); give per-replica"),
    (dict(optimizer_lr=0.1), 'host_metrics: optimizer_lr= reads the state: pass opt_state= too'),
    (dict(opt_state='factory', optimizer_lr=0.1), 'host_metrics: optimizer_lr= is for hdet around a built optimizer'),
    (dict(per_replica=1), 'host_metrics: per_replica must be True or False, got 1.'),
  ],
)
def test_host_metrics_refuses_bad_input_in_one_line(kwargs, message):
  if kwargs.get('opt_state') == 'factory':
    kwargs['opt_state'] = jax.vmap(H.hdet(optax.sgd, 0.1, num_replicas=N).init)(H.stack_replicas(jnp.zeros(2), N))
  kwargs.setdefault('metrics', {'loss': jnp.zeros(N)})
  with pytest.raises(ValueError, match=re.escape(message)) as e:
    H.host_metrics(**kwargs)
  assert '\n' not in str(e.value)
