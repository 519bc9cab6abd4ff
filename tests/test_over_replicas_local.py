"""Several replicas per device under hdet_jax.over_replicas (per_device > 1).

One global-batch step and one ``hdet(replica_axis='replica', num_replicas=8)``, the same objects in every run; only
the mesh and over_replicas' ``per_device`` change. Checked: 8 replicas on 1, 2 and 4 devices, and on 4 groups of 2
devices with FSDP kept inside each group, follow the 8-on-8 run's trajectory (two syncs, the controller moving the
learning rate) to stated bounds; the window's parameter all-reduce is compiled inside the sync's conditional, not
into every step; a raw ``jax.lax`` collective over the replica axis, which would span the devices only, is refused
with one clear error; and so is a per_device that does not fit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import hdet_jax
from benchmarks import comm
from replica_testing import one_in_flight

N, STEPS, T = 8, 7, 3  # replicas; optimizer steps; window length: syncs after steps 3 and 6
ROWS = 64  # the global batch: 8 rows per replica
TX = hdet_jax.hdet(
  optax.adamw, 3e-2, num_replicas=N, replica_axis='replica', sync_every=T, auto_lr=hdet_jax.AutoLR(total_steps=STEPS)
)
PARAMS = {
  'w1': jax.random.normal(jax.random.key(0), (4, 8)) * 0.5,
  'w2': jax.random.normal(jax.random.key(1), (8, 2)) * 0.5,
}
FSDP = {'w1': P(None, 'data'), 'w2': P('data', None)}  # one replica's parameters, FSDP over 'data'
# (mesh shape, axis names, per_device): 8 replicas on 8, 1, 2 and 4 devices, and on 4 groups of 2 with FSDP.
LAYOUTS = {
  '8x1': ((8,), ('replica',), 1),
  '1x8': ((1,), ('replica',), 8),
  '2x4': ((2,), ('replica',), 4),
  '4x2': ((4,), ('replica',), 2),
  '4x2 fsdp': ((4, 2), ('replica', 'data'), 2),
}


def loss_fn(params, batch):
  x, y = batch[:, :4], batch[:, 4:]
  return jnp.mean((jnp.tanh(x @ params['w1']) @ params['w2'] - y) ** 2)


def train_step(state, batch):
  """The user's global-batch step: the same function, and the same TX, at every per_device."""
  params, opt_state = state
  loss, grads = jax.value_and_grad(loss_fn)(params, batch)
  grads = hdet_jax.pmean_finite(grads, 'replica')
  updates, opt_state = TX.update(grads, opt_state, params, value=loss)
  return (optax.apply_updates(params, updates), opt_state), loss


def _batches():
  return np.asarray(jax.random.normal(jax.random.key(2), (STEPS, ROWS, 6)), np.float32)


def _state():
  return hdet_jax.stack_replicas((PARAMS, TX.init(PARAMS)), N)


def _compiled(layout, step_fn=train_step):
  shape, names, per_device = LAYOUTS[layout]
  mesh = Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)
  state = _state()
  fsdp = 'data' in names
  param_specs = FSDP if fsdp else {k: P() for k in PARAMS}
  whole = NamedSharding(mesh, P())
  one_replica = (jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs), jax.tree.map(lambda _: whole, state[1]))
  shardings = hdet_jax.stacked_shardings(one_replica, 'replica')
  batch_sharding = hdet_jax.batch_shardings(NamedSharding(mesh, P('data') if fsdp else P()), 'replica')
  step = jax.jit(
    hdet_jax.over_replicas(step_fn, mesh, 'replica', per_device=per_device),
    in_shardings=(shardings, batch_sharding),
    out_shardings=(shardings, None),
  )
  state = jax.device_put(state, shardings)
  return mesh, state, batch_sharding, step.lower(state, jax.ShapeDtypeStruct((ROWS, 6), jnp.float32)).compile()


