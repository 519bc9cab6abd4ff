"""Replica groups on 2-D meshes ('replica', 'fsdp'): HDET across groups, FSDP inside each.

A small MLP regression through the core alone (shard_map_replicas, group_shardings, hdet), on the
8 simulated devices. Expectations come from outside the 2-D path: the 1-D path (bit for bit at
group size 1; to float rounding when one 1-D replica sees a whole group's batch), numpy, and the
multipliers' closed form.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import hdet_jax as H

AX, INNER = 'replica', 'fsdp'
B, D_IN, D_H, D_OUT = 8, 16, 8, 4  # per-group batch; every dim divisible by 2 and 4


def mesh2d(groups, size):
  return Mesh(np.asarray(jax.devices()[: groups * size]).reshape(groups, size), (AX, INNER))


def mesh1d(groups):
  return Mesh(np.asarray(jax.devices()[:groups]), (AX,))


# Inputs come from numpy: eager jax.random calls compile one by one and cost seconds per test.
def init_params():
  rng = np.random.default_rng(1)
  return {
    'w1': np.float32(0.3) * rng.standard_normal((D_IN, D_H), np.float32),
    'b1': np.zeros(D_H, np.float32),
    'w2': np.float32(0.3) * rng.standard_normal((D_H, D_OUT), np.float32),
    'b2': np.zeros(D_OUT, np.float32),
    's': np.ones([], np.float32),
  }


def loss_fn(p, x, y):
  pred = jnp.tanh(x @ p['w1'] + p['b1']) @ p['w2'] + p['b2'] * p['s']
  return jnp.mean((pred - y) ** 2)


def batches(groups, steps, seed=0):
  """[steps] of (x [R, B, D_IN], y [R, B, D_OUT]): each group's own batch at each step."""
  rng = np.random.default_rng(seed)
  return [
    (rng.standard_normal((groups, B, D_IN), np.float32), rng.standard_normal((groups, B, D_OUT), np.float32))
    for _ in range(steps)
  ]


group_loss = jax.jit(loss_fn)  # the numbers the tests expect, computed outside the mesh
group_grad = jax.jit(jax.grad(loss_fn))


def make_tx(groups, sync_every=2, optimizer=optax.adam, **kw):
  kw.setdefault('auto_lr', H.AutoLR.paper(total_steps=100, warmup_steps=0, temperature=0.05))
  return H.hdet(
    optimizer, 1e-2, num_replicas=groups, spread=0.5, sync_every=sync_every, replica_axis=AX, exact_sync=True, **kw
  )


def setup(tx, mesh, shared=True, sync=None, loss_fn=loss_fn, params=None, rules=()):
  """(params, opt_state, jitted step, data sharding) laid out by group_shardings on ``mesh``
  (``rules``: tensor-parallel rules for a ``'tensor'`` axis)."""
  groups = mesh.shape[AX]
  params = H.stack_replicas(init_params() if params is None else params, groups)
  state = jax.jit(jax.vmap(tx.init))(params)
  psh = H.stacked_shardings(params, AX, mesh=mesh, tensor_rules=rules)
  ssh = H.stacked_shardings(state, AX, mesh=mesh, tensor_rules=rules)

  def step(p, s, batch):
    loss, g = jax.value_and_grad(loss_fn)(p, *batch)  # a group's mean: XLA reduces over 'fsdp'
    if shared:
      g = lax.pmean(g, AX)  # across groups; the low-communication mode skips it
    u, s = tx.update(g, s, p, value=loss, sync=sync)
    return H.apply_updates(p, u, s, replica_axis=AX, sync=sync), s, loss

  f = jax.jit(
    H.shard_map_replicas(step, mesh, AX), donate_argnums=(0, 1), out_shardings=(psh, ssh, NamedSharding(mesh, P(AX)))
  )
  data_sh = NamedSharding(mesh, P(AX, INNER) if INNER in mesh.shape else P(AX))
  return jax.device_put(params, psh), jax.device_put(state, ssh), f, data_sh


def train(tx, mesh, data, shared=True, check=None, **kw):
  params, state, f, data_sh = setup(tx, mesh, shared, **kw)
  losses = []
  for i, batch in enumerate(data):
    before = jax.tree.map(np.asarray, params)
    params, state, loss = f(params, state, jax.device_put(batch, data_sh))
    losses.append(np.asarray(loss))
    if check:
      check(i, before, params, state)
  return params, state, np.stack(losses)


def assert_trees_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_group_size_one_equals_the_1d_path_bit_for_bit():
  tx, data = make_tx(8), batches(8, 4)  # syncs after steps 1 and 3
  out2d = train(tx, mesh2d(8, 1), data)
  out1d = train(tx, mesh1d(8), data)
  assert_trees_equal(out2d, out1d)


