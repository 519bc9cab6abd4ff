"""Reliability: preemption (SIGKILL, SIGTERM), corrupt checkpoints, divergence, determinism, bad configs.

The figures these tests measure are recorded in results/reliability.md.
"""

import functools
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import cli_testing
from hdet_jax.trainer import ConfigError, checkpoints, config_lib

from trainer_testing import train_and_evaluate
from hdet_jax.trainer.metrics import read_metrics
import trainer_testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, 'configs', 'tiny.py')
_spec = importlib.util.spec_from_file_location('hdet_chaos', os.path.join(ROOT, 'scripts', 'chaos.py'))
chaos = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chaos)


def tiny(**overrides):
  return config_lib.with_overrides(config_lib.load_config_file(TINY), overrides)


# ---- Preemption: SIGKILL at random points and during checkpoint writes. ----


def _forked(cmd, *, cwd, env, stdout, stderr):
  """chaos.py's ``popen`` here: train.py in a child forked from a process that has imported its modules
  (tests/cli_testing.start, ~2.4 s of imports less per start), a real process that the SIGKILLs end as they end a
  subprocess, its output appended to chaos.py's log as Popen's would be."""
  assert cmd[0] == sys.executable and stderr == subprocess.STDOUT and 'a' in stdout.mode
  return cli_testing.start(cmd[1:], cwd=cwd, env=env, stdout=stdout.name, append=True)


def _cache(base):
  """The compilation cache of the chaos run and of every train.py run here: this test process's (tests/conftest.py),
  so that the runs trained in this process (_train_here) load the programs the reference compiled (the key leaves out
  the device-count flag, the one XLA flag chaos._env changes) instead of compiling them again."""
  return os.environ.get('JAX_COMPILATION_CACHE_DIR') or os.path.join(base, 'xla_cache')


@pytest.fixture(scope='module')
def chaos_run(tmp_path_factory):
  """scripts/chaos.py's run: a reference, then the same command killed 3 times (two during a checkpoint
  write, one at a random point) and restarted. ``python scripts/chaos.py`` kills 20 times."""
  base = str(tmp_path_factory.mktemp('chaos'))
  report = chaos.run(base, kills=3, seed=0, cache=_cache(base), popen=_forked)
  if len(report['kills']) < 3:
    # A 'write' kill polls for a checkpoint write in progress; on a loaded machine the poll can miss every write of
    # a start, which then trains to the end before a third kill lands. Too few kills is the setup failing, not the
    # recovery under test: run it once more (other kill points).
    report = chaos.run(base, kills=3, seed=1, cache=_cache(base), popen=_forked)
  return base, report


def test_sigkill_three_times_resumes_bit_for_bit(chaos_run):
  _, r = chaos_run
  kills = r['kills']
  assert len(kills) >= 3 and all(not k['finished_before_kill'] for k in kills)
  assert all(k['returncode'] == -signal.SIGKILL for k in kills)
  # At least two kills cut a checkpoint write short (an orbax temporary directory was left behind).
  assert sum(bool(k['cut_write']) for k in kills) >= 2, kills
  # Every restart resumed from the newest complete checkpoint that the previous start left.
  for prev, nxt in zip(kills, kills[1:]):
    if nxt['started_from_step'] is not None:
      assert nxt['started_from_step'] == (prev['complete_steps_after'] or [0])[-1]
  assert not r['corrupt_events']  # a cut write is never listed, so never even tried
  # No data lost: the final state, the averaged model and every logged metric equal the reference's.
  assert r['final_step'] == 40
  assert r['state_bitwise_equal'] and r['avg_params_bitwise_equal'] and r['fingerprints_equal']
  assert r['metrics_equal'] == {'train': True, 'controller': True, 'eval': True}
  assert r['train_steps_logged'] == [40, 40]


def test_leftovers_of_killed_writes_are_cleaned(chaos_run):
  base, _ = chaos_run
  listing = os.listdir(os.path.join(base, 'chaos', 'checkpoints'))
  assert not [n for n in listing if chaos.TMP_MARK in n]
  assert sorted(n for n in listing if n.isdigit()) == ['36', '38', '40']
  assert not os.listdir(os.path.join(base, 'chaos', 'checkpoints', 'trash'))  # old steps deleted, not piled up
  # A metrics line cut by a kill was cut off before appending: every line parses.
  with open(os.path.join(base, 'chaos', 'metrics.jsonl')) as f:
    for line in f:
      json.loads(line)


