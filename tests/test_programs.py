"""The trainer's programs (programs.py): a chunk of batches read at the optimizer's count equals per-step batches."""

import os

import chex
import jax
import numpy as np

from hdet_jax.trainer import config_lib
from hdet_jax.trainer.tasks import lm_input_pipeline as ip
from hdet_jax.trainer.tasks import lm_model as model_lib
from hdet_jax.trainer import mesh as mesh_lib
from hdet_jax.trainer import optimizer as optimizer_lib
from hdet_jax.trainer import programs as programs_lib
import trainer_testing


TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs', 'tiny.py')


def test_chunked_data_reads_each_steps_batch_at_the_optimizer_count():
  config = config_lib.load_config_file(TINY)
  # Steps cross chunk boundaries, and step 7 ends a window; the trainer runs the non-sync step there too (the
  # window end is a program of its own, test_window_end_*), so one program per chunking: half the compiles.
  n, k, steps = 8, 4, 9
  mesh = mesh_lib.make_mesh(n)
  run = trainer_testing.resolve(config)
  tx = optimizer_lib.make_optimizer(run.optimizer, n, seed=run.seed)
  graphdef, _ = model_lib.abstract_model(config.model, config.data.seq_len)
  init = programs_lib.make_init(run.task, run.task_settings, tx, mesh, n)
  rng = np.random.default_rng(0)
  batches = ip.TrainBatches(
    rng.integers(0, 256, 200_000, dtype=np.uint8), config.data.seq_len, config.data.batch_size, n, seed=1
  )
  out = {}
  for chunk in (0, k):
    params, opt_state = init(jax.random.key(0))
    step = programs_lib.make_train_step(
      graphdef, tx, mesh, sync=False, seed=run.seed, settings=run.programs, chunk_steps=chunk
    )
    losses = []
    for t in range(steps):
      data = batches.batch(t) if chunk == 0 else batches.chunk(t - t % k, k)
      params, opt_state, m = step(params, opt_state, mesh_lib.put_stacked(data, mesh))
      losses.append(np.asarray(m['loss']))
    out[chunk] = (np.stack(losses), jax.tree.map(np.asarray, params))
  np.testing.assert_array_equal(out[k][0], out[0][0])  # every step saw its own batch, bit for bit
  chex.assert_trees_all_equal(out[k][1], out[0][1])
  assert len(np.unique(out[0][0][:, 0])) == steps  # and the batches differ from step to step


def _tree_rows_norm(tree):
  """[N]: each replica's L2 norm over every leaf (float64 on the host)."""
  leaves = [np.asarray(x, np.float64).reshape(np.shape(x)[0], -1) for x in jax.tree.leaves(tree)]
  return np.sqrt(sum((x**2).sum(1) for x in leaves))


def _tiny_start(config, n):
  """(mesh, tx, graphdef, params, opt_state, batches): ``n`` replicas of ``config`` at step 0, on random bytes."""
  mesh = mesh_lib.make_mesh(n)
  run = trainer_testing.resolve(config)
  tx = optimizer_lib.make_optimizer(run.optimizer, n, seed=run.seed)
  graphdef, _ = model_lib.abstract_model(config.model, config.data.seq_len)
  params, opt_state = programs_lib.make_init(run.task, run.task_settings, tx, mesh, n)(jax.random.key(0))
  batches = ip.TrainBatches(
    np.random.default_rng(0).integers(0, 256, 200_000, dtype=np.uint8),
    config.data.seq_len,
    config.data.batch_size,
    n,
    seed=1,
  )
  return mesh, tx, graphdef, params, opt_state, batches