@pytest.mark.parametrize('groups,size', [(4, 2), (2, 4)])
def test_layout_keeps_shardings_and_bytes_and_equals_1d_on_group_batches(groups, size):
  """Every step, sync or not: each leaf keeps its group sharding and per-device bytes; the
  numbers equal a 1-D run whose replica r sees group r's whole batch."""
  # No controller: its wiring on 2-D meshes is the next tests'; this one is about layout and numbers.
  mesh, tx, data = mesh2d(groups, size), make_tx(groups, auto_lr=None), batches(groups, 4)
  params0 = H.stack_replicas(init_params(), groups)
  state0 = jax.eval_shape(jax.vmap(tx.init), params0)
  want = {'params': H.stacked_shardings(params0, AX, mesh=mesh), 'state': H.stacked_shardings(state0, AX, mesh=mesh)}

  # Independent expectation of per-device bytes: one replica's copy, split over the group
  # when some dim after the leading one divides by the group size, for the parameters and
  # the optimizer's moments; HDET's own fields whole.
  def per_device(x, split):
    one = x.size // groups * x.dtype.itemsize
    return one // size if split and any(d % size == 0 for d in x.shape[1:]) else one

  def check(i, before, params, state):
    trees = (('params', params, params), ('state', state, state._replace(inner_state=None)))
    for name, tree, whole in trees:
      whole_ids = {id(x) for x in jax.tree.leaves(whole)} if name == 'state' else set()
      for leaf, sh in zip(jax.tree.leaves(tree), jax.tree.leaves(want[name])):
        assert leaf.sharding.is_equivalent_to(sh, leaf.ndim), (name, i, leaf.sharding, sh)
        nbytes = per_device(leaf, id(leaf) not in whole_ids)
        assert {s.data.nbytes for s in leaf.addressable_shards} == {nbytes}, (name, i)

  # w1 [R, 16, 8] splits its longer dim; w2 [R, 8, 4] its first; the scalar stays whole.
  assert (want['params']['w1'].spec, want['params']['w2'].spec, want['params']['s'].spec) == (
    P(AX, INNER),
    P(AX, INNER),
    P(AX),
  )
  params, state, losses = train(tx, mesh, data, check=check)
  ref_params, ref_state, ref_losses = train(tx, mesh1d(groups), data)
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6, atol=1e-7)
  for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((ref_params, ref_state))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-7)


# Megatron-style MLP: w1 column-parallel (its hidden outputs split), w2 row-parallel (its hidden inputs).
MLP_RULES = ((r'w1$', -1), (r'b1$', -1), (r'w2$', 0))


@pytest.mark.parametrize('groups,fsdp,tensor', [(4, 1, 2), (2, 2, 2)])
def test_tensor_parallel_groups_keep_their_layout_and_equal_1d(groups, fsdp, tensor):
  """Tensor parallelism inside a group (with FSDP beside it on 2x2x2): the rules split w1's and b1's
  hidden dim and w2's over 'tensor', FSDP takes the largest other dim; every step keeps those shardings
  and the per-device bytes; the numbers equal a 1-D run whose replica r sees group r's whole batch."""
  axes = (AX,) + ((INNER,) if fsdp > 1 else ()) + ('tensor',)
  shape = (groups,) + ((fsdp,) if fsdp > 1 else ()) + (tensor,)
  mesh = Mesh(np.asarray(jax.devices()[: groups * fsdp * tensor]).reshape(shape), axes)
  tx, data = make_tx(groups, auto_lr=None), batches(groups, 4)  # syncs after steps 1 and 3
  params0 = H.stack_replicas(init_params(), groups)
  want = H.stacked_shardings(params0, AX, mesh=mesh, tensor_rules=MLP_RULES)
  f = INNER if fsdp > 1 else None
  # w1 [R, 16, 8]: hidden (8) over 'tensor', the input dim (16) over 'fsdp'; w2 [R, 8, 4]: hidden
  # over 'tensor', its output (4) over 'fsdp'; b1 [R, 8] over 'tensor'; b2 [R, 4] over 'fsdp'.
  assert {k: want[k].spec for k in ('w1', 'b1', 'w2', 'b2', 's')} == {
    'w1': P(AX, f, 'tensor'),
    'b1': P(AX, 'tensor'),
    'w2': P(AX, 'tensor', f) if f else P(AX, 'tensor'),
    'b2': P(AX, f) if f else P(AX),
    's': P(AX),
  }
  split = {'w1': fsdp * tensor, 'b1': tensor, 'w2': fsdp * tensor, 'b2': fsdp, 's': 1}

  def check(i, before, params, state):
    for k, leaf in params.items():
      assert leaf.sharding.is_equivalent_to(want[k], leaf.ndim), (k, i, leaf.sharding)
      assert {s.data.nbytes for s in leaf.addressable_shards} == {leaf.nbytes // groups // split[k]}, (k, i)
    mu = state.inner_state[0].mu  # Adam's moments follow their parameters' rules
    assert mu['w1'].sharding.is_equivalent_to(want['w1'], 3) and mu['w2'].sharding.is_equivalent_to(want['w2'], 3)

  params, state, losses = train(tx, mesh, data, check=check, rules=MLP_RULES)
  ref_params, ref_state, ref_losses = train(tx, mesh1d(groups), data)
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6, atol=1e-7)
  for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((ref_params, ref_state))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-7)


