"""Metrics: the JSONL records and, beside them, TensorBoard event files read back (no TensorFlow, no
tensorboard package) and compared number for number with the JSONL records."""

import glob
import math
import os
import struct

import numpy as np
import pytest
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c

from hdet_jax.trainer import config_lib, metrics

from trainer_testing import train_and_evaluate
from hdet_jax.trainer.metrics import read_metrics
import trainer_testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, 'configs', 'tiny.py')


def _records(path):
  """The events of one file, from TFRecord framing: length (8 bytes), its CRC, data, the data's CRC."""
  data = open(path, 'rb').read()
  out, i = [], 0
  while i < len(data):
    header = data[i : i + 8]
    (n,) = struct.unpack('<Q', header)
    assert struct.unpack('<I', data[i + 8 : i + 12])[0] == masked_crc32c(header)
    body = data[i + 12 : i + 12 + n]
    assert struct.unpack('<I', data[i + 12 + n : i + 16 + n])[0] == masked_crc32c(body)
    out.append(event_pb2.Event.FromString(body))
    i += 16 + n
  return out


def read_scalars(logdir):
  """{(tag, step): value} over the directory's event files, oldest first, as TensorBoard reads them: a file
  that opens with a SessionLog START at step s (a resumed run's purge_step) hides earlier events at steps >= s."""
  scalars = {}
  for path in sorted(glob.glob(os.path.join(logdir, 'events.out.tfevents.*'))):
    for ev in _records(path):
      if ev.HasField('session_log') and ev.session_log.status == event_pb2.SessionLog.START:
        scalars = {k: v for k, v in scalars.items() if k[1] < ev.step}
      for v in ev.summary.value:
        scalars[(v.tag, ev.step)] = v.simple_value
  return scalars


def _expected(recs):
  """What the event files should hold, from metrics.jsonl's records (as float32, TensorBoard's precision)."""
  names = recs['hyperparams'][-1]['names']
  out = {}
  for r in recs['train']:
    s = r['step']
    for i, x in enumerate(r['loss']):
      out[(f'train/loss/replica_{i}', s)] = x
    out[('train/loss/mean', s)] = float(np.mean(r['loss']))
    for name, row, base in zip(names, r['values'], r['bases']):
      out[(f'train/base/{name}', s)] = base
      for i, x in enumerate(row):
        out[(f'train/{name}/replica_{i}', s)] = x
  fit = recs['hyperparams'][-1].get('controller') == 'fit'
  for r in recs['controller']:
    s = r['step']
    for i, (w, loss) in enumerate(zip(r['weights'], r['window_losses'])):
      if not fit:  # the softmax weights are the paper's controller's; 'fit' has none
        out[(f'controller/weight/replica_{i}', s)] = w
      out[(f'controller/window_loss/replica_{i}', s)] = loss
    for g, name in enumerate(names):
      if fit:  # the line search's own quantities, named as in plots/controller.png
        out[(f'controller/lr_correction/{name}', s)] = math.exp(r['corrections'][g])
        out[(f'controller/step_asked/{name}', s)] = r['asks'][g]
        out[(f'controller/step_taken/{name}', s)] = r['deltas'][g]
        out[(f'controller/slope/{name}', s)] = r['velocities'][g]
        out[(f'controller/slope_stderr/{name}', s)] = r['stderrs'][g]
        out[(f'controller/gain/{name}', s)] = r['gains'][g]
      else:
        out[(f'controller/delta/{name}', s)] = r['deltas'][g]
        out[(f'controller/velocity/{name}', s)] = r['velocities'][g]
  for r in recs['distance']:
    for i, x in enumerate(r['distance']):
      out[(f'distance/replica_{i}', r['step'])] = x
    out[('distance/mean_norm', r['step'])] = r['mean_norm']
  for r in recs['eval']:
    out[('eval/val_loss', r['step'])] = r['val_loss']
    out[('eval/val_bits_per_byte', r['step'])] = r['val_bits_per_byte']
  for r in recs['throughput']:
    out[('throughput/tokens_per_s', r['step'])] = r['tokens_per_s']
    out[('throughput/steps_per_s', r['step'])] = r['steps_per_s']
  return {k: np.float32(v) for k, v in out.items()}


