"""The trainer's programs (programs.py): a chunk of batches read at the optimizer's count equals per-step batches."""

import os

import chex
import jax
import numpy as np

from hdet_jax.trainer import config_lib
from hdet_jax.trainer import input_pipeline as ip
from hdet_jax.trainer import model as model_lib
from hdet_jax.trainer import mesh as mesh_lib
from hdet_jax.trainer import optimizer as optimizer_lib
from hdet_jax.trainer import programs as programs_lib


TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs', 'tiny.py')


def test_chunked_data_reads_each_steps_batch_at_the_optimizer_count():
  config = config_lib.load_config_file(TINY)
  # Steps cross chunk boundaries, and step 7 ends a window; the trainer runs the non-sync step there too (the
  # window end is a program of its own, test_window_end_*), so one program per chunking: half the compiles.
  n, k, steps = 8, 4, 9
  mesh = mesh_lib.make_mesh(n)
  tx = optimizer_lib.make_optimizer(config, n)
  graphdef, _ = model_lib.abstract_model(config.model, config.data.seq_len)
  init = programs_lib.make_init(config, tx, mesh, n)
  rng = np.random.default_rng(0)
  batches = ip.TrainBatches(rng.integers(0, 256, 200_000, dtype=np.uint8), config.data.seq_len,
                            config.data.batch_size, n, seed=1)
  out = {}
  for chunk in (0, k):
    params, opt_state = init(jax.random.key(0))
    step = programs_lib.make_train_step(graphdef, tx, mesh, sync=False, config=config, chunk_steps=chunk)
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
  return np.sqrt(sum((x ** 2).sum(1) for x in leaves))


def _tiny_start(config, n):
  """(mesh, tx, graphdef, params, opt_state, batches): ``n`` replicas of ``config`` at step 0, on random bytes."""
  mesh = mesh_lib.make_mesh(n)
  tx = optimizer_lib.make_optimizer(config, n)
  graphdef, _ = model_lib.abstract_model(config.model, config.data.seq_len)
  params, opt_state = programs_lib.make_init(config, tx, mesh, n)(jax.random.key(0))
  batches = ip.TrainBatches(np.random.default_rng(0).integers(0, 256, 200_000, dtype=np.uint8),
                            config.data.seq_len, config.data.batch_size, n, seed=1)
  return mesh, tx, graphdef, params, opt_state, batches


def test_window_end_and_distance_measure_each_replicas_distance_from_the_mean():
  """The window end's `distance` is each replica's L2 distance from the average it assigns, measured on the
  replicas just before it; make_distance (runs that never average) measures the same without averaging."""
  config = config_lib.load_config_file(TINY)
  n = 8
  mesh, tx, graphdef, params, opt_state, batches = _tiny_start(config, n)
  step = programs_lib.make_train_step(graphdef, tx, mesh, sync=False, config=config)
  for t in range(8):  # tiny syncs after step 7: the replicas have drifted apart for 8 steps
    params, opt_state, _ = step(params, opt_state, mesh_lib.put_stacked(batches.batch(t), mesh))
  before = jax.tree.map(np.asarray, params)
  mean = jax.tree.map(lambda x: x.astype(np.float64).mean(0, keepdims=True), before)
  want = _tree_rows_norm(jax.tree.map(lambda x, m: x - m, before, mean))
  assert want.min() > 1e-3 and np.ptp(want) > 1e-3  # distinct replicas, at distinct distances

  got = mesh_lib.fetch(programs_lib.make_distance(mesh)(params))
  np.testing.assert_allclose(got['distance'], want, rtol=1e-4)
  np.testing.assert_allclose(got['mean_norm'], _tree_rows_norm(mean)[0], rtol=1e-5)

  after, _, m = programs_lib.make_window_end(tx, mesh)(params, opt_state)
  after = jax.tree.map(np.asarray, after)
  chex.assert_trees_all_close(jax.tree.map(lambda a: a[0], after), jax.tree.map(lambda x: x[0], mean), rtol=1e-5,
                              atol=1e-6)
  np.testing.assert_allclose(np.asarray(m['distance']), want, rtol=1e-4)
  np.testing.assert_allclose(np.asarray(m['mean_norm']), _tree_rows_norm(after), rtol=1e-6)


