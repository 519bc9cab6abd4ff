"""Exact resume and the data pipeline (docs/add_to_trainer.md, "Resume exactly"; issue 84, item 8).

A small HDET loop (4 replicas under ``jax.vmap`` on one device, Adam, a sync every 5 steps, the default controller)
trains 40 steps. Interrupted at step 20, it saves its state and its batch position with orbax into ``tmp_path``,
restores both into a freshly initialised state and resumes: it is the uninterrupted run bit for bit (the losses,
every leaf of the parameters and of HDET's state, the controller's key and the sync counter included). Resumed with
the state restored but the batch stream restarted from its first batch, as a pipeline that does not save its
position does, it is not: the controller's comparison of the replicas' losses sees other batches, so its moves of
the learning rate differ, and the final evaluation moves further than plain Adam's under the same perturbation.

``python tests/test_resume.py`` prints the figures the page quotes, over seeds 0, 1 and 2.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import hdet_jax

N, STEPS, K, T = 4, 40, 20, 5  # replicas; steps; the interruption; the sync window (4 syncs before step K)
D, HIDDEN, ROWS = 16, 32, 64  # features; hidden units; the global batch (16 rows per replica)
LR = 3e-3  # plain Adam's, and where HDET's climb starts (initial_scale=1: the optimizer's own)
W_TRUE = np.random.default_rng(0).normal(size=(D, 1)).astype(np.float32)
HDET = hdet_jax.hdet(
  optax.adam(LR),
  num_replicas=N,
  sync_every=T,
  replica_axis='replica',
  # The schedule is constant (no anneal to keep): said, so the anneal rule does not assume a cosine over the run.
  auto_lr=hdet_jax.AutoLR(total_steps=STEPS, initial_scale=1.0, schedule=optax.constant_schedule(LR)),
)
PLAIN = optax.adam(LR)


def batches(seed):
  """The pipeline: batches [N, ROWS / N, ...] of a noisy teacher, in a fixed order; its position is the count drawn."""
  rng = np.random.default_rng(seed + 1)
  while True:
    x = rng.normal(size=(N, ROWS // N, D)).astype(np.float32)
    yield x, np.tanh(x @ W_TRUE) + 0.3 * rng.normal(size=(N, ROWS // N, 1)).astype(np.float32)


def loss_fn(params, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ params['w1']) @ params['w2'] - y) ** 2)


@functools.cache
def _step(tx):
  def step(state, batch):  # one replica's view; the gradient all-reduced over the replicas
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    grads = hdet_jax.pmean_finite(grads, 'replica')
    updates, opt_state = tx.update(grads, opt_state, params, value=loss)
    return (optax.apply_updates(params, updates), opt_state), loss

  return jax.jit(jax.vmap(step, axis_name='replica'))


def init(tx):
  params = {'w1': jax.random.normal(jax.random.key(0), (D, HIDDEN)) / 4, 'w2': jnp.zeros((HIDDEN, 1))}
  return hdet_jax.stack_replicas((params, tx.init(params)), N)


def train(tx, state, data, start, stop):
  losses = []
  for _ in range(start, stop):
    state, loss = _step(tx)(state, next(data))
    losses.append(float(loss.mean()))
  return state, losses


_X = np.random.default_rng(999).normal(size=(4096, D)).astype(np.float32)
EVAL = (_X, np.tanh(_X @ W_TRUE))  # held-out rows, without the noise


def eval_loss(state):
  """The replicas' average on the held-out rows."""
  return float(loss_fn(hdet_jax.average_replicas(state[0]), EVAL))


