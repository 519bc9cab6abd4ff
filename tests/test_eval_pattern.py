"""The evaluation pattern of docs/add_to_trainer.md ("Evaluation"): ``hdet_jax.evaluate_over_replicas(eval_step,
mesh, 'replica')``, which examples/add_to_trainer's HDET trainers use, evaluates the replicas' average with each
replica group on its rows of the eval batch. Checked here: it equals the single-device evaluation of the average
to float32 rounding (replicas that differ, 1 and 2 replicas per device, linen and nnx), and its compiled program's
flops (XLA's cost analysis) against the examples' former evaluation, ``jax.jit(eval_step)`` of
``average_replicas(params)``: the same where nothing pins the batch's rows to the trainer's ``'data'`` axis (GSPMD
then splits it over every device), 0.40x where the eval step constrains its batch to ``P('data')`` as the train
step does (the former then evaluates the whole batch in every group). benchmarks/same_layout.py prints both.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import hdet_jax
from benchmarks import same_layout

# Measured (XLA:CPU, the suite's flags and XLA's defaults): the pattern and the single-device evaluation of the
# average agree to 4.7e-7 and 5.8e-7 relative (linen), 2.3e-7 and 1.1e-7 (nnx), on replicas whose own losses differ
# by 3%: the all-reduce's sum / N against average_replicas' x0 + mean(x - x0), and 8 devices' partial means
# against one device's. The bound is about seven times the largest.
RTOL = 4e-6


def _diverged(params, n, scale=0.05):
  """The stacked params with replica r moved by r * scale * (a fixed random direction): replicas that differ."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  out = []
  for key, x in zip(keys, leaves):
    step = scale * jax.random.normal(key, x.shape[1:], x.dtype)
    out.append(np.asarray(x) + np.arange(n, dtype=np.float32).reshape((n,) + (1,) * step.ndim) * np.asarray(step))
  return jax.tree.unflatten(tree, out)


def _one_device(eval_step, params, batch):
  """eval_step of the replicas' average on one device: the reference."""
  one = jax.devices()[0]
  average = jax.device_put(jax.device_get(hdet_jax.average_replicas(params)), one)
  return float(jax.jit(eval_step)(average, jax.device_put(np.asarray(batch), one)))


@pytest.fixture(scope='module')
def built():
  """hdet_{linen,nnx}.py built on the 4 x 2 mesh, each once for the file (benchmarks.same_layout.example)."""
  cache = {}

  def get(trainer):
    if trainer not in cache:
      cache[trainer] = same_layout.example(trainer)
    return cache[trainer]

  return get


@pytest.mark.parametrize('trainer', ['linen', 'nnx'])
def test_the_examples_evaluation_equals_one_device_on_the_average(built, trainer):
  """The example's own ``evaluate`` (make_trainer's: the pattern) on replicas that differ."""
  ex = built(trainer)
  params = _diverged(ex.params, ex.module.N)
  batch = jax.device_put(next(ex.module.batches(1000)), ex.split_batch)
  with same_layout._under_mesh(trainer, ex.mesh):
    got = float(ex.evaluate(params, batch))
  want = _one_device(ex.eval_step, params, batch)
  replica0 = _one_device(ex.eval_step, jax.tree.map(lambda x: x[:1], params), batch)
  assert abs(replica0 - want) > 100 * RTOL * want  # the replicas differ enough for the average to matter
  np.testing.assert_allclose(got, want, rtol=RTOL)


def test_several_replicas_per_device_and_a_tuple_of_outputs():
  """8 replicas on 4 groups (per_device=2): the local replicas' rows and average are taken too; every output is
  averaged over the replicas (a mean over rows stays the batch's mean)."""
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('replica', 'data'))

  def eval_step(params, batch):
    err = batch @ params['w'] + params['b'] - 1.0
    return jnp.mean(err**2), {'mae': jnp.mean(jnp.abs(err))}

  params = {'w': jnp.arange(24.0).reshape(8, 3) / 24, 'b': jnp.linspace(-1.0, 1.0, 8)}
  batch = jnp.sin(jnp.arange(96.0)).reshape(32, 3)
  got = jax.jit(hdet_jax.evaluate_over_replicas(eval_step, mesh, 'replica', per_device=2))(params, batch)
  want = jax.jit(eval_step)(hdet_jax.average_replicas(params), batch)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(float(a), float(b), rtol=RTOL)