def test_window_end_and_distance_measure_each_replicas_distance_from_the_mean():
  """The window end's `distance` is each replica's L2 distance from the average it assigns, measured on the
  replicas just before it; make_distance (runs that never average) measures the same without averaging."""
  config = config_lib.load_config_file(TINY)
  n = 8
  mesh, tx, graphdef, params, opt_state, batches = _tiny_start(config, n)
  step = programs_lib.make_train_step(
    graphdef,
    tx,
    mesh,
    sync=False,
    seed=trainer_testing.resolve(config).seed,
    settings=trainer_testing.resolve(config).programs,
  )
  for t in range(8):  # tiny syncs after step 7: the replicas have drifted apart for 8 steps
    params, opt_state, _ = step(params, opt_state, mesh_lib.put_stacked(batches.batch(t), mesh))
  before = jax.tree.map(np.asarray, params)
  mean = jax.tree.map(lambda x: x.astype(np.float64).mean(0, keepdims=True), before)
  want = _tree_rows_norm(jax.tree.map(lambda x, m: x - m, before, mean))
  assert want.min() > 1e-3 and np.ptp(want) > 1e-3  # distinct replicas, at distinct distances

  got = mesh_lib.fetch(programs_lib.make_distance(mesh)(params))
  np.testing.assert_allclose(got['distance'], want, rtol=1e-4)
  np.testing.assert_allclose(got['mean_norm'], _tree_rows_norm(mean)[0], rtol=1e-5)

  after, _, m = programs_lib.make_window_end(tx, mesh, seed=0)(params, opt_state)
  after = jax.tree.map(np.asarray, after)
  chex.assert_trees_all_close(
    jax.tree.map(lambda a: a[0], after), jax.tree.map(lambda x: x[0], mean), rtol=1e-5, atol=1e-6
  )
  np.testing.assert_allclose(np.asarray(m['distance']), want, rtol=1e-4)
  np.testing.assert_allclose(np.asarray(m['mean_norm']), _tree_rows_norm(after), rtol=1e-6)


def _fit_config(**overrides):
  return trainer_testing.tiny(
    **{'hdet.controller': 'fit', 'hdet.score': 'common', 'hdet.warmup_steps': 0, 'hdet.rollback': False, **overrides}
  )  # (no anchor: the window end's only extra argument is the common batch)


def _window_setup(config, n=8):
  """(n, mesh, tx, graphdef, params, opt_state, data, batches, step program) of a tiny run on n replicas."""
  mesh = mesh_lib.make_mesh(n)
  run = trainer_testing.resolve(config)
  tx = optimizer_lib.make_optimizer(run.optimizer, n, seed=run.seed)
  graphdef, _ = model_lib.abstract_model(config.model, config.data.seq_len)
  params, opt_state = programs_lib.make_init(run.task, run.task_settings, tx, mesh, n)(jax.random.key(0))
  data = np.random.default_rng(0).integers(0, 256, 200_000, dtype=np.uint8)
  batches = ip.TrainBatches(data, config.data.seq_len, config.data.batch_size, n, seed=1)
  step = programs_lib.make_train_step(graphdef, tx, mesh, sync=False, seed=run.seed, settings=run.programs)
  return n, mesh, tx, graphdef, params, opt_state, data, batches, step


def test_window_end_scores_each_replicas_last_iterate_on_the_common_batch():
  """hdet.score='common': the window end's scores are each replica's loss on the common batch, with its own
  parameters after the window's 8 steps (oracle: the task's loss of each replica's slice, on the host)."""
  config = _fit_config(**{'hdet.param_groups': False})
  n, mesh, tx, graphdef, params, opt_state, data, batches, step = _window_setup(config)
  for t in range(8):
    params, opt_state, _ = step(params, opt_state, mesh_lib.put_stacked(batches.batch(t), mesh))
  windows = ip.probe_windows(data, config.data.seq_len, config.hdet.probe_windows, config.seed, 0)
  common = mesh_lib.put_stacked(np.broadcast_to(windows, (n,) + windows.shape), mesh, batch_dim=1)
  task = programs_lib.tasks_lib.get(config.task)
  # (each replica's slice read on the host: slicing the sharded arrays eagerly would queue one multi-device program per
  # leaf and replica, the pattern behind XLA:CPU's in-process all-reduce deadlock; CONTRIBUTING.md)
  host = jax.device_get(params)
  # (the loss jitted, one program for the replicas' slices: run op by op the model compiles each of its operations)
  loss = jax.jit(lambda p: task.loss(graphdef, p, windows))
  want = [float(loss(jax.tree.map(lambda x: x[r], host))) for r in range(n)]
  end = programs_lib.make_window_end(
    tx,
    mesh,
    graphdef=graphdef,
    seed=trainer_testing.resolve(config).seed,
    settings=trainer_testing.resolve(config).programs,
  )
  _, _, m = end(params, opt_state, common)
  got = np.asarray(m['window_losses'])[0]
  np.testing.assert_allclose(got, want, rtol=2e-6)
  assert np.ptp(got) > 0  # the replicas differ: each scored its own parameters


