"""The measured default in one call: the library's shortest call is the trainer's controller.

``hdet_jax.AutoLR(total_steps=S)`` (with ``hdet()``'s default windows) is what ``python train.py`` builds from
configs/default.py: the same settings, and, driven by the same gradients and losses in a plain ``shard_map`` loop
like the README's, the same trajectory of base learning rates, bit for bit.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import hdet_jax
from hdet_jax import settings
from hdet_jax import sync as sync_lib
from hdet_jax.trainer import config_lib
from hdet_jax.trainer import optimizer as optimizer_lib
import trainer_testing

DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs', 'default.py')
N = 8


def _default(steps):
  return config_lib.with_overrides(config_lib.load_config_file(DEFAULT), {'num_train_steps': steps})


@pytest.mark.parametrize('steps', [300, 1500, 3000])
def test_the_shortest_call_is_the_trainers_controller(steps):
  """The settings and the windows: AutoLR(total_steps=S) and T = round(S / 15) at most 100."""
  config = _default(steps)
  run = trainer_testing.resolve(config)
  # initial_scale None is 0.1 around a factory (the trainer's optimizer), which the trainer's config says
  assert run.optimizer.auto_lr.initial_scale == settings.DEFAULT_INITIAL_SCALE
  assert dataclasses.replace(run.optimizer.auto_lr, initial_scale=None) == hdet_jax.AutoLR(total_steps=steps)
  assert run.optimizer.windows == (min(round(steps / 15), 100),) == (sync_lib.default_period(steps),)


def _loss(params, batch):
  x, y = batch
  return jnp.mean((x @ params['w'] - y) ** 2)


def test_a_readme_loop_with_the_shortest_call_follows_the_trainers_base_lrs_bit_for_bit():
  """Both transformations in one shard_map loop over 8 devices, on the same per-replica batches, each replica's loss
  as ``value=`` and, at a sync, its loss on a batch common to all replicas as ``score=`` (the trainer's
  hdet.score='common'): every step's base LR and every replica's LR agree bit for bit, the climb rose from its
  cautious start (a tenth of the schedule), and the run ends where the trainer's ends."""
  steps = 150  # T = 10: 15 syncs
  config = _default(steps)
  o = config.optim
  library = hdet_jax.hdet(  # the README's call, with the trainer's optimizer hyperparameters
    optax.adamw,
    hdet_jax.one_cycle(max_lr=o.max_lr, total_steps=steps, final_div_factor=o.final_div_factor),
    num_replicas=N,
    auto_lr=hdet_jax.AutoLR(total_steps=steps),
    exact_sync=True,
    b2=o.b2,
    weight_decay=o.weight_decay,
  )
  run = trainer_testing.resolve(config)
  trainer = optimizer_lib.make_optimizer(run.optimizer, N, seed=run.seed)
  assert jax.device_count() >= N
  mesh = Mesh(np.array(jax.devices()[:N]), ('data',))
  rng = np.random.default_rng(0)
  true_w = rng.normal(size=(6, 3)).astype(np.float32)
  xs = rng.normal(size=(steps, N, 16, 6)).astype(np.float32)
  ys = xs @ true_w + 0.3 * rng.normal(size=(steps, N, 16, 3)).astype(np.float32)
  common_x = rng.normal(size=(64, 6)).astype(np.float32)
  common = (common_x, common_x @ true_w)

  def make_step(tx, sync):
    def step(params, opt_state, batch):  # one replica's view
      loss, grads = jax.value_and_grad(_loss)(params, batch)
      grads = jax.lax.pmean(grads, 'data')
      score = _loss(params, common) if sync else None  # (scored before this step's update, as a window end does)
      updates, opt_state = tx.update(grads, opt_state, params, value=loss, score=score, sync=sync)
      return hdet_jax.apply_updates(params, updates, opt_state, sync=sync), opt_state

    return jax.jit(hdet_jax.shard_map_replicas(step, mesh, 'data'))

  init = {'w': jnp.zeros((6, 3), jnp.float32)}
  base = {}
  for name, tx in (('library', library), ('trainer', trainer)):
    programs = {s: make_step(tx, s) for s in (False, True)}
    params = hdet_jax.stack_replicas(init, N)
    opt_state = jax.jit(jax.vmap(tx.init))(params)
    params, opt_state = jax.device_put((params, opt_state), NamedSharding(mesh, P('data')))
    bases, lrs = [], []
    for t in range(steps):
      bases.append(np.asarray(opt_state.base)[0, 0])
      lrs.append(np.asarray(opt_state.values)[0, 0])
      params, opt_state = programs[hdet_jax.is_sync_step(10, t)](params, opt_state, (xs[t], ys[t]))
    base[name] = (np.asarray(bases), np.asarray(lrs), jax.device_get(params))
  np.testing.assert_array_equal(base['library'][0], base['trainer'][0])
  np.testing.assert_array_equal(base['library'][1], base['trainer'][1])
  jax.tree.map(np.testing.assert_array_equal, base['library'][2], base['trainer'][2])
  schedule = run.optimizer.schedule
  correction = base['library'][0] / np.asarray(jax.vmap(schedule)(jnp.arange(steps)))
  np.testing.assert_allclose(correction[:10], 0.1, rtol=1e-5)  # the cautious start
  assert correction[-1] > 0.15  # ... which the climb raised
