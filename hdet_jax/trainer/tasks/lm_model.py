"""A small byte-level causal transformer language model in ``flax.nnx``.

Pre-LayerNorm blocks (causal multi-head self-attention, GELU MLP), learned positions, and an
output head tied to the byte embedding. Dropout rate and attention temperature are call
arguments rather than module attributes, so HDET can give every replica its own (traced)
value; with the defaults (no dropout key, temperature 1) a forward pass is a pure function of
the parameters and the bytes, which is how the averaged model is evaluated.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hdet_jax.trainer.tasks.base import Regularization, dropout  # noqa: F401 (the model's per-call settings)

VOCAB_SIZE = 256  # bytes

# Tensor parallelism inside a replica group (mesh.tensor > 1), Megatron-style: (regex on a parameter's
# path, the dimension split over the 'tensor' axis). Column-parallel layers (qkv, fc1) split their
# output features, row-parallel ones (out, fc2) their input features, so each pair needs one
# all-reduce of activations in the forward pass. The qkv split is contiguous in the (q, k, v) x heads
# layout, not aligned to heads, so the partitioner adds a small reshuffle of q, k, v around
# attention (counted in results/mesh2d.md). Embeddings, positions and norms stay whole.
TENSOR_RULES = (
  (r'attn/qkv/(kernel|bias)$', -1),
  (r'attn/out/kernel$', 0),
  (r'fc1/(kernel|bias)$', -1),
  (r'fc2/kernel$', 0),
)
# FSDP inside a group shards each leaf's largest dimension. With a 'tensor' axis beside it, these leaves
# are kept whole over 'fsdp' instead (dimension None): with the byte embedding's rows (or features)
# split over 'fsdp', XLA's partitioner fails a check ("ExpandDeviceGroupsWithIota") on the lookup's
# gather. The table is small (256 x d_model).
FSDP_RULES = ((r'embed/embedding$', None),)


class CausalSelfAttention(nnx.Module):
  def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs):
    if d_model % num_heads:
      raise ValueError(f'model.d_model={d_model} must be divisible by model.num_heads={num_heads}.')
    self.num_heads = num_heads
    self.qkv = nnx.Linear(d_model, 3 * d_model, rngs=rngs)
    self.out = nnx.Linear(d_model, d_model, rngs=rngs)

  def __call__(self, x: jax.Array, temperature: Any = 1.0) -> jax.Array:
    b, t, d = x.shape
    h = d // self.num_heads
    q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3, self.num_heads, h), 3, axis=2)
    # Dividing q by the temperature divides the logits q.k / sqrt(h) by it.
    q = q[:, :, 0] / jnp.asarray(temperature, q.dtype)
    y = jax.nn.dot_product_attention(q, k[:, :, 0], v[:, :, 0], is_causal=True)
    return self.out(y.reshape(b, t, d))


class Block(nnx.Module):
  def __init__(self, d_model: int, num_heads: int, mlp_ratio: int, *, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
    self.attn = CausalSelfAttention(d_model, num_heads, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
    self.fc1 = nnx.Linear(d_model, mlp_ratio * d_model, rngs=rngs)
    self.fc2 = nnx.Linear(mlp_ratio * d_model, d_model, rngs=rngs)

  def __call__(self, x: jax.Array, reg: Regularization, keys: tuple[Any, Any]) -> jax.Array:
    x = x + dropout(self.attn(self.ln1(x), reg.attn_temperature), reg.dropout_rate, keys[0])
    return x + dropout(self.fc2(jax.nn.gelu(self.fc1(self.ln2(x)))), reg.dropout_rate, keys[1])


class TransformerLM(nnx.Module):
  """Bytes ``[batch, time]`` (int) to next-byte logits ``[batch, time, 256]``."""

  def __init__(self, *, d_model: int, num_layers: int, num_heads: int, mlp_ratio: int, max_len: int, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    self.embed = nnx.Embed(VOCAB_SIZE, d_model, embedding_init=init, rngs=rngs)
    self.pos = nnx.Param(init(rngs.params(), (max_len, d_model)))
    self.blocks = nnx.List([Block(d_model, num_heads, mlp_ratio, rngs=rngs) for _ in range(num_layers)])
    self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)

  def __call__(self, tokens: jax.Array, reg: Regularization = Regularization()) -> jax.Array:
    x = self.embed(tokens) + self.pos[: tokens.shape[1]]
    n = len(self.blocks)
    keys = [None] * (2 * n) if reg.dropout_key is None else list(jax.random.split(reg.dropout_key, 2 * n))
    for i, block in enumerate(self.blocks):
      x = block(x, reg, (keys[2 * i], keys[2 * i + 1]))
    return self.embed.attend(self.ln_f(x))


def make_model(model_config: Any, seq_len: int, key: jax.Array) -> TransformerLM:
  """The model described by ``config.model`` (its positions cover ``seq_len``), initialised from ``key``."""
  return TransformerLM(
    d_model=model_config.d_model,
    num_layers=model_config.num_layers,
    num_heads=model_config.num_heads,
    mlp_ratio=model_config.mlp_ratio,
    max_len=seq_len,
    rngs=nnx.Rngs(params=key),
  )


def split_model(model_config: Any, seq_len: int, key: jax.Array) -> tuple[nnx.GraphDef, dict]:
  """(graphdef, parameters as a pure dict); jit this for a fast init."""
  graphdef, params = nnx.split(make_model(model_config, seq_len, key), nnx.Param)
  return graphdef, nnx.to_pure_dict(params)


def check_tensor_parallel(model_config: Any, seq_len: int, tensor: int) -> None:
  """Raises ValueError unless every dimension :data:`TENSOR_RULES` splits divides by ``tensor``."""
  from hdet_jax.shardings import tensor_dim
  from hdet_jax.param_groups import path_string

  _, shapes = abstract_model(model_config, seq_len)
  for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
    tensor_dim(path_string(path), (1,) + tuple(leaf.shape), TENSOR_RULES, tensor)


def abstract_model(model_config: Any, seq_len: int) -> tuple[nnx.GraphDef, dict]:
  """(graphdef, parameter shapes) without computing anything."""
  graphdef, params = nnx.split(nnx.eval_shape(lambda: make_model(model_config, seq_len, jax.random.key(0))), nnx.Param)
  return graphdef, nnx.to_pure_dict(params)


def loss_fn(
  graphdef: nnx.GraphDef,
  params: dict,
  batch: jax.Array,
  reg: Regularization = Regularization(),
  label_smoothing: Any = 0.0,
) -> jax.Array:
  """Mean next-byte training loss in nats; ``batch`` is ``[B, seq_len + 1]`` bytes."""
  return losses(graphdef, params, batch, reg, label_smoothing)[0]


def losses(
  graphdef: nnx.GraphDef,
  params: dict,
  batch: jax.Array,
  reg: Regularization = Regularization(),
  label_smoothing: Any = 0.0,
) -> tuple[jax.Array, jax.Array]:
  """(training loss, plain cross-entropy), both mean nats per byte.

  The training loss uses label smoothing ``eps``: targets ``(1 - eps) onehot + eps / 256``.
  The plain cross-entropy is what replicas are compared on: a replica with more smoothing
  would otherwise look worse by definition.
  """
  tokens = batch.astype(jnp.int32)
  logits = nnx.merge(graphdef, params)(tokens[:, :-1], reg).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits)
  nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  ce = nll.mean()
  smooth = -logp.mean(-1)  # cross-entropy against the uniform distribution
  eps = jnp.asarray(label_smoothing, jnp.float32)
  return ((1.0 - eps) * nll + eps * smooth).mean(), ce


def bits_per_byte(nats: float) -> float:
  """Cross-entropy in nats per byte to bits per byte."""
  return nats / math.log(2.0)
