"""The hdet transformation: fan-out, converge, controller wiring, backends, composition, errors."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import hdet_jax as H
from hdet_jax import controller as ctrl
from hdet_jax import transform
from replica_testing import AX, N, hdet_plan, make_mesh, one_in_flight, put, quad_problem, quad_step, run


@pytest.fixture(scope='module')
def mesh():
  return make_mesh()


# The 'fit' controller as AutoLR(controller='fit') was before 1.0, the guarded climb's parts off (a start at the
# schedule, trust 0.25, no acceleration, no stop, no back-off, no settling).
PLAIN_FIT = dict(
  controller='fit',
  initial_scale=1.0,
  trust=0.25,
  step_growth=1.0,
  stop_steps=None,
  after_stop='hold',
  backoff=False,
  backoff_stderrs=0.0,
  backoff_fraction=0.0,
  settle=False,
)


# --- alpha = 0: exactly plain data parallelism -------------------------------------------------

FACTORIES = {
  'adam': optax.adam,
  'adamw': lambda learning_rate: optax.adamw(learning_rate, weight_decay=0.1),
  'sgd_momentum': lambda learning_rate: optax.sgd(learning_rate, momentum=0.9),
}


@pytest.mark.parametrize('name', list(FACTORIES))
def test_alpha_zero_equals_plain_data_parallel_bitwise(mesh, name):
  """Static dispatch (the trainer's path): the whole trajectory equals plain optax bit for bit."""
  sched = H.one_cycle(max_lr=0.05, total_steps=30)
  factory = FACTORIES[name]
  tx = H.hdet(factory, sched, num_replicas=N, spread=0.0, sync_every=1000, replica_axis=AX)
  plain = factory(sched)
  params, c = quad_problem()
  _, _, trace, _ = run(mesh, tx, 24, params, c, record=True, sync=False)

  def plain_step(p, s, c):
    loss, g = jax.value_and_grad(lambda p: 0.5 * jnp.sum((p['w'] - c) ** 2))(p)
    u, s = plain.update(lax.pmean(g, AX), s, p)
    return optax.apply_updates(p, u), s, loss

  pp = put(mesh, H.stack_replicas(params, N))
  ps = jax.jit(jax.vmap(plain.init))(pp)
  f = one_in_flight(jax.jit(H.shard_map_replicas(plain_step, mesh, AX)))
  for t in range(24):
    pp, ps, _ = f(pp, ps, put(mesh, c))
    np.testing.assert_array_equal(trace[t][0], np.asarray(pp['w']))  # bit for bit, every step
  assert np.abs(np.asarray(pp['w'])).max() > 0.1  # it actually trained


@pytest.mark.parametrize('name', list(FACTORIES))
def test_alpha_zero_updates_equal_wrapped_optimizer_bitwise_under_cond(mesh, name):
  """lax.cond dispatch: every update equals the wrapped optimizer's bit for bit. (The trajectory
  may differ from a plain program's by an ulp: XLA can fuse ``p - lr * g`` into an FMA in a
  program without the cond boundary, and not across it.)"""
  sched = H.one_cycle(max_lr=0.05, total_steps=30)
  factory = FACTORIES[name]
  tx = H.hdet(factory, sched, num_replicas=N, spread=0.0, sync_every=1000, replica_axis=AX)
  plain = factory(sched)
  params, c = quad_problem()

  def step(p, s, ps, c):
    g = lax.pmean(jax.grad(lambda p: 0.5 * jnp.sum((p['w'] - c) ** 2))(p), AX)
    u, s = tx.update(g, s, p)
    u_plain, ps = plain.update(g, ps, p)
    return optax.apply_updates(p, u), s, ps, u, u_plain

  sp = put(mesh, H.stack_replicas(params, N))
  ss, ps = jax.jit(jax.vmap(tx.init))(sp), jax.jit(jax.vmap(plain.init))(sp)
  f = one_in_flight(jax.jit(H.shard_map_replicas(step, mesh, AX)))
  for _ in range(24):
    sp, ss, ps, u, u_plain = f(sp, ss, ps, put(mesh, c))
    np.testing.assert_array_equal(np.asarray(u['w']), np.asarray(u_plain['w']))
  assert np.abs(np.asarray(sp['w'])).max() > 0.1


def test_alpha_zero_with_syncs_stays_within_rounding(mesh):
  sched = 0.05
  tx = H.hdet(optax.adam, sched, num_replicas=N, spread=0.0, sync_every=4, replica_axis=AX)
  params, c = quad_problem()
  sp, _, _, _ = run(mesh, tx, 20, params, c)
  plain = optax.adam(sched)
  p, s = params, plain.init(params)
  for _ in range(20):
    u, s = plain.update({'w': jnp.mean(p['w'][None] - c, 0)}, s, p)  # the replicas' mean gradient
    p = optax.apply_updates(p, u)
  np.testing.assert_allclose(np.asarray(sp['w'][0]), np.asarray(p['w']), rtol=1e-6, atol=1e-7)


# --- quadratic case: the mean follows the alpha = 0 trajectory --------------------------------


def test_quadratic_mean_tracks_alpha_zero_and_offsets_follow_rho(mesh):
  T, lr, alpha = 5, 0.1, 0.3
  params, c = quad_problem(dim=4)
  tx = H.hdet(optax.sgd, lr, num_replicas=N, spread=alpha, sync_every=T, replica_axis=AX)
  base = H.hdet(optax.sgd, lr, num_replicas=N, spread=0.0, sync_every=T, replica_axis=AX)
  _, _, trace, _ = run(mesh, tx, 23, params, c, record=True)
  _, _, trace0, _ = run(mesh, base, 23, params, c, record=True)
  rho = H.multipliers.spread_multipliers(N, alpha)
  nonzero_offsets = 0
  for t, ((w, st), (w0, _)) in enumerate(zip(trace, trace0)):
    mean = w.mean(0)
    np.testing.assert_allclose(mean, w0[0], rtol=1e-5, atol=1e-6)  # eq. 2 with mean(rho) = 1
    if (t + 1) % T:
      # Between syncs theta_r - mean = -(rho[perm(r)] - 1) * lr * (sum of mean gradients since the sync).
      perm = st.controller.perm[0, 0]
      off = w - mean
      k = rho[perm] - 1.0
      direction = off[-1] / k[-1] if abs(k[-1]) > 0 else off[0] / k[0]
      np.testing.assert_allclose(off, k[:, None] * direction[None], rtol=1e-3, atol=1e-6)
      assert np.abs(off).max() > 1e-4
      nonzero_offsets += 1
  assert nonzero_offsets == 23 - 23 // T


# --- the window's end as its own program ---------------------------------------------------------


# --- per-step cost ----------------------------------------------------------------------------------


def test_donated_state_buffers_pair_with_their_own_outputs(mesh):
  """jit drops inputs a program never reads and pairs donated buffers with outputs in order per shape;
  a state field overwritten without being read would shift that pairing and cost a copy of every later
  same-shaped field on every step. The non-sync program keeps every pairing positional."""
  params, c = quad_problem(dim=16)
  tx = H.hdet(
    optax.adam,
    H.one_cycle(0.05, 100),
    num_replicas=N,
    spread=0.25,
    sync_every=10,
    replica_axis=AX,
    exact_sync=True,
    auto_lr=H.AutoLR.paper(total_steps=100, warmup_steps=10),
  )
  sp = H.stack_replicas(params, N)
  sp, ss, data = put(mesh, (sp, jax.jit(jax.vmap(tx.init))(sp), c))
  step = jax.jit(H.shard_map_replicas(quad_step(tx, sync=False, exact=True), mesh, AX), donate_argnums=(0, 1))
  text = step.lower(sp, ss, data).compile().as_text()
  alias = text[text.index('input_output_alias={') :]
  pairs = re.findall(r'\{(\d+)\}: \((\d+), \{\}, may-alias\)', alias[: alias.index('\n')])
  assert len(pairs) >= len(jax.tree.leaves((sp, ss))) - 2  # all donated leaves but the two write-only ones
  assert [o for o, p in pairs if o != p] == []


# --- sync exactness ---------------------------------------------------------------------------


def test_compiles_once_across_sync_and_non_sync_steps(mesh):
  params, c = quad_problem()
  tx = H.hdet(
    optax.adam,
    H.one_cycle(0.05, 40),
    num_replicas=N,
    spread=0.25,
    sync_every=3,
    replica_axis=AX,
    auto_lr=H.AutoLR.paper(total_steps=40, warmup_steps=6, temperature=0.05),
  )
  _, ss, _, f = run(mesh, tx, 14, params, c)
  assert int(ss.sync_count[0]) == 4
  assert f._cache_size() == 1


# --- backends ---------------------------------------------------------------------------------


def test_backends_agree(mesh):
  params, c = quad_problem()

  def make():
    return H.hdet(
      optax.adam,
      H.one_cycle(0.05, 40),
      num_replicas=N,
      spread=0.25,
      sync_every=3,
      replica_axis=AX,
      auto_lr=H.AutoLR.paper(total_steps=40, warmup_steps=6, temperature=0.05),
    )

  out = {b: run(mesh, make(), 20, params, c, backend=b) for b in ('shard_map', 'pmap', 'vmap')}
  ref_p, ref_s = out['shard_map'][0], out['shard_map'][1]
  assert float(ref_s.controller.velocity[0, 0]) != 0.0  # the controller ran
  for b in ('pmap', 'vmap'):
    np.testing.assert_allclose(np.asarray(out[b][0]['w']), np.asarray(ref_p['w']), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(out[b][1].base), np.asarray(ref_s.base), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(out[b][1].controller.perm), np.asarray(ref_s.controller.perm))


# --- controller wiring ------------------------------------------------------------------------


def test_base_values_schedule_then_smooth_controller_path():
  """Before the controller's first sync: the schedule. After: base_k (1 - gamma)^(i/T - 1) at step i of the
  window (smooth), or base_k (held); 'fit': the schedule times exp(correction)."""
  sched = optax.linear_schedule(1e-2, 1e-3, 40)
  for smooth in (True, False):
    paper = H.AutoLR.paper(total_steps=40, warmup_steps=6, smooth_decay=smooth)
    plan = hdet_plan(optax.sgd, sched, num_replicas=N, sync_every=4, auto_lr=paper)
    assert plan.controller_start == 8
    c = ctrl.init_controller_state(jnp.asarray([5e-3]), N, jnp.zeros(2, jnp.uint32))
    gamma = plan.decay[0]
    for t in range(20):
      got = float(transform.base_values(plan, jnp.asarray(t), c)[0])
      want = float(sched(t)) if t < 8 else 5e-3 * ((1 - gamma) ** ((t % 4) / 4 - 1) if smooth else 1.0)
      np.testing.assert_allclose(got, want, rtol=1e-6)
  plan = hdet_plan(optax.sgd, sched, num_replicas=N, sync_every=4, auto_lr=H.AutoLR(total_steps=40))  # 'fit'
  c = c._replace(correction=jnp.asarray([0.7]))
  for t in (0, 9, 30):
    np.testing.assert_allclose(
      float(transform.base_values(plan, jnp.asarray(t), c)[0]), float(sched(t)) * np.exp(0.7), rtol=1e-6
    )


def test_controller_state_and_no_signal_decay(mesh):
  """Identical losses on every replica (no signal): the base decays geometrically from the
  schedule's value at the controller's start to its final value; all logging fields are live."""
  S, T, W = 60, 5, 10
  sched = H.one_cycle(max_lr=0.1, total_steps=S)
  tx = H.hdet(
    optax.sgd,
    sched,
    num_replicas=N,
    spread=0.25,
    sync_every=T,
    replica_axis=AX,
    auto_lr=H.AutoLR.paper(total_steps=S, warmup_steps=W, temperature=0.1),
  )
  sp = H.stack_replicas({'w': jnp.zeros(3)}, N)
  ss = jax.vmap(tx.init)(sp)

  def step(p, s):
    g = jax.tree.map(jnp.zeros_like, p)
    u, s = tx.update(g, s, p, value=jnp.float32(1.0))  # identical losses: weights uniform, delta 0
    return optax.apply_updates(p, u), s

  f = jax.jit(jax.vmap(step, axis_name=AX))
  bases = []
  for t in range(S):
    bases.append(float(ss.base[0, 0]))  # the base step t trains with
    sp, ss = f(sp, ss)
  bases = np.array(bases)
  sched_np = np.array([float(sched(t)) for t in range(S)])
  np.testing.assert_allclose(bases[:W], sched_np[:W], rtol=1e-6)  # before the controller: the schedule
  t = np.arange(W, S)
  expected = sched_np[W] * (sched_np[S - 1] / sched_np[W]) ** ((t - W) / (S - 1 - W))
  np.testing.assert_allclose(bases[W:], expected, rtol=1e-4)
  # Logging fields.
  np.testing.assert_allclose(ss.weights if hasattr(ss, 'weights') else ss.controller.weights, 1.0 / N, rtol=1e-6)
  assert np.all(np.asarray(ss.controller.delta) == 0) and np.all(np.asarray(ss.controller.velocity) == 0)
  np.testing.assert_allclose(ss.controller.window_losses, 1.0)
  assert int(ss.sync_count[0]) == S // T
  lrs = np.asarray(ss.learning_rates[0])  # every replica's LR for step S
  rho = H.multipliers.spread_multipliers(N, 0.25)
  np.testing.assert_allclose(np.sort(lrs), np.sort(float(ss.base[0, 0]) * rho), rtol=1e-6)
  np.testing.assert_allclose(lrs, float(ss.base[0, 0]) * rho[np.asarray(ss.controller.perm[0, 0])], rtol=1e-6)


@pytest.mark.parametrize('controller', ['paper', 'fit'])
@pytest.mark.parametrize('favour', [+1, -1])
def test_direction_end_to_end(favour, controller):
  """A loss that favours larger LRs raises the base above the no-signal path, and vice versa."""
  S, T = 200, 5
  auto_lr = (
    H.AutoLR.paper(total_steps=S, warmup_steps=0, temperature=0.01, decay=0.0)
    if controller == 'paper'
    else H.AutoLR(total_steps=S, warmup_steps=0, **PLAIN_FIT)
  )
  tx = H.hdet(optax.sgd, 1e-2, num_replicas=N, spread=0.25, sync_every=T, replica_axis=AX, auto_lr=auto_lr)
  sp = H.stack_replicas({'w': jnp.zeros(3)}, N)
  ss = jax.vmap(tx.init)(sp)

  def step(p, s):
    my_lr = s.values[0, lax.axis_index(AX)]  # the LR this replica trains with at this step
    loss = 1.0 - favour * 10.0 * my_lr
    u, s = tx.update(jax.tree.map(jnp.zeros_like, p), s, p, value=loss)
    return optax.apply_updates(p, u), s

  f = jax.jit(jax.vmap(step, axis_name=AX))
  for _ in range(60):
    sp, ss = f(sp, ss)
  assert (float(ss.base[0, 0]) - 1e-2) * favour > 1e-4


# --- composition ------------------------------------------------------------------------------


def test_chain_with_clip_forwards_value(mesh):
  params, c = quad_problem()
  inner = H.hdet(
    optax.sgd,
    0.1,
    num_replicas=N,
    spread=0.25,
    sync_every=4,
    replica_axis=AX,
    auto_lr=H.AutoLR.paper(total_steps=50, warmup_steps=0, temperature=0.05),
  )
  tx = optax.chain(optax.clip_by_global_norm(0.01), inner)
  sp, ss, _, _ = run(mesh, tx, 8, params, c)
  # Clipped: each replica moved by at most lr * rho_max * 0.01 per step.
  assert np.max(np.linalg.norm(np.asarray(sp['w']), axis=-1)) <= 8 * 0.1 * 1.25 * 0.01 + 1e-6
  hstate = ss[1]
  assert int(hstate.sync_count[0]) == 2 and float(np.abs(hstate.controller.window_losses).sum()) > 0


def test_multi_transform_both_ways(mesh):
  params = {'a': jnp.zeros(3), 'b': jnp.zeros(2)}
  c = jax.random.normal(jax.random.key(0), (N, 5))
  labels = {'a': 'hdet', 'b': 'frozen'}

  def loss_fn(p, c):
    return 0.5 * jnp.sum((p['a'] - c[:3]) ** 2) + 0.5 * jnp.sum((p['b'] - c[3:]) ** 2)

  def go(tx):
    def step(p, s, c):
      loss, g = jax.value_and_grad(loss_fn)(p, c)
      u, s = tx.update(lax.pmean(g, AX), s, p, value=loss)
      return optax.apply_updates(p, u), s, loss

    sp = put(mesh, H.stack_replicas(params, N))
    ss = jax.jit(jax.vmap(tx.init))(sp)
    f = one_in_flight(jax.jit(H.shard_map_replicas(step, mesh, AX)))
    outs = []
    for _ in range(6):
      sp, ss, _ = f(sp, ss, put(mesh, c))
      outs.append(jax.tree.map(np.asarray, sp))
    return outs

  # HDET inside one branch of multi_transform: only that branch diverges and syncs.
  outs = go(
    optax.multi_transform(
      {
        'hdet': H.hdet(optax.sgd, 0.1, num_replicas=N, spread=0.25, sync_every=3, replica_axis=AX),
        'frozen': optax.set_to_zero(),
      },
      labels,
    )
  )
  assert np.all(outs[-1]['b'] == 0)
  assert np.max(np.abs(outs[1]['a'] - outs[1]['a'][0])) > 1e-4
  assert np.max(np.abs(outs[2]['a'] - outs[2]['a'][0])) < 1e-6  # synced after step 3
  # multi_transform inside the HDET factory: per-group optimizers, one spread LR.
  factory = lambda learning_rate: optax.multi_transform(
    {'hdet': optax.sgd(learning_rate), 'frozen': optax.sgd(learning_rate * 0.0)}, labels
  )
  outs = go(H.hdet(factory, 0.1, num_replicas=N, spread=0.25, sync_every=3, replica_axis=AX))
  assert np.all(outs[-1]['b'] == 0) and np.max(np.abs(outs[1]['a'] - outs[1]['a'][0])) > 1e-4


def test_nnx_optimizer_under_vmap():
  from flax import nnx

  tx = H.hdet(
    optax.adam,
    0.05,
    num_replicas=N,
    spread=0.25,
    sync_every=3,
    replica_axis=AX,
    auto_lr=H.AutoLR.paper(total_steps=50, warmup_steps=0, temperature=0.05),
  )
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  graphdef, state = nnx.split((model, opt))
  stacked = H.stack_replicas(state, N)
  x = jax.random.normal(jax.random.key(1), (N, 4, 3))

  def step(state, x):
    model, opt = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    grads = jax.tree.map(lambda g: lax.pmean(g, AX), grads)
    opt.update(model, grads, value=loss)
    return nnx.state((model, opt)), loss

  f = jax.jit(jax.vmap(step, axis_name=AX))
  losses = []
  for _ in range(7):
    stacked, loss = f(stacked, x)
    losses.append(np.asarray(loss).mean())
  _, st = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], stacked))
  hstate = st.opt_state.value if hasattr(st.opt_state, 'value') else st.opt_state
  assert int(np.asarray(jax.tree.leaves(nnx.state(st))[0]).size) > 0
  assert losses[-1] < losses[0]
  assert int(np.asarray(hstate.sync_count)) == 2


