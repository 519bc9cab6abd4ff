"""hdet_jax.noise_scale: the two-batch-size estimator against a known noise, the batch factor's closed forms."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from hdet_jax import noise_scale as ns


def test_the_estimates_recover_a_known_gradient_and_noise():
  """Per-example gradients G + e, e ~ N(0, diag(sigma^2)): over many steps the two estimates' means are |G|^2 and
  sum(sigma^2), and their ratio the noise scale sum(sigma^2) / |G|^2, from 8 replicas of b examples each."""
  rng = np.random.default_rng(0)
  dim, n, b, steps = 20, 8, 4, 4000
  g = rng.normal(size=dim)
  sigma = rng.uniform(0.5, 2.0, size=dim)
  examples = g + sigma * rng.normal(size=(steps, n, b, dim))
  local = examples.mean(2)  # [steps, n, dim]: each replica's gradient over its b examples
  local_sq = (local ** 2).sum(-1).mean(1)  # the replicas' mean |g_r|^2, per step
  global_sq = (local.mean(1) ** 2).sum(-1)  # the all-reduced gradient's |g_B|^2
  trace, signal = ns.noise_terms(local_sq, global_sq, b, n * b)
  assert trace.shape == signal.shape == (steps,)
  want_trace, want_signal = float((sigma ** 2).sum()), float((g ** 2).sum())
  np.testing.assert_allclose(trace.mean(), want_trace, rtol=0.05)
  np.testing.assert_allclose(signal.mean(), want_signal, atol=0.05 * want_trace / b)
  np.testing.assert_allclose(ns.noise_scale(local_sq, global_sq, b, n * b), want_trace / want_signal, rtol=0.1)


def test_no_signal_is_an_infinite_noise_scale():
  # |g_B|^2 no larger than the noise's share of it (S / B): the signal's estimate is not positive.
  assert ns.noise_scale([2.0], [0.25], 1, 8) == math.inf


def test_squared_norm_sums_every_leaf():
  tree = {'a': jnp.arange(3.0), 'b': [jnp.ones((2, 2)) * 2]}
  assert float(ns.squared_norm(tree)) == pytest.approx(0 + 1 + 4 + 4 * 4)


def _lr_sgd(batch, noise):  # McCandlish et al. (2018), eq. 2.7, lr_max = 1
  return 1.0 / (1.0 + noise / batch)


def _lr_adam(batch, noise):  # Li et al. (2024): the surge, lr_max = 1
  return 1.0 / (0.5 * (math.sqrt(noise / batch) + math.sqrt(batch / noise)))


@pytest.mark.parametrize('noise', [1.0, 30.0, 256.0, 700.0, 1e5])
def test_batch_factor_is_the_ratio_of_the_rules_best_lrs(noise):
  for rule, lr in (('sgd', _lr_sgd), ('adam', _lr_adam)):
    want = lr(256.0, noise) / lr(32.0, noise)
    assert ns.batch_factor(noise, 256.0, 8, rule) == pytest.approx(want, rel=1e-12)


def test_batch_factor_limits():
  # Noise-dominated: SGD's linear rule and Adam's square root; the surge's peak between the two batches: 1.
  assert ns.batch_factor(math.inf, 64, 8, 'sgd') == 8 and ns.batch_factor(math.inf, 64, 8, 'adam') == math.sqrt(8)
  assert ns.batch_factor(1e9, 64, 8, 'sgd') == pytest.approx(8, rel=1e-6)
  assert ns.batch_factor(1e9, 64, 8, 'adam') == pytest.approx(math.sqrt(8), rel=1e-6)
  assert ns.batch_factor(64 / math.sqrt(8), 64, 8, 'adam') == pytest.approx(1.0)
  assert ns.batch_factor(0.0, 64, 8, 'sgd') == 1.0
  assert ns.batch_factor(0.0, 64, 8, 'adam') == pytest.approx(1 / math.sqrt(8))


def test_bad_arguments_are_refused_by_name():
  with pytest.raises(ValueError, match='rule must be one of'):
    ns.batch_factor(10.0, 64, 8, 'lion')
  with pytest.raises(ValueError, match='smaller_by'):
    ns.batch_factor(10.0, 64, 0.5, 'sgd')
  with pytest.raises(ValueError, match='local_batch < global_batch'):
    ns.noise_terms([1.0], [1.0], 8, 8)
