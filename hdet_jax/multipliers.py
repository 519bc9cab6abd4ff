"""The fan-out spread (paper eq. 1), the shared-key permutations that assign it to replicas, and each replica's
values under them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import chex
import jax
import jax.numpy as jnp
import numpy as np

from hdet_jax import arguments

if TYPE_CHECKING:
  from hdet_jax.settings import Plan


def spread_multipliers(num_replicas: int, spread: float) -> np.ndarray:
  """Returns the symmetric multipliers of paper eq. 1, as float64 numpy.

  .. math::

    \\rho_r = 1 + \\alpha \\frac{r - (N-1)/2}{\\max((N-1)/2, 0.5)}, \\quad r = 0..N-1

  The multipliers are symmetric around 1, so their mean is exactly 1 (the
  ensemble's mean learning rate equals the base schedule), and they span
  ``[1 - spread, 1 + spread]`` (for N = 1 the single multiplier is 1).

  Args:
    num_replicas: N, the size of the replica axis (>= 1).
    spread: alpha, in ``[0, 1)`` so that every multiplier stays positive.

  Returns:
    A float64 array of shape ``[N]``, increasing in r.

  Example:
    >>> from hdet_jax.multipliers import spread_multipliers
    >>> spread_multipliers(4, 0.25)
    array([0.75      , 0.91666667, 1.08333333, 1.25      ])
  """
  if int(num_replicas) != num_replicas or num_replicas < 1:
    raise ValueError(f'num_replicas must be a positive integer, got {num_replicas!r}.')
  if not arguments.is_spread(spread):
    raise ValueError(f'spread must be in [0, 1) so every multiplier 1 +- spread stays positive, got {spread!r}.')
  centred, scale = _centred(int(num_replicas))
  rho = 1.0 + spread * centred / scale
  # Set the lower half to 2 - (upper half), which is exact (Sterbenz), so each
  # pair r, N-1-r sums to exactly 2 and the mean is 1 to the last bit.
  upper = centred > 0  # r > (N-1)/2 (r - (N-1)/2 is exact: a whole or half number)
  rho[::-1][upper] = 2.0 - rho[upper]
  return rho


def unit_offsets(num_replicas: int) -> np.ndarray:
  """Eq. 1's offsets ``u_r = (r - (N-1)/2) / max((N-1)/2, 0.5)`` in [-1, 1], so rho = 1 + alpha u."""
  centred, scale = _centred(int(num_replicas))
  return centred / scale


def _centred(n: int) -> tuple[np.ndarray, float]:
  """Eq. 1's offsets before the division, ``r - (N-1)/2`` (float64, r = 0..N-1), and the divisor
  ``max((N-1)/2, 0.5)``: each caller divides in its own order (alpha times first for the multipliers), so both
  keep their bits."""
  half = (n - 1) / 2.0
  return np.arange(n, dtype=np.float64) - half, max(half, 0.5)


def draw_permutations(key: chex.PRNGKey, num_hyperparams: int, num_replicas: int) -> chex.Array:
  """Draws one independent permutation of ``range(N)`` per explored hyperparameter.

  Replica r takes multiplier ``rho[g, perm[g, r]]`` for hyperparameter g. Every replica
  calls this with the same key (it lives in the replicated controller state), so every
  replica draws the same permutations without communicating and without global RNG state
  (the reference reseeds torch's global RNG instead; one extra draw on one rank
  desynchronises it).

  Args:
    key: a PRNG key that is identical on all replicas.
    num_hyperparams: G.
    num_replicas: N.

  Returns:
    int32 array ``[G, N]``; each row is a permutation.
  """
  keys = jax.random.split(key, num_hyperparams)
  return jax.vmap(lambda k: jax.random.permutation(k, num_replicas))(keys).astype(jnp.int32)


def identity_permutations(num_hyperparams: int, num_replicas: int) -> chex.Array:
  """Replica r takes ``rho[r]`` for every hyperparameter (the assignment before any sync)."""
  return jnp.broadcast_to(jnp.arange(num_replicas, dtype=jnp.int32), (num_hyperparams, num_replicas))


def replica_values(plan: Plan, base: jax.Array, perm: jax.Array, settled: jax.Array | None = None) -> jax.Array:
  """[G, N]: every replica's value for base [G] under permutations perm [G, N].

  .. math::

    v_{g,r} = \\mathrm{clip}(b_g \\rho_{g,\\pi_g(r)} + o_{g,\\pi_g(r)}, \\mathrm{low}_g, \\mathrm{high}_g)

  with ``b`` the base, ``rho`` the eq. 1 multipliers (1 for additive hyperparameters), ``o`` the additive offsets
  (0 for multiplicative ones) and ``pi_g`` hyperparameter g's permutation of the window. A settled hyperparameter
  (``settled`` [G] bool, see ``AutoLR.settle``) takes the base on every replica.
  """
  v = base[:, None] * jnp.take_along_axis(jnp.asarray(plan.scale), perm, axis=1) + jnp.take_along_axis(
    jnp.asarray(plan.offset), perm, axis=1
  )
  if settled is not None:
    v = jnp.where(settled[:, None], base[:, None], v)
  return jnp.clip(v, np.asarray(plan.lows, np.float32)[:, None], np.asarray(plan.highs, np.float32)[:, None])
