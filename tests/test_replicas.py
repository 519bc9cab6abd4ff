"""Replica-axis helpers (hdet_jax.replicas): stacking and averaging, the finite mean."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hdet_jax as H

from jax.sharding import PartitionSpec as P
from replica_testing import AX, N, make_mesh


@pytest.fixture(scope='module')
def mesh():
  return make_mesh()


def test_average_replicas_is_the_mean_and_exact_on_agreeing_replicas():
  x = jax.random.normal(jax.random.key(0), (N, 1000)) * 3 + 1
  np.testing.assert_allclose(
    np.asarray(H.average_replicas({'a': x})['a']), np.asarray(x, np.float64).mean(0), rtol=1e-6, atol=1e-6
  )
  same = jnp.broadcast_to(x[3], x.shape)
  np.testing.assert_array_equal(np.asarray(H.average_replicas(same)), np.asarray(x[3]))


def test_finite_mean_equals_pmean_when_all_finite(mesh):
  x = jax.random.normal(jax.random.key(0), (N, 33))
  f = lambda fn: jax.jit(jax.shard_map(lambda a: fn(a), mesh=mesh, in_specs=P(AX), out_specs=P(AX)))
  a = f(lambda a: H.pmean_finite(a, AX))(x)
  b = f(lambda a: lax.pmean(a, AX))(x)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize('devices', [1, 2, 4])
def test_collectives_over_a_device_axis_and_a_vmap_axis_are_the_replica_axis(devices):
  """8 replicas on ``devices`` devices (shard_map x vmap, replica axis ('data', 'local')): each replica's index,
  the mean, the sum and the gather equal numpy's over the 8 rows, in replica order r = d * (8 / D) + v."""
  from jax.sharding import Mesh, NamedSharding

  mesh = Mesh(np.asarray(jax.devices()[:devices]), (AX,))
  k = N // devices
  axis = (AX, 'local') if k > 1 else AX  # the map's replica axis: the device axis, paired with its local vmap axis
  x = np.asarray(jax.random.normal(jax.random.key(1), (N, 6)), np.float32)

  def per_replica(a):
    return {
      'index': H.axes.axis_index(axis),
      'size': jnp.asarray(H.axes.axis_size(axis)),
      'mean': H.axes.pmean(a, axis),
      'sum': H.axes.psum(a, axis),
      'gather': H.axes.all_gather(a[0], axis),
    }

  out = jax.jit(H.shard_map_replicas(per_replica, mesh, AX, per_device=k))(
    jax.device_put(x, NamedSharding(mesh, P(AX)))
  )
  out = jax.tree.map(np.asarray, out)
  assert out['index'].tolist() == list(range(N)) and out['size'].tolist() == [N] * N
  np.testing.assert_allclose(out['mean'], np.broadcast_to(x.astype(np.float64).mean(0), x.shape), rtol=2e-6, atol=1e-7)
  np.testing.assert_allclose(out['sum'], np.broadcast_to(x.astype(np.float64).sum(0), x.shape), rtol=2e-6, atol=1e-6)
  np.testing.assert_array_equal(out['gather'], np.broadcast_to(x[:, 0], (N, N)))  # exact: no arithmetic
  # Every replica holds the same mean, bit for bit (one sum, broadcast).
  assert np.all(out['mean'] == out['mean'][0])


def test_shard_map_replicas_refuses_a_bad_per_device():
  with pytest.raises(ValueError, match='per_device must be a positive integer, got 0'):
    H.shard_map_replicas(lambda a: a, make_mesh(), AX, per_device=0)


def test_packed_state_round_trips_bit_for_bit_and_is_one_vector():
  """pack_state / unpack_state on a real HDETState (NaN payloads, negative zeros, bools, the uint32 key)."""
  import optax

  tx = H.hdet(
    optax.adam,
    1e-3,
    num_replicas=N,
    sync_every=4,
    replica_axis=AX,
    auto_lr=H.AutoLR.paper(total_steps=100, warmup_steps=0),
  )
  params = {'w': jnp.ones((3, 2)), 'b': jnp.zeros((2,))}
  # (init, pack and unpack jitted: run op by op they compile each of their many small operations on its own; the
  # docstring examples of hdet_jax.packing run them so)
  state = jax.jit(tx.init)(params)
  state = state._replace(
    loss_sum=jnp.float32(-0.0),
    replica_ok=jnp.zeros([], bool),
    synced=jnp.ones([], bool),
    base=jnp.full_like(state.base, jnp.nan),
    count=jnp.int32(-7),
  )
  packed = jax.jit(H.packing.pack_state)(state)
  small_leaves = jax.tree.leaves(state._replace(inner_state=None))
  assert packed.small.dtype == jnp.uint32 and packed.small.shape == (sum(x.size for x in small_leaves),)
  like = jax.eval_shape(tx.init, params)
  back = jax.jit(lambda p: H.packing.unpack_state(p, like))(packed)
  assert jax.tree.structure(back) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(
      np.atleast_1d(np.asarray(a)).view(np.uint8), np.atleast_1d(np.asarray(b)).view(np.uint8)
    )
  with pytest.raises(ValueError, match='packed from another hdet'):
    H.packing.unpack_state(packed._replace(small=packed.small[1:]), like)


