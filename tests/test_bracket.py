"""The LR bracket (hdet_jax/trainer/bracket.py): its LRs, rung arithmetic and ranking against closed forms, its
refusals, and a tiny bracket end to end against the same runs trained straight."""

import json
import math
import os

import numpy as np
import pytest

import cli_testing
from hdet_jax.trainer import bracket
from hdet_jax.trainer import config_lib
from hdet_jax.trainer import run_settings
from hdet_jax.trainer import schema
from hdet_jax.trainer.config_lib import ConfigError
from trainer_testing import tiny
import trainer_testing

PLAIN = {
  'hdet.spread': 0.0,
  'hdet.sync_every': 0,
  'hdet.num_syncs': 0,
  'hdet.auto_lr': False,
  'hdet.param_groups': False,
  'plots': False,
  'eval_windows': 16,
  'checkpoint_every': 0,
}


def test_point_lrs_are_geometric_around_max_lr():
  lrs = bracket.point_lrs(0.01, 8, 2.0)
  np.testing.assert_allclose(lrs, [0.01 * 2.0 ** (k - 3.5) for k in range(8)], rtol=1e-12)
  np.testing.assert_allclose(math.sqrt(lrs[3] * lrs[4]), 0.01, rtol=1e-12)  # centred: the middle pair's mean
  np.testing.assert_allclose(lrs[-1] / lrs[0], 128.0, rtol=1e-12)
  np.testing.assert_allclose(bracket.point_lrs(0.3, 3, 10.0), [0.03, 0.3, 3.0], rtol=1e-12)


def test_compute_in_runs():
  # 8 to 0.1, 4 from 0.1 to 0.3, 1 from 0.3 to 1: 0.8 + 0.8 + 0.7
  assert bracket.compute_runs(8, [(0.1, 4), (0.3, 1)], 1000) == pytest.approx(2.3)
  assert bracket.compute_runs(8, [(0.3, 1)], 1000) == pytest.approx(1 + 7 * 0.3)  # one comparison: 1 + 7 f
  # floor(0.1 * 15) = 1, floor(0.3 * 15) = 4: 8 * 1 + 4 * 3 + 11 steps
  assert bracket.compute_runs(8, [(0.1, 4), (0.3, 1)], 15) == pytest.approx((8 + 12 + 11) / 15)


def test_rungs_parse_and_steps():
  assert schema.parse_rungs('0.1:4, 0.3:1') == [(0.1, 4), (0.3, 1)]
  assert schema.rung_steps([(0.1, 4), (0.3, 1)], 750) == [75, 225]
  assert schema.rung_steps([(0.3, 1)], 40) == [12]  # 0.3 * 40 = 11.999...: not 11
  with pytest.raises(ValueError):
    schema.parse_rungs('0.1-4')


def test_survivors_rank_by_loss_ties_to_the_lower_lr_and_nonfinite_loses():
  losses = {0.1: 2.0, 0.2: 1.5, 0.4: 1.5, 0.8: math.inf, 1.6: math.nan, 0.05: 1.7}
  assert bracket.survivors(losses, 1) == [0.2]  # a tie goes to the lower LR
  assert bracket.survivors(losses, 3) == [0.05, 0.2, 0.4]  # returned lowest LR first
  assert bracket.survivors({0.1: math.nan, 0.2: math.inf, 0.4: 9.0}, 1) == [0.4]


def test_window_loss_reads_the_steps_before_the_rung(tmp_path):
  path = str(tmp_path / 'metrics.jsonl')
  rows = [{'kind': 'train', 'step': s, 'loss': [float(s), float(s) + 2]} for s in range(12)]
  rows.append({'kind': 'train', 'step': 9, 'loss': [100.0, 100.0]})  # re-logged after a resume: the last one counts
  with open(path, 'w') as f:
    f.write(''.join(json.dumps(r) + '\n' for r in rows))
  # steps 7, 8, 9 (9 re-logged) before step 10, each the mean over replicas: 8, 9, 100
  assert bracket.window_loss(path, 10, 3, None) == pytest.approx((8 + 9 + 100) / 3)
  assert bracket.window_loss(path, 2, 5, None) == pytest.approx((1 + 2) / 2)  # steps 0 and 1 only
  assert bracket.window_loss(path, 10, 3, 8) == math.inf  # diverged inside the window
  assert bracket.window_loss(path, 10, 3, 10) == pytest.approx((8 + 9 + 100) / 3)  # diverged after it
  with pytest.raises(RuntimeError, match='lacks'):
    bracket.window_loss(path, 20, 3, None)


