"""plain_linen.py's global-batch trainer in flax nnx, before HDET.

An ``nnx.Module`` and ``nnx.Optimizer(model, tx, wrt=nnx.Param)``, split once into a
static graphdef and a state; one plain ``jax.jit`` (not ``nnx.jit``) with in/out
shardings and donation around a step that merges, updates and returns the state; FSDP
through ``nnx.with_partitioning`` on a mesh axis named ``'data'`` (nnx shards each
annotated Variable as it is created, so the state is built under ``jax.set_mesh``);
``with_sharding_constraint`` in the step; ``optax.MultiSteps(optax.chain(clip,
adamw(schedule, mask=...)))``; orbax checkpoints. The task, the model's architecture
and the batches are plain_linen.py's. ``hdet_nnx.py`` is this file plus HDET
(docs/add_to_trainer.md).
"""
import flax.nnx as nnx
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

VOCAB, WIDTH, SEQ = 32, 64, 16
BATCH, ACCUM, STEPS, PEAK_LR = 64, 2, 40, 1e-2  # global batch, micro-batches, steps


class Model(nnx.Module):
  def __init__(self, rngs):
    fsdp = lambda init: nnx.with_partitioning(init, (None, 'data'))  # FSDP on 'data'
    normal, lecun = nnx.initializers.normal(0.5), nnx.initializers.lecun_normal()
    self.embed = nnx.Embed(VOCAB, WIDTH, embedding_init=fsdp(normal), rngs=rngs)
    self.up = nnx.Linear(WIDTH, 4 * WIDTH, kernel_init=fsdp(lecun), rngs=rngs)
    self.down = nnx.Linear(4 * WIDTH, WIDTH, kernel_init=fsdp(lecun), rngs=rngs)
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.out = nnx.Linear(WIDTH, VOCAB, kernel_init=fsdp(lecun), rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    x = x + self.down(nnx.gelu(self.up(x)))
    return self.out(self.norm(x))


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


def loss_fn(model, batch):
  logits = model(batch[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def make_optimizer():
  schedule = optax.warmup_cosine_decay_schedule(0.0, PEAK_LR, STEPS // 10, STEPS)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
  optimizer = optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(schedule, weight_decay=0.1, mask=decay_mask))
  return optax.MultiSteps(optimizer, ACCUM)


def create_state(key):
  model = Model(nnx.Rngs(key))
  optimizer = nnx.Optimizer(model, make_optimizer(), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))
  return graphdef, state


def make_trainer(mesh):
  graphdef, abstract = jax.eval_shape(create_state, jax.random.key(0))
  model_def = nnx.graphdef(nnx.eval_shape(lambda: Model(nnx.Rngs(0))))  # for eval
  state_sharding = nnx.get_named_sharding(abstract, mesh)
  batch_sharding = NamedSharding(mesh, P('data'))

  def train_step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    batch = jax.lax.with_sharding_constraint(batch, NamedSharding(mesh, P('data')))
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), {'loss': loss}

  def eval_step(params, batch):
    return loss_fn(nnx.merge(model_def, params), batch)

  step = jax.jit(train_step, in_shardings=(state_sharding, batch_sharding),
                 out_shardings=(state_sharding, None), donate_argnames=('state',))
  evaluate = jax.jit(eval_step)
  init = jax.jit(lambda key: create_state(key)[1], out_shardings=state_sharding)
  return init, step, evaluate, batch_sharding


def train(workdir, steps=STEPS, seed=0):
  mesh = Mesh(np.array(jax.devices()), ('data',))
  with jax.set_mesh(mesh):  # nnx shards the annotated Variables as it creates them
    init, step, evaluate, batch_sharding = make_trainer(mesh)
    manager = ocp.CheckpointManager(workdir)
    state = init(jax.random.key(seed))  # state[0]: the model, state[1]: the optimizer
    if manager.latest_step() is not None:
      target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
      args = ocp.args.StandardRestore(target)
      state = manager.restore(manager.latest_step(), args=args)
    data, losses = batches(seed), []
    start = manager.latest_step() or 0  # optimizer steps saved
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
    eval_loss = float(evaluate(state[0], eval_batch))
  return state, losses, eval_loss


if __name__ == '__main__':
  import sys
  import tempfile
  jax.config.update('jax_num_cpu_devices', 8)
  steps = 20 if '--quick' in sys.argv else STEPS
  state, losses, eval_loss = train(tempfile.mkdtemp(), steps)
  print(f'train loss {losses[0]:.3f} -> {losses[-1]:.3f}; eval loss {eval_loss:.3f}')