# --- bad settings -----------------------------------------------------------------------------

SCHED = H.one_cycle(1e-3, 100)


@pytest.mark.parametrize(
  'kwargs, name',
  [
    (dict(spread=-0.1), 'spread'),
    (dict(spread=1.0), 'spread'),
    (dict(sync_every=0), 'sync_every'),
    (dict(num_replicas=0), 'num_replicas'),
    (dict(auto_lr=H.AutoLR.paper(total_steps=100, temperature=0.0)), 'temperature'),
    (dict(auto_lr=H.AutoLR.paper(total_steps=100, temperature=-1.0)), 'temperature'),
    (dict(auto_lr=H.AutoLR.paper(total_steps=100, momentum=1.0)), 'momentum'),
    (dict(auto_lr=H.AutoLR.paper(total_steps=100, momentum=-0.1)), 'momentum'),
    (dict(auto_lr=H.AutoLR.paper(total_steps=100, warmup_steps=-1)), 'warmup_steps'),
    (dict(auto_lr=H.AutoLR.paper(total_steps=100, warmup_steps=100)), 'warmup_steps'),
    (dict(auto_lr=H.AutoLR.paper(total_steps=100), spread=0.0), 'spread'),
    (dict(auto_lr=H.AutoLR(total_steps=100), spread=0.0), 'spread'),
    (
      dict(auto_lr=H.AutoLR.paper(total_steps=100), learning_rate=optax.linear_schedule(1e-3, 0.0, 99)),
      'learning_rate',
    ),
    (dict(auto_lr=H.AutoLR.paper(total_steps=100, min_value=0.0)), 'min_value'),
    (dict(auto_lr=H.AutoLR(total_steps=100, controller='psychic')), 'controller'),
    (dict(auto_lr=H.AutoLR(total_steps=100, controller='fit', trust=0.0)), 'trust'),
    (dict(auto_lr=H.AutoLR(total_steps=100, controller='fit', memory=1.0)), 'memory'),
    (dict(auto_lr=H.AutoLR.paper(total_steps=100, stop_steps=-5)), 'stop_steps'),
    (dict(auto_lr=H.AutoLR(total_steps=100, controller='fit', initial_scale=0.0)), 'initial_scale'),
    # The paper's controller takes none of the fit's settings (AutoLR.paper leaves them neutral).
    (
      dict(auto_lr=dataclasses.replace(H.AutoLR.paper(total_steps=100), initial_scale=0.1)),
      "controller='paper' takes none of the 'fit' settings, got initial_scale=0.1; build it with hdet_jax.AutoLR.paper",
    ),
    (
      dict(auto_lr=dataclasses.replace(H.AutoLR.paper(total_steps=100), after_stop='rise')),
      "controller='paper' takes none of the 'fit' settings, got after_stop='rise';",
    ),
    (
      dict(auto_lr=dataclasses.replace(H.AutoLR.paper(total_steps=100), backoff=True)),
      "controller='paper' takes none of the 'fit' settings, got backoff=True;",
    ),
    (dict(auto_lr=H.AutoLR(total_steps=100, controller='fit', backoff=1)), 'backoff must be a bool'),
    (
      dict(
        auto_lr=H.AutoLR(total_steps=100, controller='fit', backoff=False, backoff_stderrs=2.0, backoff_fraction=0.0)
      ),
      'backoff_stderrs must be a number >= 0, and > 0 only with backoff=True',
    ),
    (
      dict(auto_lr=H.AutoLR(total_steps=100, controller='fit', backoff=True, backoff_stderrs=-1.0)),
      'backoff_stderrs must be a number >= 0',
    ),
    (
      dict(
        auto_lr=H.AutoLR(total_steps=100, controller='fit', backoff=False, backoff_stderrs=0.0, backoff_fraction=0.05)
      ),
      r'backoff_fraction must be a number in \[0, 1\), and > 0 only with backoff=True',
    ),
    (
      dict(auto_lr=H.AutoLR(total_steps=100, controller='fit', backoff=True, backoff_fraction=1.0)),
      'backoff_fraction must be a number in',
    ),
    (dict(auto_lr=H.AutoLR(total_steps=100, controller='fit', after_stop='fall')), 'after_stop'),
    (
      dict(auto_lr=H.AutoLR(total_steps=100, controller='fit', after_stop='hold', settle=True)),
      'settle must be a bool, and True only with',
    ),
    (dict(auto_lr=H.AutoLR(total_steps=100, controller='fit', after_stop='rise', settle=1)), 'settle must be a bool'),
  ],
)
def test_bad_settings_raise_at_construction(kwargs, name):
  args = dict(learning_rate=SCHED, num_replicas=4, spread=0.25, sync_every=10)
  args.update(kwargs)
  with pytest.raises(ValueError, match=name):
    H.hdet(optax.adam, **args)