@pytest.mark.parametrize(
  'over, names',
  [
    ({'bracket.points': 1}, 'bracket.points'),
    ({'bracket.factor': 1.0}, 'bracket.factor'),
    ({'bracket.compare_steps': 0}, 'bracket.compare_steps'),
    ({'bracket.rungs': '0.1'}, 'bracket.rungs'),
    ({'bracket.rungs': '0.3:4,0.1:1'}, 'bracket.rungs'),  # not increasing
    ({'bracket.rungs': '0.1:4,0.3:2'}, 'bracket.rungs'),  # the last does not keep 1
    ({'bracket.rungs': '0.1:8,0.3:1'}, 'bracket.rungs'),  # keeps all 8
    ({'bracket.rungs': '0.01:4,0.3:1'}, 'bracket.rungs'),  # floor(0.01 * 40) = 0: before any step
    ({'bracket.rungs': '0.5:4,1.0:1'}, 'bracket.rungs'),  # at the end: nothing left to run
    ({'hdet.auto_lr': True}, 'hdet.auto_lr'),
    ({'stop_at_step': 10}, 'stop_at_step'),
  ],
)
def test_bad_bracket_settings_are_refused_naming_the_field(over, names):
  config = tiny(**{**PLAIN, 'bracket.points': 8, **over})
  with pytest.raises(ConfigError, match=names.replace('.', r'\.')):
    trainer_testing.resolve(config)


def test_default_config_is_one_run_and_its_bracket_fields_stay_out_of_the_record():
  config = tiny()
  assert config.bracket.points == 0
  fields = trainer_testing.resolve(config).training_fields(8)
  assert not any(k.startswith('bracket.') for k in fields)
  # A bracket's runs never read bracket.*: no value of them changes a run's identity (its resume, its records).
  # (The identity of the fields as given: tiny's auto-LR with bracket.points=8 would not resolve.)
  for over in (
    {'bracket.rungs': '0.1:4,0.3:1'},
    {'bracket.points': 8},
    {'bracket.factor': 4.0},
    {'bracket.compare_steps': 3},
  ):
    assert run_settings.identity(config_lib.flatten(json.loads(tiny(**over).to_json())), 8) == fields, over
  assert trainer_testing.resolve(tiny(**{'seed': 1})).training_fields(8) != fields


def test_the_default_rungs_keep_5_then_1_for_2_5_runs():
  """The default bracket (configs/bracket.py): 8 points, 5 kept at 0.1 of the run, 1 at 0.3: 0.8 + 1.0 + 0.7 runs."""
  from trainer_testing import ROOT

  config = config_lib.load_config_file(os.path.join(ROOT, 'configs', 'bracket.py'))
  assert (config.bracket.points, config.bracket.factor) == (8, 2.0)
  assert schema.parse_rungs(config.bracket.rungs) == [(0.1, 5), (0.3, 1)]
  assert bracket.compute_runs(8, schema.parse_rungs(config.bracket.rungs), 1500) == pytest.approx(2.5)


def test_a_workdir_whose_recorded_fields_hold_bracket_fields_still_resumes(tmp_path):
  """A run written before bracket.* left a run's identity recorded them where not at their defaults."""
  from hdet_jax.trainer import checks

  fields = trainer_testing.resolve(tiny()).training_fields(8)
  old = {**fields, 'bracket.rungs': '0.1:5,0.3:1', 'bracket.factor': 4.0}
  (tmp_path / 'config.json').write_text(json.dumps({'training_fields': old}))
  assert checks.check_workdir(str(tmp_path), fields) is False  # (no checkpoints: nothing to resume yet)
  with pytest.raises(ConfigError, match=r'different config \(seed: 0 -> 1\)'):
    checks.check_workdir(str(tmp_path), trainer_testing.resolve(tiny(seed=1)).training_fields(8))


def test_a_workdir_of_another_kind_is_refused_untouched(tmp_path):
  workdir = tmp_path / 'w'
  workdir.mkdir()
  (workdir / 'metrics.jsonl').write_text('{"kind": "train", "step": 0, "loss": [1.0]}\n')
  config = tiny(**PLAIN, **{'bracket.points': 4, 'bracket.rungs': '0.5:1'})
  with pytest.raises(ConfigError, match='not an LR bracket'):
    trainer_testing.run_bracket(config, str(workdir))
  assert sorted(os.listdir(workdir)) == ['metrics.jsonl']


def _train_losses(workdir):
  from hdet_jax.trainer.metrics import read_metrics

  return {r['step']: float(np.mean(r['loss'])) for r in read_metrics(os.path.join(workdir, 'metrics.jsonl'))['train']}


