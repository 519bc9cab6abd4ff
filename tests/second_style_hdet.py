"""A second trainer style for the tests (issue 73, item 5): second_style_trainer.py trains without HDET, and
second_style_hdet.py is the same file plus HDET (tests/test_second_style.py counts and tests the difference).

Written for the tests, in the manner of JAX LM trainers whose optimizer comes from a helper: ``get_optimizer(config)``
makes its warmup-cosine schedule inside and returns the built chain (clipping, AdamW with a weight-decay mask, the
embedding's steps scaled by a layerwise multiplier), which the trainer wraps in ``optax.MultiSteps``. The model is
a small flax-linen transformer whose attention projections are ``nn.DenseGeneral`` with 3-D kernels annotated by
``nn.with_partitioning`` (FSDP on the mesh axis ``'data'``), the boxed parameters kept in a flax ``TrainState``.
The step is one ``jax.jit`` with in/out shardings that donates the state and the batch; it reports the loss, the
tokens it trained on and the learning rate. orbax saves and restores the state. The data: sequences of a fixed
random Markov chain.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import hdet_jax.trainer.linen
import optax
import orbax.checkpoint as ocp
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 32
  seq_len: int = 16
  d_model: int = 32
  heads: int = 4
  head_dim: int = 8
  layers: int = 1
  global_batch: int = 32
  grad_accum: int = 2  # micro-batches per optimizer step
  steps: int = 24  # optimizer steps
  warmup_steps: int = 3
  peak_lr: float = 1e-2
  embed_lr_mult: float = 0.5  # the embedding's steps, relative to the rest
  weight_decay: float = 0.1
  clip_norm: float = 1.0
  save_every: int = 8
  seed: int = 0
  replicas: int = 4  # HDET's


def lr_schedule(config):
  return optax.warmup_cosine_decay_schedule(
    0.0, config.peak_lr, config.warmup_steps, config.steps, end_value=0.1 * config.peak_lr
  )


def get_optimizer(config):
  """Clipped AdamW on the warmup-cosine schedule; no decay on vectors; the embedding steps embed_lr_mult as far."""
  schedule = lr_schedule(config)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
  group = lambda path, _: 'embed' if path[0].key == 'embed' else 'rest'
  return optax.chain(
    optax.clip_by_global_norm(config.clip_norm),
    optax.adamw(schedule, b2=0.98, weight_decay=config.weight_decay, mask=decay_mask),
    optax.multi_transform(
      {'embed': optax.scale(config.embed_lr_mult), 'rest': optax.identity()},
      lambda params: jax.tree_util.tree_map_with_path(group, params),
    ),
  )


class SelfAttention(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, x):
    c, init = self.config, nn.initializers.lecun_normal()
    project = lambda name: nn.DenseGeneral(
      (c.heads, c.head_dim), use_bias=False, name=name, kernel_init=nn.with_partitioning(init, ('data', None, None))
    )  # kernel [d_model, heads, head_dim]
    q, k, v = project('query')(x), project('key')(x), project('value')(x)
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    y = nn.dot_product_attention(q, k, v, mask=mask)
    out = nn.DenseGeneral(  # kernel [heads, head_dim, d_model]
      c.d_model, axis=(-2, -1), use_bias=False, name='out', kernel_init=nn.with_partitioning(init, (None, None, 'data'))
    )
    return out(y)


class LM(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, tokens):
    c, init = self.config, nn.initializers.lecun_normal()
    embed = nn.Embed(
      c.vocab, c.d_model, embedding_init=nn.with_partitioning(nn.initializers.normal(1.0), (None, 'data')), name='embed'
    )
    x = embed(tokens)
    for _ in range(c.layers):
      x = x + SelfAttention(c)(nn.LayerNorm()(x))
      h = nn.Dense(4 * c.d_model, kernel_init=nn.with_partitioning(init, ('data', None)))(nn.LayerNorm()(x))
      x = x + nn.Dense(c.d_model, kernel_init=nn.with_partitioning(init, (None, 'data')))(nn.gelu(h))
    return nn.Dense(c.vocab, kernel_init=nn.with_partitioning(init, ('data', None)), name='unembed')(nn.LayerNorm()(x))


def markov_batches(config, seed):
  """Global batches [global_batch, seq_len + 1] from one fixed random Markov chain over the vocabulary."""
  cdf = np.random.default_rng(1234).dirichlet(np.full(config.vocab, 0.2), config.vocab).cumsum(1)
  rng = np.random.default_rng(seed)
  while True:
    tokens = np.empty((config.global_batch, config.seq_len + 1), np.int32)
    tokens[:, 0] = rng.integers(config.vocab, size=config.global_batch)
    for t in range(config.seq_len):
      u = rng.random((config.global_batch, 1))
      tokens[:, t + 1] = np.minimum((cdf[tokens[:, t]] < u).sum(1), config.vocab - 1)
    yield tokens


def loss_fn(params, apply_fn, batch):
  inputs, targets = batch[:, :-1], batch[:, 1:]
  logits = apply_fn({'params': params}, inputs)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(), targets.size


def create_state(config, key):
  model = LM(config)
  params = model.init(key, jnp.zeros((1, config.seq_len), jnp.int32))['params']
  tx = get_optimizer(config)
  tx = hdet_jax.hdet(tx, num_replicas=config.replicas, replica_axis='replica', auto_lr=hdet_jax.AutoLR(config.steps))
  tx = optax.MultiSteps(tx, config.grad_accum)
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  state = hdet_jax.stack_replicas(state, config.replicas)
  return state


def make_step(config, mesh):
  create = functools.partial(create_state, config)
  abstract_state = jax.eval_shape(create, jax.random.key(0))
  state_sharding = nn.get_sharding(abstract_state, mesh)
  state_sharding = hdet_jax.stacked_shardings(state_sharding, 'replica')
  batch_sharding = NamedSharding(mesh, P('data'))
  batch_sharding = hdet_jax.batch_shardings(batch_sharding, 'replica')
  schedule = lr_schedule(config)

  def train_step(state, batch):
    batch = jax.lax.with_sharding_constraint(batch, NamedSharding(mesh, P('data')))
    (loss, tokens), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, state.apply_fn, batch)
    grads = jax.lax.pmean(grads, 'replica')
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params, value=loss)
    metrics = {'loss': loss, 'tokens': tokens, 'learning_rate': schedule(state.opt_state.gradient_step)}
    metrics['learning_rate'] *= hdet_jax.hyperparams(state.opt_state)['lr_scale'][jax.lax.axis_index('replica')]
    params = optax.apply_updates(state.params, updates)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

  train_step = hdet_jax.over_replicas(hdet_jax.trainer.linen.dense_general_ok(train_step), mesh, 'replica')
  step = jax.jit(
    train_step,
    in_shardings=(state_sharding, batch_sharding),
    out_shardings=(state_sharding, None),
    donate_argnames=('state', 'batch'),
  )
  init = jax.jit(create, out_shardings=state_sharding)
  return init, step, batch_sharding


def train(config, workdir, stop_at=None):
  """Trains to config.steps (or stops after stop_at), resuming from workdir's latest checkpoint; returns the state
  and one record per optimizer step."""
  mesh = Mesh(np.array(jax.devices()).reshape(config.replicas, -1), ('replica', 'data'))
  init, step, batch_sharding = make_step(config, mesh)
  state = init(jax.random.key(config.seed))
  manager = ocp.CheckpointManager(workdir)
  start = manager.latest_step() or 0  # optimizer steps done
  if start:
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    state = manager.restore(start, args=ocp.args.StandardRestore(target))
  data, history = markov_batches(config, config.seed), []
  for _ in range(start):  # the batches already trained on
    next(data)
  for t in range(start, stop_at or config.steps):
    logged = []
    for micro in np.split(next(data), config.grad_accum):
      state, metrics = step(state, jax.device_put(micro, batch_sharding))
      logged.append(jax.device_get(metrics))
    history.append(
      {
        'loss': np.mean([m['loss'] for m in logged]),
        'tokens': np.sum([m['tokens'] for m in logged]),
        'learning_rate': logged[-1]['learning_rate'],
      }
    )
    if (t + 1) % config.save_every == 0:
      manager.save(t + 1, args=ocp.args.StandardSave(state))
  manager.wait_until_finished()
  return state, history
