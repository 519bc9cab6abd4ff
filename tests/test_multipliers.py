"""Eq. 1 multipliers, the shared-key permutations, and each replica's values under them (against numpy:
clip(base rho[perm] + offset[perm]))."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hdet_jax as H
from hdet_jax import multipliers
from replica_testing import hdet_plan


@pytest.mark.parametrize('n', [1, 2, 3, 4, 7, 8, 16])
@pytest.mark.parametrize('alpha', [0.0, 1 / 9, 0.25, 0.5, 0.99])
def test_symmetric_mean_one_and_bounded(n, alpha):
  rho = multipliers.spread_multipliers(n, alpha)
  chex.assert_shape(rho, (n,))
  # Symmetric: each pair r, N-1-r sums to exactly 2, so the mean is exactly 1.
  np.testing.assert_array_equal(rho + rho[::-1], 2.0)
  assert abs(np.mean(rho) - 1.0) <= 1e-15
  assert np.all(rho >= 1 - alpha - 1e-15) and np.all(rho <= 1 + alpha + 1e-15)
  assert np.all(np.diff(rho) >= 0)


def test_closed_form_values():
  # Independent closed forms of eq. 1.
  np.testing.assert_allclose(multipliers.spread_multipliers(4, 0.25), [0.75, 11 / 12, 13 / 12, 1.25], rtol=1e-15)
  np.testing.assert_allclose(multipliers.spread_multipliers(2, 0.25), [0.75, 1.25], rtol=1e-15)
  np.testing.assert_array_equal(multipliers.spread_multipliers(1, 0.5), [1.0])
  # The paper's setting: N = 8, alpha = 1/9 spans [8/9, 10/9] (0.0008..0.001 at base 0.0009).
  rho = multipliers.spread_multipliers(8, 1 / 9)
  np.testing.assert_allclose([rho[0], rho[-1]], [8 / 9, 10 / 9], rtol=1e-15)
  np.testing.assert_allclose(rho[1] - rho[0], (2 / 9) / 7, rtol=1e-12)


@pytest.mark.parametrize('bad', [-0.1, 1.0, 1.5])
def test_bad_spread_names_parameter(bad):
  with pytest.raises(ValueError, match='spread'):
    multipliers.spread_multipliers(4, bad)


@pytest.mark.parametrize('bad', [0, -3, 2.5])
def test_bad_num_replicas_names_parameter(bad):
  with pytest.raises(ValueError, match=rf'num_replicas must be a positive integer, got {bad!r}'):
    multipliers.spread_multipliers(bad, 0.25)
  # An integral float is the integer: 3 replicas at 0.75, 1, 1.25.
  np.testing.assert_allclose(multipliers.spread_multipliers(3.0, 0.25), [0.75, 1.0, 1.25], rtol=1e-15)


def test_permutations_are_permutations_and_independent():
  key = jax.random.key(3)
  perms = np.asarray(multipliers.draw_permutations(key, 3, 8))
  chex.assert_shape(perms, (3, 8))
  for row in perms:
    assert sorted(row.tolist()) == list(range(8))
  # Same key, same draw (every replica holds the same key).
  chex.assert_trees_all_equal(perms, np.asarray(multipliers.draw_permutations(key, 3, 8)))
  # Independent across hyperparameters: over many draws the rows differ and the position of
  # multiplier 0 in row 0 and row 1 is uncorrelated (8 x 8 contingency close to uniform).
  counts = np.zeros((8, 8))
  for i in range(2000):
    p = np.asarray(multipliers.draw_permutations(jax.random.key(i), 2, 8))
    counts[np.argmin(p[0]), np.argmin(p[1])] += 1
  expected = 2000 / 64
  chi2 = np.sum((counts - expected) ** 2 / expected)
  assert chi2 < 110, chi2  # 63 dof: p ~ 1e-4 at 110


def test_replica_values_against_numpy():
  """Multiplicative LR, an additive dropout clipped to [0, 0.2], a multiplicative wd: each row is
  clip(base * rho[perm] + offset[perm], low, high) with its own permutation."""
  plan = hdet_plan(
    optax.sgd,
    1e-2,
    num_replicas=8,
    sync_every=4,
    explore={
      'dropout': H.Explore(0.1, 0.05, additive=True, low=0.0, high=0.2, to_optimizer=False),
      'weight_decay': (1e-3, 0.5),
    },
  )
  rng = np.random.default_rng(0)
  perm = np.stack([rng.permutation(8) for _ in range(3)])
  base = np.array([2e-2, 0.19, 1e-3], np.float32)  # the controller may move a base near an edge
  got = np.asarray(multipliers.replica_values(plan, jnp.asarray(base), jnp.asarray(perm)))
  u = (np.arange(8) - 3.5) / 3.5  # eq. 1's offsets for N = 8
  want = np.stack(
    [
      base[0] * (1 + 0.25 * u)[perm[0]],
      np.clip(base[1] + 0.05 * u[perm[1]], 0.0, 0.2),
      base[2] * (1 + 0.5 * u)[perm[2]],
    ]
  )
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert got[1].max() == np.float32(0.2)  # the clip is live
