"""research/lowcomm.py: records from finished workdirs (checked against the study's configs), the report they draw
and its regeneration, a rerun that trains only what is missing; its --quick run trains every mode (opt-in)."""

import json
import os

import numpy as np
import pytest

from research import lowcomm as L


def _finished_workdir(path, config, bpb: float, wall_s: float = 120.0, **summary):
  """A workdir as the trainer leaves a finished run: config.json (its fields) and summary.json (its numbers)."""
  os.makedirs(path, exist_ok=True)
  given = json.loads(config.to_json())
  with open(os.path.join(path, 'config.json'), 'w') as f:
    json.dump({'training_fields': {'seed': config.seed}, 'config': given}, f)
  out = {
    'step': config.num_train_steps,
    'num_train_steps': config.num_train_steps,
    'stopped_early': False,
    'preempted': False,
    'diverged_at': None,
    'final_train_loss': 1.5,
    'final_val_loss': bpb * np.log(2),
    'final_val_bits_per_byte': bpb,
    'tokens_per_s': 'nan',  # (how summary.json writes a non-finite number)
    'setup_s': 3.0,
    'wall_s': wall_s,
    'num_replicas': 4,
    'num_devices': 8,
    'num_params': 1000,
    'workdir': str(path),
    'machine': {'cpu': 'test'},
    **summary,
  }
  with open(os.path.join(path, 'summary.json'), 'w') as f:
    json.dump(out, f)


# Seeds 0 and 1 of shared and lowcomm, seed 0 of lowcomm_avg_opt: a partial study.
BPB = {('shared', 0): 2.0, ('shared', 1): 2.2, ('lowcomm', 0): 2.2, ('lowcomm', 1): 2.31, ('lowcomm_avg_opt', 0): 2.1}


def _workdirs(root, quick: bool):
  for (mode, seed), bpb in BPB.items():
    _finished_workdir(root / L.run_name(mode, seed), L.run_config(mode, seed, quick), bpb, wall_s=60.0 * (seed + 1))
  os.makedirs(root / 'lowcomm_seed2')  # a run still training: no summary yet
  (root / 'shared_seed0.lock').write_text('')  # not a run


def test_imported_workdirs_make_records_and_the_report_they_draw(tmp_path, capsys):
  _workdirs(tmp_path / 'src', quick=False)
  study = L.Study(str(tmp_path / 'runs'), str(tmp_path / 'work'), quick=False)
  assert study.import_workdirs(str(tmp_path / 'src')) == sorted(L.run_name(m, s) for m, s in BPB)
  assert 'lowcomm_seed2: skipped: ' in capsys.readouterr().out
  rec = json.load(open(tmp_path / 'runs' / 'lowcomm_seed1.json'))
  assert (rec['mode'], rec['seed'], rec['final_val_bits_per_byte'], rec['wall_s']) == ('lowcomm', 1, 2.31, 120.0)
  assert rec['tokens_per_s'] is None and 'workdir' not in rec and rec['machine'] == {'cpu': 'test'}
  assert rec['config']['hdet']['low_communication'] is True and rec['config']['hdet']['sync_every'] == 25
  paths = L.write_report(study, str(tmp_path / 'out'))
  assert sorted(os.path.basename(p) for p in paths) == ['lowcomm.json', 'lowcomm.md']
  js = json.load(open(tmp_path / 'out' / 'lowcomm.json'))
  assert js['modes']['shared']['mean'] == pytest.approx(2.1)
  assert js['modes']['lowcomm']['val_bits_per_byte'] == {'0': 2.2, '1': 2.31}
  # Each mode against the shared gradient on the seeds both hold: the ratio of their means, less 1.
  assert js['vs_shared']['lowcomm']['seeds'] == [0, 1]
  assert js['vs_shared']['lowcomm']['gap'] == pytest.approx((2.2 + 2.31) / (2.0 + 2.2) - 1)  # +7.4%
  assert js['vs_shared']['lowcomm_avg_opt'] == {'seeds': [0], 'gap': pytest.approx(2.1 / 2.0 - 1), 'se': None}
  md = (tmp_path / 'out' / 'lowcomm.md').read_text()
  assert 'Seeds recorded: shared 0, 1; lowcomm 0, 1; lowcomm_avg_opt 0 (of 0, 1, 2).' in md
  assert 'Low-communication: +7.4% (2 seeds: 0, 1)' in md
  assert 'with the optimizer state averaged at each sync: +5.0% (1 seed: 0)' in md
  assert '(T = 25, 1500 steps, the fit controller)' in md and 'same 64 windows a step' in md
  assert '| mode | val bits/byte, mean | seed 0 | seed 1 | run time, min (mean) |' in md
  assert '| shared | 2.1000 | 2.0000 | 2.2000 | 1.5 |' in md
  assert '| lowcomm_avg_opt | 2.1000 | 2.1000 |  | 1.0 |' in md
  # Importing again leaves the records as they are.
  before = {p: (tmp_path / 'runs' / p).read_bytes() for p in os.listdir(tmp_path / 'runs')}
  assert study.import_workdirs(str(tmp_path / 'src')) == []
  assert {p: (tmp_path / 'runs' / p).read_bytes() for p in os.listdir(tmp_path / 'runs')} == before