@pytest.fixture(scope='module')
def flops(built):
  """XLA's flops per device of the linen example's evaluation, before and with the pattern, in two layouts."""
  programs, _ = same_layout.eval_programs(built('linen'), layouts=same_layout.EVAL_LAYOUTS[::2])
  out = {}
  for key, (fn, args) in programs.items():
    cost = fn.lower(*args).compile().cost_analysis()
    out[key] = float((cost[0] if isinstance(cost, (list, tuple)) else cost)['flops'])
  return out


def test_each_group_evaluates_its_rows_and_no_more(flops):
  """Measured (the suite's flags): as the example has it, before 9,325,204 and the pattern 9,362,557 flops per
  device (1.004x: the average's all-reduce and the mean), the single-device program's 74,578,944 / 8 = 9,322,368;
  with the train step's P('data') constraint in the eval step, before 23,321,640 (2.5x: each group evaluates more
  than its rows) and the pattern the same 9,362,557 (0.40x)."""
  as_is, pinned = same_layout.EVAL_LAYOUTS[0], same_layout.EVAL_LAYOUTS[2]
  assert flops[('evaluate_over_replicas', as_is)] <= 1.01 * flops[('before', as_is)]
  assert flops[('evaluate_over_replicas', pinned)] <= 0.45 * flops[('before', pinned)]
  assert flops[('evaluate_over_replicas', pinned)] <= 1.01 * flops[('evaluate_over_replicas', as_is)]


V, D, L = 11, 6, 5  # the masked test's vocabulary, width and sequence length


def _lm_params(n):
  """N replicas of a tiny bigram LM that differ: embed [N, V, D], out [N, D, V]."""
  k1, k2, k3, k4 = jax.random.split(jax.random.key(3), 4)
  embed = jax.random.normal(k1, (V, D)) + 0.3 * jax.random.normal(k2, (n, V, D))
  out = jax.random.normal(k3, (D, V)) / np.sqrt(D) + 0.3 * jax.random.normal(k4, (n, D, V))
  return {'embed': embed, 'out': out}


def _masked_batch(rows, shards):
  """A batch of ``rows`` sequences whose masks differ per shard: shard s's rows keep their first s + 1 tokens
  and, every other row, one token fewer, so the shards' token counts run 1 to L (and differ within a shard)."""
  tokens = jax.random.randint(jax.random.key(4), (rows, L), 0, V)
  targets = jax.random.randint(jax.random.key(5), (rows, L), 0, V)
  shard = np.arange(rows) // (rows // shards)
  keep = np.minimum(shard % L + 1, L) - (np.arange(rows) % 2) * (shard % L > 0)
  mask = (np.arange(L)[None, :] < keep[:, None]).astype(np.float32)
  return {'tokens': tokens, 'targets': targets, 'mask': jnp.asarray(mask)}


def _token_losses(params, batch):
  """[B, L] cross-entropy of each token under the bigram LM."""
  logits = params['embed'][batch['tokens']] @ params['out']
  return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, batch['targets'][..., None], -1)[..., 0]


def sums_and_counts(params, batch):
  """The eval step that returns sums and counts (to be summed over the shards)."""
  losses = _token_losses(params, batch)
  return {'loss_sum': jnp.sum(losses * batch['mask']), 'tokens': jnp.sum(batch['mask'])}


def masked_mean(params, batch):
  """The eval step that returns the count-weighted mean over its masked tokens, and their count."""
  losses, mask = _token_losses(params, batch), batch['mask']
  tokens = jnp.sum(mask)
  return {'loss': jnp.sum(losses * mask) / tokens, 'tokens': tokens}


def weighted(y):
  """``reduce=`` for :func:`masked_mean`: the shards' means weighted by their counts, [N] each."""
  tokens = jnp.sum(y['tokens'])
  return {'loss': jnp.sum(y['loss'] * y['tokens']) / tokens, 'tokens': tokens}


def _oracle(params, batch):
  """numpy, float64: the count-weighted mean token loss of the replicas' exact average on the whole batch."""
  avg = {k: np.asarray(v, np.float64).mean(axis=0) for k, v in params.items()}
  logits = avg['embed'][np.asarray(batch['tokens'])] @ avg['out']
  top = logits.max(-1, keepdims=True)
  lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
  losses = lse - np.take_along_axis(logits, np.asarray(batch['targets'])[..., None], -1)[..., 0]
  mask = np.asarray(batch['mask'], np.float64)
  return float((losses * mask).sum() / mask.sum()), float(mask.sum())