def test_packed_hdet_is_hdet_bit_for_bit_under_vmap():
  """packed(hdet(...)) steps exactly as hdet(...) over syncs (the controller moving), under vmap over 8 replicas."""
  import optax

  def make():
    return H.hdet(
      optax.adam,
      1e-2,
      num_replicas=N,
      sync_every=2,
      replica_axis=AX,
      auto_lr=H.AutoLR.paper(total_steps=100, warmup_steps=0),
    )

  plain_tx, packed_tx = make(), H.packed(make())
  params = {'w': jnp.asarray(np.random.default_rng(0).normal(size=(N, 4)), jnp.float32)}
  targets = jnp.asarray(np.random.default_rng(1).normal(size=(6, N, 4)), jnp.float32)

  def stepper(tx):
    def step(p, s, c):
      loss, g = jax.value_and_grad(lambda p: 0.5 * jnp.sum((p['w'] - c) ** 2))(p)
      u, s = tx.update(lax.pmean(g, AX), s, p, value=loss)
      return optax.apply_updates(p, u), s

    return jax.vmap(step, axis_name=AX)

  # Both runs' steps in one compiled program (run op by op, the update compiles each of its many small operations
  # on its own; and one program compiles the kernels the two share once).
  plain, packed = stepper(plain_tx), stepper(packed_tx)
  both = jax.jit(lambda runs, c: (plain(*runs[0], c), packed(*runs[1], c)))
  runs = jax.jit(lambda p: ((p, jax.vmap(plain_tx.init)(p)), (p, jax.vmap(packed_tx.init)(p))))(params)
  for t in range(6):
    runs = both(runs, targets[t])
  (p0, s0), (p1, s1) = runs
  like = jax.eval_shape(plain_tx.init, {'w': params['w'][0]})
  s1 = jax.jit(jax.vmap(lambda s: H.packing.unpack_state(s, like)))(s1)
  np.testing.assert_array_equal(np.asarray(p0['w']), np.asarray(p1['w']))
  for a, b in zip(jax.tree.leaves(s0), jax.tree.leaves(s1)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(s1.sync_count[0]) == 3 and float(jnp.abs(s1.controller.delta).max()) > 0  # the controller moved


def test_replica_picks_one_copy_of_a_stacked_tree():
  tree = {'w': np.arange(6, dtype=np.float32).reshape(2, 3), 'b': np.float32(7.0)}
  stacked = {'w': np.stack([tree['w'] + r for r in range(4)]), 'b': np.arange(4, dtype=np.float32)}
  got = H.replica(stacked, 2)
  np.testing.assert_array_equal(got['w'], tree['w'] + 2)
  assert got['w'].shape == (2, 3) and got['b'] == 2.0


def test_replica_sharding_puts_one_replica_on_each_device(mesh):
  sharding = H.shardings.replica_sharding(mesh, AX)
  assert sharding.spec == P(AX) and sharding.mesh is mesh
  assert sharding.shard_shape((N, 3, 5)) == (1, 3, 5)


def test_group_shardings_rule_keeping_a_leaf_whole_and_a_size_one_tensor_axis():
  """Shapes only. A tensor rule with dim None keeps the leaf whole over the tensor axis (FSDP still takes its largest
  dimension); on a mesh whose tensor axis has size 1 the rules are not applied at all, even one no size divides."""
  from jax.sharding import Mesh

  leaf = {'w': jax.ShapeDtypeStruct((2, 4, 6), jnp.float32)}  # [replicas, 4, 6]
  mesh3 = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2), (AX, 'fsdp', 'tensor'))
  assert H.stacked_shardings(leaf, AX, mesh=mesh3, tensor_rules=((r'w$', None),))['w'].spec == P(AX, None, 'fsdp')
  assert H.stacked_shardings(leaf, AX, mesh=mesh3, tensor_rules=((r'w$', 0),))['w'].spec == P(AX, 'tensor', 'fsdp')
  mesh1 = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4, 1), (AX, 'fsdp', 'tensor'))
  assert H.stacked_shardings(leaf, AX, mesh=mesh1, tensor_rules=((r'w$', 5),))['w'].spec == P(AX, 'fsdp')
  with pytest.raises(ValueError, match=r"tensor-parallel rule \('w\$', 5\) matches 'w'"):
    H.stacked_shardings(leaf, AX, mesh=mesh3, tensor_rules=((r'w$', 5),))


@pytest.mark.parametrize('dtype', [jnp.float16, jnp.bfloat16, jnp.int8, jnp.uint16])
def test_pack_state_refuses_a_leaf_without_an_exact_32_bit_word(dtype):
  """Shapes only (jax.eval_shape): a float16/bfloat16/int8/uint16 leaf raises naming its dtype; the state's own
  float32/int32/uint32/bool leaves pack into one uint32 vector of their total size."""
  import optax

  tx = H.hdet(optax.sgd, 1e-3, num_replicas=N, sync_every=4, replica_axis=AX)
  like = jax.eval_shape(tx.init, {'w': jnp.zeros(3)})
  packed = jax.eval_shape(H.packing.pack_state, like)
  assert packed.small.dtype == jnp.uint32
  assert packed.small.shape == (sum(int(np.prod(x.shape)) for x in jax.tree.leaves(like._replace(inner_state=None))),)
  odd = like._replace(loss_sum=jax.ShapeDtypeStruct((), dtype))
  with pytest.raises(ValueError, match=f'pack_state: a leaf of dtype {jnp.dtype(dtype).name} has no exact 32-bit'):
    jax.eval_shape(H.packing.pack_state, odd)


