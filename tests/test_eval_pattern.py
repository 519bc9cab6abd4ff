"""The evaluation pattern of docs/add_to_trainer.md ("Evaluation"): ``hdet_jax.evaluate_over_replicas(eval_step,
mesh, 'replica')``, which examples/add_to_trainer's HDET trainers use, evaluates the replicas' average with each
replica group on its rows of the eval batch. Checked here: it equals the single-device evaluation of the average
to float32 rounding (replicas that differ, 1 and 2 replicas per device, linen and nnx), and its compiled program's
flops (XLA's cost analysis) against the examples' former evaluation, ``jax.jit(eval_step)`` of
``average_replicas(params)``: the same where nothing pins the batch's rows to the trainer's ``'data'`` axis (GSPMD
then splits it over every device), 0.40x where the eval step constrains its batch to ``P('data')`` as the train
step does (the former then evaluates the whole batch in every group). benchmarks/same_layout.py prints both.
"""

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