def test_tensor_rule_that_does_not_divide_is_one_clear_error():
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), (AX, 'tensor'))
  params = H.stack_replicas(init_params(), 2)
  # A rule on w2's last dim (4 outputs over 4 devices) splits w2 alone.
  got = H.stacked_shardings(params, AX, mesh=mesh, tensor_rules=((r'w2$', -1),))
  assert (got['w2'].spec, got['b1'].spec) == (P(AX, None, 'tensor'), P(AX))
  # FSDP rules pick FSDP's dimension (default: the largest), or keep a leaf whole (None).
  mesh3 = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2), (AX, INNER, 'tensor'))
  got = H.stacked_shardings(params, AX, mesh=mesh3, tensor_rules=MLP_RULES, fsdp_rules=((r'w2$', None), (r'w1$', 1)))
  assert (got['w1'].spec, got['w2'].spec, got['b2'].spec) == (P(AX, None, 'tensor'), P(AX, 'tensor'), P(AX, INNER))
  got = H.stacked_shardings(params, AX, mesh=mesh3, fsdp_rules=((r'w1$', 1),))
  assert (got['w1'].spec, got['w2'].spec) == (P(AX, None, INNER), P(AX, INNER))
  with pytest.raises(
    ValueError,
    match=r"rule \('b\$', 0\) matches 'b' of shape \(6,\), whose dimension 0 is not "
    r'split evenly by the tensor axis of size 4',
  ):
    H.stacked_shardings({'b': jnp.zeros((2, 6))}, AX, mesh=mesh, tensor_rules=((r'b$', 0),))


@pytest.mark.parametrize('groups,size', [(4, 2), (2, 4)])
def test_lrs_identical_in_a_group_follow_the_multipliers_across_groups(groups, size):
  """SGD on the shared gradient: every device's parameter step is -lr_r * g, with g the numpy
  gradient of the mean loss over all groups' batches and lr_r = base * rho[perm[r]] (eq. 1)."""
  mesh, data = mesh2d(groups, size), batches(groups, 3)
  tx = make_tx(groups, sync_every=100, optimizer=optax.sgd, auto_lr=None)
  rho = 1 + 0.5 * (np.arange(groups) - (groups - 1) / 2) / max((groups - 1) / 2, 0.5)

  def check(i, before, params, state):
    x, y = data[i]
    g = np.mean(
      [group_grad(jax.tree.map(lambda a: a[r], before), x[r], y[r])['w1'] for r in range(groups)], axis=0
    )  # the gradient all groups share
    perm = np.asarray(state.controller.perm)[0, 0]
    for r in range(groups):
      # p' - p in float32 carries one rounding of p (|p| < 1): atol 1e-7.
      np.testing.assert_allclose(
        np.asarray(params['w1'][r]) - before['w1'][r], -1e-2 * rho[perm[r]] * g, rtol=1e-4, atol=1e-7
      )
    # The learning rates each device holds: one row per group, the same on its devices.
    for s in state.values.addressable_shards:
      r = s.index[0].start
      np.testing.assert_allclose(np.asarray(s.data)[0, 0], 1e-2 * rho[perm], rtol=1e-6)
      assert r < groups

  train(tx, mesh, data, check=check)


@pytest.mark.parametrize('groups,size', [(4, 2), (2, 4)])
def test_controller_sees_one_loss_per_group_the_groups_mean(groups, size):
  mesh, data = mesh2d(groups, size), batches(groups, 2)
  tx = make_tx(groups, sync_every=2)
  seen = []

  def check(i, before, params, state):
    x, y = data[i]
    seen.append([float(group_loss(jax.tree.map(lambda a: a[r], before), x[r], y[r])) for r in range(groups)])

  _, state, losses = train(tx, mesh, data, check=check)
  np.testing.assert_allclose(losses, np.asarray(seen), rtol=2e-6)  # each group's mean over its batch
  window = np.asarray(state.controller.window_losses)  # [R (stacked), R]: what the controller read
  assert window.shape == (groups, groups)
  np.testing.assert_allclose(window, np.broadcast_to(np.mean(seen, axis=0), window.shape), rtol=2e-6)