def _tail_config(**overrides):
  return config_lib.with_overrides(config_lib.load_config_file(TINY), {
      'hdet.controller': 'fit', 'hdet.score': 'common', 'hdet.warmup_steps': 0, 'hdet.score_tail': 0.5,
      'hdet.rollback': False, **overrides})  # (no anchor: the window end's arguments are the tail's)


def test_tail_weight_is_one_over_k_on_each_windows_last_steps():
  """hdet.score_tail=0.5: a window of 8 averages its last 4 steps (weights 1, 1/2, 1/3, 1/4: a running
  mean), a window of 2 its last step; off (0, or scoring window losses) it is 0 everywhere."""
  config = _tail_config(**{'hdet.early_sync_every': 2, 'hdet.early_sync_steps': 4})  # windows 0-1, 2-3, 4-11, ...
  got = [optimizer_lib.tail_weight(config, t) for t in range(20)]
  want = [0, 1, 0, 1] + [0] * 4 + [1, 1 / 2, 1 / 3, 1 / 4] + [0] * 4 + [1, 1 / 2, 1 / 3, 1 / 4]
  np.testing.assert_allclose(got, want, rtol=0, atol=0)
  assert [optimizer_lib.tail_weight(_tail_config(**{'hdet.score_tail': 0.3}), t) for t in range(8)] == [0] * 6 + [1, 1 / 2]
  assert all(optimizer_lib.tail_weight(_tail_config(**{'hdet.score_tail': 0.0}), t) == 0 for t in range(20))
  assert all(optimizer_lib.tail_weight(_tail_config(**{'hdet.score': 'window'}), t) == 0 for t in range(20))


def _window_setup(config, n=8):
  """(n, mesh, tx, graphdef, params, opt_state, data, batches, step program) of a tiny run on n replicas."""
  mesh = mesh_lib.make_mesh(n)
  tx = optimizer_lib.make_optimizer(config, n)
  graphdef, _ = model_lib.abstract_model(config.model, config.data.seq_len)
  params, opt_state = programs_lib.make_init(config, tx, mesh, n)(jax.random.key(0))
  data = np.random.default_rng(0).integers(0, 256, 200_000, dtype=np.uint8)
  batches = ip.TrainBatches(data, config.data.seq_len, config.data.batch_size, n, seed=1)
  step = programs_lib.make_train_step(graphdef, tx, mesh, sync=False, config=config)
  return n, mesh, tx, graphdef, params, opt_state, data, batches, step


def test_window_end_scores_the_running_mean_of_the_tail():
  """The tail update keeps the mean of each replica's iterates over the window's tail (numpy oracle), and
  the window end then scores that mean: the same losses as a window end handed the mean as its parameters."""
  config = _tail_config()
  n, mesh, tx, graphdef, params, opt_state, data, batches, step = _window_setup(config)
  update = programs_lib.make_tail_update()
  tail, seen = jax.tree.map(lambda x: x.copy(), params), []
  for t in range(8):  # the window's steps 4-7 are its tail
    params, opt_state, _ = step(params, opt_state, mesh_lib.put_stacked(batches.batch(t), mesh))
    if optimizer_lib.tail_weight(config, t) > 0:
      tail = update(tail, params, np.float32(optimizer_lib.tail_weight(config, t)))
      seen.append(jax.tree.map(np.asarray, params))
  assert len(seen) == 4
  want = jax.tree.map(lambda *xs: np.mean(np.stack(xs).astype(np.float64), 0), *seen)
  chex.assert_trees_all_close(jax.tree.map(np.asarray, tail), want, rtol=2e-6, atol=1e-7)
  assert not np.allclose(np.asarray(jax.tree.leaves(tail)[0]), jax.tree.leaves(seen[-1])[0])  # not the last iterate

  windows = ip.probe_windows(data, config.data.seq_len, config.hdet.probe_windows, config.seed, 0)
  common = mesh_lib.put_stacked(np.broadcast_to(windows, (n,) + windows.shape), mesh, batch_dim=1)
  end = programs_lib.make_window_end(tx, mesh, graphdef=graphdef, config=config)
  copy = lambda tree: jax.tree.map(lambda x: x.copy(), tree)
  _, _, with_tail = end(copy(params), copy(opt_state), common, tail)
  _, _, at_tail = end(copy(tail), copy(opt_state), common)
  _, _, at_last = end(params, opt_state, common)
  np.testing.assert_array_equal(np.asarray(with_tail['window_losses']), np.asarray(at_tail['window_losses']))
  assert np.ptp(np.asarray(with_tail['window_losses'])[0]) > 0  # the replicas' tails differ
  assert not np.array_equal(np.asarray(with_tail['window_losses']), np.asarray(at_last['window_losses']))


