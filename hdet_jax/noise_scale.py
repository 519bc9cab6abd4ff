"""The gradient noise scale, read from data parallelism's own two batch sizes (McCandlish et al., 2018).

Every replica computes its gradient on its own ``b`` examples before the all-reduce averages them over the
global batch ``B = N b``. With ``G`` the true gradient and ``S = tr(Sigma)`` the per-example gradient's total
variance, a mean over ``k`` examples has

    E |g_k|^2 = |G|^2 + S / k,

so the replicas' mean squared norm (``k = b``) and the all-reduced gradient's (``k = B``) give both:

    S     = (mean_r |g_r|^2 - |g_B|^2) / (1 / b - 1 / B),
    |G|^2 = |g_B|^2 - S / B,

and the simple noise scale ``B_noise = S / |G|^2``: the batch at which the gradient's noise and its signal are
equal. Both estimates are unbiased but noisy per step; the ratio is taken of their means over many steps
(:func:`noise_scale`), never per step.

What it is for here: the best learning rate depends on the batch through ``B / B_noise``. For SGD
(McCandlish et al., eq. 2.7) ``lr*(B) = lr_max / (1 + B_noise / B)``; for Adam-style (sign-like) updates
(Li et al., 2024, "Surge phenomenon") ``lr*(B) = lr_max / (0.5 (sqrt(B_noise / B) + sqrt(B / B_noise)))``:
:func:`batch_factor` gives ``lr*(B) / lr*(B / m)`` under each.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

RULES = ('sgd', 'adam')


def squared_norm(tree: Any) -> jax.Array:
  """``sum of squares`` over every leaf of ``tree`` (float32 scalar)."""
  return sum((jnp.sum(jnp.square(jnp.asarray(x, jnp.float32))) for x in jax.tree.leaves(tree)),
             jnp.zeros((), jnp.float32))


def noise_terms(local_sq: Any, global_sq: Any, local_batch: int, global_batch: int) -> tuple[np.ndarray, np.ndarray]:
  """Per-step unbiased estimates ``(S, |G|^2)`` from the replicas' mean ``|g_r|^2`` and the all-reduced ``|g_B|^2``.

  Args:
    local_sq: the replicas' mean squared gradient norm, each over ``local_batch`` examples (any shape: per step).
    global_sq: the squared norm of their average, over ``global_batch`` examples (the same shape).
    local_batch: ``b``, the examples behind each replica's gradient.
    global_batch: ``B``, the examples behind the average (``N b``; must exceed ``b``).

  Returns:
    ``(S, |G|^2)`` with ``local_sq``'s shape (float64).
  """
  if not 0 < local_batch < global_batch:
    raise ValueError(f'need 0 < local_batch < global_batch, got {local_batch} and {global_batch}.')
  local_sq, global_sq = np.asarray(local_sq, np.float64), np.asarray(global_sq, np.float64)
  trace = (local_sq - global_sq) / (1.0 / local_batch - 1.0 / global_batch)
  return trace, global_sq - trace / global_batch


def noise_scale(local_sq: Any, global_sq: Any, local_batch: int, global_batch: int) -> float:
  """``B_noise = mean(S) / mean(|G|^2)`` over the given steps (see :func:`noise_terms`); inf where the signal's
  estimate is not positive (noise dominates at every batch the steps can resolve).

  Example::

    b_noise = noise_scale(grad_sq_mean_over_replicas, mean_grad_sq, local_batch=8, global_batch=64)
  """
  trace, signal = noise_terms(local_sq, global_sq, local_batch, global_batch)
  s, g = float(np.mean(trace)), float(np.mean(signal))
  return s / g if g > 0 else math.inf


def batch_factor(noise: float, batch: float, smaller_by: float, rule: str) -> float:
  """``lr*(batch) / lr*(batch / smaller_by)`` given the noise scale ``noise`` (see the module's docstring).

  With ``x = noise / batch``:

  - ``'sgd'``:  ``(1 + smaller_by x) / (1 + x)``, from 1 (no noise) to ``smaller_by`` (noise-dominated);
  - ``'adam'``: ``sqrt(smaller_by) (1 + 1 / (smaller_by x)) / (1 + 1 / x)``, ``sqrt(smaller_by)`` where noise
    dominates (the square-root rule), 1 at ``batch = sqrt(smaller_by) noise``, below 1 beyond (the surge's far
    side: the larger batch wants the smaller LR).
  """
  if rule not in RULES:
    raise ValueError(f'rule must be one of {RULES}, got {rule!r}.')
  if not (batch > 0 and smaller_by >= 1 and noise >= 0):
    raise ValueError(f'need batch > 0, smaller_by >= 1, noise >= 0; got {batch}, {smaller_by}, {noise}.')
  if math.isinf(noise):
    return smaller_by if rule == 'sgd' else math.sqrt(smaller_by)
  x = noise / batch
  if rule == 'sgd':
    return (1 + smaller_by * x) / (1 + x)
  if x == 0:
    return 1.0 / math.sqrt(smaller_by)  # (both batches far beyond the peak: lr* proportional to 1 / sqrt(B))
  return math.sqrt(smaller_by) * (1 + 1 / (smaller_by * x)) / (1 + 1 / x)
