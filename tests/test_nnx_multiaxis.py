"""HDET in an nnx trainer with partitioned multi-axis kernels (issue 73, item 2, the nnx half): attention whose 3-D
kernels are ``nnx.LinearGeneral`` and ``nnx.Einsum`` under ``nnx.with_partitioning``, (d_model, heads, head_dim)
sharded ('data', None, None) and (heads, head_dim, d_model) sharded (None, None, 'data'), trained in
examples/add_to_trainer/hdet_nnx.py's style: an ``nnx.Optimizer`` around ``hdet`` of a built ``adamw(schedule)``,
split into a graphdef and a state, stacked, stepped under ``over_replicas`` on a (4, 2) ('replica', 'data') mesh.

linen's ``nn.DenseGeneral`` needs ``hdet_jax.trainer.linen.dense_general_ok`` (flax issue 3676: it re-runs its
flattened kernel's initializer, and so the 3-name constraint on a 2-D value, on every apply). nnx needs nothing:
``nnx.LinearGeneral`` reshapes the flattened kernel before it becomes an annotated ``nnx.Param``, once, at
creation, and ``nnx.Einsum`` creates its kernel in its own shape; the step never re-initializes.
"""

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import hdet_jax
from replica_testing import one_in_flight

VOCAB, D, HEADS, HEAD_DIM, SEQ, BATCH = 16, 16, 2, 8, 8, 16
N, STEPS = 4, 10
IN_SPEC, OUT_SPEC = ('data', None, None), (None, None, 'data')  # (d_model, heads, head_dim), (heads, head_dim, d_model)


class Attention(nnx.Module):
  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    qk = lambda: nnx.LinearGeneral(
      D, (HEADS, HEAD_DIM), kernel_init=nnx.with_partitioning(init, IN_SPEC), use_bias=False, rngs=rngs
    )
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.query, self.key = qk(), qk()
    self.value = nnx.Einsum(
      'bsm,mhd->bshd', (D, HEADS, HEAD_DIM), kernel_init=nnx.with_partitioning(init, IN_SPEC), rngs=rngs
    )
    self.out = nnx.LinearGeneral(
      (HEADS, HEAD_DIM), D, axis=(-2, -1), kernel_init=nnx.with_partitioning(init, OUT_SPEC), rngs=rngs
    )
    self.head = nnx.Linear(D, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    q, k, v = self.query(x), self.key(x), self.value(x)
    weights = jax.nn.softmax(jnp.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(HEAD_DIM), axis=-1)
    return self.head(x + self.out(jnp.einsum('bhqk,bkhd->bqhd', weights, v)))


def loss_fn(model, batch):
  logits = model(batch)
  return optax.softmax_cross_entropy_with_integer_labels(logits, (batch + 1) % VOCAB).mean()  # the next token


def create_state(key):
  # (AutoLR over 10 steps syncs every step, the climb up to x2.7 each: started at 1e-2 it passed 60x and diverged;
  # it starts at a tenth of this 3e-2 peak)
  schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 2, STEPS)
  tx = hdet_jax.hdet(
    optax.adamw(schedule), num_replicas=N, replica_axis='replica', auto_lr=hdet_jax.AutoLR(total_steps=STEPS)
  )
  model = Attention(nnx.Rngs(key))
  graphdef, state = nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))
  return graphdef, hdet_jax.stack_replicas(state, N)


def test_nnx_multi_axis_kernels_train_sharded_with_no_workaround():
  mesh = Mesh(np.array(jax.devices()).reshape(N, -1), ('replica', 'data'))
  with jax.set_mesh(mesh):  # nnx shards the annotated Variables as it creates them
    graphdef, abstract = jax.eval_shape(create_state, jax.random.key(0))
    state_sharding = hdet_jax.stacked_shardings(nnx.get_named_sharding(abstract, mesh), 'replica')
    batch_sharding = NamedSharding(mesh, P('data'))
    split_batch = hdet_jax.batch_shardings(batch_sharding, 'replica')

    def train_step(state, batch):
      model, optimizer = nnx.merge(graphdef, state)
      batch = jax.lax.with_sharding_constraint(batch, batch_sharding)
      loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
      grads = hdet_jax.pmean_finite(grads, 'replica')
      optimizer.update(model, grads, value=loss)
      return nnx.state((model, optimizer)), {'loss': loss}

    step = jax.jit(
      hdet_jax.over_replicas(train_step, mesh, 'replica'),
      in_shardings=(state_sharding, split_batch),
      out_shardings=(state_sharding, None),
      donate_argnames=('state',),
    )
    step = one_in_flight(step)  # (CONTRIBUTING.md, "Known XLA:CPU limit")
    state = jax.jit(lambda key: create_state(key)[1], out_shardings=state_sharding)(jax.random.key(0))
    rng, losses = np.random.default_rng(0), []
    for _ in range(STEPS):
      batch = jax.device_put(rng.integers(VOCAB, size=(BATCH, SEQ), dtype=np.int32), split_batch)
      state, metrics = step(state, batch)
      losses.append(float(np.asarray(metrics['loss']).mean()))
  assert losses[-1] < 0.7 * losses[0], losses

  leaves = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(state)[0]}
  kernels = {k: v for k, v in leaves.items() if "['kernel']" in k and v.ndim == 4}  # [N, 3-D kernel]
  # the 4 attention kernels, in the model and in AdamW's two moments
  moments = [sum(f"['{m}']" in k for k in kernels) for m in ('mu', 'nu')]
  assert len(kernels) == 12 and moments == [4, 4], sorted(kernels)
  for key, leaf in kernels.items():
    spec = OUT_SPEC if "['out']" in key else IN_SPEC
    assert leaf.sharding.spec == P('replica', *spec), (key, leaf.sharding.spec)
    shard = tuple(n // 2 if name == 'data' else n for n, name in zip(leaf.shape[1:], spec))
    assert leaf.shape[0] == N and leaf.addressable_shards[0].data.shape == (1, *shard), key
  hp = hdet_jax.hyperparams(state)
  assert np.shape(hp['lr_scale']) == (N,) and len(set(np.round(np.asarray(hp['lr_scale']), 6))) == N
