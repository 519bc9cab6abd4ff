"""experiments/autolr: the --quick smoke run of every stage, its cache, its report and its bad input."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import autolr as A
from experiments import autolr_report as R

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_runs_every_stage_and_reuses_its_cache(tmp_path, capsys):
  A.main(['--quick', '--workdir', str(tmp_path)])
  out = json.load(open(tmp_path / 'quick' / 'autolr.json'))
  res = out['adamw']
  assert res['grid_best']['lr'] in A.QUICK_GRIDS['adamw']
  assert set(res['grid']) == {f'{lr:.4g}' for lr in A.QUICK_GRIDS['adamw']}
  high = res['variants']['fit_common']['high']
  assert high['start_lr'] == pytest.approx(10 * res['anchor_lr'])
  assert np.isfinite(high['val_bpb']) and high['final_lr'] > 0
  assert np.isfinite(res['peers']['adam_plateau']['val_bpb'])
  for f in ('autolr.md', 'figures/autolr_lr_adamw.png', 'figures/autolr_signal_adamw.png'):
    assert (tmp_path / 'quick' / f).stat().st_size > 0
  records = sorted((tmp_path / 'quick' / 'records' / 'adamw').glob('*.json'))
  assert len(records) == 5  # 2 grid points, 1 HDET start, 1 peer, the anchor
  before = {p: p.read_bytes() for p in records}
  capsys.readouterr()
  A.main(['--quick', '--workdir', str(tmp_path)])  # every run cached: nothing trains again
  assert 'val ' not in capsys.readouterr().out
  assert {p: p.read_bytes() for p in records} == before


def test_signal_per_sync_matches_a_direct_regression():
  # Losses exactly linear in the LR offset: the difference across the spread is slope x range, noise 0.
  rho = np.array([0.75, 1.25, 1.0, 0.9, 1.1, 0.8, 1.2, 1.05])
  losses = 3.0 - 0.4 * (rho - 1.0)
  rec = {'hyperparams': ['learning_rate'], 'controller': [
      {'step': 24, 'values': [list(1e-3 * rho)], 'window_losses': list(losses)}]}
  (sig,) = R.signal_per_sync(rec)
  assert sig['diff'] == pytest.approx(-0.4 * (rho.max() - rho.min()), rel=1e-6)  # the loss change across the spread
  assert sig['noise'] == pytest.approx(0.0, abs=1e-9)


def test_bad_override_is_one_error_line(tmp_path):
  r = subprocess.run([sys.executable, '-m', 'experiments.autolr', '--quick', '--workdir', str(tmp_path),
                      '--config.hdet.spred=0.2'], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert r.returncode == 2
  assert r.stderr.strip().startswith('error:') and 'spred' in r.stderr and len(r.stderr.strip().splitlines()) == 1
  assert not any(tmp_path.iterdir())  # nothing written
