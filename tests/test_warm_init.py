"""Warm noisy init (eq. 10): the noise scale, per-replica independence, reproducibility."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from hdet_jax.trainer import warm_init


def _params():
  k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
  return {
    'a': {'kernel': 0.3 * jax.random.normal(k1, (200, 300)), 'bias': jnp.full((300,), 0.5)},
    'b': 2.0 + jax.random.normal(k2, (50_000,)),
    'c': jax.random.uniform(k3, (10, 10)),
  }


def _flat(tree):
  return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(tree)])


def test_noise_has_the_stated_scale():
  params, nu = _params(), 0.01
  theta = _flat(params)
  d = theta.size
  want = nu * np.linalg.norm(theta) / np.sqrt(d)
  np.testing.assert_allclose(float(warm_init.noise_std(params, nu)), want, rtol=1e-5)
  stacked = warm_init.warm_noisy_init(params, 4, nu, jax.random.key(0))
  for r in range(4):
    eps = _flat(jax.tree.map(lambda s, p: s[r] - p, stacked, params))
    # d ~ 110k samples: the empirical std is within ~0.5% of the target, the mean near 0.
    assert abs(eps.std() / want - 1) < 0.01, (r, eps.std(), want)
    assert abs(eps.mean()) < 4 * want / np.sqrt(d)
    # The noise vector's norm is about nu * ||theta_0||.
    np.testing.assert_allclose(np.linalg.norm(eps), nu * np.linalg.norm(theta), rtol=0.01)


def test_noise_differs_per_replica_and_is_reproducible():
  params = _params()
  key = jax.random.key(3)
  stacked = warm_init.warm_noisy_init(params, 4, 0.01, key)
  eps = [_flat(jax.tree.map(lambda s, p: s[r] - p, stacked, params)) for r in range(4)]
  for i in range(4):
    for j in range(i + 1, 4):
      assert abs(np.corrcoef(eps[i], eps[j])[0, 1]) < 0.02  # independent draws
  again = warm_init.warm_noisy_init(params, 4, 0.01, key)
  chex.assert_trees_all_equal(stacked, again)
  # Replica r's noise does not depend on how many replicas there are.
  two = warm_init.warm_noisy_init(params, 2, 0.01, key)
  chex.assert_trees_all_equal(jax.tree.map(lambda x: x[:2], stacked), two)
  other = warm_init.warm_noisy_init(params, 4, 0.01, jax.random.key(4))
  assert not np.array_equal(_flat(other), _flat(stacked))


def test_nu_zero_copies_the_checkpoint():
  params = _params()
  stacked = warm_init.warm_noisy_init(params, 3, 0.0, jax.random.key(0))
  for r in range(3):
    chex.assert_trees_all_equal(jax.tree.map(lambda s: s[r], stacked), params)