def test_jsonl_records_round_trip_non_finite_numbers_and_keep_the_last_of_each_step(tmp_path):
  """NaN and inf survive as strings, numpy values as plain JSON; a resumed run's rewrite of a step wins; a
  line a kill cut short is cut before appending, so the next record starts a fresh line."""
  path = str(tmp_path / 'metrics.jsonl')
  assert metrics.to_json_safe(
    {'a': np.float32(np.nan), 'b': [np.inf, -np.inf], 'c': np.arange(2), 'd': np.bool_(1)}
  ) == {'a': 'nan', 'b': ['inf', '-inf'], 'c': [0, 1], 'd': True}
  w = metrics.MetricsWriter(path)
  w.write('train', step=0, loss=np.array([1.5, np.nan], np.float32))
  w.write('train', step=1, loss=np.array([1.0, 2.0], np.float32))
  w.close()
  with open(path, 'a') as f:
    f.write('{"kind": "train", "step": 2, "lo')  # a write cut by a kill
  w = metrics.MetricsWriter(path)  # the resumed run recomputes step 1
  w.write('train', step=1, loss=np.array([3.0, 4.0], np.float32))
  w.close()
  train = read_metrics(path)['train']
  assert [r['step'] for r in train] == [0, 1] and train[1]['loss'] == [3.0, 4.0]
  assert train[0]['loss'][0] == 1.5 and np.isnan(train[0]['loss'][1])


@pytest.mark.own_programs  # (its programs emit two metrics more: no other run may take them, nor it another's)
def test_trainer_event_files_hold_the_jsonl_numbers_and_a_new_metric_takes_one_place(tmp_path, monkeypatch):
  """The tiny run's event files hold its records' numbers under the tags they always had; and a metric added where
  a program emits it (here one each replica computes, one read from the state, one per hyperparameter of the
  controller's; programs.py) reaches metrics.jsonl and TensorBoard with no other edit, after the record's keys."""
  import jax.numpy as jnp

  from hdet_jax.trainer import programs

  train, controller = programs._train_metrics, programs._controller_metrics  # pylint: disable=protected-access
  monkeypatch.setattr(
    programs,
    '_train_metrics',
    lambda loss, used: {
      **train(loss, used),
      'twice_loss': programs.Each(2 * loss),
      'lr_max': jnp.max(used.learning_rates),
    },
  )
  monkeypatch.setattr(programs, '_controller_metrics', lambda c: {**controller(c), 'gains_squared': c.gain**2})
  workdir = str(tmp_path / 'tiny')
  train_and_evaluate(config_lib.with_overrides(config_lib.load_config_file(TINY), {'plots': False}), workdir)
  files = glob.glob(os.path.join(workdir, 'events.out.tfevents.*'))
  assert len(files) == 1  # beside metrics.jsonl
  got = read_scalars(workdir)
  recs = read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  want = _expected(recs)
  new = {}
  for r in recs['train']:
    assert list(r)[-2:] == ['twice_loss', 'lr_max'] and r['twice_loss'] == [2 * x for x in r['loss']]
    assert r['lr_max'] == max(r['lr'])
    new.update({(f'train/twice_loss/{i}', r['step']): x for i, x in enumerate(r['twice_loss'])})
    new[('train/lr_max', r['step'])] = r['lr_max']
  for r in recs['controller']:
    assert list(r)[-1] == 'gains_squared' and len(r['gains_squared']) == 3
    new.update({(f'controller/gains_squared/{g}', r['step']): x for g, x in enumerate(r['gains_squared'])})
  assert set(got) == set(want) | set(new)  # every tag as before, and the new metrics' own
  want.update({k: np.float32(v) for k, v in new.items()})
  bad = [(k, got[k], want[k]) for k in want if not np.float32(got[k]) == want[k]]
  assert not bad, bad[:5]
  # What the run covers: 40 steps x 8 replicas, the per-group learning rates, 5 syncs, 2 evaluations.
  names = recs['hyperparams'][-1]['names']
  assert len(names) == 3 and all(n.startswith('learning_rate/') for n in names)
  assert sorted({s for t, s in got if t == 'train/loss/replica_7'}) == list(range(40))
  assert sorted({s for t, s in got if t == 'controller/window_loss/replica_0'}) == [7, 15, 23, 31, 39]
  # The tiny run's controller is 'fit': its own tags, not the paper's softmax weights or eq. 6-7 names.
  assert recs['hyperparams'][-1]['controller'] == 'fit'
  assert sorted({s for t, s in got if t == f'controller/step_asked/{names[2]}'}) == [7, 15, 23, 31, 39]
  assert not any(t.startswith(('controller/weight/', 'controller/delta/', 'controller/velocity/')) for t, _ in got)
  assert sorted({s for t, s in got if t == 'distance/replica_3'}) == [7, 15, 23, 31, 39]
  assert sorted({s for t, s in got if t == 'eval/val_bits_per_byte'}) == [20, 40]
  assert len({t for t, _ in got if t.startswith(f'train/{names[0]}/replica_')}) == 8