def test_window_end_scores_each_replica_after_an_annealed_continuation():
  """hdet.score_anneal=0.5 at T=8: each replica's copy takes k=4 more SGD steps on the next batches at its LR times
  1, 3/4, 1/2, 1/4, on the all-reduced gradient, and that copy is scored. Oracle: the momentum SGD written out in
  float64 (gradients from jax.grad of the task's loss), from the state the window's 8 steps left."""
  config = _tail_config(**{'hdet.score_tail': 0.0, 'hdet.score_anneal': 0.5, 'hdet.param_groups': False,
                           'optim.name': 'sgd', 'optim.max_lr': 0.3})
  assert optimizer_lib.anneal_steps(config) == 4
  k = 4
  n, mesh, tx, graphdef, params, opt_state, data, batches, step = _window_setup(config)
  for t in range(8):
    params, opt_state, _ = step(params, opt_state, mesh_lib.put_stacked(batches.batch(t), mesh))
  windows = ip.probe_windows(data, config.data.seq_len, config.hdet.probe_windows, config.seed, 0)
  common = mesh_lib.put_stacked(np.broadcast_to(windows, (n,) + windows.shape), mesh, batch_dim=1)
  ahead = batches.chunk(8, k)  # [N, k, B, L+1]
  state = jax.vmap(lambda p, s: programs_lib.unpack(tx, p, s))(params, opt_state)
  lrs = np.asarray(state.values)[0, 0].astype(np.float64)  # [N]: each replica's LR for the coming step
  assert np.ptp(lrs) > 0
  momentum = [np.asarray(x, np.float64)[0] for x in jax.tree.leaves(state.inner_state[0].trace)]
  ps = [[np.asarray(x, np.float64)[r] for x in jax.tree.leaves(params)] for r in range(n)]
  tree = jax.tree.structure(params)
  task = programs_lib.tasks_lib.get(config)
  grad = jax.jit(jax.grad(lambda p, b: task.losses(graphdef, p, b)[0]))
  for j in range(k):
    g = [jax.tree.leaves(grad(jax.tree.unflatten(tree, [np.float32(x) for x in ps[r]]), ahead[r, j])) for r in range(n)]
    gbar = [np.mean([np.asarray(g[r][i], np.float64) for r in range(n)], 0) for i in range(len(momentum))]
    momentum = [gb + config.optim.b1 * m for gb, m in zip(gbar, momentum)]
    ps = [[x - lrs[r] * (1 - j / k) * m for x, m in zip(ps[r], momentum)] for r in range(n)]
  want = [float(task.loss(graphdef, jax.tree.unflatten(tree, [np.float32(x) for x in ps[r]]), windows)) for r in range(n)]
  end = programs_lib.make_window_end(tx, mesh, graphdef=graphdef, config=config)
  copy = lambda tree: jax.tree.map(lambda x: x.copy(), tree)
  _, _, annealed = end(copy(params), copy(opt_state), common, mesh_lib.put_stacked(ahead, mesh, batch_dim=2))
  got = np.asarray(annealed['window_losses'])[0]
  np.testing.assert_allclose(got, want, rtol=2e-5)
  # (each replica's slice read on the host: slicing the sharded arrays eagerly would queue one multi-device program per
  # leaf and replica, the pattern behind XLA:CPU's in-process all-reduce deadlock; README, "Known XLA:CPU limit")
  host = jax.device_get(params)
  at_last = [float(task.loss(graphdef, jax.tree.map(lambda x: x[r], host), windows)) for r in range(n)]
  assert np.min(np.abs(got - np.asarray(at_last))) > 3e-4  # the anneal moved every score (beyond the tolerance)


