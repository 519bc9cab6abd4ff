"""Warm noisy initialisation (paper §3.5, eq. 10).

Every replica starts from a pre-trained model plus its own Gaussian noise:

.. math::

  \\theta_r = \\bar\\theta_0 + \\epsilon_r, \\qquad
  \\epsilon_r \\sim \\mathcal{N}\\left(0, \\frac{\\nu^2 \\|\\bar\\theta_0\\|^2}{d}\\right),

with ``||theta_0||`` the L2 norm of all parameters together and ``d`` their count, so the noise
vector has norm about ``nu * ||theta_0||``. Replica r's noise comes from
``fold_in(key, r)`` (and then one key per leaf), so it is reproducible from the seed and does not
depend on how many replicas there are.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def noise_std(params: Any, nu: float) -> jax.Array:
  """``nu * ||theta|| / sqrt(d)``, the per-parameter standard deviation of eq. 10."""
  leaves = jax.tree.leaves(params)
  sq = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)
  d = sum(x.size for x in leaves)
  return nu * jnp.sqrt(sq) / jnp.sqrt(jnp.float32(d))


def replica_noise(params: Any, nu: float, key: jax.Array, replica: int | jax.Array) -> Any:
  """Replica ``replica``'s noise epsilon_r, a tree shaped like ``params``."""
  std = noise_std(params, nu)
  leaves, treedef = jax.tree.flatten(params)
  rkey = jax.random.fold_in(key, replica)
  noise = [
    std * jax.random.normal(jax.random.fold_in(rkey, i), x.shape, jnp.float32).astype(x.dtype)
    for i, x in enumerate(leaves)
  ]
  return jax.tree.unflatten(treedef, noise)


def warm_noisy_init(params: Any, num_replicas: int, nu: float, key: jax.Array) -> Any:
  """Stacked ``[N, ...]`` parameters: ``params + epsilon_r`` for replica r (eq. 10)."""

  def one(r):
    return jax.tree.map(lambda p, e: p + e, params, replica_noise(params, nu, key, r))

  return jax.vmap(one)(jnp.arange(num_replicas))
