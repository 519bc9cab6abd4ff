"""Hyperparameter exploration in the trainer: real per-replica dropout, no dropout at evaluation,
per-group LRs and regularizers explored end to end."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hdet_jax as H
from hdet_jax.trainer.tasks import lm_model as model_lib
from hdet_jax.trainer import mesh as mesh_lib, optimizer as optimizer_lib, programs as programs_lib
import trainer_testing

CONFIGS = os.path.join(os.path.dirname(__file__), '..', 'configs')


def _tiny(explore=True):
  config = trainer_testing.tiny()
  if explore:
    config.model.dropout = 0.2
    config.optim.label_smoothing = 0.05
    config.hdet.explore.dropout = 0.15
    config.hdet.explore.label_smoothing = 0.05
    config.hdet.explore.weight_decay = 0.5
  return config


def test_dropout_rate_really_differs_per_replica():
  """Each replica's dropout rate (from the optimizer state) is what its activations see."""
  config = _tiny()
  n = 8
  run = trainer_testing.resolve(config)
  tx = optimizer_lib.make_optimizer(run.optimizer, n, seed=run.seed)
  names = run.programs.hyperparam_names
  assert names == (
    'learning_rate/embedding',
    'learning_rate/no_decay',
    'learning_rate/weights',
    'weight_decay',
    'dropout',
    'label_smoothing',
  )
  graphdef, params = model_lib.split_model(config.model, config.data.seq_len, jax.random.key(0))
  stacked = H.stack_replicas(params, n)
  state = jax.vmap(tx.init)(stacked)
  x = jnp.ones((n, 64, 512))

  def measure(state, x):
    reg, _ = programs_lib.regularization(run.programs, run.seed, state)
    y = model_lib.dropout(x, reg.dropout_rate, reg.dropout_key)
    return jnp.mean(y == 0), reg.dropout_rate

  zero_frac, rates = jax.vmap(measure, axis_name=mesh_lib.AXIS)(state, x)
  rates, zero_frac = np.asarray(rates), np.asarray(zero_frac)
  expected = 0.2 + 0.15 * H.multipliers.unit_offsets(n)
  np.testing.assert_allclose(np.sort(rates), expected, rtol=1e-6)
  np.testing.assert_allclose(zero_frac, rates, atol=0.01)  # measured on activations (32k draws each)
  assert zero_frac.max() - zero_frac.min() > 0.25


def test_evaluation_uses_no_dropout():
  config = _tiny()
  graphdef, params = model_lib.split_model(config.model, config.data.seq_len, jax.random.key(0))
  batch = jax.random.randint(jax.random.key(1), (4, config.data.seq_len + 1), 0, 256)
  a = model_lib.loss_fn(graphdef, params, batch)
  b = model_lib.loss_fn(graphdef, params, batch, model_lib.Regularization())
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  c = model_lib.loss_fn(graphdef, params, batch, model_lib.Regularization(0.5, jax.random.key(2)))
  assert float(c) != float(a)  # dropout does change the training forward pass


def test_explore_run_end_to_end(tmp_path):
  from trainer_testing import train_and_evaluate

  config = _tiny()
  config.plots = True
  workdir = str(tmp_path / 'run')
  train_and_evaluate(config, workdir)
  recs = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'))]
  names = [r for r in recs if r['kind'] == 'hyperparams'][0]['names']
  assert len(names) == 6
  train = [r for r in recs if r['kind'] == 'train']
  values = np.array([r['values'] for r in train], dtype=float)  # [S, G, N]
  assert values.shape[1:] == (6, 8) and np.all(np.isfinite(values))
  d = values[:, names.index('dropout')]
  assert np.all(d >= 0) and np.all(d <= 0.9) and np.ptp(d[0]) == pytest.approx(0.3, rel=1e-5)
  assert os.path.exists(os.path.join(workdir, 'plots', 'hyperparams.png'))


@pytest.mark.parametrize('score', ['window', 'common'])
def test_common_batch_score_removes_the_dropout_bias(tmp_path, score):
  """Replicas that differ only in their dropout rate (the LR is ~0, so the parameters stay equal):
  compared on their own training losses they differ (own batches, own dropout noise: the source of the
  bias toward less dropout), while on the common batch without dropout they are equal, so the
  controller gets no spurious dropout signal and the dropout base does not move."""
  from trainer_testing import train_and_evaluate

  config = _tiny(explore=False)
  config.num_train_steps, config.hdet.sync_every, config.hdet.warmup_steps = 16, 8, 0
  config.optim.max_lr = 1e-9
  config.model.dropout, config.hdet.explore.dropout = 0.3, 0.25
  config.hdet.controller, config.hdet.score = 'fit', score
  config.eval_every, config.checkpoint_every, config.plots = 0, 0, False
  workdir = str(tmp_path / score)
  train_and_evaluate(config, workdir)
  recs = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'))]
  names = [r for r in recs if r['kind'] == 'hyperparams'][0]['names']
  syncs = [r for r in recs if r['kind'] == 'controller']
  assert [r['step'] for r in syncs] == [7, 15]
  d = names.index('dropout')
  bases = [r['bases'][d] for r in recs if r['kind'] == 'train']
  for r in syncs:
    scores = np.asarray(r['window_losses'])
    if score == 'window':  # own batches and own dropout noise: the replicas' scores differ
      assert np.ptp(scores) > 1e-3
    else:  # the same model on the same batch, no dropout: no signal, so the dropout base holds
      assert np.ptp(scores) < 1e-5 * np.mean(scores)
  if score == 'common':
    np.testing.assert_allclose(bases, 0.3, rtol=1e-6)