def runs(tx, seed, workdir):
  """The uninterrupted run, and the run interrupted at step K, saved to ``workdir`` and resumed from a fresh state:
  with its batch position restored, and with its batch stream restarted. (state, losses of steps K to STEPS)."""
  straight = train(tx, init(tx), batches(seed), 0, STEPS)
  data = batches(seed)
  state, _ = train(tx, init(tx), data, 0, K)
  with ocp.CheckpointManager(workdir) as manager:
    manager.save(K, args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave({'batches': K})))
    manager.wait_until_finished()
  with ocp.CheckpointManager(workdir) as manager:  # a new run: a fresh state's shapes are the target
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, init(tx))
    args = ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore())
    restored = manager.restore(manager.latest_step(), args=args)
  position = restored['data']['batches']
  resumed = train(tx, restored['state'], itertools.islice(batches(seed), position, None), position, STEPS)
  restarted = train(tx, restored['state'], batches(seed), position, STEPS)  # the pipeline's position lost
  return {
    'straight': straight,
    'saved': state,
    'restored': restored['state'],
    'resumed': resumed,
    'restarted': restarted,
  }


def _leaves_equal(a, b):
  return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope='module')
def hdet_runs(tmp_path_factory):
  return runs(HDET, 0, tmp_path_factory.mktemp('resume') / 'hdet')


def test_hdets_state_round_trips_and_the_restored_stream_resumes_bit_for_bit(hdet_runs):
  got = hdet_runs
  saved, restored = got['saved'][1], got['restored'][1]
  assert _leaves_equal(got['saved'], got['restored'])
  assert int(restored.sync_count[0]) == K // T and int(restored.count[0]) == K  # 4 syncs, 20 updates
  np.testing.assert_array_equal(np.asarray(restored.controller.key), np.asarray(saved.controller.key))
  (straight, losses), (resumed, resumed_losses) = got['straight'], got['resumed']
  assert resumed_losses == losses[K:]  # steps 20-39, bit for bit
  assert _leaves_equal(resumed, straight)  # parameters, Adam's moments, HDET's controller, key, counters
  assert eval_loss(resumed) == eval_loss(straight)


def test_a_restarted_stream_moves_the_controller_and_hdet_more_than_plain(hdet_runs, tmp_path):
  """Restarting the stream at step 20 changes the batches of steps 20-39 (they repeat steps 0-19's). Measured (seed
  0, the same at the suite's XLA flags and at XLA's defaults): HDET's learned factor x5.11 against the uninterrupted
  run's x6.31, its final evaluation 10.0% off, plain Adam's 1.6% (seeds 1 and 2: HDET 12.0% and 6.3%, plain 1.8% and
  1.9%; ``python tests/test_resume.py``). Asserted: both runs differ from their uninterrupted ones, HDET's learned
  factor by more than 10%, and HDET's evaluation by more than twice plain's."""
  hdet, plain = hdet_runs, runs(PLAIN, 0, tmp_path / 'plain')
  changes = {}
  for name, got in (('hdet', hdet), ('plain', plain)):
    straight, restarted = got['straight'][0], got['restarted'][0]
    assert not _leaves_equal(restarted, straight), name
    changes[name] = abs(eval_loss(restarted) / eval_loss(straight) - 1)
    assert changes[name] > 0, name
  base = [float(hdet_jax.hyperparams(got[0][1])['base_lr_scale']) for got in (hdet['straight'], hdet['restarted'])]
  assert abs(np.log(base[1] / base[0])) > np.log(1.1), base  # the controller moved elsewhere
  assert changes['hdet'] > 2 * changes['plain'], changes


if __name__ == '__main__':
  import tempfile

  for seed in range(3):
    line = [f'seed {seed}']
    for name, tx in (('hdet', HDET), ('plain', PLAIN)):
      got = runs(tx, seed, tempfile.mkdtemp())
      straight, resumed, restarted = (eval_loss(got[k][0]) for k in ('straight', 'resumed', 'restarted'))
      line.append(
        f'{name} eval {straight:.4f}, restored {resumed / straight - 1:+.2%}, restarted {restarted / straight - 1:+.2%}'
      )
      if name == 'hdet':
        base = [float(hdet_jax.hyperparams(got[k][0][1])['base_lr_scale']) for k in ('straight', 'restarted')]
        line.append(f'base lr x{base[0]:.3f} (restarted x{base[1]:.3f})')
    print('; '.join(line))
