"""The byte-level causal transformer: shapes, initial loss, causality, parameter count."""

import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from hdet_jax.trainer import metrics
from hdet_jax.trainer.tasks import lm_model as model_lib


def _cfg(d=32, layers=2, heads=4):
  return ml_collections.ConfigDict(dict(d_model=d, num_layers=layers, num_heads=heads, mlp_ratio=4))


@functools.lru_cache(maxsize=None)
def _jitted(d, layers, heads, seq):
  cfg = _cfg(d, layers, heads)
  graphdef, _ = model_lib.abstract_model(cfg, seq)
  init = jax.jit(lambda k: model_lib.split_model(cfg, seq, k)[1])
  forward = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
  return graphdef, init, forward


def _init(cfg, seq, key):
  """(graphdef, params), the init jitted once per shape (eager init compiles op by op)."""
  graphdef, init, _ = _jitted(cfg.d_model, cfg.num_layers, cfg.num_heads, seq)
  return graphdef, init(key)


def test_shapes_and_initial_loss_is_uniform_over_bytes():
  graphdef, params = _init(_cfg(), 16, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, 256).astype(jnp.uint8)
  logits = _jitted(32, 2, 4, 16)[2](params, tokens[:, :-1].astype(jnp.int32))
  assert logits.shape == (4, 16, 256)
  loss = float(jax.jit(lambda p: model_lib.loss_fn(graphdef, p, tokens))(params))
  assert abs(loss - math.log(256)) < 0.05  # small init: about 8 bits per byte
  assert abs(model_lib.bits_per_byte(loss) - 8.0) < 0.1


def test_the_model_is_causal():
  _, params = _init(_cfg(), 16, jax.random.key(0))
  forward = _jitted(32, 2, 4, 16)[2]
  x = np.asarray(jax.random.randint(jax.random.key(2), (2, 16), 0, 256))
  y = x.copy()
  y[:, 9] = (y[:, 9] + 1) % 256
  a, b = np.asarray(forward(params, x)), np.asarray(forward(params, y))
  np.testing.assert_array_equal(a[:, :9], b[:, :9])  # the past does not see the future
  assert np.abs(a[:, 9:] - b[:, 9:]).max() > 1e-4


def test_parameter_count_and_abstract_shapes():
  d, layers, seq = 64, 2, 64
  _, params = model_lib.abstract_model(_cfg(d, layers), seq)
  per_block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
  want = 256 * d + seq * d + layers * per_block + 2 * d
  assert metrics.num_params(params) == want == 120_576
  _, real = _init(_cfg(d, layers), seq, jax.random.key(0))
  assert jax.tree.map(lambda s: s.shape, params) == jax.tree.map(lambda s: s.shape, real)


def test_gradients_are_finite_and_init_is_seeded():
  graphdef, p0 = _init(_cfg(), 16, jax.random.key(0))
  _, p1 = _init(_cfg(), 16, jax.random.key(0))
  _, p2 = _init(_cfg(), 16, jax.random.key(1))
  for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(p0['embed']['embedding'], p2['embed']['embedding'])
  batch = jnp.asarray(np.frombuffer(b'In the beginning God created the ', np.uint8)[None, :17])
  grads = jax.jit(jax.grad(lambda p: model_lib.loss_fn(graphdef, p, batch)))(p0)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  assert float(jnp.abs(grads['embed']['embedding']).max()) > 0


def test_label_smoothing_loss_closed_form():
  """The model's training loss with label smoothing eps is the cross-entropy against the smoothed targets
  (1 - eps) onehot + eps / 256, computed here in numpy from the model's own logits; the second loss, which
  replicas are compared on, stays the plain cross-entropy."""
  graphdef, params = _init(_cfg(), 16, jax.random.key(0))
  params = jax.tree.map(lambda x: 20.0 * x, params)  # sharper than the init: the two terms differ clearly
  batch = np.asarray(jax.random.randint(jax.random.key(3), (4, 17), 0, 256))
  logits = np.asarray(_jitted(32, 2, 4, 16)[2](params, batch[:, :-1]), np.float64)  # [4, 16, 256]
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  onehot = np.eye(256)[batch[:, 1:]]
  plain = -(onehot * logp).sum(-1).mean()
  losses = jax.jit(
    lambda p, eps: model_lib.losses(graphdef, p, jnp.asarray(batch, jnp.uint8), model_lib.Regularization(), eps)
  )
  for eps in (0.0, 0.1, 0.3):
    want = -(((1 - eps) * onehot + eps / 256) * logp).sum(-1).mean()
    train, ce = (float(x) for x in losses(params, eps))
    np.testing.assert_allclose(train, want, rtol=2e-6)
    np.testing.assert_allclose(ce, plain, rtol=2e-6)
  assert abs(float(losses(params, 0.3)[0]) - plain) > 0.05  # smoothing changes the training loss