def test_controller_tags_follow_the_controller(tmp_path):
  """The paper's controller keeps its eq. 4-7 tags; 'fit' gets its own (the correction as a factor)."""
  rec = dict(
    step=9,
    weights=[0.5, 0.5],
    window_losses=[1.0, 2.0],
    deltas=[0.2],
    velocities=[-0.3],
    corrections=[math.log(0.25)],
    asks=[0.1],
    stderrs=[0.05],
    gains=[2.0],
  )
  tags = {}
  for controller in ('paper', 'fit'):
    w = metrics.TensorBoardWriter(str(tmp_path / controller))
    w.write('hyperparams', dict(step=0, names=['learning_rate'], controller=controller))
    tags[controller] = w._scalars('controller', rec)  # pylint: disable=protected-access
    w.close()
  assert tags['paper'] == {
    'controller/window_loss/replica_0': 1.0,
    'controller/window_loss/replica_1': 2.0,
    'controller/weight/replica_0': 0.5,
    'controller/weight/replica_1': 0.5,
    'controller/delta/learning_rate': 0.2,
    'controller/velocity/learning_rate': -0.3,
  }
  fit = {k: v for k, v in tags['fit'].items() if not k.startswith('controller/window_loss/')}
  assert fit == {
    'controller/lr_correction/learning_rate': 0.25,
    'controller/step_asked/learning_rate': 0.1,
    'controller/step_taken/learning_rate': 0.2,
    'controller/slope/learning_rate': -0.3,
    'controller/slope_stderr/learning_rate': 0.05,
    'controller/gain/learning_rate': 2.0,
  }


def test_tensorboard_off_writes_only_the_jsonl(tmp_path):
  w = metrics.MetricsWriter(str(tmp_path / 'metrics.jsonl'), tensorboard=False)
  w.write('event', step=0, event='start')
  w.write('eval', step=1, val_loss=2.0, val_bits_per_byte=3.0)
  w.close()
  assert os.listdir(tmp_path) == ['metrics.jsonl']
  assert read_metrics(str(tmp_path / 'metrics.jsonl'))['eval'][0]['val_loss'] == 2.0


def test_tensorboard_is_a_run_setting_not_a_training_field():
  """Turning it on or off (or a config that gains the field) does not make a workdir another run's."""
  plain = config_lib.load_config_file(TINY)
  assert plain.get('tensorboard', True)  # on by default
  off = config_lib.load_config_file(TINY)
  with off.unlocked():
    off.tensorboard = False
  assert trainer_testing.resolve(off).training_fields(8) == trainer_testing.resolve(plain).training_fields(8)


def test_a_resumed_writer_purges_like_tensorboardx(tmp_path):
  """A resume at step 3 opens its file the way tensorboardX's SummaryWriter(purge_step=3) does, so the
  steps a killed run logged after its checkpoint are shown once (the resumed run's values)."""
  from tensorboardX import SummaryWriter

  ours, theirs = tmp_path / 'ours', tmp_path / 'theirs'
  ours.mkdir()
  w = metrics.MetricsWriter(str(ours / 'metrics.jsonl'), tensorboard=True)
  w.write('event', step=0, event='start')
  for s in range(6):
    w.write('eval', step=s, val_loss=float(s), val_bits_per_byte=1.0)
  w.close()
  w = metrics.MetricsWriter(str(ours / 'metrics.jsonl'), tensorboard=True)
  w.write('event', step=3, event='resume')
  for s in range(3, 5):
    w.write('eval', step=s, val_loss=10.0 + s, val_bits_per_byte=1.0)
  w.close()
  got = read_scalars(str(ours))
  assert {s: v for (t, s), v in got.items() if t == 'eval/val_loss'} == {0: 0.0, 1: 1.0, 2: 2.0, 3: 13.0, 4: 14.0}

  ref = SummaryWriter(logdir=str(theirs), purge_step=3)
  ref.add_scalar('eval/val_loss', 13.0, 3)
  ref.close()
  head = lambda evs: [(e.step, e.file_version, e.session_log.status) for e in evs if not e.HasField('summary')]
  (ours_second,) = sorted(glob.glob(str(ours / 'events.out.tfevents.*')))[1:]
  (theirs_file,) = glob.glob(str(theirs / 'events.out.tfevents.*'))
  assert head(_records(ours_second)) == head(_records(theirs_file))
