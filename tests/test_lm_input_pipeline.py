"""The data pipeline: the KJV corpus, the split, and deterministic, disjoint, train-only batches."""

import numpy as np
import pytest

from hdet_jax.trainer.tasks import lm_input_pipeline as ip


def _synthetic(n_train=20_000, n_val=2_000):
  """Train bytes are lowercase letters, validation bytes are digits: any leak is visible."""
  rng = np.random.default_rng(0)
  train = rng.integers(ord('a'), ord('z') + 1, n_train).astype(np.uint8)
  val = rng.integers(ord('0'), ord('9') + 1, n_val).astype(np.uint8)
  return np.concatenate([train, val]), n_val / (n_train + n_val)


def test_kjv_corpus_is_the_bible_text():
  text = ip.load_kjv()
  assert text.startswith(b'In the beginning God created the heaven and the earth.')
  assert text.rstrip().endswith(b'The grace of our Lord Jesus Christ [be] with you all. Amen.')
  assert 4_100_000 < len(text) < 4_300_000
  assert b'"""' not in text
  text.decode('utf-8')
  data = ip.load_corpus(None)
  assert data.dtype == np.uint8 and len(data) == len(text)


def test_split_holds_out_the_tail():
  data = np.arange(1000, dtype=np.int64).astype(np.uint8)
  train, val = ip.split(data, 0.05)
  assert len(train) == 950 and len(val) == 50
  np.testing.assert_array_equal(np.concatenate([train, val]), data)


def test_batches_are_deterministic_given_seed_and_step():
  data, frac = _synthetic()
  train, _ = ip.split(data, frac)
  a = ip.TrainBatches(train, 31, 4, 8, seed=3)
  b = ip.TrainBatches(train.copy(), 31, 4, 8, seed=3)
  c = ip.TrainBatches(train, 31, 4, 8, seed=4)
  assert a.batch(0).shape == (8, 4, 32) and a.batch(0).dtype == np.uint8
  far = 3 * a.steps_per_epoch + 5  # a later epoch, reached without visiting the steps before it
  for step in (0, 1, a.steps_per_epoch - 1, a.steps_per_epoch, far):
    np.testing.assert_array_equal(a.batch(step), b.batch(step))
    assert not np.array_equal(a.batch(step), c.batch(step))
  assert not np.array_equal(a.batch(0), a.batch(1))
  assert not np.array_equal(a.batch(0), a.batch(a.steps_per_epoch))  # epochs are reshuffled
  assert a.position(far) == {'epoch': 3, 'batch_in_epoch': 5}


def test_replicas_get_distinct_windows_within_an_epoch():
  data, frac = _synthetic()
  train, _ = ip.split(data, frac)
  tb = ip.TrainBatches(train, 31, 4, 8, seed=0)
  offsets = np.stack([tb.offsets(s) for s in range(tb.steps_per_epoch)])  # [steps, N, B]
  assert len(np.unique(offsets)) == offsets.size  # no window twice in an epoch, across replicas and steps
  # Windows do not overlap: every offset is shift + k * window for one shift.
  assert len(np.unique(offsets % tb.window)) == 1
  batch = tb.batch(0)
  for r in range(1, 8):
    assert not np.array_equal(batch[0], batch[r])
  # Each window is the corpus at its offset.
  np.testing.assert_array_equal(batch[2, 1], train[offsets[0, 2, 1] : offsets[0, 2, 1] + 32])


def test_validation_bytes_never_appear_in_training_batches():
  data, frac = _synthetic()
  train, val = ip.split(data, frac)
  assert set(np.unique(val)) <= set(range(ord('0'), ord('9') + 1))
  tb = ip.TrainBatches(train, 31, 4, 8, seed=0)
  seen = np.concatenate([tb.batch(s).ravel() for s in range(2 * tb.steps_per_epoch + 3)])
  assert seen.min() >= ord('a') and seen.max() <= ord('z')
  offsets = np.stack([tb.offsets(s) for s in range(2 * tb.steps_per_epoch)])
  assert offsets.min() >= 0 and offsets.max() + tb.window <= len(train)


def test_validation_windows_cover_the_split_prefix():
  data, frac = _synthetic()
  _, val = ip.split(data, frac)
  w = ip.validation_windows(val, 31, 8, max_windows=40)
  assert w.shape == (8, 5, 32)
  np.testing.assert_array_equal(w.reshape(-1), val[: 8 * 5 * 32])
  assert ip.validation_windows(val, 31, 8, max_windows=0).shape == (8, len(val) // 32 // 8, 32)


def test_local_file_corpus(tmp_path):
  path = tmp_path / 'corpus.txt'
  path.write_text('Grüße, world. ' * 1000, encoding='utf-8')
  data = ip.load_corpus(str(path))
  assert bytes(data[:7]) == 'Grüße'.encode('utf-8')[:7]
  assert len(data) == len(('Grüße, world. ' * 1000).encode('utf-8'))


def test_bad_corpora_say_what_to_do(tmp_path):
  with pytest.raises(ip.DataError, match='no such file'):
    ip.load_corpus(str(tmp_path / 'missing.txt'))
  bad = tmp_path / 'latin1.txt'
  bad.write_bytes(b'caf\xe9 ' * 100)
  with pytest.raises(ip.DataError, match='not UTF-8'):
    ip.load_corpus(str(bad))
  small = np.frombuffer(b'x' * 500, np.uint8)
  with pytest.raises(ip.DataError, match='too few for one batch'):
    ip.TrainBatches(small, 31, 4, 8, seed=0)
  with pytest.raises(ip.DataError, match='validation split'):
    ip.validation_windows(small[:100], 31, 8, 0)


def test_chunk_stacks_consecutive_steps_batches():
  data, frac = _synthetic()
  train, _ = ip.split(data, frac)
  tb = ip.TrainBatches(train, 31, 4, 8, seed=3)
  first = tb.steps_per_epoch - 2  # straddles an epoch boundary
  chunk = tb.chunk(first, 5)
  assert chunk.shape == (8, 5, 4, 32) and chunk.dtype == np.uint8
  for i in range(5):
    np.testing.assert_array_equal(chunk[:, i], tb.batch(first + i))


def test_probe_windows_are_fresh_deterministic_training_windows():
  data = np.frombuffer(bytes(range(256)) * 40, np.uint8)
  train, val = ip.split(data, 0.1)
  a = ip.probe_windows(train, 16, 8, seed=3, index=5)
  assert a.shape == (8, 17) and a.dtype == np.uint8
  np.testing.assert_array_equal(a, ip.probe_windows(train, 16, 8, seed=3, index=5))
  assert not np.array_equal(a, ip.probe_windows(train, 16, 8, seed=3, index=6))
  assert not np.array_equal(a, ip.probe_windows(train, 16, 8, seed=4, index=5))
  # Every window is a contiguous slice of the training split (bytes increase by 1 mod 256).
  np.testing.assert_array_equal((np.diff(a.astype(int), axis=1)) % 256, 1)
  assert a.max() < 256 and len(train) + len(val) == len(data)