def test_a_bracket_keeps_the_run_the_straight_runs_rank_first(tmp_path, monkeypatch):
  """4 points a factor 8 apart, 16 steps, rungs at 0.25 (keep 2) and 0.5 (keep 1), compared over 3 steps: the picks
  are those the same LRs' straight 16-step runs give, and the kept run ends bit for bit as its straight run."""
  from trainer_testing import train_and_evaluate

  over = {**PLAIN, 'num_train_steps': 16, 'optim.max_lr': 0.01, 'log_every': 4, 'eval_every': 0}
  config = tiny(
    **over, **{'bracket.points': 4, 'bracket.factor': 8.0, 'bracket.rungs': '0.25:2,0.5:1', 'bracket.compare_steps': 3}
  )

  def killed(run_config, workdir, **kwargs):  # a bracket killed inside its first run, before any rung was decided
    os.makedirs(os.path.join(workdir, 'checkpoints'))
    raise KeyboardInterrupt

  with monkeypatch.context() as m:
    m.setattr(bracket.trainer_lib, 'train_and_evaluate', killed)
    with pytest.raises(KeyboardInterrupt):
      trainer_testing.run_bracket(config, str(tmp_path / 'b'))
  assert json.load(open(tmp_path / 'b' / 'bracket.json'))['rungs'] == []  # recorded before any training
  summary = trainer_testing.run_bracket(config, str(tmp_path / 'b'))  # resumes it (the workdir is the bracket's own)
  state = summary['bracket']
  lrs = [0.01 * 8.0 ** (k - 1.5) for k in range(4)]
  np.testing.assert_allclose(state['lrs'], lrs, rtol=1e-12)
  # The oracle: each LR trained straight to the end in a workdir of its own, ranked by numpy. (Built as the points
  # are, with the LR's power of two applied at run time, so that they reuse the points' compiled programs; such a
  # run is the plain one bit for bit: tests/test_optimizer.py.)
  straight = {
    lr: train_and_evaluate(
      tiny(**{**over, 'optim.max_lr': lr, 'optim.runtime_lr_scale': True}), str(tmp_path / f's{k}')
    )
    for k, lr in enumerate(state['lrs'])
  }
  losses = {lr: _train_losses(s['workdir']) for lr, s in straight.items()}
  at4 = {lr: np.mean([losses[lr][s] for s in (1, 2, 3)]) for lr in lrs}
  kept4 = sorted(sorted(lrs, key=lambda lr: at4[lr])[:2])
  at8 = {lr: np.mean([losses[lr][s] for s in (5, 6, 7)]) for lr in kept4}
  winner = min(kept4, key=lambda lr: at8[lr])
  assert [r['step'] for r in state['rungs']] == [4, 8]
  np.testing.assert_allclose(
    [state['rungs'][0]['losses'][f'{lr:.6g}'] for lr in lrs], [at4[lr] for lr in lrs], rtol=1e-6
  )
  np.testing.assert_allclose(state['rungs'][0]['kept'], kept4, rtol=1e-12)
  np.testing.assert_allclose(state['rungs'][1]['kept'], [winner], rtol=1e-12)
  assert state['winner']['lr'] == pytest.approx(winner, rel=1e-12)
  assert summary['step'] == 16 and not summary['stopped_early']
  want = straight[min(straight, key=lambda lr: abs(lr - winner))]
  assert summary['final_metric'] == want['final_metric']  # bit for bit: resumed at its rungs, the same run
  assert state['compute_runs'] == pytest.approx((4 * 4 + 2 * 4 + 8) / 16)
  # Each point stopped where the bracket left it: the losers at their rung, the winner at the end.
  stopped = {lr: max(_train_losses(bracket._point_dir(str(tmp_path / 'b'), k, lr))) + 1 for k, lr in enumerate(lrs)}
  assert sorted(stopped.values()) == [4, 4, 8, 16]
  # Rerun: resumes the finished bracket, trains nothing, reports the same; also where its record was written by a
  # version that kept bracket.* among its runs' training fields.
  path = tmp_path / 'b' / 'bracket.json'
  old = json.load(open(path))
  old['fields']['training'].update({'bracket.points': 4, 'bracket.factor': 8.0, 'bracket.rungs': '0.25:2,0.5:1'})
  path.write_text(json.dumps(old))
  again = trainer_testing.run_bracket(config, str(tmp_path / 'b'))
  assert again['bracket']['rungs'] == json.loads(json.dumps(state['rungs']))
  assert again['final_metric'] == summary['final_metric']
  with pytest.raises(ConfigError, match='different config'):
    trainer_testing.run_bracket(
      tiny(
        **over,
        **{'bracket.points': 4, 'bracket.factor': 4.0, 'bracket.rungs': '0.25:2,0.5:1', 'bracket.compare_steps': 3},
      ),
      str(tmp_path / 'b'),
    )