def test_the_command_imports_redraws_byte_for_byte_and_refuses_bad_input(tmp_path, capsys):
  """--quick keeps its records under the work root: import, --report-only, and one error line for bad input."""
  root, src = tmp_path / 'root', tmp_path / 'src'
  with pytest.raises(SystemExit, match=r'^error: --report-only: no records in .*records\.$'):
    L.main(['--quick', '--work-root', str(root), '--report-only'])
  _workdirs(src, quick=True)
  got = L.main(['--quick', '--work-root', str(root), '--import-workdirs', str(src)])
  assert got == {'shared': {0: 2.0, 1: 2.2}, 'lowcomm': {0: 2.2, 1: 2.31}, 'lowcomm_avg_opt': {0: 2.1}}
  first = {n: (root / n).read_bytes() for n in ('lowcomm.md', 'lowcomm.json')}
  assert b'`--quick` smoke run' in first['lowcomm.md']
  L.main(['--quick', '--work-root', str(root), '--report-only', '--out', str(tmp_path / 'again')])
  assert {n: (tmp_path / 'again' / n).read_bytes() for n in first} == first
  # A workdir of another config (here the shared run's, under lowcomm's name) is refused, naming the difference.
  _finished_workdir(src / 'lowcomm_avg_opt_seed1', L.run_config('shared', 1, True), 2.0)
  with pytest.raises(SystemExit, match=r'^error: lowcomm_avg_opt_seed1: not the run .* \(hdet.average_opt_state'):
    L.main(['--quick', '--work-root', str(root), '--import-workdirs', str(src)])
  with pytest.raises(SystemExit, match=r'^error: --import-workdirs: .* is not a folder$'):
    L.main(['--quick', '--work-root', str(root), '--import-workdirs', str(tmp_path / 'nowhere')])
  capsys.readouterr()


def test_a_rerun_trains_only_the_runs_without_a_record(tmp_path, monkeypatch):
  """A recorded run is not trained again; a finished workdir is recorded, not retrained; the rest train, are recorded
  and their workdirs deleted (the stand-in trainer writes what the trainer leaves)."""
  from hdet_jax.trainer import run_settings, trainer

  trained = []

  def fake_train(config, workdir, tuning=None):
    trained.append(os.path.basename(workdir))  # (config.json holds the tuning given in Python, as the trainer's)
    _finished_workdir(workdir, run_settings.recorded_config(config, tuning), 3.0 + config.seed)
    return {'preempted': False, 'machine': {'cpu': 'test'}}

  monkeypatch.setattr(trainer, 'train_and_evaluate', fake_train)
  study = L.Study(str(tmp_path / 'runs'), str(tmp_path / 'work'), quick=True)
  _finished_workdir(tmp_path / 'work' / 'lowcomm_seed0', L.run_config('lowcomm', 0, True), 2.5)  # finished earlier
  assert study.run('shared', 0)['final_val_bits_per_byte'] == 3.0
  assert study.run('lowcomm', 0)['final_val_bits_per_byte'] == 2.5
  assert study.run('shared', 0)['final_val_bits_per_byte'] == 3.0  # recorded
  assert trained == ['shared_seed0'] and not os.path.exists(tmp_path / 'work' / 'shared_seed0')
  assert sorted(os.listdir(tmp_path / 'runs')) == ['lowcomm_seed0.json', 'shared_seed0.json']
  # A record of another config stands for nothing: that run trains again.
  rec = json.load(open(tmp_path / 'runs' / 'shared_seed0.json'))
  rec['config']['hdet']['sync_every'] = 7
  (tmp_path / 'runs' / 'shared_seed0.json').write_text(json.dumps(rec))
  study.run('shared', 0)
  assert trained == ['shared_seed0', 'shared_seed0']


@pytest.mark.skipif(not os.environ.get('HDET_SLOW_TESTS'), reason='about a minute: set HDET_SLOW_TESTS=1')
def test_lowcomm_quick_runs_every_mode_and_reuses_finished_runs(tmp_path):
  first = L.main(['--quick', '--work-root', str(tmp_path)])
  assert set(first) == set(L.MODES) and all(np.isfinite(v[0]) for v in first.values())
  assert L.main(['--quick', '--work-root', str(tmp_path)]) == first  # read back, not rerun
  assert sorted(os.listdir(tmp_path / 'records')) == sorted(f'{m}_seed0.json' for m in L.MODES)
  assert sorted(os.listdir(tmp_path)) == ['lowcomm.json', 'lowcomm.md', 'records']  # the workdirs deleted
