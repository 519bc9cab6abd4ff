"""A global-batch trainer in the style most JAX trainers use, before HDET.

flax linen with a ``TrainState``; one ``jax.jit`` with in/out shardings and donation;
FSDP through ``nn.with_partitioning`` on a mesh axis named ``'data'``;
``with_sharding_constraint`` in the step; ``optax.MultiSteps(optax.chain(clip,
adamw(schedule, mask=...)))``; orbax checkpoints. The task: next-token prediction on
sequences of a fixed random Markov chain. ``hdet_linen.py`` is this file plus HDET
(docs/add_to_trainer.md). ``python plain_linen.py [--quick]`` trains it.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.training.train_state import TrainState
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

VOCAB, WIDTH, SEQ = 32, 64, 16
BATCH, ACCUM, STEPS, PEAK_LR = 64, 2, 40, 1e-2  # global batch, micro-batches, steps


class Model(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    fsdp = lambda init: nn.with_partitioning(init, (None, 'data'))  # FSDP on 'data'
    normal, lecun = nn.initializers.normal(0.5), nn.initializers.lecun_normal()
    x = nn.Embed(VOCAB, WIDTH, embedding_init=fsdp(normal))(tokens)
    h = nn.gelu(nn.Dense(4 * WIDTH, kernel_init=fsdp(lecun))(x))
    x = x + nn.Dense(WIDTH, kernel_init=fsdp(lecun))(h)
    return nn.Dense(VOCAB, kernel_init=fsdp(lecun))(nn.LayerNorm()(x))


def batches(seed=0):
  """Global batches [BATCH, SEQ + 1] of one fixed Markov chain's tokens."""
  chain = np.random.default_rng(0).dirichlet(np.full(VOCAB, 0.1), VOCAB).cumsum(1)
  rng = np.random.default_rng(seed + 1)
  while True:
    x = np.empty((BATCH, SEQ + 1), np.int32)
    x[:, 0] = rng.integers(VOCAB, size=BATCH)
    for t in range(SEQ):
      u = rng.random((BATCH, 1))
      x[:, t + 1] = np.minimum((chain[x[:, t]] < u).sum(1), VOCAB - 1)
    yield x


def loss_fn(params, apply_fn, batch):
  logits = apply_fn({'params': params}, batch[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def make_optimizer():
  schedule = optax.warmup_cosine_decay_schedule(0.0, PEAK_LR, STEPS // 10, STEPS)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
  optimizer = optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(schedule, weight_decay=0.1, mask=decay_mask))
  return optax.MultiSteps(optimizer, ACCUM)


def create_state(key):
  params = Model().init(key, jnp.zeros((1, SEQ), jnp.int32))['params']
  state = TrainState.create(apply_fn=Model().apply, params=params, tx=make_optimizer())
  return state


def make_trainer(mesh):
  abstract = jax.eval_shape(create_state, jax.random.key(0))
  state_sharding = nn.get_sharding(abstract, mesh)
  batch_sharding = NamedSharding(mesh, P('data'))

  def train_step(state, batch):
    batch = jax.lax.with_sharding_constraint(batch, NamedSharding(mesh, P('data')))
    loss, grads = jax.value_and_grad(loss_fn)(state.params, state.apply_fn, batch)
    state = state.apply_gradients(grads=grads)
    return state, {'loss': loss}

  def eval_step(params, batch):
    return loss_fn(params, Model().apply, batch)

  step = jax.jit(train_step, in_shardings=(state_sharding, batch_sharding),
                 out_shardings=(state_sharding, None), donate_argnames=('state',))
  evaluate = jax.jit(eval_step)
  init = jax.jit(create_state, out_shardings=state_sharding)
  return init, step, evaluate, batch_sharding


def train(workdir, steps=STEPS, seed=0):
  mesh = Mesh(np.array(jax.devices()), ('data',))
  init, step, evaluate, batch_sharding = make_trainer(mesh)
  manager = ocp.CheckpointManager(workdir)
  state = init(jax.random.key(seed))
  if manager.latest_step() is not None:
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    args = ocp.args.StandardRestore(target)
    state = manager.restore(manager.latest_step(), args=args)
  data, losses = batches(seed), []
  start = manager.latest_step() or 0  # optimizer steps saved: resume from there
  for _ in range(start):  # the batch position: skip the batches trained on
    next(data)
  for t in range(start, steps):
    for micro in np.split(next(data), ACCUM):
      state, metrics = step(state, jax.device_put(micro, batch_sharding))
    losses.append(float(metrics['loss']))
    if (t + 1) % 10 == 0:
      manager.save(t + 1, args=ocp.args.StandardSave(state))
  manager.wait_until_finished()
  eval_batch = jax.device_put(next(batches(seed + 1000)), batch_sharding)
  eval_loss = float(evaluate(state.params, eval_batch))
  return state, losses, eval_loss


if __name__ == '__main__':
  import sys
  import tempfile
  jax.config.update('jax_num_cpu_devices', 8)
  steps = 20 if '--quick' in sys.argv else STEPS
  state, losses, eval_loss = train(tempfile.mkdtemp(), steps)
  print(f'train loss {losses[0]:.3f} -> {losses[-1]:.3f}; eval loss {eval_loss:.3f}')
