"""Independent float64 numpy oracles of the controllers (eqs. 4-7 and the 'fit' line search)."""

import numpy as np


def numpy_controller(v, losses, lrs, sigma, lam, beta, gamma, floor=-np.inf):
  """Eqs. 4-7 written independently in float64 numpy. lrs: [N, G]."""
  losses = np.asarray(losses, np.float64)
  s = (losses.mean() - losses) / sigma
  w = np.exp(s - s.max())
  w /= w.sum()
  eta_tilde = (w[:, None] * lrs).sum(0)
  eta_bar = lrs.mean(0)
  delta = eta_tilde - eta_bar
  v = beta * v + (1 - beta) * delta
  base = np.maximum(eta_bar * (1 - gamma) + v * lam, floor)
  return w, delta, v, base


def numpy_fit(xtx, xty, scores, offsets, multiplicative, memory, trust):
  """The 'fit' update written independently in float64 numpy: regress centred losses on centred
  [u, u^2] per hyperparameter (statistics forgotten by ``memory`` per sync), take the fitted
  quadratic's minimum u* and step toward log(1 + u*) (multiplicative) or u* (additive) within the trust
  region; without an interior minimum (or with 1 + u* <= 0), the full trust step against the slope."""
  scores = np.asarray(scores, np.float64)
  u = np.asarray(offsets, np.float64)
  g = u.shape[1]
  x = np.concatenate([u - u.mean(0), u**2 - (u**2).mean(0)], 1)
  y = scores - scores.mean()
  xtx = memory * xtx + x.T @ x
  xty = memory * xty + x.T @ y
  theta = np.linalg.lstsq(xtx, xty, rcond=None)[0]
  b, c = theta[:g], theta[g:]
  step = np.zeros(g)
  for k in range(g):
    if c[k] > 0 and (not multiplicative[k] or 1 - b[k] / (2 * c[k]) > 0):
      u_star = -b[k] / (2 * c[k])
      target = np.log(1 + u_star) if multiplicative[k] else u_star
    else:
      target = -np.sign(b[k]) * trust[k]
    step[k] = np.clip(target, -trust[k], trust[k])
  return b, c, step, xtx, xty


def numpy_accelerate(steps, growth, max_gain, trust, confident=None):
  """Rprop's gain on a sequence of fitted steps, written as a plain loop in float64: the gain starts at
  1, multiplies by ``growth`` (up to ``max_gain``) while a confident step has the previous nonzero step's
  sign, and resets to 1 on a reversal, after a zero step or on an unconfident step; the taken step is
  ``clip(gain * step, -trust, trust)``."""
  taken, gain, last_sign = [], 1.0, 0.0
  confident = [True] * len(steps) if confident is None else confident
  for s, sure in zip(np.asarray(steps, np.float64), confident):
    sign = float(np.sign(s))
    gain = min(gain * growth, max_gain) if sure and sign != 0 and sign == last_sign else 1.0
    taken.append(float(np.clip(gain * s, -trust, trust)))
    last_sign = sign
  return np.asarray(taken)


def numpy_slope_stderr(scores, offsets):
  """The standard error of the fitted slope b from one sync alone: ordinary least squares of the centred
  scores on ``[u - mean u, u^2 - mean u^2]``, residual variance over N - 1 - 2G degrees of freedom."""
  y = np.asarray(scores, np.float64)
  y = y - y.mean()
  u = np.asarray(offsets, np.float64)
  g = u.shape[1]
  x = np.concatenate([u - u.mean(0), u**2 - (u**2).mean(0)], 1)
  inv = np.linalg.inv(x.T @ x)
  resid = y - x @ (inv @ x.T @ y)
  dof = max(len(y) - 1 - 2 * g, 1)
  return np.sqrt(np.diag(inv * (resid @ resid) / dof)[:g])
