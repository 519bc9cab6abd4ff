"""The trainer's controller features end to end on the tiny config: tail scoring, the guard's rollback and settling,
each checkpointed and resumed bit for bit (kept apart from tests/test_trainer.py so that the suite's two workers
share the trainer's runs)."""

import os

import numpy as np

from trainer_testing import train_and_evaluate
from hdet_jax.trainer.metrics import read_metrics

from trainer_testing import leaves as _leaves, restore_raw as _restore_raw, tiny


def test_rollback_returns_to_the_last_sync_where_the_back_off_fires_and_resumes_bit_for_bit(tmp_path):
  """hdet.rollback (tiny at max_lr 1.0: windows of 8, the second window's training loss rises; the back-off on any
  rise, its margins 0): the sync that
  backs off leaves every replica with the parameters and wrapped optimizer state of the sync before, bit for
  bit, and the anchor every checkpoint holds is one copy of the state the last sync left, which every replica
  held. Without the rollback the same back-off keeps the blown-up parameters. A run stopped inside the window
  before the rollback resumes bit for bit. The same with the 8 replicas on 2 devices (4 each, under vmap)."""
  fit = {
    'num_train_steps': 24,
    'plots': False,
    'optim.max_lr': 1.0,
    'hdet.controller': 'fit',
    'hdet.score': 'common',
    'hdet.warmup_steps': 0,
    'hdet.backoff': True,
    'hdet.backoff_stderrs': 0.0,
    'hdet.backoff_fraction': 0.0,
  }
  ref, plain, two = str(tmp_path / 'straight'), str(tmp_path / 'backoff_only'), str(tmp_path / 'two_devices')
  train_and_evaluate(tiny(checkpoint_every=4, max_checkpoints=0, **fit, **{'hdet.rollback': True}), ref)
  train_and_evaluate(tiny(checkpoint_every=8, **fit, **{'hdet.rollback': False}), plain)
  train_and_evaluate(
    tiny(
      checkpoint_every=4, max_checkpoints=0, **{**fit, 'num_train_steps': 16, 'hdet.rollback': True, 'mesh.devices': 2}
    ),
    two,
  )
  backed = lambda w: [
    c['step'] for c in read_metrics(os.path.join(w, 'metrics.jsonl'))['controller'] if c.get('backed_off')
  ]
  assert backed(ref) == [15] == backed(plain) == backed(two)
  same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(_leaves(a), _leaves(b)))
  every = lambda one, stacked: all(
    np.array_equal(np.broadcast_to(x, y.shape), y)  # one copy == every replica's
    for x, y in zip(_leaves(one), _leaves(stacked))
  )
  states = {w: {k: _restore_raw(w, k)[0] for k in steps} for w, steps in ((ref, (8, 12, 16, 24)), (two, (8, 12, 16)))}
  for state in states.values():
    assert same(state[16]['params'], state[8]['params'])
    assert same(state[16]['opt_state']['inner_state'], state[8]['opt_state']['inner_state'])
    assert not same(state[12]['params'], state[8]['params'])
    for k in state:
      last_sync = 8 * (k // 8)
      assert every(state[k]['anchor']['params'], state[last_sync]['params'])
      assert every(state[k]['anchor']['inner'], state[last_sync]['opt_state']['inner_state'])
  # The anchor's training loss is the back-off's baseline after a rollback: the window that led to the state it
  # returned to (step 7's after the rollback at 15), else the window the sync ended.
  window = {c['step']: c['train_loss'] for c in read_metrics(os.path.join(ref, 'metrics.jsonl'))['controller']}
  for k, end in ((8, 7), (12, 7), (16, 7), (24, 23)):
    np.testing.assert_array_equal(states[ref][k]['anchor']['train_loss'], np.float32(window[end]))
  assert not same(_restore_raw(plain, 16)[0]['params'], states[ref][8]['params'])
  workdir = str(tmp_path / 'resumed')
  train_and_evaluate(tiny(stop_at_step=12, **fit, **{'hdet.rollback': True}), workdir)
  train_and_evaluate(tiny(**fit, **{'hdet.rollback': True}), workdir)
  assert same(_restore_raw(workdir, 24)[0], states[ref][24])


def test_settle_trains_unspread_after_the_climb_and_resumes_bit_for_bit(tmp_path):
  """hdet.settle on the tiny run (rise-only from the first sync, a cautious start at a tenth): the LR climbs, then
  the line search asks down with confidence at two syncs in a row (read from the records: slope > 2 standard
  errors), and the climb settles at the second. From the next step every replica trains at one LR (before, they
  spread) under the held correction; the records say so from that sync on. A run stopped after the settling
  sync resumes bit for bit (the flag is part of the checkpointed state)."""
  fit = {
    'num_train_steps': 64,
    'plots': False,
    'hdet.settle': True,
    'hdet.after_stop': 'rise',
    'hdet.stop_fraction': 0.0,
    'hdet.warmup_steps': 0,
    'hdet.param_groups': False,
    'hdet.trust': 1.0,
    'hdet.step_growth': 2.0,
    'hdet.initial_scale': 0.1,
  }
  ref = str(tmp_path / 'straight')
  train_and_evaluate(tiny(**fit), ref)
  m = read_metrics(os.path.join(ref, 'metrics.jsonl'))
  ctrl = [c for c in m['controller'] if 'velocities' in c]
  down = [c['velocities'][0] > 2 * c['stderrs'][0] for c in ctrl]
  risen = [c['corrections'][0] - c['deltas'][0] > np.log(0.1) + 1e-6 for c in ctrl]  # above the start before it
  at = next(i for i in range(1, len(ctrl)) if down[i] and down[i - 1] and risen[i])
  settle_step = ctrl[at]['step']
  assert 20 < settle_step < 60 and sum(c['deltas'][0] > 0.1 for c in ctrl[:at]) >= 2  # it climbed first
  assert [c['step'] for c in ctrl if c.get('settled')] == [c['step'] for c in ctrl[at:]]
  assert all(c['settled'] == [True] and c['corrections'] == ctrl[at]['corrections'] for c in ctrl[at:])
  lrs = {r['step']: np.array(r['lr']) for r in m['train']}
  assert all(np.ptp(lrs[t]) > 0.3 * lrs[t].mean() for t in range(1, settle_step + 1))
  assert all(np.ptp(lrs[t]) == 0 for t in range(settle_step + 1, 64))
  workdir = str(tmp_path / 'resumed')
  train_and_evaluate(tiny(stop_at_step=settle_step + 5, **fit), workdir)
  train_and_evaluate(tiny(**fit), workdir)
  a, b = _restore_raw(ref, 64)[0], _restore_raw(workdir, 64)[0]
  assert all(np.array_equal(x, y) for x, y in zip(_leaves(a), _leaves(b)))


def test_the_rollback_recovers_a_divergence_inside_a_window(tmp_path, monkeypatch):
  """tiny with the controller from the first sync; every replica's loss made NaN (tests/fault_testing.py: a NaN
  factor in the batch, so the gradient and every replica's parameters are NaN after that step) at steps the test
  chooses, not where a high LR happens to blow up (that step depends on the last bits of the machine's arithmetic).
  Divergences inside three windows in a row (steps 10, 18 and 27): with the rollback the run trains on to each
  window's sync, whose back-off (the window's training loss is not finite) returns it to the sync before; each time
  against the last good window's loss, the baseline the anchor keeps, so a second and a third divergence in a row
  are caught too. Each rollback leaves the state the first sync left, bit for bit, and the run ends at step 40 with
  finite losses. Without the rollback the first divergence stops the run at the next log interval, as before. A
  divergence in the first window (step 5) has no good window before it: the run stops. A divergence at the first
  step after a rollback (steps 8 and 16) says the state it returned to is itself lost: the run stops there instead of
  rolling back to it again."""
  import fault_testing

  base = {'plots': False, 'checkpoint_every': 0, 'hdet.warmup_steps': 0}
  events = lambda w: [
    (e['step'], e['event'])
    for e in read_metrics(os.path.join(w, 'metrics.jsonl'))['event']
    if e['event'] in ('diverged', 'rolled_back', 'nonfinite')
  ]
  runs = {}
  for name, at, overrides in (
    ('rollback', (10, 18, 27), {'hdet.rollback': True, 'checkpoint_every': 8, 'max_checkpoints': 0}),
    ('backoff_only', (10,), {'hdet.rollback': False}),
    ('first_window', (5,), {'hdet.rollback': True}),
    ('lost', (8, 16), {'hdet.rollback': True}),
  ):
    fault_testing.install({step: fault_testing.ALL for step in at}, monkeypatch.setattr)
    runs[name] = str(tmp_path / name), train_and_evaluate(tiny(**{**base, **overrides}), str(tmp_path / name))
  # Syncs every 8 steps (7, 15, 23, ...): each divergence is rolled back at the sync that ends its window.
  w, s = runs['rollback']
  assert events(w) == [
    (10, 'diverged'),
    (15, 'rolled_back'),
    (18, 'diverged'),
    (23, 'rolled_back'),
    (27, 'diverged'),
    (31, 'rolled_back'),
  ]
  assert s['diverged_at'] is None and s['step'] == 40
  m = read_metrics(os.path.join(w, 'metrics.jsonl'))
  assert [c['step'] for c in m['controller'] if c.get('backed_off')] == [15, 23, 31]
  # Finite up to each fault, NaN from it to the rollback, finite again after it and to the end.
  finite = [r['step'] for r in m['train'] if np.all(np.isfinite(r['loss']))]
  assert finite == [*range(10), 16, 17, *range(24, 27), *range(32, 40)]
  assert np.isfinite(s['final_val_loss'])
  # Checkpoints 16, 24 and 32 (after the rollbacks at 15, 23 and 31) hold the state the sync at step 7 left
  # (checkpoint 8), bit for bit, and its anchor: that state, and the window before it's training loss as the baseline.
  same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(_leaves(a), _leaves(b)))
  states = {k: _restore_raw(w, k)[0] for k in (8, 16, 24, 32)}
  window = {c['step']: c['train_loss'] for c in m['controller'] if 'train_loss' in c}
  for k in (16, 24, 32):
    assert same(states[k]['params'], states[8]['params'])
    assert same(states[k]['opt_state']['inner_state'], states[8]['opt_state']['inner_state'])
    assert same(states[k]['anchor']['params'], states[8]['anchor']['params'])
    np.testing.assert_array_equal(states[k]['anchor']['train_loss'], np.float32(window[7]))
  w, s = runs['backoff_only']
  assert events(w) == [(10, 'diverged')] and s['diverged_at'] == 10 and s['step'] == 15  # (its log interval)
  # Before the first sync there is no good window to compare with: the sync at 7 does not back off, the run stops.
  w, s = runs['first_window']
  assert events(w) == [(5, 'diverged')] and s['diverged_at'] == 5 and s['step'] == 10
  # One rollback to the state the sync at 7 left, NaN at once: the run stops there instead of rolling back again.
  w, s = runs['lost']
  assert events(w) == [(8, 'diverged'), (15, 'rolled_back'), (16, 'diverged')]
  assert s['diverged_at'] == 16 and s['step'] == 20