@pytest.fixture(scope='module')
def runs():
  """Each layout: (its final state on the host, [STEPS, N] losses, the compiled step's HLO, the mesh, the state's
  shardings as they came back)."""
  out = {}
  for layout in LAYOUTS:
    mesh, state, batch_sharding, step = _compiled(layout)
    call, losses = one_in_flight(step), []
    for batch in _batches():
      state, loss = call(state, jax.device_put(batch, batch_sharding))
      losses.append(np.asarray(loss))
    specs = jax.tree.map(lambda x: (x.sharding.spec, x.addressable_shards[0].data.shape), state[0])
    out[layout] = (jax.tree.map(np.asarray, state), np.stack(losses), step.as_text(), mesh, specs)
  return out


def test_the_trajectory_is_the_8_on_8_runs(runs):
  """Same step, optimizer, initial state and batches; only where the replicas run differs, and with it the order
  of the gradient's and the average's sums (a vmap's reduction over a device's replicas, then an all-reduce over
  the devices, against one all-reduce over 8): float32 rounding, about 6e-8 relative per sum, carried through 7
  Adam steps, two averages and two decisions of a controller that reads the losses. Measured (XLA:CPU, the suite's
  flags): losses within 2.0e-7 relative, parameters 2.4e-7 absolute (they are about 0.5), the learning rates bit for
  bit. The bounds are about ten times those (the learning rates': 1e-5, room for one decision's rounding)."""
  ref_state, ref_losses = runs['8x1'][0], runs['8x1'][1]
  ref_hp = hdet_jax.hyperparams(ref_state[1])
  # The controller moved the learning rate off its start (a tenth of 3e-2) at the two syncs, the same way in all.
  assert ref_state[1].sync_count.tolist() == [2] * N
  assert float(ref_hp['base_learning_rate']) > 2 * 3e-3, ref_hp
  for layout in LAYOUTS:
    state, losses = runs[layout][0], runs[layout][1]
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6, err_msg=layout)
    for a, b in zip(jax.tree.leaves(state[0]), jax.tree.leaves(ref_state[0])):
      np.testing.assert_allclose(a, b, rtol=0, atol=2.5e-6, err_msg=layout)
    hp = hdet_jax.hyperparams(state[1])
    np.testing.assert_allclose(hp['learning_rate'], ref_hp['learning_rate'], rtol=1e-5, err_msg=layout)
    assert state[1].sync_count.tolist() == [2] * N, layout
    # After the second sync (step 6) and one more step the replicas differ again; right after it they agreed.
    assert len({round(float(x), 6) for x in state[0]['w1'][:, 0, 0]}) > 1, layout


def test_fsdp_stays_inside_each_group_of_local_replicas(runs):
  """4 groups of 2 devices, 2 replicas per group: each device holds its group's 2 replicas, half of each kernel."""
  specs = runs['4x2 fsdp'][4]
  assert specs['w1'] == (P('replica', None, 'data'), (2, 4, 4)), specs
  assert specs['w2'] == (P('replica', 'data', None), (2, 4, 2)), specs


def _param_bytes(fsdp):
  """One replica's parameters' bytes on one device (halved by FSDP over 'data')."""
  return sum(x.nbytes for x in jax.tree.leaves(PARAMS)) // (2 if fsdp else 1)


@pytest.mark.parametrize('layout', ['1x8', '2x4', '4x2', '4x2 fsdp'])
def test_the_windows_all_reduce_runs_only_in_the_sync_branch(runs, layout):
  """Across replicas (devices of different replica groups; on one device, XLA's one-device all-reduces), every step
  sends the gradient's all-reduce (and the finite-replica count) and nothing else; the parameters' all-reduce is
  compiled inside the sync's conditional. Measured: 192 B every step (the gradient) and 4 B (the count), 200 B in
  the branch (the parameters and the count); 96, 4 and 104 B with FSDP."""
  hlo, mesh = runs[layout][2], runs[layout][3]
  across = lambda c: c.crosses_replicas or mesh.shape['replica'] == 1
  always, in_branches = comm.collectives_by_place(hlo, tuple(mesh.devices.shape))
  grad = _param_bytes('data' in mesh.axis_names)
  assert {c.op for c in always if across(c)} == {'all-reduce'}, always
  assert grad <= sum(c.operand_bytes for c in always if across(c)) <= grad + 8, always
  averaged = sum(c.operand_bytes for c in in_branches if across(c) and c.op == 'all-reduce')
  assert averaged >= grad, in_branches
  assert hlo.count(' conditional(') == 1


