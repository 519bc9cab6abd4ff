"""The trainer on grouped meshes (--config.mesh.fsdp=F, --config.mesh.tensor=K): its step programs keep
the FSDP and tensor-parallel layout, a group size of 1 equals the 1-D trainer bit for bit, FSDP x tensor
groups equal it to float rounding, the low-communication switch removes the gradient
all-reduce across groups, and a 2-D run resumes bit for bit (opt-in: HDET_SLOW_TESTS=1)."""

import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from benchmarks import comm
from hdet_jax.param_groups import path_string
from hdet_jax.trainer import config_lib
from trainer_testing import train_and_evaluate
from hdet_jax.trainer import metrics
from hdet_jax.trainer.tasks import lm_input_pipeline as ip
from hdet_jax.trainer.tasks import lm_model as model_lib
from hdet_jax.trainer import mesh as mesh_lib, optimizer as optimizer_lib, programs as programs_lib
import trainer_testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, 'configs', 'tiny.py')


def tiny(**overrides):
  return trainer_testing.tiny(**overrides)


def run_steps(config, mesh, n, steps):
  """``steps`` trainer steps (the window end after each sync) on ``mesh``; (params, opt_state, losses)."""
  run = trainer_testing.resolve(config)
  tx = optimizer_lib.make_optimizer(run.optimizer, n, seed=run.seed)
  graphdef, _ = model_lib.abstract_model(config.model, config.data.seq_len)
  params, opt_state = programs_lib.make_init(run.task, run.task_settings, tx, mesh, n)(jax.random.key(0))
  layout = mesh_lib.layout(mesh, params, opt_state)
  step = programs_lib.make_train_step(
    graphdef, tx, mesh, sync=False, seed=run.seed, settings=run.programs, shardings=layout
  )
  window_end = programs_lib.make_window_end(tx, mesh, seed=run.seed, shardings=layout)
  batches = ip.TrainBatches(
    np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8),
    config.data.seq_len,
    config.data.batch_size,
    n,
    seed=1,
  )
  losses = []
  for t in range(steps):
    params, opt_state, m = step(params, opt_state, mesh_lib.put_stacked(batches.batch(t), mesh, batch_dim=1))
    losses.append(np.asarray(m['loss']))
    if run.is_sync_step(t):
      params, opt_state, _ = window_end(params, opt_state)
    if layout is not None:  # the layout holds after every program, sync or not
      for tree, want in zip((params, opt_state), layout):
        for leaf, sh in zip(jax.tree.leaves(tree), jax.tree.leaves(want)):
          assert leaf.sharding.is_equivalent_to(sh, leaf.ndim), (t, leaf.sharding, sh)
  return params, opt_state, np.stack(losses)