def _device_bytes(tree, device):
  return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards if s.device == device)


def test_the_rollback_anchor_is_one_copy_per_device_in_the_groups_layout():
  """make_anchor keeps one copy of the state every replica holds (each device takes its first replica's): 8
  replicas on 1 or 2 devices hold 1/8 or 1/4 of the stacked parameters and wrapped optimizer state in it; on a
  4 x 2 FSDP mesh each leaf keeps its group's split (the stacked spec without the replica axis), and a device
  holds half a copy. Its values are the replicas' (all alike at the start), bit for bit."""
  config = config_lib.load_config_file(TINY)
  n = 8
  for devices, fsdp in ((1, 1), (2, 1), (None, 2)):
    mesh = mesh_lib.make_mesh(n if fsdp == 1 else 4, fsdp=fsdp, devices=devices)
    reps = n if fsdp == 1 else 4
    tx = optimizer_lib.make_optimizer(config, reps, devices)
    params, opt_state = programs_lib.make_init(config, tx, mesh, reps)(jax.random.key(0))
    if fsdp > 1:
      layout = mesh_lib.layout(mesh, params, opt_state)
      params, inner = jax.device_put(params, layout[0]), jax.device_put(opt_state.inner_state, layout[1].inner_state)
      opt_state = opt_state._replace(inner_state=inner)
    stacked = {'params': params, 'inner': opt_state.inner_state}
    anchor = programs_lib.make_anchor(mesh, tx, mesh_lib.anchor_layout(mesh, params, opt_state.inner_state))(
        params, opt_state)
    c = programs_lib.unpack(tx, *jax.tree.map(lambda a: a[0], (params, opt_state))).controller
    assert np.isnan(anchor.pop('train_loss')) and np.isnan(anchor.pop('train_loss_se'))  # no window yet
    assert np.isnan(c.train_loss)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, anchor), jax.tree.map(lambda a: np.asarray(a)[0], stacked))
    dev = mesh.devices.flat[0]
    copies = _device_bytes(anchor, dev) / _device_bytes(stacked, dev)
    assert copies == (1 / 8 if devices == 1 else 1 / 4 if devices == 2 else 1.0), (devices, fsdp, copies)
    if fsdp > 1:  # each leaf split in its group as the stacked one is: half a copy per device
      from jax.sharding import NamedSharding, PartitionSpec as P
      same = jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(NamedSharding(mesh, P(*s.sharding.spec[1:])), a.ndim),
                          anchor, stacked)
      assert all(jax.tree.leaves(same))
      assert any('fsdp' in a.sharding.spec for a in jax.tree.leaves(anchor))


