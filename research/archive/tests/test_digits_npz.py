"""research/digits_npz.py: the committed digits data against what the UCI digits are, and rebuilt exactly."""

import numpy as np
import pytest

from research.archive import digits_npz

# The class sizes of the 1,797 digits (UCI "Optical Recognition of Handwritten Digits", the test set's counts as
# scikit-learn's load_digits documents them).
CLASS_SIZES = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
COMMITTED = digits_npz.PATH


def test_the_committed_digits_are_the_1797_images_split_1437_360():
  with np.load(COMMITTED) as f:
    d = {k: f[k] for k in f.files}
  assert sorted(d) == ['x', 'x_test', 'y', 'y_test']
  assert d['x'].shape == (1437, 64) and d['x_test'].shape == (360, 64)
  assert d['x'].dtype == np.float16 and d['y'].dtype == np.int8
  x, y = np.concatenate([d['x'], d['x_test']]), np.concatenate([d['y'], d['y_test']])
  assert np.bincount(y).tolist() == CLASS_SIZES
  counts = x.astype(np.float64) * 16  # the images' 0-16 pixel counts, exactly
  assert np.array_equal(counts, np.round(counts)) and counts.min() == 0 and counts.max() == 16
  assert np.bincount(d['y_test'], minlength=10).min() >= 20  # every class is in the test split


def test_the_command_rebuilds_the_committed_arrays_exactly(tmp_path, monkeypatch):
  pytest.importorskip('sklearn')  # (the test extra installs it; the trainer does not need it: the data is committed)
  monkeypatch.setattr(digits_npz, 'PATH', str(tmp_path / 'digits.npz'))
  digits_npz.main()
  with np.load(tmp_path / 'digits.npz') as rebuilt, np.load(COMMITTED) as committed:
    assert rebuilt.files == committed.files
    for k in committed.files:
      assert rebuilt[k].dtype == committed[k].dtype and np.array_equal(rebuilt[k], committed[k]), k