@pytest.mark.skipif(
  not os.environ.get('HDET_MULTIPROCESS_TESTS'),
  reason='a bracket in one process, then in two x 4 CPU devices: 1-2 minutes; set HDET_MULTIPROCESS_TESTS=1',
)
def test_two_processes_run_the_bracket_one_process_runs(tmp_path):
  """train.py as 2 processes x 4 CPU devices (jax.distributed on localhost): 3 points a factor 8 apart, one rung at
  half of 16 steps. Both processes rank the same losses and keep the same run as the bracket in one process of 8
  devices; the losses differ only by the cross-process all-reduce's order: a float32 ulp at the rung (measured
  2e-7 relative), grown by the kept run's high LR to 2e-4 in its final metric by step 16."""
  from process_testing import run_two_processes
  from trainer_testing import ROOT

  over = {
    **PLAIN,
    'num_train_steps': 16,
    'optim.max_lr': 0.01,
    'log_every': 4,
    'eval_every': 0,
    'bracket.points': 3,
    'bracket.factor': 8.0,
    'bracket.rungs': '0.5:1',
    'bracket.compare_steps': 3,
  }
  one = trainer_testing.run_bracket(tiny(**over), str(tmp_path / 'one'))['bracket']
  two_dir = str(tmp_path / 'two')
  args = [f'--{"tuning" if k in schema.tuning_fields() else "config"}.{k}={v}' for k, v in over.items()]
  outs = run_two_processes(os.path.join(ROOT, 'configs', 'tiny.py'), two_dir, args, train=trainer_testing.TUNED_TRAIN)
  assert 'LR bracket over 3 peak LRs' in outs[0] and 'LR bracket over' not in outs[1]  # (process 0 reports)
  two = json.load(open(os.path.join(two_dir, 'bracket.json')))
  assert two['lrs'] == one['lrs'] and [r['kept'] for r in two['rungs']] == [r['kept'] for r in one['rungs']]
  a, b = one['rungs'][0]['losses'], two['rungs'][0]['losses']
  assert sorted(a) == sorted(b) and len(set(a.values())) == 3  # (three distinct losses to rank)
  np.testing.assert_allclose([b[k] for k in sorted(a)], [a[k] for k in sorted(a)], rtol=2e-6)
  np.testing.assert_allclose(two['winner']['final_metric'], one['winner']['final_metric'], rtol=1e-3)
  assert two['winner']['lr'] == one['winner']['lr'] and two['winner']['workdir'].startswith(two_dir)


def test_a_bad_bracket_on_the_command_line_is_one_error_line_and_writes_nothing(tmp_path):
  from trainer_testing import ROOT, chaos

  proc = cli_testing.run(
    [
      os.path.join(ROOT, 'train.py'),
      '--config',
      os.path.join(ROOT, 'configs', 'bracket.py'),
      '--workdir',
      str(tmp_path / 'w'),
      '--config.bracket.rungs=0.3:4,0.1:1',
    ],
    cwd=ROOT,
    env=chaos._env(),
    timeout=120,
  )
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: bracket.rungs=') and 'Traceback' not in proc.stderr
  assert not os.path.exists(tmp_path / 'w')


def test_format_bracket_lists_each_rung_and_the_kept_run():
  state = {
    'lrs': [0.01, 0.02, 0.04],
    'compute_runs': 1.6,
    'rungs': [{'fraction': 0.3, 'step': 30, 'losses': {'0.01': 2.5, '0.02': 2.25, '0.04': math.inf}, 'kept': [0.02]}],
    'winner': {'lr': 0.02, 'final_metric': 2.125, 'workdir': 'W/bracket/point1_lr0.02'},
  }
  lines = bracket.format_bracket(state).splitlines()
  assert lines[0] == 'LR bracket over 3 peak LRs (0.01, 0.02, 0.04); compute 1.60 runs.'
  assert lines[1] == '  step 30 (0.3 of the run): training loss 0.01 2.5000, 0.02 2.2500, 0.04 inf; kept 0.02'
  assert lines[2] == '  kept run: peak LR 0.02, final metric 2.1250 (W/bracket/point1_lr0.02)'