def test_log_noise_scale_logs_the_replicas_and_the_all_reduced_squared_norms():
  """With ``log_noise_scale`` a step also returns the replicas' mean |g_r|^2 and the all-reduced gradient's |g|^2:
  against each replica's gradient computed apart (plain jax.grad on its own batch and parameters, the replicas
  fanned out by two steps), and the run trains bit for bit as without the logging."""
  from hdet_jax.trainer import tasks as tasks_lib
  n = 8
  out = {}
  for flag in (False, True):
    config = config_lib.with_overrides(config_lib.load_config_file(TINY), {'log_noise_scale': flag,
                                                                           'hdet.param_groups': False})
    mesh, tx, graphdef, params, opt_state, batches = _tiny_start(config, n)
    step = programs_lib.make_train_step(graphdef, tx, mesh, sync=False, config=config)
    for t in range(3):
      if t == 2:
        before = jax.tree.map(np.asarray, params)
      params, opt_state, m = step(params, opt_state, mesh_lib.put_stacked(batches.batch(t), mesh))
    out[flag] = (jax.tree.map(np.asarray, params), m, opt_state)
  chex.assert_trees_all_equal(out[True][0], out[False][0])
  assert 'grad_sq' not in out[False][1]

  task = tasks_lib.get(config)
  data = batches.batch(2)
  grads = [jax.grad(lambda p, r=r: task.losses(graphdef, p, data[r])[0])(jax.tree.map(lambda x, r=r: x[r], before))
           for r in range(n)]
  flat = np.stack([np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(g)]) for g in grads])
  assert np.ptp(_tree_rows_norm(before)) > 0  # the replicas were apart
  m = out[True][1]
  np.testing.assert_allclose(np.asarray(m['grad_sq']), np.full(n, (flat ** 2).sum(1).mean()), rtol=1e-4)
  np.testing.assert_allclose(np.asarray(m['mean_grad_sq']), np.full(n, (flat.mean(0) ** 2).sum()), rtol=1e-4)
  assert (flat ** 2).sum(1).mean() > 1.05 * (flat.mean(0) ** 2).sum()  # the two differ (the batch noise)
  # Preconditioned as Adam's update divides them: by sqrt(nu / (1 - b2^t)) + 1e-8, nu the second moment after this step.
  import optax
  row = lambda tree: jax.tree.map(lambda x: np.asarray(x)[0], tree)
  state = programs_lib.unpack(tx, row(out[True][0]), row(out[True][2]))
  (_, adam), = optax.tree_utils.tree_get_all_with_path(state, 'ScaleByAdamState')
  assert int(adam.count) == 3
  correction = 1 - config.optim.b2 ** 3  # (bias-corrected, as the update uses it)
  scale = np.concatenate([np.ravel(1.0 / (np.sqrt(np.asarray(v, np.float64) / correction) + 1e-8))
                          for v in jax.tree.leaves(adam.nu)])
  pre = flat * scale
  np.testing.assert_allclose(np.asarray(m['pre_grad_sq']), np.full(n, (pre ** 2).sum(1).mean()), rtol=1e-3)
  np.testing.assert_allclose(np.asarray(m['pre_mean_grad_sq']), np.full(n, (pre.mean(0) ** 2).sum()), rtol=1e-3)


def test_noise_sums_are_the_same_over_one_vector_and_leaf_by_leaf():
  """_noise_sums' two layouts (one vector where leaves are whole, per leaf on grouped meshes) against numpy."""
  import optax
  rng = np.random.default_rng(0)
  params = {'a': np.zeros((3, 4), np.float32), 'b': np.zeros((5,), np.float32)}
  tx = optax.adam(0.1, b2=0.9)
  state = tx.init(params)
  local = {k: rng.normal(size=(4,) + v.shape).astype(np.float32) for k, v in params.items()}  # 4 replicas
  shared = jax.tree.map(lambda x: x.mean(0), local)
  _, state = tx.update(shared, state, params)
  state = tx.update(shared, state, params)[1]  # count 2
  got = {}
  for flat in (True, False):
    f = jax.vmap(lambda g, flat=flat: programs_lib._noise_sums(g, shared, state, 'r', 0.9, flat), axis_name='r')
    got[flat] = jax.tree.map(lambda x: np.asarray(x)[0], f(local))  # pylint: disable=protected-access
  vec = lambda tree: np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])
  g_r = np.stack([vec(jax.tree.map(lambda x, r=r: x[r], local)) for r in range(4)])
  g_b = vec(shared)
  (_, adam), = optax.tree_utils.tree_get_all_with_path(state, 'ScaleByAdamState')
  w = 1.0 / (np.sqrt(vec(adam.nu) / (1 - 0.9 ** 2)) + 1e-8)
  want = {'grad_sq': (g_r ** 2).sum(1).mean(), 'mean_grad_sq': (g_b ** 2).sum(),
          'pre_grad_sq': ((g_r * w) ** 2).sum(1).mean(), 'pre_mean_grad_sq': ((g_b * w) ** 2).sum()}
  for flat in (True, False):
    assert set(got[flat]) == set(want)
    for k, v in want.items():
      np.testing.assert_allclose(got[flat][k], v, rtol=1e-5, err_msg=f'{k}, flat={flat}')