# Measured (XLA:CPU, the suite's flags) on the masked test's three layouts: the count-weighted mean through
# evaluate_over_replicas against the numpy oracle (float64) of the exact average, at most 1.4e-7 relative, and
# against jax's own one-device evaluation of average_replicas(params) at most 1.3e-7 (float32 sums over the shards
# in another order; the all-reduce's sum / N against x0 + mean(x - x0)). The default mean of the shards' means is
# off by 7.6e-3 to 3.1e-2. The bound is RTOL, 4e-6 (about 28 times the largest), as documented.
@pytest.mark.parametrize('layout', [(8, 1, 1), (4, 2, 1), (4, 2, 2)], ids=['8x1', '4x2', '4x2-per-device-2'])
def test_a_masked_count_weighted_eval_is_the_one_devices(layout):
  """Masks that differ per shard (token counts 1 to 5 per row, by shard): the sums and counts summed over the
  shards (``reduce='sum'``), and each shard's count-weighted mean weighted by its count (``reduce=`` a callable),
  give the numpy oracle's and the one device's count-weighted mean to RTOL; the default mean of the shards'
  means does not (it weighs a shard of 8 tokens as one of 40)."""
  groups, inner, per_device = layout
  n = groups * per_device
  mesh = Mesh(np.array(jax.devices()).reshape(groups, inner), ('replica', 'data'))
  params, batch = _lm_params(n), _masked_batch(4 * n, n)
  want, count = _oracle(params, batch)
  one = jax.jit(sums_and_counts)(hdet_jax.average_replicas(params), batch)
  one_device = float(one['loss_sum'] / one['tokens'])

  def through(step, reduce):
    return jax.jit(hdet_jax.evaluate_over_replicas(step, mesh, 'replica', per_device=per_device, reduce=reduce))(
      params, batch
    )

  summed = through(sums_and_counts, 'sum')
  by_tree = through(sums_and_counts, {'loss_sum': 'sum', 'tokens': 'sum'})
  means = through(masked_mean, weighted)
  assert float(summed['tokens']) == float(by_tree['tokens']) == float(means['tokens']) == count
  for got in (float(summed['loss_sum'] / summed['tokens']), float(by_tree['loss_sum'] / by_tree['tokens'])):
    np.testing.assert_allclose(got, want, rtol=RTOL)
    np.testing.assert_allclose(got, one_device, rtol=RTOL)
  np.testing.assert_allclose(float(means['loss']), want, rtol=RTOL)
  np.testing.assert_allclose(float(means['loss']), one_device, rtol=RTOL)
  averaged = through(masked_mean, 'mean')  # the default: each shard's mean counts alike, whatever its tokens
  assert abs(float(averaged['loss']) - want) > 100 * RTOL * want
  assert float(averaged['tokens']) == count / n  # and a count comes back divided by N


def test_the_default_reduction_is_the_mean_of_the_shards_bit_for_bit():
  """``reduce='mean'``, given or left out, is what evaluate_over_replicas returned before it had ``reduce``: the
  plain mean over the N shards' results (computed here from the shards' own results, reduce=lambda y: y)."""
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('replica', 'data'))
  params, batch = _lm_params(4), _masked_batch(16, 4)
  evaluate = lambda **kw: jax.jit(hdet_jax.evaluate_over_replicas(masked_mean, mesh, 'replica', **kw))(params, batch)
  shards = evaluate(reduce=lambda y: y)
  for got in (evaluate(), evaluate(reduce='mean')):
    for name in ('loss', 'tokens'):
      assert np.asarray(got[name]).tobytes() == np.asarray(jnp.mean(shards[name], axis=0)).tobytes()


@pytest.mark.parametrize(
  'reduce, message',
  [
    ('avg', "reduce='avg' is not a reduction; pass reduce='mean'"),
    ({'loss': 'total'}, "reduce='total' is not a reduction"),
    (None, 'reduce=None is not a reduction'),
  ],
)
def test_a_bad_reduce_is_refused_before_any_work(reduce, message):
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('replica', 'data'))
  with pytest.raises(ValueError, match=re.escape(message)) as e:
    hdet_jax.evaluate_over_replicas(masked_mean, mesh, 'replica', reduce=reduce)
  assert '\n' not in str(e.value)


def test_a_reduce_that_does_not_match_the_outputs_says_so():
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('replica', 'data'))
  evaluate = hdet_jax.evaluate_over_replicas(masked_mean, mesh, 'replica', reduce={'loss_sum': 'sum'})
  with pytest.raises(ValueError, match=r"reduce=\{'loss_sum': 'sum'\} does not match the outputs") as e:
    jax.jit(evaluate)(_lm_params(4), _masked_batch(16, 4))
  assert '\n' not in str(e.value)