def test_trace_time_errors():
  tx = H.hdet(
    optax.adam,
    1e-3,
    num_replicas=4,
    spread=0.25,
    sync_every=2,
    auto_lr=H.AutoLR.paper(total_steps=100, warmup_steps=0),
    replica_axis=AX,
  )
  p = {'w': jnp.zeros(2)}
  s = tx.init(p)
  with pytest.raises(ValueError, match="replica_axis='data' is not bound"):
    tx.update(p, s, p, value=1.0)
  sp, ss = H.stack_replicas(p, 3), H.stack_replicas(s, 3)
  with pytest.raises(ValueError, match='num_replicas=4 but the axis'):
    jax.vmap(lambda p, s: tx.update(p, s, p, value=1.0), axis_name=AX)(sp, ss)
  sp, ss = H.stack_replicas(p, 4), H.stack_replicas(s, 4)
  with pytest.raises(ValueError, match='value=loss'):
    jax.vmap(lambda p, s: tx.update(p, s, p), axis_name=AX)(sp, ss)
  with pytest.raises(ValueError, match='scalar loss'):
    jax.vmap(lambda p, s: tx.update(p, s, p, value=jnp.ones(3)), axis_name=AX)(sp, ss)


def test_update_needs_params_and_a_python_bool_sync():
  """Checked while tracing (shapes only, nothing compiled): params=None and a non-bool sync raise, naming them; the
  same call with params and sync=True/False traces to updates shaped like the parameters."""
  tx = H.hdet(optax.sgd, 1e-3, num_replicas=N, spread=0.25, sync_every=2, replica_axis=AX)
  p = {'w': jnp.zeros(2)}
  sp, ss = H.stack_replicas(p, N), jax.eval_shape(lambda q: H.stack_replicas(tx.init(q), N), p)
  traced = lambda kw: jax.eval_shape(jax.vmap(lambda g, s, q: tx.update(g, s, **kw(q)), axis_name=AX), sp, ss, sp)
  with pytest.raises(ValueError, match=r'hdet: update\(\) needs params \(the sync averages them\)'):
    traced(lambda q: dict(params=None))
  for bad in (1, np.bool_(True), 'yes'):
    with pytest.raises(ValueError, match=f'hdet: sync must be None or a Python bool, got {type(bad).__name__}'):
      traced(lambda q: dict(params=q, sync=bad))
  for sync in (None, True, False):
    updates, state = traced(lambda q: dict(params=q, sync=sync))
    assert updates['w'].shape == (N, 2) and state.values.shape == (N, 1, N)


