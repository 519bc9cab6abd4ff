"""The sync schedule (hdet_jax.windows) against a brute-force oracle: the windows laid end to end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hdet_jax as H
from hdet_jax import windows as W

SCHEDULES = [(100,), (7,), (25, 25, 25, 25, 100), (3, 5, 2, 6), (1, 4)]


def oracle_windows(windows, steps):
  """[(start, length)] of every window covering steps 0..steps-1, by laying them end to end."""
  out, start, k = [], 0, 0
  while start < steps:
    length = windows[min(k, len(windows) - 1)]
    out.append((start, length))
    start, k = start + length, k + 1
  return out


def oracle_of_step(windows, steps):
  """Per step t: (start, length) of its window, and whether a sync follows it."""
  table = {}
  for start, length in oracle_windows(windows, steps):
    for t in range(start, start + length):
      table[t] = (start, length, t + 1 == start + length)
  return [table[t] for t in range(steps)]


@pytest.mark.parametrize('windows', SCHEDULES)
def test_window_of_and_ends_window_match_the_windows_laid_end_to_end(windows):
  steps = 400
  want = oracle_of_step(windows, steps)
  t = np.arange(steps)
  start, length = W.window_of(windows, t)  # numpy, vectorised
  np.testing.assert_array_equal(start, [w[0] for w in want])
  np.testing.assert_array_equal(length, [w[1] for w in want])
  np.testing.assert_array_equal(W.ends_window(windows, t + 1), [w[2] for w in want])
  # Inside jit, on traced scalars, the same answers.
  traced = jax.jit(jax.vmap(lambda c: (*W.window_of(windows, c - 1), W.ends_window(windows, c))))(
    jnp.arange(1, steps + 1, dtype=jnp.int32)
  )
  np.testing.assert_array_equal(
    np.stack([np.asarray(x) for x in traced], 1), np.array([(s, n, e) for s, n, e in want], np.int64)
  )
  # The public helper, from the user's sync_every, on Python ints (the host loop).
  syncs = [s for s in range(steps) if H.is_sync_step(windows if len(windows) > 1 else windows[0], s)]
  assert syncs == [t for t in range(steps) if want[t][2]]
  assert all(type(H.is_sync_step(windows, s)) is bool for s in range(5))


@pytest.mark.parametrize('windows', SCHEDULES)
def test_counting_syncs_first_sync_and_continuous_sync_count(windows):
  steps = 400
  ends = [s + n for s, n in oracle_windows(windows, steps)]  # the counts at which syncs happen
  for count in range(steps):
    assert W.syncs_through(windows, count) == sum(e <= count for e in ends)
    assert W.window_length(windows, count + 1) == oracle_of_step(windows, count + 1)[count][1]
  for warmup in (0, 1, 13, 25, 99, 100, 101, 250):
    assert W.first_sync_at_or_after(windows, warmup) == min(e for e in ends if e >= max(warmup, 1))
  # Syncs between two steps, counted continuously: sum over the steps of 1 / their window's length.
  per_step = [1.0 / n for _, n, _ in oracle_of_step(windows, steps)]
  for first, last in ((0, 399), (25, 300), (100, 101), (7, 7)):
    assert W.syncs_between(windows, first, last) == pytest.approx(sum(per_step[first:last]), rel=1e-12)


def test_a_fixed_period_counts_syncs_exactly_as_before():
  """For one T the continuous count is exactly (last - first) / T (the paper controller's decay reads it)."""
  assert W.syncs_between((100,), 100, 1499) == (1499 - 100) / 100
  assert W.syncs_between((25,), 375, 1499) == (1499 - 375) / 25
  assert W.first_sync_at_or_after((100,), 250) == 300 and W.first_sync_at_or_after((100,), 0) == 100


@pytest.mark.parametrize('bad', [0, -3, (), (25, 0), (25, 2.5), 2.5, True, 'x', None])
def test_bad_sync_every_is_one_clear_error(bad):
  with pytest.raises(ValueError, match=r'sync_every \(T\) must be an integer >= 1, or a sequence'):
    W.as_windows(bad)
  if bad is None:  # hdet's sync_every=None is the measured default (default_period), not an error
    return
  with pytest.raises(ValueError, match='sync_every'):
    H.hdet(lambda learning_rate: None, 1e-3, num_replicas=8, sync_every=bad)


@pytest.mark.parametrize(
  'total_steps, period',
  [
    (1, 1),
    (7, 1),
    (22, 1),
    (23, 2),
    (300, 20),
    (307, 20),
    (308, 21),
    (1492, 99),
    (1493, 100),
    (1500, 100),
    (3000, 100),
    (10**6, 100),
  ],
)
def test_default_period_is_a_fifteenth_of_the_run_at_least_1_at_most_100(total_steps, period):
  """T = round(S / 15), at least 1 and at most 100 (hand-computed: 22 / 15 = 1.47, 23 / 15 = 1.53, 307 / 15 = 20.47,
  308 / 15 = 20.53, 1492 / 15 = 99.47, 1493 / 15 = 99.53); longest_window=0 lifts the cap."""
  assert W.default_period(total_steps) == period
  if total_steps == 3000:
    assert W.default_period(total_steps, longest_window=0) == 200
    assert W.default_period(total_steps, num_syncs=10, longest_window=250) == 250
