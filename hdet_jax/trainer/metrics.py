"""Metrics: a JSONL writer (one record a line, appended, never rewritten) and a tqdm progress bar.

Records in ``WORKDIR/metrics.jsonl`` carry a ``kind``:

- ``train``: one per step: ``step``, ``loss`` (each replica's), ``lr`` (each replica's), ``base_lr``,
  ``sync`` (whether this step averaged the replicas);
- ``controller``: one per sync step: ``weights``, ``window_losses``, ``delta``, ``velocity``, ``base_lr``;
- ``throughput``: at each log interval: ``tokens_per_s``, ``steps_per_s``;
- ``eval``: ``val_loss`` (nats) and ``val_bits_per_byte`` of the averaged model;
- ``event``: start, resume, ``nonfinite`` (some replicas' loss is NaN/inf), ``diverged`` (all), end.

A resumed run appends (first cutting a last line a killed run left unfinished); readers keep the
last record of each (kind, step), so steps a killed run logged after its last checkpoint, then
recomputed by the resumed run, appear once.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable

import numpy as np


def _clean(x: Any) -> Any:
  """JSON-safe: numpy to Python, non-finite floats to the strings 'nan' / 'inf' / '-inf'."""
  if isinstance(x, dict):
    return {k: _clean(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_clean(v) for v in x]
  if isinstance(x, np.ndarray):
    return _clean(x.tolist())
  if isinstance(x, (np.floating, float)):
    x = float(x)
    return x if math.isfinite(x) else str(x)
  if isinstance(x, np.integer):
    return int(x)
  if isinstance(x, np.bool_):
    return bool(x)
  return x


def _restore(x: Any) -> Any:
  if isinstance(x, dict):
    return {k: _restore(v) for k, v in x.items()}
  if isinstance(x, list):
    return [_restore(v) for v in x]
  if x in ('nan', 'inf', '-inf'):
    return float(x)
  return x


def _drop_partial_last_line(path: str) -> None:
  """Cuts a last line that a killed run left without its newline, so appending starts a fresh line.

  (Appending to it instead would glue the next record onto the fragment, and the reader would drop both.)
  """
  if not os.path.exists(path):
    return
  with open(path, 'rb+') as f:
    size = f.seek(0, os.SEEK_END)
    if size == 0:
      return
    f.seek(size - 1)
    if f.read(1) == b'\n':
      return
    pos = size
    while pos > 0:  # back to the last newline, in blocks
      start = max(0, pos - 65536)
      f.seek(start)
      block = f.read(pos - start)
      i = block.rfind(b'\n')
      if i >= 0:
        f.truncate(start + i + 1)
        return
      pos = start
    f.truncate(0)


class MetricsWriter:
  """Appends records to a JSONL file (only where ``enabled``, i.e. on process 0)."""

  def __init__(self, path: str, enabled: bool = True):
    self.path = path
    self.enabled = enabled
    if enabled:
      _drop_partial_last_line(path)
    self._f = open(path, 'a', encoding='utf-8') if enabled else None

  def write(self, kind: str, **record: Any) -> None:
    if self._f is not None:
      self._f.write(json.dumps(_clean({'kind': kind, **record})) + '\n')

  def write_many(self, kind: str, records: Iterable[dict]) -> None:
    for r in records:
      self.write(kind, **r)

  def flush(self) -> None:
    if self._f is not None:
      self._f.flush()

  def close(self) -> None:
    if self._f is not None:
      self._f.close()
      self._f = None


def read_metrics(path: str) -> dict[str, list[dict]]:
  """Records by kind, sorted by step, keeping the last record of each (kind, step)."""
  by_kind: dict[str, dict] = {}
  events: list[dict] = []
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path}: no metrics file; run train.py with this workdir first.')
  with open(path, encoding='utf-8') as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        rec = _restore(json.loads(line))
      except json.JSONDecodeError:
        continue  # a line cut short by a crash
      kind = rec.get('kind', '')
      if kind == 'event':
        events.append(rec)
      else:
        by_kind.setdefault(kind, {})[rec.get('step')] = rec
  out = {k: [v[s] for s in sorted(v)] for k, v in by_kind.items()}
  out['event'] = events
  return out


class ProgressBar:
  """A tqdm bar: step, train loss, base LR, steps/s and ETA (only where ``enabled``)."""

  def __init__(self, total: int, initial: int, enabled: bool = True):
    self._bar = None
    if enabled:
      from tqdm.auto import tqdm
      self._bar = tqdm(total=total, initial=initial, unit='step', dynamic_ncols=True, smoothing=0.1,
                       bar_format='{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]')

  def update(self, steps: int, loss: float, base_lr: float) -> None:
    if self._bar is not None:
      self._bar.set_postfix_str(f'loss={loss:.4f} lr={base_lr:.2e}', refresh=False)
      self._bar.update(steps)

  def write(self, message: str) -> None:
    if self._bar is not None:
      self._bar.write(message)
    else:
      print(message, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
