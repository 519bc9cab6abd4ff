"""research/lowcomm.py: its --quick run trains every mode on 4x2 and reads finished runs back (opt-in)."""

import os

import numpy as np
import pytest


@pytest.mark.skipif(not os.environ.get('HDET_SLOW_TESTS'), reason='about a minute: set HDET_SLOW_TESTS=1')
def test_lowcomm_quick_runs_every_mode_and_reuses_finished_runs(tmp_path):
  from research import lowcomm

  first = lowcomm.main(['--quick', '--work-root', str(tmp_path)])
  assert set(first) == set(lowcomm.MODES) and all(np.isfinite(v[0]) for v in first.values())
  assert lowcomm.main(['--quick', '--work-root', str(tmp_path)]) == first  # read back, not rerun