def test_group_size_one_equals_the_1d_trainer_bit_for_bit():
  """An 8x1 mesh through the trainer's programs (layout pinned) against the 1-D trainer: the
  transformer's step is where leaving the size-1 axis Auto once cost an ulp (see shard_map_replicas).
  Three steps before any sync, no controller and one LR group keep it to two small programs: the sync
  and the controller on 8x1 are tests/test_mesh2d.py's (bit for bit there too)."""
  config = tiny(**{'hdet.score': 'window', 'hdet.auto_lr': False, 'hdet.param_groups': False})
  steps = 3
  one_d = run_steps(config, mesh_lib.make_mesh(8), 8, steps)
  eight_by_one = run_steps(
    config, Mesh(np.asarray(jax.devices()).reshape(8, 1), (mesh_lib.AXIS, mesh_lib.INNER)), 8, steps
  )
  for a, b in zip(jax.tree.leaves(one_d), jax.tree.leaves(eight_by_one)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.skipif(not os.environ.get('HDET_SLOW_TESTS'), reason='about 20 s: set HDET_SLOW_TESTS=1')
def test_4x2_trainer_programs_keep_the_layout():
  config = tiny(**{'hdet.score': 'window'})
  steps = 9  # across the sync after step 7
  params, _, losses = run_steps(config, mesh_lib.make_mesh(4, 2), 4, steps)
  assert losses.shape == (steps, 4) and np.isfinite(losses).all()  # one loss per group
  w = max(jax.tree.leaves(params), key=lambda x: x.size)  # the byte embedding [4, 256, 32]
  assert {s.data.nbytes for s in w.addressable_shards} == {w.nbytes // 8}  # one group's copy, halved


def test_tensor_parallel_and_fsdp_groups_equal_the_1d_trainer():
  """2 groups of 2 (FSDP) x 2 (tensor parallel) through the trainer's programs against the 1-D trainer
  on 2 devices (replica r sees group r's whole batch): the same losses and parameters to float rounding,
  the attention and MLP kernels split over 'tensor' by model.TENSOR_RULES (run_steps checks that the
  layout holds after every program). The exception is the key bias, q.k-invariant under softmax: its
  gradient is rounding noise on both paths, which Adam's normalised step turns into LR-sized moves."""
  config = tiny(**{'hdet.score': 'window', 'hdet.sync_every': 2})
  steps = 3  # across the sync after step 1
  one_d = run_steps(config, mesh_lib.make_mesh(2), 2, steps)
  grouped = run_steps(config, mesh_lib.make_mesh(2, 2, 2), 2, steps)
  np.testing.assert_allclose(grouped[2], one_d[2], rtol=1e-6)
  d = config.model.d_model
  flat = jax.tree_util.tree_flatten_with_path(grouped[0])[0]
  for (path, a), b in zip(flat, jax.tree.leaves(one_d[0])):
    name = path_string(path)
    a, b = np.asarray(a), np.asarray(b)
    if name.endswith('attn/qkv/bias'):
      a, b = np.delete(a, np.s_[d : 2 * d], -1), np.delete(b, np.s_[d : 2 * d], -1)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)
  specs = {path_string(p): x.sharding.spec for p, x in flat}
  assert specs['blocks/0/fc1/kernel'] == P('data', 'fsdp', 'tensor')  # column-parallel: outputs split
  assert specs['blocks/0/fc2/kernel'] == P('data', 'tensor', 'fsdp')  # row-parallel: inputs split
  assert specs['blocks/0/ln1/scale'] == P('data', 'fsdp')  # no tensor rule: FSDP alone
  assert specs['embed/embedding'] == P('data')  # model.FSDP_RULES: whole beside a tensor axis


def test_low_communication_switch_removes_the_gradient_all_reduce_across_groups():
  """The trainer's step on 4x2 with hdet.low_communication sends nothing across groups but the
  metrics' scalars (the shared mode's step sends the gradient: results/mesh2d.md, and the core's
  test_replica_axis_bytes_per_mode_from_the_hlo)."""
  mesh, n = mesh_lib.make_mesh(4, 2), 4
  config = tiny(**{'hdet.low_communication': True, 'hdet.score': 'window'})
  run = trainer_testing.resolve(config)
  tx = optimizer_lib.make_optimizer(run.optimizer, n, seed=run.seed)
  graphdef, abstract = model_lib.abstract_model(config.model, config.data.seq_len)
  params, opt_state = programs_lib.make_init(run.task, run.task_settings, tx, mesh, n)(jax.random.key(0))
  data = mesh_lib.put_stacked(np.zeros((n, config.data.batch_size, config.data.seq_len + 1), np.uint8), mesh, 1)
  step = programs_lib.make_train_step(
    graphdef,
    tx,
    mesh,
    sync=False,
    seed=run.seed,
    settings=run.programs,
    shardings=mesh_lib.layout(mesh, params, opt_state),
  )
  got = comm.replica_axis_bytes(step.lower(params, opt_state, data).compile().as_text(), (4, 2))
  assert got < 64 < metrics.num_params(abstract)  # no gradient crosses groups


def test_bad_mesh_config_is_one_clear_error(tmp_path):
  with pytest.raises(config_lib.ConfigError, match='data.batch_size=4 .* mesh.fsdp=8'):
    train_and_evaluate(tiny(**{'mesh.fsdp': 8}), str(tmp_path / 'a'))
  with pytest.raises(config_lib.ConfigError, match='mesh.replicas=8 x mesh.fsdp=2 needs 16 devices'):
    train_and_evaluate(tiny(**{'mesh.fsdp': 2, 'mesh.replicas': 8}), str(tmp_path / 'b'))
  with pytest.raises(config_lib.ConfigError, match='mesh.replicas=4 x mesh.fsdp=1 x mesh.tensor=4 needs 16'):
    train_and_evaluate(tiny(**{'mesh.tensor': 4, 'mesh.replicas': 4}), str(tmp_path / 'c'))
  with pytest.raises(
    config_lib.ConfigError, match=r"mesh.tensor=3: tensor-parallel rule .* matches 'blocks/0/attn/out/kernel'"
  ):
    train_and_evaluate(tiny(**{'mesh.tensor': 3, 'mesh.replicas': 2}), str(tmp_path / 'd'))
  assert not os.listdir(tmp_path)  # nothing was created


@pytest.mark.skipif(not os.environ.get('HDET_SLOW_TESTS'), reason='about a minute: set HDET_SLOW_TESTS=1')
@pytest.mark.parametrize('low,tensor', [(False, 1), (True, 1), (False, 2)])
def test_2d_run_resumes_bit_exact(tmp_path, low, tensor):
  """4x2 (tensor=2: 2 groups of 2 FSDP x 2 tensor-parallel), stopped at step 12 (mid fan-out: syncs after
  steps 8 and 16, the controller from 8) and resumed to 16: bit for bit the straight run, checkpoint and metrics."""
  import orbax.checkpoint as ocp

  def saved(workdir):  # the final checkpoint's state and averaged model, as plain arrays
    path = os.path.join(workdir, 'checkpoints', '16')
    with ocp.StandardCheckpointer() as ckptr:
      return [
        np.asarray(x)
        for item in ('state', 'avg_params')
        for x in jax.tree.leaves(ckptr.restore(os.path.join(path, item)))
      ]

  over = {
    'mesh.fsdp': 2,
    'mesh.tensor': tensor,
    'num_train_steps': 16,
    'hdet.warmup_steps': 4,
    'plots': False,
    'hdet.low_communication': low,
    'hdet.average_opt_state': low,
  }
  straight = str(tmp_path / 'straight')
  train_and_evaluate(tiny(**over), straight)
  resumed = str(tmp_path / 'resumed')
  assert train_and_evaluate(tiny(**over, stop_at_step=12), resumed)['stopped_early']
  assert train_and_evaluate(tiny(**over), resumed)['step'] == 16
  a, b = saved(straight), saved(resumed)
  assert len(a) == len(b) > 0
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)