def test_replica_axis_bytes_per_mode_from_the_hlo():
  """Shared gradient: each non-sync step all-reduces the gradient (params' bytes per group
  device) across groups. Low-communication: nothing crosses the groups between syncs."""
  from benchmarks import comm  # (the checkout's benchmarks/: .ci/newest_jax runs this file on the installed core)

  mesh = mesh2d(4, 2)
  tx = make_tx(4, sync_every=1000, auto_lr=None)
  per_device_params = sum(np.prod(x.shape) * 4 for x in jax.tree.leaves(init_params())) / 2
  for shared, low, high in ((True, 0.9 * per_device_params, 1.5 * per_device_params), (False, 0, 0)):
    params, state, f, data_sh = setup(tx, mesh, shared, sync=False)
    text = f.lower(params, state, jax.device_put(batches(4, 1)[0], data_sh)).compile().as_text()
    got = comm.replica_axis_bytes(text, tuple(mesh.devices.shape))
    assert low <= got <= high, (shared, got, per_device_params)
  # The end of a window alone (what a sync adds to a step): the average is its only traffic across
  # groups, on each device's shard; nothing is gathered inside a group for it (no all-gather, no
  # all-to-all; the step's forward pass gathers for FSDP's sake, not HDET's).
  params, state, _, _ = setup(tx, mesh, False)

  def window_end(p, s):
    u, s = tx.update(None, s, p, sync=True)
    return H.apply_updates(p, u, s, replica_axis=AX, sync=True), s

  shardings = jax.tree.map(lambda x: x.sharding, (params, state))
  end = jax.jit(H.shard_map_replicas(window_end, mesh, AX), out_shardings=shardings)
  found = comm.collectives(end.lower(params, state).compile().as_text(), tuple(mesh.devices.shape))
  across = sum(c.operand_bytes for c in found if c.crosses_replicas)
  assert 0.9 * per_device_params <= across <= 1.5 * per_device_params, across
  assert not [c for c in found if c.op in ('all-gather', 'all-to-all') and not c.crosses_replicas]


def quad_loss(p, target):
  return 0.5 * jnp.sum((p['w'] - target) ** 2)  # curvature 1: SGD's best step is LR 1


@pytest.mark.parametrize('start_lr,average_opt_state', [(0.15, False), (1.6, True)])
def test_low_communication_controller_moves_towards_the_better_lr(start_lr, average_opt_state):
  """Each group steps on its own noisy gradient (no all-reduce between syncs). On a bowl of
  curvature 1 the window loss is lowest near LR 1: from below the base must rise, from above
  fall. With average_opt_state the momentum after a sync is the groups' numpy mean."""
  groups, steps, T, beta = 4, 30, 5, 0.5
  rng = np.random.default_rng(0)
  data = [(jnp.asarray(3.0 + 0.1 * rng.standard_normal((groups, 8)), jnp.float32),) for _ in range(steps)]
  tx = H.hdet(
    optax.sgd,
    start_lr,
    num_replicas=groups,
    spread=0.5,
    sync_every=T,
    replica_axis=AX,
    exact_sync=True,
    momentum=beta,
    average_opt_state=average_opt_state,
    auto_lr=H.AutoLR.paper(total_steps=steps, temperature=0.1, min_value=0.01),
  )
  synced = []

  def check(i, before, params, state):
    if (i + 1) % T:
      return
    trace = np.asarray(state.inner_state[0].trace['w'])  # [R, 8] after the sync
    if average_opt_state:  # g_r + beta * trace_r before the step, averaged
      g = before['w'] - np.asarray(data[i][0])
      np.testing.assert_allclose(trace, np.broadcast_to(np.mean(g + beta * before_trace[0], 0), trace.shape), rtol=1e-5)
    synced.append(float(state.base_learning_rate[0]))

  before_trace = [None]

  def track(i, before, params, state):
    check(i, before, params, state)
    before_trace[0] = np.asarray(state.inner_state[0].trace['w'])

  train(tx, mesh2d(groups, 2), data, shared=False, check=track, loss_fn=quad_loss, params={'w': jnp.zeros(8)})
  moves = np.diff([start_lr] + synced)
  # At every sync but the last: the last falls on the run's last step, where nothing moves (the controller holds).
  assert (np.sign(moves[:-1]) == (1 if start_lr < 1 else -1)).all(), synced
  assert moves[-1] == 0.0, synced


def test_bad_2d_arguments_are_one_clear_error():
  with pytest.raises(ValueError, match='average_opt_state must be True or False'):
    make_tx(4, average_opt_state='yes')
  with pytest.raises(ValueError, match="no axis 'replica'.*pass replica_axis="):
    H.stacked_shardings({'w': jnp.zeros((4, 2))}, AX, mesh=Mesh(np.asarray(jax.devices()), ('data',)))