def test_without_the_unbatched_count_the_average_would_run_every_step(monkeypatch):
  """The control: with the step count left batched under the vmap (axes.unbatched made the identity), the cond
  becomes a select and the parameters' all-reduce runs on every step. So the test above can tell."""
  monkeypatch.setattr(hdet_jax.axes, 'unbatched', lambda x, axis_name=None: x)
  mesh, _, _, step = _compiled('2x4')
  always, in_branches = comm.collectives_by_place(step.as_text(), tuple(mesh.devices.shape))
  assert in_branches == [] and ' conditional(' not in step.as_text()
  assert sum(c.operand_bytes for c in always if c.crosses_replicas) >= 2 * _param_bytes(False)


def _raw(kind):
  def step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    if kind == 'pmean':
      grads = lax.pmean(grads, 'replica')  # spans the devices only
    elif kind == 'axis_index':
      loss = loss + lax.axis_index('replica')
    else:  # a psum inside a sub-jaxpr (a cond's branch)
      grads = lax.cond(loss > 0, lambda g: lax.psum(g, 'replica'), lambda g: g, grads)
    updates, opt_state = TX.update(grads, opt_state, params, value=loss)
    return (optax.apply_updates(params, updates), opt_state), loss

  return step


@pytest.mark.parametrize('kind', ['pmean', 'axis_index', 'psum in a cond'])
def test_a_raw_lax_collective_over_the_replica_axis_is_refused(kind):
  mesh = Mesh(np.array(jax.devices()[:2]), ('replica',))
  step = hdet_jax.over_replicas(_raw(kind), mesh, 'replica', per_device=4)
  with pytest.raises(ValueError, match=r"use hdet_jax.pmean_finite\(grads, 'replica'\)") as e:
    jax.eval_shape(step, _state(), jax.ShapeDtypeStruct((ROWS, 6), jnp.float32))
  message = str(e.value)
  assert '\n' not in message and 'per_device=4' in message and 'test_over_replicas_local.py:' in message, message
  # At one replica per device the same step is plain data parallelism: accepted.
  jax.eval_shape(
    hdet_jax.over_replicas(_raw(kind), Mesh(np.array(jax.devices()), ('replica',)), 'replica'),
    _state(),
    jax.ShapeDtypeStruct((ROWS, 6), jnp.float32),
  )


@pytest.mark.parametrize('bad', [0, -2, 2.0, True, '4'])
def test_a_per_device_that_is_not_a_positive_integer_is_one_clear_error(bad):
  with pytest.raises(ValueError, match=r'^over_replicas: per_device must be a positive integer, got') as e:
    hdet_jax.over_replicas(train_step, Mesh(np.array(jax.devices()[:2]), ('replica',)), 'replica', per_device=bad)
  assert '\n' not in str(e.value)


@pytest.mark.parametrize(
  'devices, per_device, fix',
  [(2, 3, r'pass per_device=4 \(N / D\)'), (2, 8, r'pass per_device=4 \(N / D\)'), (3, 2, 'use a multiple of 3')],
)
def test_a_per_device_that_does_not_fit_the_replicas_is_one_clear_error(devices, per_device, fix):
  mesh = Mesh(np.array(jax.devices()[:devices]), ('replica',))
  step = hdet_jax.over_replicas(train_step, mesh, 'replica', per_device=per_device)
  with pytest.raises(ValueError, match=rf'^over_replicas: the state holds N=8 replicas .*; {fix}') as e:
    jax.eval_shape(step, _state(), jax.ShapeDtypeStruct((ROWS, 6), jnp.float32))
  assert '\n' not in str(e.value)
