"""The held-out ``digits`` check's data: scikit-learn's bundled handwritten digits as 1-D signals, in an ``.npz``.

The 1,797 8x8 images of the UCI "Optical Recognition of Handwritten Digits" test set (Alpaydin and Kaynak, 1998;
CC BY 4.0), as scikit-learn ships them inside its wheel (``sklearn.datasets.load_digits``: no download). Each image
is read row by row as a 64-sample signal, its 0-16 counts divided by 16 (exact in float16). A fixed random split
(numpy's Philox, seed 0): 1,437 training and 360 test examples. The mnist1d task reads it with ``data.path``.

The file is committed (``research/data/digits.npz``, about 57 kB); this command rebuilds it bit for bit and
needs scikit-learn, which the project does not depend on::

    pip install scikit-learn && python -m research.archive.digits_npz
"""

from __future__ import annotations

import os

import numpy as np

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'data', 'digits.npz')  # research/data/
TEST_EXAMPLES = 360


def arrays() -> dict[str, np.ndarray]:
  """x, y, x_test, y_test from scikit-learn's bundled digits (see the module's docstring)."""
  from sklearn.datasets import load_digits

  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float16)  # [1797, 64], multiples of 1/16
  y = digits.target.astype(np.int8)
  order = np.random.Generator(np.random.Philox(0)).permutation(len(y))
  test, train = order[:TEST_EXAMPLES], order[TEST_EXAMPLES:]
  return {'x': x[train], 'y': y[train], 'x_test': x[test], 'y_test': y[test]}


def main() -> None:
  os.makedirs(os.path.dirname(PATH), exist_ok=True)
  np.savez_compressed(PATH, **arrays())
  print(f'wrote {os.path.relpath(PATH)} ({os.path.getsize(PATH):,} bytes)')


if __name__ == '__main__':
  main()
