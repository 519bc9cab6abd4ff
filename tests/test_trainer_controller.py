"""The trainer's controller features end to end on the tiny config: tail scoring, the guard's rollback and settling,
each checkpointed and resumed bit for bit (kept apart from tests/test_trainer.py so that the suite's two workers
share the trainer's runs)."""

import os

import numpy as np

from hdet_jax.trainer import train_and_evaluate
from hdet_jax.trainer.metrics import read_metrics

from trainer_testing import leaves as _leaves, restore_raw as _restore_raw, tiny


def test_rollback_returns_to_the_last_sync_where_the_back_off_fires_and_resumes_bit_for_bit(tmp_path):
  """hdet.rollback (tiny at max_lr 1.0: windows of 8, the second window's training loss rises; the back-off on any
  rise, its margins 0): the sync that
  backs off leaves every replica with the parameters and wrapped optimizer state of the sync before, bit for
  bit, and the anchor every checkpoint holds is one copy of the state the last sync left, which every replica
  held. Without the rollback the same back-off keeps the blown-up parameters. A run stopped inside the window
  before the rollback resumes bit for bit. The same with the 8 replicas on 2 devices (4 each, under vmap)."""
  fit = {'num_train_steps': 24, 'plots': False, 'optim.max_lr': 1.0, 'hdet.controller': 'fit', 'hdet.score': 'common',
         'hdet.warmup_steps': 0, 'hdet.backoff': True, 'hdet.backoff_stderrs': 0.0, 'hdet.backoff_fraction': 0.0}
  ref, plain, two = str(tmp_path / 'straight'), str(tmp_path / 'backoff_only'), str(tmp_path / 'two_devices')
  train_and_evaluate(tiny(checkpoint_every=4, max_checkpoints=0, **fit, **{'hdet.rollback': True}), ref)
  train_and_evaluate(tiny(checkpoint_every=8, **fit, **{'hdet.rollback': False}), plain)
  train_and_evaluate(tiny(checkpoint_every=4, max_checkpoints=0, **{
      **fit, 'num_train_steps': 16, 'hdet.rollback': True, 'mesh.devices': 2}), two)
  backed = lambda w: [c['step'] for c in read_metrics(os.path.join(w, 'metrics.jsonl'))['controller']
                      if c.get('backed_off')]
  assert backed(ref) == [15] == backed(plain) == backed(two)
  same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(_leaves(a), _leaves(b)))
  every = lambda one, stacked: all(np.array_equal(np.broadcast_to(x, y.shape), y)  # one copy == every replica's
                                   for x, y in zip(_leaves(one), _leaves(stacked)))
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
  fit = {'num_train_steps': 64, 'plots': False, 'hdet.settle': True, 'hdet.after_stop': 'rise',
         'hdet.stop_fraction': 0.0, 'hdet.warmup_steps': 0, 'hdet.param_groups': False, 'hdet.trust': 1.0,
         'hdet.step_growth': 2.0, 'hdet.initial_scale': 0.1}
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


def test_the_rollback_recovers_a_divergence_inside_a_window(tmp_path):
  """tiny with SGD at a peak LR of 30 (the controller from the first sync): every replica's loss goes NaN inside a
  window three times. With the rollback the run trains on to the window's sync, whose back-off (the window's
  training loss is not finite) returns it to the sync before; each time against the last good window's loss, the
  baseline the anchor keeps, so a second divergence in a row is caught too. The run ends with finite losses.
  Without the rollback the first divergence stops the run at the next log interval, as before. At a peak LR of 300
  or 500 the state after the first sync is already lost (NaN from its first step): after one rollback it diverges at
  once, and the run stops there instead of rolling back to it again."""
  sgd = {'plots': False, 'checkpoint_every': 0, 'optim.name': 'sgd', 'hdet.warmup_steps': 0}
  events = lambda w: [(e['step'], e['event']) for e in read_metrics(os.path.join(w, 'metrics.jsonl'))['event']
                      if e['event'] in ('diverged', 'rolled_back')]
  runs = {}
  for name, lr, rollback in (('rollback', 30.0, True), ('backoff_only', 30.0, False), ('lost', 300.0, True),
                             ('lost_too', 500.0, True)):
    runs[name] = str(tmp_path / name)
    s = train_and_evaluate(tiny(**{**sgd, 'optim.max_lr': lr, 'hdet.rollback': rollback}), runs[name])
    runs[name] = (runs[name], s)
  w, s = runs['rollback']
  # Each divergence is rolled back at the sync that ends its window (syncs every 8 steps: 7, 15, 23, ...). The step a
  # replica's loss first goes NaN depends on the last bits of the machine's arithmetic (10, 19, 27 on one CPU; 10,
  # 18, 27 on another), the sync that catches it does not.
  ev = events(w)
  assert [e for _, e in ev] == ['diverged', 'rolled_back'] * 3
  assert [step for step, e in ev if e == 'rolled_back'] == [15, 23, 31]
  assert all(rolled - 8 < diverged <= rolled for (diverged, _), (rolled, _) in zip(ev[::2], ev[1::2]))
  assert s['diverged_at'] is None and s['step'] == 40
  m = read_metrics(os.path.join(w, 'metrics.jsonl'))
  assert np.all(np.isfinite(m['train'][-1]['loss'])) and np.isfinite(s['final_val_loss'])
  assert [c['step'] for c in m['controller'] if c.get('backed_off')] == [15, 23, 31, 39]
  w, s = runs['backoff_only']
  first = ev[0][0]  # the same run up to its first divergence (step 10 or 11, by the machine's last bits)
  assert 8 <= first < 15 and events(w) == [(first, 'diverged')] and s['diverged_at'] == first
  assert s['step'] <= 15  # (its log interval)
  # At 300 and 500 every replica goes NaN in the first window or just after the first sync (step 7), which of the two
  # depending on the machine's arithmetic (one CPU: 300 at step 8 and 500 at 8; another: 300 at 7 and 500 at 8).
  # Before the first sync there is no anchor: the run stops. After it, the anchor is the lost state: one rollback
  # to it, NaN at once, and the run stops there instead of rolling back again.
  lost = []
  for name in ('lost', 'lost_too'):
    w, s = runs[name]
    ev = events(w)
    if ev[0][0] <= 7:
      assert ev == [(ev[0][0], 'diverged')] and s['diverged_at'] == ev[0][0] and s['step'] < 15
    else:
      assert ev == [(ev[0][0], 'diverged'), (15, 'rolled_back'), (16, 'diverged')]
      assert s['diverged_at'] == 16 and s['step'] < 23
      lost.append(name)
  assert lost, 'neither LR reached the first sync: the rollback to a lost state was not exercised'