def test_replica_value_is_this_replicas_column():
  """Inside the map, replica r reads row g, column r of state.values (the coming step's [G, N] values); with a
  (device, local) axis pair replica r = d * (N / D) + v."""
  tx = H.hdet(
    optax.adam,
    0.1,
    num_replicas=N,
    spread=0.2,
    sync_every=10,
    replica_axis=AX,
    explore={'dropout': H.Explore(0.1, 0.05, additive=True, low=0.0, high=0.5, to_optimizer=False)},
  )
  like = jax.eval_shape(tx.init, {'w': jnp.zeros(3)})  # shapes only; replica_value reads the values alone
  assert like.values.shape == (2, N)
  values = np.broadcast_to(np.arange(2 * N, dtype=np.float32).reshape(2, N), (N, 2, N))  # [replica, G, N]
  read = lambda axis: lambda v: jnp.stack([H.replica_value(like._replace(values=v), g, axis) for g in (0, 1)])
  got, pairs = jax.jit(
    lambda v: (  # one compilation for both maps
      jax.vmap(read(AX), axis_name=AX)(v),
      jax.vmap(jax.vmap(read((AX, 'local')), axis_name='local'), axis_name=AX)(v.reshape(4, 2, 2, N)),
    )
  )(values)
  want = np.stack([np.arange(N), np.arange(N, 2 * N)], 1)  # replica r: (values[0, r], values[1, r])
  np.testing.assert_array_equal(np.asarray(got), want)
  np.testing.assert_array_equal(np.asarray(pairs).reshape(N, 2), want)


# --- the controllers as wired into hdet, with a real signal, against numpy oracles --------------


def test_update_runs_in_five_modules():
  """Issue 83: a reader follows ``tx.update`` through these hdet_jax modules, whichever controller or optimizer path
  (scripts/update_path.py prints them); settings.py is not among them (the plan carries what update reads)."""
  import importlib.util
  import pathlib

  path = pathlib.Path(__file__).resolve().parent.parent / 'scripts' / 'update_path.py'
  spec = importlib.util.spec_from_file_location('update_path', path)
  update_path = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(update_path)
  want = {f'hdet_jax.{m}' for m in ('axes', 'controller', 'multipliers', 'sync', 'transform')}
  for auto_lr in (H.AutoLR(total_steps=100), H.AutoLR.paper(total_steps=100)):
    tx = H.hdet(optax.adamw, 1e-2, num_replicas=4, auto_lr=auto_lr)
    assert set(update_path.modules_in_update(tx)) == want
  built = H.hdet(optax.adamw(1e-2), num_replicas=4, auto_lr=H.AutoLR(total_steps=100), rollback=True)
  assert set(update_path.modules_in_update(built)) == want
