"""A small byte-level causal transformer language model in ``flax.nnx``.

Pre-LayerNorm blocks (causal multi-head self-attention, GELU MLP), learned positions, and an
output head tied to the byte embedding. No dropout, so a forward pass is a pure function of
the parameters and the bytes.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

VOCAB_SIZE = 256  # bytes


class CausalSelfAttention(nnx.Module):

  def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs):
    if d_model % num_heads:
      raise ValueError(f'model.d_model={d_model} must be divisible by model.num_heads={num_heads}.')
    self.num_heads = num_heads
    self.qkv = nnx.Linear(d_model, 3 * d_model, rngs=rngs)
    self.out = nnx.Linear(d_model, d_model, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3, self.num_heads, d // self.num_heads), 3, axis=2)
    y = jax.nn.dot_product_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], is_causal=True)
    return self.out(y.reshape(b, t, d))


class Block(nnx.Module):

  def __init__(self, d_model: int, num_heads: int, mlp_ratio: int, *, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
    self.attn = CausalSelfAttention(d_model, num_heads, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
    self.fc1 = nnx.Linear(d_model, mlp_ratio * d_model, rngs=rngs)
    self.fc2 = nnx.Linear(mlp_ratio * d_model, d_model, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.ln1(x))
    return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))


class TransformerLM(nnx.Module):
  """Bytes ``[batch, time]`` (int) to next-byte logits ``[batch, time, 256]``."""

  def __init__(self, *, d_model: int, num_layers: int, num_heads: int, mlp_ratio: int, max_len: int,
               rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    self.embed = nnx.Embed(VOCAB_SIZE, d_model, embedding_init=init, rngs=rngs)
    self.pos = nnx.Param(init(rngs.params(), (max_len, d_model)))
    self.blocks = nnx.List([Block(d_model, num_heads, mlp_ratio, rngs=rngs) for _ in range(num_layers)])
    self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens) + self.pos[:tokens.shape[1]]
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.ln_f(x))


def make_model(model_config: Any, seq_len: int, key: jax.Array) -> TransformerLM:
  """The model described by ``config.model`` (its positions cover ``seq_len``), initialised from ``key``."""
  return TransformerLM(
      d_model=model_config.d_model, num_layers=model_config.num_layers,
      num_heads=model_config.num_heads, mlp_ratio=model_config.mlp_ratio, max_len=seq_len,
      rngs=nnx.Rngs(params=key))


def split_model(model_config: Any, seq_len: int, key: jax.Array) -> tuple[nnx.GraphDef, dict]:
  """(graphdef, parameters as a pure dict); jit this for a fast init."""
  graphdef, params = nnx.split(make_model(model_config, seq_len, key), nnx.Param)
  return graphdef, nnx.to_pure_dict(params)


def abstract_model(model_config: Any, seq_len: int) -> tuple[nnx.GraphDef, dict]:
  """(graphdef, parameter shapes) without computing anything."""
  graphdef, params = nnx.split(
      nnx.eval_shape(lambda: make_model(model_config, seq_len, jax.random.key(0))), nnx.Param)
  return graphdef, nnx.to_pure_dict(params)


def loss_fn(graphdef: nnx.GraphDef, params: dict, batch: jax.Array) -> jax.Array:
  """Mean next-byte cross-entropy in nats; ``batch`` is ``[B, seq_len + 1]`` bytes."""
  tokens = batch.astype(jnp.int32)
  logits = nnx.merge(graphdef, params)(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), tokens[:, 1:]).mean()


def bits_per_byte(nats: float) -> float:
  """Cross-entropy in nats per byte to bits per byte."""
  return nats / math.log(2.0)


def num_params(params: Any) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(params))
