"""HDET in your own flax.nnx training loop: jax.shard_map over a mesh, per-replica dropout explored.

Eight replicas (one per device; 8 simulated CPU devices without an accelerator) train a small MLP
classifier on synthetic data. Each replica trains with its own learning rate (the spread) and its own
dropout rate (``Explore``, read in the step with ``replica_value``); every 25 steps the replicas are
averaged and the auto-LR controller (``AutoLR``'s default, the guarded climb) raises the learning rate from a
tenth of the schedule toward the better replicas.

    python examples/nnx_shard_map.py            # 400 steps, a few seconds after compiling
    python examples/nnx_shard_map.py --quick    # 50 steps (the test runs this)
"""

import sys

import jax

jax.config.update('jax_num_cpu_devices', 8)  # 8 simulated devices on CPU; before anything touches a device

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import hdet_jax

STEPS = 50 if '--quick' in sys.argv else 400
N = jax.device_count()                        # one replica per device
FEATURES, CLASSES, BATCH = 32, 4, 64          # BATCH: examples per replica and step


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(FEATURES, 128, rngs=rngs)
    self.fc2 = nnx.Linear(128, 128, rngs=rngs)
    self.out = nnx.Linear(128, CLASSES, rngs=rngs)

  def __call__(self, x, dropout_rate=0.0, key=None):
    def dropout(h, key):  # inverted dropout at a traced, per-replica rate (nnx.Dropout's rate is static)
      if key is None:
        return h
      keep = jax.random.bernoulli(key, 1.0 - dropout_rate, h.shape)
      return jnp.where(keep, h / (1.0 - dropout_rate), 0.0)
    k1, k2 = (None, None) if key is None else jax.random.split(key)
    h = dropout(jax.nn.relu(self.fc1(x)), k1)
    h = dropout(jax.nn.relu(self.fc2(h)), k2)
    return self.out(h)


def synthetic_data(key, n):
  """A noisy random teacher: 4 classes from a linear map of 32 Gaussian features, 10% labels flipped."""
  kx, kn, kf = jax.random.split(key, 3)
  x = jax.random.normal(kx, (n, FEATURES))
  y = jnp.argmax(x @ jax.random.normal(jax.random.key(42), (FEATURES, CLASSES)), -1)
  return x, jnp.where(jax.random.uniform(kf, (n,)) < 0.1, jax.random.randint(kn, (n,), 0, CLASSES), y)


graphdef, init_params = nnx.split(MLP(nnx.Rngs(0)))   # the parameters as a pytree (nnx.State)
explore = {'dropout': hdet_jax.Explore(0.1, 0.1, additive=True, low=0.0, high=0.5, to_optimizer=False)}
DROPOUT = hdet_jax.hyperparam_names(explore=explore).index('dropout')  # its row in opt_state.values
tx = hdet_jax.hdet(
    optax.adamw, hdet_jax.one_cycle(max_lr=1e-2, total_steps=STEPS), num_replicas=N, spread=0.25,
    sync_every=25, replica_axis='data', explore=explore, weight_decay=1e-4,
    auto_lr=hdet_jax.AutoLR(total_steps=STEPS))


def loss_fn(params, x, y, dropout_rate=0.0, key=None):
  logits = nnx.merge(graphdef, params)(x, dropout_rate, key)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def train_step(params, opt_state, x, y):                  # one replica's view: its params, state, batch
  me = jax.lax.axis_index('data')
  rate = hdet_jax.replica_value(opt_state, DROPOUT, 'data')  # this replica's dropout for this step
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(1), opt_state.count), me)
  loss, grads = jax.value_and_grad(loss_fn)(params, x, y, rate, key)
  grads = hdet_jax.pmean_finite(grads, 'data')             # the data-parallel all-reduce
  updates, opt_state = tx.update(grads, opt_state, params, value=loss)
  return optax.apply_updates(params, updates), opt_state, loss


mesh = Mesh(np.array(jax.devices()), ('data',))
put = lambda tree: jax.device_put(tree, NamedSharding(mesh, P('data')))
params = hdet_jax.stack_replicas(init_params, N)         # [N, ...] on every leaf
opt_state = put(jax.jit(jax.vmap(tx.init))(params))
params = put(params)
step = jax.jit(hdet_jax.shard_map_replicas(train_step, mesh, 'data'), donate_argnums=(0, 1))

x_val, y_val = synthetic_data(jax.random.key(999), 4096)
for t in range(STEPS):
  x, y = synthetic_data(jax.random.key(t), N * BATCH)
  params, opt_state, loss = step(params, opt_state, put(x.reshape(N, BATCH, -1)), put(y.reshape(N, BATCH)))
  if (t + 1) % 25 == 0:
    hp = hdet_jax.hyperparams(opt_state, names=hdet_jax.hyperparam_names(explore=explore))
    print(f'step {t + 1:4d}  loss {float(loss.mean()):.3f}  base LR {float(hp["base_learning_rate"]):.2e}'
          f'  dropout {np.round(np.asarray(hp["dropout"]), 3)}')

model = hdet_jax.average_replicas(params)                # the ensemble's model: evaluate and export this
val_loss = float(loss_fn(model, x_val, y_val))
accuracy = float(jnp.mean(jnp.argmax(nnx.merge(graphdef, model)(x_val), -1) == y_val))
print(f'averaged model: validation loss {val_loss:.3f}, accuracy {accuracy:.3f} '
      f'({int(opt_state.sync_count[0])} syncs)')