def test_packed_update_needs_params():
  import optax

  tx = H.packed(H.hdet(optax.sgd, 1e-3, num_replicas=N, sync_every=4, replica_axis=AX))
  p = {'w': jnp.zeros(3)}
  with pytest.raises(ValueError, match=r'packed\(hdet\): update\(\) needs params'):
    tx.update(p, None)
  # With params it traces to the packed state's shape (shapes only).
  state = jax.eval_shape(tx.init, p)
  sp, ss = H.stack_replicas(p, N), jax.eval_shape(lambda s: H.stack_replicas(s, N), state)
  updates, new = jax.eval_shape(jax.vmap(lambda g, s, q: tx.update(g, s, q, sync=False), axis_name=AX), sp, ss, sp)
  assert updates['w'].shape == (N, 3) and new.small.shape == (N,) + state.small.shape


def _step(state, batch, scale=2.0, *, train=True):
  """A per-replica step with a default, a keyword-only flag (a jit static argument) and a global batch."""
  out = state * scale + jnp.mean(batch) if train else state
  return out, jnp.sum(batch)


def test_the_wrappers_keep_the_signature_keyword_calls_donation_and_static_arguments(mesh):
  """inspect.signature names the step's parameters; keyword calls, an omitted default, donate_argnames and
  static_argnames work as on the step itself. Oracle: numpy, per replica (the batch split by rows)."""
  import inspect

  for wrapped in (H.shard_map_replicas(_step, mesh, AX, batch_argnames=('batch',)), H.over_replicas(_step, mesh, AX)):
    assert list(inspect.signature(wrapped).parameters) == ['state', 'batch', 'scale', 'train']
    step = jax.jit(wrapped, donate_argnames=('state',), static_argnames=('train',))
    state0 = np.arange(N, dtype=np.float32)
    batch = np.arange(4 * N, dtype=np.float32)  # replica r sees rows [4r, 4r + 4)
    rows = batch.reshape(N, 4)
    state = jax.device_put(state0, H.shardings.replica_sharding(mesh, AX))
    out, total = step(batch=batch, state=state)
    assert state.is_deleted()  # donated
    np.testing.assert_allclose(np.asarray(out), state0 * 2.0 + rows.mean(1))
    np.testing.assert_allclose(np.asarray(total), rows.sum(1))
    frozen, _ = step(jax.device_put(state0, H.shardings.replica_sharding(mesh, AX)), batch, 3.0, train=False)
    np.testing.assert_array_equal(np.asarray(frozen), state0)  # the static flag took the other branch


def test_batch_argnames_must_name_parameters_and_the_mesh_must_have_the_axis(mesh):
  with pytest.raises(ValueError, match=r"batch_argnames \('data',\) are not parameters of '_step'"):
    H.shard_map_replicas(_step, mesh, AX, batch_argnames=('data',))
  with pytest.raises(ValueError, match=r"the mesh has no axis 'replica'"):
    H.over_replicas(_step, mesh, 'replica')


def test_stacked_and_batch_shardings_add_the_replica_axis():
  from jax.sharding import Mesh, NamedSharding

  mesh2 = Mesh(np.array(jax.devices()).reshape(4, 2), ('replica', 'data'))
  tree = {'w': NamedSharding(mesh2, P(None, 'data')), 'b': NamedSharding(mesh2, P()), 'spec': P('data')}
  stacked = H.stacked_shardings(tree, 'replica')
  assert stacked['w'].spec == P('replica', None, 'data') and stacked['b'].spec == P('replica')
  assert stacked['spec'] == P('replica', 'data') and stacked['w'].mesh is mesh2
  batch = H.batch_shardings(tree, 'replica')
  assert batch['w'].spec == P('replica', 'data') and batch['b'].spec == P('replica')
  assert batch['spec'] == P(('replica', 'data'))
  with pytest.raises(ValueError, match='expected NamedSharding or PartitionSpec leaves'):
    H.stacked_shardings({'w': 'data'}, 'replica')


def test_average_replicas_takes_replica_zero_for_integer_and_boolean_leaves():
  """A whole train state averages: floats are the mean, counters and flags (no mean) replica 0's."""
  tree = {'w': jnp.arange(8.0).reshape(4, 2), 'step': jnp.array([3, 3, 3, 3]), 'ok': jnp.array([True, False] * 2)}
  got = H.average_replicas(tree)
  np.testing.assert_allclose(np.asarray(got['w']), [3.0, 4.0])
  assert int(got['step']) == 3 and bool(got['ok']) is True and got['step'].dtype == jnp.int32
