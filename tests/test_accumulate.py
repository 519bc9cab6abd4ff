"""hdet_jax.multi_steps: optax.MultiSteps' results, with the wrapped update run once per optimizer step.

Checked: on plain optax.adamw and under hdet (8 replicas, 4 micro-batches per optimizer step, two syncs) the state,
updates and parameters equal optax.MultiSteps' (bit for bit at the suite's XLA flags; a stated bound covers XLA's
default flags); the window's average runs once per window, not once per micro-batch (counted as it runs, and located
in the compiled program: inside the micro-batch's conditional); several replicas per device keep both conditionals;
and a bad every_k is one clear error.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import hdet_jax
from test_over_replicas_local import loss_fn  # the user's loss of the per_device tests
from benchmarks import comm
from hdet_jax import sync as sync_lib
from replica_testing import one_in_flight

N, K, STEPS, T = 8, 4, 5, 2  # replicas, micro-batches per optimizer step, optimizer steps, window: syncs after 2 and 4
PARAMS = {
  'w1': jax.random.normal(jax.random.key(0), (4, 8)) * 0.5,
  'w2': jax.random.normal(jax.random.key(1), (8, 2)) * 0.5,
}
# XLA:CPU at its default flags fuses the wrapped update differently inside a conditional's branch than in the main
# program: an update or a moment differs by float32 ulps. Measured, as a fraction of the leaf's largest entry (an
# entry that cancels to near 0 keeps the ulp of the terms it came from): at most 2.7e-7 at XLA's default flags, 0
# (bit for bit) at the suite's. The bound is about ten times that.
RTOL = 3e-6


def _assert_close(got, want, what):
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (what, jax.tree_util.keystr(path))
    if a.dtype.kind == 'f':  # relative to the leaf's largest entry: an entry that cancels to near 0 keeps its ulp
      scale = RTOL * float(np.max(np.abs(b), initial=0.0))
      np.testing.assert_allclose(a, b, rtol=0, atol=scale, err_msg=f'{what} {jax.tree_util.keystr(path)}')
    else:
      np.testing.assert_array_equal(a, b, err_msg=f'{what} {jax.tree_util.keystr(path)}')


@pytest.mark.parametrize('k, use_grad_mean', [(1, True), (3, True), (3, False)])
def test_equals_optax_multisteps_on_adamw(k, use_grad_mean):
  """Seven micro-batches (two optimizer steps and one accumulating at k = 3): updates, state and parameters."""
  ours = hdet_jax.multi_steps(optax.adamw(1e-2, weight_decay=0.1), k, use_grad_mean=use_grad_mean)
  ref = optax.MultiSteps(optax.adamw(1e-2, weight_decay=0.1), k, use_grad_mean=use_grad_mean)
  params, state, ref_state = PARAMS, ours.init(PARAMS), ref.init(PARAMS)
  assert isinstance(state, optax.MultiStepsState)
  _assert_close(state, ref_state, 'init')
  update, ref_update = jax.jit(ours.update), jax.jit(ref.update)
  for t in range(7):
    grads = jax.tree.map(lambda x: jnp.sin(x * (t + 1.3)), params)
    updates, state = update(grads, state, params)
    ref_updates, ref_state = ref_update(grads, ref_state, params)
    _assert_close((updates, state), (ref_updates, ref_state), f'micro-batch {t}')
    params = optax.apply_updates(params, updates)
    if (t + 1) % k:  # before the last micro-batch: zero updates, the wrapped state untouched
      assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  assert int(state.gradient_step) == 7 // k and int(state.mini_step) == 7 % k


def _hdet_step(wrap, mesh, per_device):
  tx = wrap(
    hdet_jax.hdet(
      optax.adamw,
      3e-2,
      num_replicas=N,
      replica_axis='replica',
      sync_every=T,
      auto_lr=hdet_jax.AutoLR(total_steps=STEPS),
    ),
    K,
  )

  def train_step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    grads = hdet_jax.pmean_finite(grads, 'replica')
    updates, opt_state = tx.update(grads, opt_state, params, value=loss)
    return (optax.apply_updates(params, updates), opt_state), loss

  state = hdet_jax.stack_replicas((PARAMS, tx.init(PARAMS)), N)
  step = jax.jit(hdet_jax.over_replicas(train_step, mesh, 'replica', per_device=per_device))
  return state, step.lower(state, jax.ShapeDtypeStruct((64, 6), jnp.float32)).compile()


# (wrapper, devices, per_device)
RUNS = {
  'optax.MultiSteps': (optax.MultiSteps, 8, 1),
  'multi_steps': (hdet_jax.multi_steps, 8, 1),
  'multi_steps, 4 per device': (hdet_jax.multi_steps, 2, 4),
}


@pytest.fixture(scope='module')
def runs():
  """Each run: (final state, [STEPS * K, N] losses, HLO, syncs run as counted by a callback in the window's end)."""
  calls, end_window = [], sync_lib.end_window

  def counted(*args, **kwargs):  # runs where the window's end runs: once per device each time
    jax.debug.callback(lambda: calls.append(1))
    return end_window(*args, **kwargs)

  data = np.asarray(jax.random.normal(jax.random.key(2), (STEPS * K, 64, 6)), np.float32)
  out = {}
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(sync_lib, 'end_window', counted)
    for name, (wrap, devices, per_device) in RUNS.items():
      mesh = Mesh(np.array(jax.devices()[:devices]), ('replica',))
      state, step = _hdet_step(wrap, mesh, per_device)
      calls.clear()
      call, losses = one_in_flight(step), []
      for batch in data:
        state, loss = call(state, batch)
        losses.append(np.asarray(loss))
      out[name] = (jax.tree.map(np.asarray, state), np.stack(losses), step.as_text(), len(calls) / devices)
  return out


def test_under_hdet_it_equals_optax_multisteps(runs):
  """The same trajectory: parameters, HDET's state inside MultiStepsState (inner_opt_state), losses. At several
  replicas per device, the 8-device run's to the over_replicas bound (tests/test_over_replicas_local.py):
  measured 3.6e-7 absolute on the parameters."""
  ref_state, ref_losses = runs['optax.MultiSteps'][:2]
  state, losses = runs['multi_steps'][:2]
  _assert_close(state, ref_state, 'multi_steps')
  np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
  hdet_state = state[1].inner_opt_state
  assert hdet_state.sync_count.tolist() == [STEPS // T] * N and state[1].gradient_step.tolist() == [STEPS] * N
  # The controller compared the replicas on the loss passed on with value= (the last micro-batch's): all-gathered.
  scores = hdet_state.controller.window_losses[0]
  assert np.all(np.isfinite(scores)) and len(set(scores.tolist())) == N, scores
  local_state, local_losses = runs['multi_steps, 4 per device'][:2]
  for a, b in zip(jax.tree.leaves(local_state[0]), jax.tree.leaves(ref_state[0])):
    np.testing.assert_allclose(a, b, rtol=0, atol=2.5e-6)
  np.testing.assert_allclose(local_losses, ref_losses, rtol=2e-6)


def test_the_windows_average_runs_once_per_window_not_once_per_micro_batch(runs):
  """Counted as the programs run (a callback in the window's end, once per device each time it runs): two windows
  end in these 5 optimizer steps; optax.MultiSteps runs the end (its average and all-gather) on each of the 4
  micro-batches of those steps, multi_steps on the last one only."""
  assert runs['optax.MultiSteps'][3] == K * (STEPS // T)
  assert runs['multi_steps'][3] == STEPS // T
  assert runs['multi_steps, 4 per device'][3] == STEPS // T


def _conditional_depths(hlo):
  """{computation: how many conditionals enclose it} (the deepest way ENTRY reaches it)."""
  bodies, name, entry = {}, None, None
  for line in hlo.splitlines():
    head = re.match(r'^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$', line)
    if head and not line.startswith(' '):
      name = head.group(2)
      bodies[name] = []
      entry = name if head.group(1) else entry
    elif name is not None:
      bodies[name].append(line)
  depths, frontier = {entry: 0}, [entry]
  while frontier:
    caller = frontier.pop()
    for line in bodies[caller]:
      branches = re.findall(r'branch_computations=\{([^}]*)\}', line)
      callees = [(n.strip().lstrip('%'), 1) for group in branches for n in group.split(',')]
      callees += [(n, 0) for n in re.findall(r'(?:calls|to_apply|body|condition)=%?([\w.\-]+)', line)]
      for callee, deeper in callees:
        if depths.get(callee, -1) < depths[caller] + deeper:
          depths[callee] = depths[caller] + deeper
          frontier.append(callee)
  return depths, bodies


@pytest.mark.parametrize('name', list(RUNS))
def test_the_compiled_step_sends_the_average_only_inside_the_micro_batch_conditional(runs, name):
  """Per micro-batch, across replicas: the gradient's all-reduce (192 B) and the finite count (4 B) on every call;
  the parameters' average (200 B: the parameters and the count) inside a branch. Under optax.MultiSteps that branch
  is HDET's sync (1 conditional deep), taken on every micro-batch of a window's last step; under multi_steps it is
  inside the last micro-batch's branch too (2 deep), so the average is sent once per window."""
  hlo, devices = runs[name][2], RUNS[name][1]
  always, in_branches = comm.collectives_by_place(hlo, (devices,))
  params_bytes = sum(x.nbytes for x in jax.tree.leaves(PARAMS))
  assert sorted(c.operand_bytes for c in always if c.op == 'all-reduce') == [4, params_bytes]
  averages = [c for c in in_branches if c.op == 'all-reduce' and c.operand_bytes > params_bytes]
  assert len(averages) == 1, in_branches
  depths, bodies = _conditional_depths(hlo)
  holding = [n for n, body in bodies.items() if any(re.search(r' all-reduce(-start)?\(', ln) for ln in body)]
  deepest = max(depths.get(n, 0) for n in holding)
  assert deepest == (1 if name == 'optax.MultiSteps' else 2), {n: depths.get(n) for n in holding}


@pytest.mark.parametrize('bad', [0, -1, 2.0, True, None])
def test_a_bad_every_k_is_one_clear_error(bad):
  with pytest.raises(ValueError, match=r'^multi_steps: every_k must be a positive integer .*, got') as e:
    hdet_jax.multi_steps(optax.sgd(0.1), bad)
  assert '\n' not in str(e.value)