@pytest.mark.skipif(
  not os.environ.get('HDET_MULTIPROCESS_TESTS'),
  reason='two processes x 4 CPU devices on 4x2: about a minute (52 s measured); set HDET_MULTIPROCESS_TESTS=1',
)
def test_two_processes_match_one_on_4x2(tmp_path):
  """train.py as 2 processes x 4 CPU devices (each holding two groups of 2) against one process x 8."""
  from hdet_jax.trainer.metrics import read_metrics
  from process_testing import run_two_processes

  over = ['--config.mesh.fsdp=2', '--config.num_train_steps=16', '--tuning.hdet.warmup_steps=4', '--config.plots=False']
  one = str(tmp_path / 'one')
  train_and_evaluate(tiny(**{'mesh.fsdp': 2, 'num_train_steps': 16, 'hdet.warmup_steps': 4, 'plots': False}), one)
  two = str(tmp_path / 'two')
  outs = run_two_processes(TINY, two, over, timeout=600, train=trainer_testing.TUNED_TRAIN)
  assert 'Run finished 16 steps.' in outs[0]
  a = np.array([r['loss'] for r in read_metrics(os.path.join(one, 'metrics.jsonl'))['train']])
  b = np.array([r['loss'] for r in read_metrics(os.path.join(two, 'metrics.jsonl'))['train']])
  assert a.shape == b.shape and a.shape[1] == 4  # one loss per group
  # Only the cross-process collectives (gloo) may sum in another order (the 1-D test measured 1.5 ulp).
  assert float(np.max(np.abs(a - b))) <= 2e-6
