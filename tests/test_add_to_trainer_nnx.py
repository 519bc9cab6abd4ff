"""HDET in a flax-nnx jit-with-shardings trainer: examples/add_to_trainer/plain_nnx.py is plain_linen.py's global-batch
trainer written for nnx (an nnx.Module and nnx.Optimizer split into a graphdef and a state, a plain jax.jit with
in/out shardings and donation, FSDP through nnx.with_partitioning on a mesh axis named 'data', MultiSteps(chain(clip,
masked adamw)), orbax), and hdet_nnx.py is the same file with linen's HDET changes. Checked here: the diff is small
and counted; both train; HDET's replicas run apart and agree after a sync; its kernels and moments stay FSDP-sharded
inside each replica; and save, restore, continue equals an uninterrupted run bit for bit.
"""

import pathlib
import re

import flax.nnx as nnx
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import hdet_jax
from test_add_to_trainer import PAGE, _diff, _load  # the linen pair's helpers: the same files' layout

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / 'examples' / 'add_to_trainer'
PLAIN_STEPS = 12
# HDET's optimizer steps: hdet's sync_every defaults to round(STEPS / 15) = 3 with AutoLR(total_steps=40), so step 18
# ends on a sync; the checkpoints are at 10 (the resumed run restarts there) and not at 18.
STEPS = 18
ADDED, REMOVED = 13, 6  # 12 statements; 1 added line is a continuation at the docs' 88 columns: 19 (from 26)


plain = _load('plain_nnx')
hdet = _load('hdet_nnx')


def test_the_page_shows_the_nnx_diff_and_it_is_small():
  diff = _diff('plain_nnx.py', 'hdet_nnx.py')
  blocks = re.findall(r'^```diff\n(.*?)^```', PAGE.read_text(), re.S | re.M)
  assert len(blocks) >= 2 and blocks[1].splitlines() == diff, '\n'.join(diff)
  added = [line for line in diff if line.startswith('+')]
  removed = [line for line in diff if line.startswith('-')]
  assert (len(added), len(removed)) == (ADDED, REMOVED), (len(added), len(removed))
  kept = (
    'with_sharding_constraint',
    "donate_argnames=('state',)",
    "nnx.with_partitioning(init, (None, 'data'))",
    'ocp.CheckpointManager',
    'MultiSteps',
    'clip_by_global_norm',
    'mask=decay_mask',
    'nnx.split((model, optimizer))',
    'nnx.merge(graphdef, state)',
    'wrt=nnx.Param',
  )
  for name in ('plain_nnx.py', 'hdet_nnx.py'):
    text = (EXAMPLES / name).read_text()
    assert all(k in text for k in kept), name
    assert max(len(line) for line in text.splitlines()) <= 87, name  # the page's code width, less the +/-


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """The plain trainer; HDET straight to STEPS; HDET to 10 (a checkpoint) then resumed to STEPS (one process)."""
  root = tmp_path_factory.mktemp('add_to_trainer_nnx')
  out = {'plain': plain.train(str(root / 'plain'), PLAIN_STEPS), 'straight': hdet.train(str(root / 'straight'), STEPS)}
  out['first_half'] = hdet.train(str(root / 'resumed'), 10)
  out['resumed'] = hdet.train(str(root / 'resumed'), STEPS)
  return out


def _merged(module, state, mesh):
  """(model, optimizer) from a trained state: the graphdef is the module's own (nnx shards annotated Variables as
  it creates them, so the abstract state is built under the run's mesh)."""
  with jax.set_mesh(mesh):
    graphdef, _ = jax.eval_shape(module.create_state, jax.random.key(0))
  return nnx.merge(graphdef, state)


def test_both_trainers_learn(runs):
  for name, steps in (('plain', PLAIN_STEPS), ('straight', STEPS)):
    _, losses, eval_loss = runs[name]
    assert len(losses) == steps and losses[-1] < 0.7 * losses[0] and eval_loss < 0.7 * losses[0], (name, losses)
  state = runs['plain'][0]
  assert int(state[1]['step'][...]) == PLAIN_STEPS * plain.ACCUM
  assert state[0]['up']['kernel'][...].sharding.spec == P(None, 'data')  # FSDP in the plain trainer


def test_hdet_replicas_run_apart_and_agree_after_a_sync(runs):
  state = runs['straight'][0]
  mesh = Mesh(np.array(jax.devices()).reshape(hdet.N, -1), ('replica', 'data'))
  _, optimizer = _merged(hdet, state, mesh)
  hp = hdet_jax.hyperparams(optimizer.opt_state.inner_opt_state)
  lrs, base = np.asarray(hp['lr_scale']), float(hp['base_lr_scale'])  # [N] and the base: factors on adamw's LR
  assert lrs.shape == (hdet.N,) and len(set(np.round(lrs / base, 6))) == hdet.N, lrs  # N distinct multipliers
  steps = np.asarray(state[1]['step'][...])
  assert (steps == STEPS * hdet.ACCUM).all(), steps  # every replica's counter; train() reads replica 0's
  inner = state[1]['opt_state']['inner_opt_state']
  assert np.asarray(inner['synced'][...]).all() and (np.asarray(inner['sync_count'][...]) == STEPS // 3).all()
  for leaf in jax.tree.leaves(state[0]):  # the last step was a sync: the replicas agree to about an ulp
    x = np.asarray(leaf)
    assert np.abs(x - x[0]).max() <= 2.0**-22 * np.abs(x).max(), np.abs(x - x[0]).max()
  # between syncs they do run apart: the first half ended at step 10, one step after the sync at 9
  x = np.asarray(runs['first_half'][0][0]['up']['kernel'][...])
  assert np.abs(x - x[0]).max() > 1e-5


def test_hdet_kernels_and_moments_stay_fsdp_sharded_inside_each_replica(runs):
  state = runs['straight'][0]
  leaves = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(state)[0]}
  sharded = {k: v for k, v in leaves.items() if k.endswith(("['kernel'].value", "['embedding'].value"))}
  # 3 kernels and the embedding, in the params, in MultiSteps' accumulated gradient and in AdamW's two moments
  assert len(sharded) == 16, sorted(sharded)
  for key, leaf in sharded.items():
    assert leaf.sharding.spec == P('replica', None, 'data'), (key, leaf.sharding.spec)
    n, rows, cols = leaf.shape
    assert n == hdet.N and leaf.addressable_shards[0].data.shape == (1, rows, cols // 2), key
  for key, leaf in leaves.items():  # everything else is the replica's own, whole inside its group
    assert leaf.shape[0] == hdet.N and leaf.sharding.spec[0] == 'replica', key


def test_save_restore_continue_equals_an_uninterrupted_run(runs):
  straight, resumed = runs['straight'], runs['resumed']
  assert resumed[1] == straight[1][10:]  # the resumed run's losses, steps 10-17, bit for bit
  a, b = jax.tree_util.tree_flatten_with_path(straight[0])[0], jax.tree_util.tree_flatten_with_path(resumed[0])[0]
  assert [k for k, _ in a] == [k for k, _ in b]
  for (key, x), (_, y) in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(key))
  assert straight[2] == resumed[2]