# ---- Corrupt or partial checkpoints are never loaded. ----


def _largest_file(d):
  files = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]
  return max(files, key=os.path.getsize)


def _corrupt(step_dir, how):
  if how == 'truncate':  # a write cut short after the rename (e.g. a disk filling up)
    path = _largest_file(os.path.join(step_dir, 'state'))
    with open(path, 'r+b') as f:
      f.truncate(os.path.getsize(path) // 2)
  elif how == 'flip':  # same size, other bytes: a decode error, or (in raw bytes) silently other values
    path = _largest_file(os.path.join(step_dir, 'state'))
    with open(path, 'r+b') as f:
      size = os.path.getsize(path)
      f.seek(size // 2)
      chunk = f.read(64)
      f.seek(size // 2)
      f.write(bytes(b ^ 0x5A for b in chunk))
  elif how == 'stale':  # silent corruption: a valid item, but other bits than were saved (an older step's copy)
    shutil.rmtree(os.path.join(step_dir, 'state'))
    shutil.copytree(os.path.join(os.path.dirname(step_dir), '38', 'state'), os.path.join(step_dir, 'state'))
  elif how == 'meta':
    with open(os.path.join(step_dir, 'meta', 'metadata'), 'w') as f:
      f.write('{"step": 4')
  elif how == 'missing':  # a partial copy: a whole item gone
    shutil.rmtree(os.path.join(step_dir, 'state'))
  else:
    raise ValueError(how)


def _train(base, workdir, *extra, timeout=300, faults=''):
  """The chaos run's command (same config, its warm compilation cache) in ``workdir``; ``faults``: the steps
  (separated by commas) at which every replica's loss is made NaN (train.py run by tests/fault_testing.py)."""
  cmd = chaos.train_cmd(workdir, _cache(base), extra=extra)
  if faults:
    assert cmd[1] == os.path.join(ROOT, 'train.py')
    cmd[1:2] = [os.path.join(ROOT, 'tests', 'fault_testing.py'), faults]
  return cli_testing.run(cmd[1:], cwd=ROOT, env=chaos._env(), timeout=timeout)


def _train_here(workdir, capsys, **overrides):
  """The chaos run's config (``chaos.train_cmd``'s overrides) trained in this process, as train.py would: (the summary,
  what it printed). The first such run here builds its programs and the next ones take them (program_cache: the
  checkpoint cadence is not in a program), so they build nothing; the numbers are those of a fresh process
  (test_trainer.py's resume test compares the two bit for bit, and these tests compare with the reference's bits)."""
  capsys.readouterr()
  config = tiny(**{'checkpoint_every': 2, 'max_checkpoints': 3, 'plots': False, **overrides})
  summary = train_and_evaluate(config, workdir)
  return summary, capsys.readouterr().out


def _finished(summary):
  """What train.py's exit status 0 says: the run ended at its last step, neither diverged nor preempted."""
  return summary['step'] == 40 and summary['diverged_at'] is None and not summary['preempted']


@functools.cache
def _reference_checkpoint(base, step):
  """The reference's checkpoint, read once for the tests that compare with it (~1 s a read; none writes there)."""
  return chaos.load_checkpoint(os.path.join(base, 'reference'), step)


def _assert_equal_to_reference(base, workdir, step=40):
  a_state, a_avg, _ = _reference_checkpoint(base, step)
  b_state, b_avg, _ = chaos.load_checkpoint(workdir, step)
  assert len(a_state) == len(b_state) and len(a_avg) == len(b_avg)
  for x, y in zip(a_state + a_avg, b_state + b_avg):
    assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


@pytest.mark.parametrize('how', ['truncate', 'flip', 'stale', 'meta', 'missing'])
def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(chaos_run, tmp_path, capsys, how):
  """The reference's workdir with its newest checkpoint corrupted, rerun with the same config: it warns, falls back to
  step 38 and trains to the end. (Rerun in this process: one fresh process for each of the five would be five setups;
  train.py's resume in a fresh process is the chaos run's, above.)"""
  base, _ = chaos_run
  workdir = str(tmp_path / 'w')
  shutil.copytree(os.path.join(base, 'reference'), workdir)
  _corrupt(os.path.join(workdir, 'checkpoints', '40'), how)
  summary, out = _train_here(workdir, capsys)
  assert _finished(summary), out[-2000:]
  assert 'warning: checkpoint step 40:' in out and 'falling back to the previous one' in out
  assert f'Resuming {workdir} from step 38.' in out
  fingerprint = re.search(r"of the \d+ arrays of 'state' read back other bits than were saved", out)
  if how == 'stale':  # orbax reads the item back without complaint: only the fingerprint sees it
    assert fingerprint, out[-2000:]
  if how == 'flip':  # (where the flipped bytes land, compressed or raw, depends on the bits the machine computed)
    assert fingerprint or "'state' cannot be read" in out, out[-2000:]
  events = read_metrics(os.path.join(workdir, 'metrics.jsonl'))['event']
  assert [e['step'] for e in events if e['event'] == 'corrupt_checkpoint'] == [40]
  assert os.listdir(os.path.join(workdir, 'checkpoints', 'corrupt'))[0].startswith('40-')
  # Steps 38 -> 40 retrained from the previous complete checkpoint: the reference, bit for bit.
  _assert_equal_to_reference(base, workdir)


def test_every_checkpoint_corrupt_is_a_clear_error(chaos_run, tmp_path):
  base, _ = chaos_run
  workdir = str(tmp_path / 'w')
  shutil.copytree(os.path.join(base, 'reference'), workdir)
  for step in ('36', '38', '40'):
    _corrupt(os.path.join(workdir, 'checkpoints', step), 'flip')
  with pytest.raises(ConfigError, match=r'every checkpoint in .* is corrupt .*step 40.*step 38.*step 36'):
    train_and_evaluate(tiny(plots=False), workdir)
  assert checkpoints.all_steps(workdir) == []  # set aside in checkpoints/corrupt, never loaded


# ---- SIGTERM writes a checkpoint before exiting. ----


def test_sigterm_checkpoints_then_exits_and_resumes_bit_for_bit(chaos_run, tmp_path, capsys):
  base, _ = chaos_run
  workdir = str(tmp_path / 'term')
  cmd = chaos.train_cmd(workdir, _cache(base))
  cmd = [c for c in cmd if not c.startswith('--config.checkpoint_every')] + ['--config.checkpoint_every=0']
  log = tmp_path / 'term.log'
  proc = cli_testing.start(cmd[1:], cwd=ROOT, env=chaos._env(), stdout=log)  # (a real process, as _forked's)
  path = os.path.join(workdir, 'metrics.jsonl')
  deadline = time.time() + 120
  while time.time() < deadline:  # wait for training to be under way: a 'train' record on disk
    if os.path.exists(path) and '"kind": "train"' in open(path).read():
      break
    time.sleep(0.05)
  t_signal = time.time()
  proc.send_signal(signal.SIGTERM)
  proc.wait(timeout=120)
  out = log.read_text()
  exit_s = time.time() - t_signal
  assert proc.returncode == 143, out[-2000:]
  assert 'Stopped by SIGTERM after step' in out and 'Traceback' not in out
  stopped = int(out.split('Stopped by SIGTERM after step ')[1].split(':')[0])
  assert 0 < stopped < 40
  assert checkpoints.all_steps(workdir) == [stopped]  # checkpoint_every=0: only the preemption wrote one
  assert checkpoints.read_meta(workdir)['step'] == stopped
  assert exit_s < 30
  # Rerunning the same config finishes the run: bit for bit the reference. (In this process, with the programs the
  # tests above kept: train.py resuming in a fresh process is the chaos run's.)
  summary, again = _train_here(workdir, capsys, checkpoint_every=0)
  assert _finished(summary), again[-2000:]
  assert f'Resuming {workdir} from step {stopped}.' in again
  _assert_equal_to_reference(base, workdir)


# ---- Every replica non-finite: a clear stop, the last good checkpoint intact. ----


def test_divergence_stops_with_an_error_and_keeps_the_last_good_checkpoint(chaos_run, tmp_path):
  """train.py with every replica's loss made NaN at step 9 (tests/fault_testing.py: a NaN factor in the batch, so the
  gradient and every replica's parameters are NaN after it; a divergence at a step the test chooses, not where a high
  LR happens to blow up, which depends on the last bits of the machine's arithmetic) and no controller (no back-off
  to roll it back), checkpointing every 2 steps: it stops at the next log interval with exit status 1 and the error,
  and the checkpoints before the divergence are kept; none after it is written."""
  base, _ = chaos_run
  workdir = str(tmp_path / 'nan')
  proc = _train(
    base, workdir, '--config.hdet.auto_lr=False', '--config.max_checkpoints=0', '--config.log_every=1', faults='9'
  )
  assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert 'error: training diverged at step 9 ' in proc.stderr and 'last good checkpoint is kept' in proc.stderr
  assert 'Traceback' not in proc.stderr
  summary = json.load(open(os.path.join(workdir, 'summary.json')))
  assert summary['diverged_at'] == 9 and summary['step'] == 10
  steps = checkpoints.all_steps(workdir)
  assert steps == [2, 4, 6, 8], steps
  # The last checkpoint is intact: finite, and its averaged model matches the fingerprint recorded at save time.
  state, avg, meta = chaos.load_checkpoint(workdir, steps[-1])
  assert all(np.all(np.isfinite(x)) for x in avg)
  assert any(np.all(np.isfinite(x)) for x in state)
  import jax.numpy as jnp

  assert checkpoints.fingerprint([jnp.asarray(x) for x in avg]) == meta['fingerprint']['avg_params']


# ---- Determinism. ----

_TIMING = {'wall_s', 'setup_s', 'tokens_per_s', 'steps_per_s', 'restore_s', 'workdir', 'metrics', 'checkpoints'}


def _records(workdir):
  out = []
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    for line in f:
      rec = json.loads(line)
      if rec['kind'] == 'throughput':
        continue
      out.append({k: v for k, v in rec.items() if k not in _TIMING})
  return out


def test_same_seed_same_metrics_other_seed_other_metrics(chaos_run, tmp_path, capsys):
  """The same config and seed in another process give the same records: the chaos run's restarts, each a fresh
  process, logged exactly the reference's (test_sigkill_three_times_resumes_bit_for_bit). Another seed: others (that
  run in this process, checkpointing only at its end: the cadence is a run field and its records are not compared)."""
  base, r = chaos_run
  assert r['metrics_equal'] == {'train': True, 'controller': True, 'eval': True} and len(r['kills']) >= 3
  summary, out = _train_here(str(tmp_path / 'other'), capsys, seed=1, checkpoint_every=0)
  assert _finished(summary), out[-2000:]
  ref, other = (_records(d) for d in (os.path.join(base, 'reference'), tmp_path / 'other'))
  assert len(ref) > 40
  la = [r['loss'] for r in ref if r['kind'] == 'train']
  lc = [r['loss'] for r in other if r['kind'] == 'train']
  assert len(la) == len(lc) == 40 and all(a != c for a, c in zip(la, lc))
  ea = [r['val_loss'] for r in ref if r['kind'] == 'eval']
  ec = [r['val_loss'] for r in other if r['kind'] == 'eval']
  assert len(ea) == len(ec) == 2 and all(a != c for a, c in zip(ea, ec))


# ---- Bad configs: one line naming the field, never a traceback from inside JAX. ----

_NAN, _INF = float('nan'), float('inf')
# field -> invalid values of the field's type (a wrong type is refused by ml_collections itself).
_INVALID = {
  'seed': [-1, 2**32],
  'num_train_steps': [-5, 0, 1],
  'data.val_fraction': [0.0, 1.0, -0.1, _NAN],
  'data.seq_len': [0, -3],
  'data.batch_size': [0, -1],
  'model.d_model': [0, -8],
  'model.num_layers': [0, -1],
  'model.num_heads': [0, -2],
  'model.mlp_ratio': [0, -1],
  'optim.max_lr': [0.0, -1e-3, _NAN, _INF],
  'optim.pct_start': [0.0, 1.0, 1.5, _NAN],
  'optim.div_factor': [0.0, -1.0, _INF],
  'optim.final_div_factor': [0.0, -2.0, _NAN],
  'optim.b1': [1.0, -0.1, _NAN],
  'optim.b2': [1.0, 2.0, _NAN],
  'optim.weight_decay': [-0.1, _NAN, _INF],
  'optim.grad_clip_norm': [-1.0, _NAN],
  'hdet.num_replicas': [-1],
  'hdet.spread': [1.0, 1.5, -0.1, _NAN, _INF],
  'hdet.sync_every': [-1, -100],
  'hdet.warmup_steps': [-1, 40, 1000],
  'hdet.temperature': [0.0, -0.1, _NAN],
  'hdet.lr_of_lr': [-0.5, _NAN],
  'hdet.momentum': [1.0, -0.1, _NAN],
  'warm_init.nu': [-0.01, _NAN],
  'log_every': [0, -1],
  'eval_every': [-1],
  'eval_windows': [-1],
  'checkpoint_every': [-1],
  'max_checkpoints': [-1],
  'stop_at_step': [-1],
  'num_cpu_devices': [-1],
  'optim.name': ['adamax', '', 'ADAM', 'lion'],
}
_OPTIONAL = {  # fields of newer configs, checked when present
  'model.dropout': [1.0, -0.1, _NAN],
  'model.attn_temperature': [0.0, -1.0, _NAN],
  'optim.label_smoothing': [1.0, -0.1],
  'hdet.explore.weight_decay': [1.0, -0.5],
  'hdet.explore.dropout': [-0.1, _NAN],
  'hdet.explore.label_smoothing': [-0.1, _INF],
  'hdet.explore.attn_temperature': [1.0, -0.1],
}
_BASE = tiny()
for _field, _values in _OPTIONAL.items():
  if _field in config_lib.flatten(_BASE):
    _INVALID[_field] = _values


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_invalid_config_values_are_one_line_naming_the_field(data, tmp_path_factory):
  fields = data.draw(st.lists(st.sampled_from(sorted(_INVALID)), min_size=1, max_size=3, unique=True))
  overrides = {f: data.draw(st.sampled_from(_INVALID[f]), label=f) for f in fields}
  workdir = str(tmp_path_factory.mktemp('bad') / 'w')
  with pytest.raises(ConfigError) as e:
    train_and_evaluate(tiny(**overrides), workdir)
  msg = str(e.value)
  assert '\n' not in msg
  assert any(f in msg for f in fields), (overrides, msg)  # names one of the fields it was given
  assert not os.path.exists(workdir)  # refused before anything was written


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_valid_edge_values_pass_the_checks(data):
  valid = {
    'seed': st.integers(0, 2**32 - 1),
    'data.val_fraction': st.floats(1e-6, 0.999),
    'optim.b1': st.floats(0, 0.999),
    'hdet.spread': st.floats(0, 0.999),
    'hdet.sync_every': st.integers(0, 50),
    'optim.max_lr': st.floats(1e-8, 10),
    'hdet.momentum': st.floats(0, 0.999),
    'eval_every': st.integers(0, 100),
  }
  fields = data.draw(st.lists(st.sampled_from(sorted(valid)), min_size=1, max_size=4, unique=True))
  trainer_testing.resolve(tiny(**{f: data.draw(valid[f], label=f) for f in fields}))


@pytest.mark.parametrize(
  'override,field',
  [
    ('--config.num_train_steps=-5', 'num_train_steps'),
    ('--config.hdet.spread=1.0', 'hdet.spread'),
    ('--config.data.batch_size=0', 'data.batch_size'),
    ('--config.optim.name=adamax', 'optim.name'),
    ('--config.hdet.sync_every=-1', 'hdet.sync_every'),
    ('--config.num_train_steps=2.5', 'num_train_steps'),  # a wrong type, refused while parsing the flags
  ],
)
def test_bad_values_on_the_command_line(tmp_path, override, field):
  proc = cli_testing.run(
    [os.path.join(ROOT, 'train.py'), '--config', TINY, '--workdir', str(tmp_path / 'w'), override],
    cwd=ROOT,
    env=chaos._env(),
    timeout=120,
  )
  assert proc.returncode == 2
  assert 'Traceback' not in proc.stderr and field.split('.')[-1] in proc.stderr, proc.stderr
  assert not os.path.exists(tmp_path / 'w')
