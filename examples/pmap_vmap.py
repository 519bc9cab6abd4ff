"""The same HDET train step under jax.pmap (one replica per device) and jax.vmap (all replicas on one device).

``hdet`` only needs the replica axis to be bound by name, so a step written for one replica runs unchanged
under ``jax.shard_map`` (see nnx_shard_map.py), ``jax.pmap(step, axis_name='data')`` and
``jax.jit(jax.vmap(step, axis_name='data'))``. Here a flax.nnx MLP with per-replica dropout trains both ways
on the same data; the two end at the same parameters, to float rounding.

    python examples/pmap_vmap.py            # 200 steps
    python examples/pmap_vmap.py --quick    # 30 steps (the test runs this)
"""

import sys

import jax

jax.config.update('jax_num_cpu_devices', 8)  # 8 simulated devices on CPU; before anything touches a device

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import hdet_jax

STEPS = 30 if '--quick' in sys.argv else 200
N, FEATURES, CLASSES, BATCH = 8, 16, 3, 32     # N replicas; BATCH examples per replica and step


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(FEATURES, 64, rngs=rngs)
    self.out = nnx.Linear(64, CLASSES, rngs=rngs)

  def __call__(self, x, dropout_rate=0.0, key=None):
    h = jax.nn.relu(self.fc1(x))
    if key is not None:  # inverted dropout at a traced, per-replica rate
      keep = jax.random.bernoulli(key, 1.0 - dropout_rate, h.shape)
      h = jnp.where(keep, h / (1.0 - dropout_rate), 0.0)
    return self.out(h)


graphdef, init_params = nnx.split(MLP(nnx.Rngs(0)))
explore = {'dropout': hdet_jax.Explore(0.2, 0.1, additive=True, low=0.0, high=0.5, to_optimizer=False)}
DROPOUT = hdet_jax.hyperparam_names(explore=explore).index('dropout')
tx = hdet_jax.hdet(optax.adam, hdet_jax.one_cycle(max_lr=1e-2, total_steps=STEPS), num_replicas=N,
                   spread=0.25, sync_every=10, replica_axis='data', explore=explore,
                   auto_lr=hdet_jax.AutoLR(total_steps=STEPS))


def train_step(params, opt_state, x, y):                  # one replica's view, exactly as under shard_map
  rate = hdet_jax.replica_value(opt_state, DROPOUT, 'data')
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(1), opt_state.count), jax.lax.axis_index('data'))

  def loss_fn(params):
    logits = nnx.merge(graphdef, params)(x, rate, key)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  grads = hdet_jax.pmean_finite(grads, 'data')
  updates, opt_state = tx.update(grads, opt_state, params, value=loss)
  return optax.apply_updates(params, updates), opt_state, loss


def batches():
  teacher = jax.random.normal(jax.random.key(42), (FEATURES, CLASSES))
  for t in range(STEPS):
    x = jax.random.normal(jax.random.key(t), (N, BATCH, FEATURES))   # [replicas, per-replica batch, ...]
    yield x, jnp.argmax(x @ teacher, -1)


def train(step):
  params = hdet_jax.stack_replicas(init_params, N)       # [N, ...] on every leaf
  opt_state = jax.vmap(tx.init)(params)
  for x, y in batches():
    params, opt_state, loss = step(params, opt_state, x, y)
  base = hdet_jax.hyperparams(opt_state, hdet_jax.hyperparam_names(explore=explore))['base_learning_rate']
  print(f'  final loss {float(np.mean(loss)):.4f}, {int(opt_state.sync_count[0])} syncs, base LR {float(base):.2e}')
  return hdet_jax.average_replicas(params)


results = {}
if jax.device_count() >= N:
  print(f'pmap: {N} replicas on {N} devices')
  results['pmap'] = train(jax.pmap(train_step, axis_name='data', devices=jax.devices()[:N]))
else:
  print(f'pmap: skipped, {jax.device_count()} device(s) < {N} replicas')
print(f'vmap: {N} replicas on one device ({jax.devices()[0]})')
results['vmap'] = train(jax.jit(jax.vmap(train_step, axis_name='data')))

if len(results) == 2:
  gap = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(results['pmap']),
                                                         jax.tree.leaves(results['vmap'])))
  print(f'largest difference between the two averaged models: {gap:.2e}')
  assert gap < 1e-4, gap