def _device_bytes(tree, device):
  return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards if s.device == device)


def test_the_rollback_anchor_is_one_copy_per_device_in_the_groups_layout():
  """make_anchor keeps the library's anchor (hdet(..., rollback=True)) once per device, each device taking its first
  replica's: 8 replicas on 1 or 2 devices hold 1/8 or 1/4 of the stacked parameters and wrapped optimizer state
  in it; on a 4 x 2 FSDP mesh each leaf keeps its group's split, and a device holds half a copy. The copy a
  checkpoint holds (make_saved_anchor: one, replicated) is the same per device, and make_restored_anchor gives the
  loop's back bit for bit. Its values are the replicas' (all alike at the start), bit for bit."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  config = config_lib.load_config_file(TINY)
  n = 8
  for devices, fsdp in ((1, 1), (2, 1), (None, 2)):
    mesh = mesh_lib.make_mesh(n if fsdp == 1 else 4, fsdp=fsdp, devices=devices)
    reps = n if fsdp == 1 else 4
    run = trainer_testing.resolve(config)
    tx = optimizer_lib.make_optimizer(run.optimizer, reps, seed=run.seed, rollback=True)
    params, opt_state = programs_lib.make_init(run.task, run.task_settings, tx, mesh, reps)(jax.random.key(0))
    if fsdp > 1:
      layout = mesh_lib.layout(mesh, params, opt_state)
      params, inner = jax.device_put(params, layout[0]), jax.device_put(opt_state.inner_state, layout[1].inner_state)
      opt_state = opt_state._replace(inner_state=inner)
    stacked = {'params': params, 'inner': opt_state.inner_state}
    shapes = jax.eval_shape(programs_lib.first_anchor(tx, mesh), params, opt_state)
    anchor = programs_lib.make_anchor(mesh, tx, mesh_lib.stacked_anchor_layout(mesh, shapes))(params, opt_state)
    assert {a.shape[0] for a in jax.tree.leaves(anchor)} == {mesh.shape['data']}  # one per device (or group)
    saved = programs_lib.make_saved_anchor(mesh, mesh_lib.anchor_layout(mesh, params, opt_state.inner_state))(anchor)
    back = programs_lib.make_restored_anchor(mesh, mesh_lib.stacked_anchor_layout(mesh, shapes))(saved)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, back), jax.tree.map(np.asarray, anchor))
    # (jitted: run op by op, the slicing and unpacking compile each of their many small operations)
    c = jax.jit(lambda p, s: programs_lib.unpack(tx, *jax.tree.map(lambda a: a[0], (p, s))).controller)(
      params, opt_state
    )
    assert np.isnan(saved.pop('train_loss')) and np.isnan(saved.pop('train_loss_se'))  # no window yet
    assert np.isnan(c.train_loss)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, saved), jax.tree.map(lambda a: np.asarray(a)[0], stacked))
    dev = mesh.devices.flat[0]
    expected = 1 / 8 if devices == 1 else 1 / 4 if devices == 2 else 1.0
    for held in (saved, {'params': anchor.params, 'inner': anchor.inner_state}):
      copies = _device_bytes(held, dev) / _device_bytes(stacked, dev)
      assert copies == expected, (devices, fsdp, copies)
    if fsdp > 1:  # each leaf split in its group as the stacked one is: half a copy per device
      same = jax.tree.map(
        lambda a, s: a.sharding.is_equivalent_to(NamedSharding(mesh, P(*s.sharding.spec[1:])), a.ndim), saved, stacked
      )
      assert all(jax.tree.leaves(same))
      assert any('fsdp' in a.sharding.spec for a in jax.tree.leaves(saved))
      same = jax.tree.map(
        lambda a, s: a.sharding.is_equivalent_to(s.sharding, a.ndim),
        {'params': anchor.params, 'inner': anchor.inner_state},
        stacked,
      )
      assert all(jax.tree.leaves(same))
