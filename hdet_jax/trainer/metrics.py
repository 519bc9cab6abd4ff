"""Metrics: a JSONL writer (one record a line, appended, never rewritten) and a tqdm progress bar.

Records in ``WORKDIR/metrics.jsonl`` carry a ``kind``:

- ``train``: one per step: ``step``, ``loss`` (each replica's), ``lr`` (each replica's), ``base_lr``,
  ``sync`` (whether this step averaged the replicas);
- ``hyperparams``: at each start: ``names`` (the explored hyperparameters, ``[G]`` order) and ``controller``
  (``'fit'``, ``'paper'``, or None without auto-LR);
- ``controller``: one per sync step: ``weights``, ``window_losses``, ``delta``, ``velocity``, ``base_lr``, and
  per hyperparameter ``deltas`` (the step taken: the log-correction's change for 'fit'), ``velocities`` (the
  fitted slope for 'fit'), and the 'fit' controller's ``corrections`` (its log-correction of the schedule
  after the step), ``asks`` (the fitted step before gain, rise-only rule and trust region), ``stderrs`` (the
  slope's standard error), ``gains``, ``train_loss`` and ``train_loss_se`` (the replicas' mean training loss
  over the window and its standard error, with ``hdet.backoff``; absent without), and ``backed_off: true`` where the
  back-off stepped the LR down (with ``hdet.rollback`` the replicas then returned to the previous sync's state), and
  with ``hdet.settle`` ``settled`` (per hyperparameter, whether its climb has ended and its replicas train unspread)
  once any has;
- ``distance``: one per sync step, just before the average (runs that never average: at each log
  interval): ``distance`` (each replica's L2 distance from the replicas' mean) and ``mean_norm`` (the
  mean's L2 norm);
- ``throughput``: at each log interval: ``tokens_per_s``, ``steps_per_s``;
- ``eval``: ``val_loss`` (nats) and ``val_bits_per_byte`` of the averaged model;
- ``event``: start, resume, ``nonfinite`` (some replicas' loss is NaN/inf), ``diverged`` (all), end.

The per-step records ('train', 'controller', 'distance') are written by name: the programs emit each record's keys
as ``{record: {key: value}}`` (``programs.py``: ``_train_metrics``, ``_controller_metrics``, ``_distance_metrics``),
and :func:`write_step` writes every key under its own name, in the order emitted, as :class:`TensorBoardWriter` shows
it as ``<record>/<key>``; the few keys written otherwise, and the tags from before that rule, are one table each here
(``_AFTER``, ``_WHERE``; ``_TAGS``). A new metric is one line where its program emits it.

A resumed run appends (first cutting a last line a killed run left unfinished); readers keep the
last record of each (kind, step), so steps a killed run logged after its last checkpoint, then
recomputed by the resumed run, appear once.

Beside it, the same numbers go to TensorBoard event files (``WORKDIR/events.out.tfevents.*``, written
with tensorboardX, no TensorFlow; ``tensorboard --logdir WORKDIR``), see :class:`TensorBoardWriter`.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np


def num_params(params: Any) -> int:
  """The number of parameters of a pytree of arrays or shapes (``jax.ShapeDtypeStruct``): the sum of each leaf's
  product of its shape."""
  import jax  # (imported here: reading records needs no jax)

  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


def to_json_safe(x: Any) -> Any:
  """JSON-safe: numpy to Python, non-finite floats to the strings 'nan' / 'inf' / '-inf'."""
  if isinstance(x, dict):
    return {k: to_json_safe(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [to_json_safe(v) for v in x]
  if isinstance(x, np.ndarray):
    return to_json_safe(x.tolist())
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


# TensorBoard's tags: a record's key ``k`` (of the records in _SHOWN, ``step`` aside) is the tag ``<record>/<k>``, and
# an array's element ``[i, j]`` the tag ``<record>/<k>/<i>/<j>``: a new metric needs nothing here. The tags shown
# before that rule, kept as they were: (record, key) -> (tag, each axis's labels: 'r' ``replica_<r>``, 'g' the
# hyperparameter's name; and the value's transform) or None (not shown). 'fit' shows its own controller quantities,
# named as in plots/controller.png.
_SHOWN = ('train', 'controller', 'distance', 'eval', 'throughput')
_TAGS = {
  ('train', 'loss'): ('train/loss', 'r'),  # (and its mean: _MEANS)
  ('train', 'values'): ('train', 'gr'),
  ('train', 'bases'): ('train/base', 'g'),
  ('controller', 'window_losses'): ('controller/window_loss', 'r'),
  ('controller', 'weights'): ('controller/weight', 'r'),
  ('controller', 'deltas'): ('controller/delta', 'g'),
  ('controller', 'velocities'): ('controller/velocity', 'g'),
  ('distance', 'distance'): ('distance', 'r'),
  **dict.fromkeys([('train', k) for k in ('lr', 'base_lr', 'sync')]),
  **dict.fromkeys(
    ('controller', k)
    for k in ('delta', 'velocity', 'base_lr', 'corrections', 'asks', 'stderrs', 'gains')
    + ('train_loss', 'train_loss_se', 'backed_off', 'settled')
  ),
}
_FIT_TAGS = {
  **_TAGS,
  ('controller', 'weights'): None,
  ('controller', 'corrections'): ('controller/lr_correction', 'g', np.exp),  # the factor on the schedule
  ('controller', 'asks'): ('controller/step_asked', 'g'),
  ('controller', 'deltas'): ('controller/step_taken', 'g'),
  ('controller', 'velocities'): ('controller/slope', 'g'),
  ('controller', 'stderrs'): ('controller/slope_stderr', 'g'),
  ('controller', 'gains'): ('controller/gain', 'g'),
}
_MEANS = {('train', 'loss'): 'train/loss/mean'}


class TensorBoardWriter:
  """The scalars of the ``train``, ``controller``, ``distance``, ``eval`` and ``throughput`` records as TensorBoard
  events: each key's tag is ``<record>/<key>`` (an array's element: ``<record>/<key>/<i>``), but for the tags kept
  from before that rule (:data:`_TAGS`): e.g. ``train/loss/replica_<r>``, ``train/loss/mean``,
  ``train/<name>/replica_<r>`` (each replica's explored values; ``<name>`` from the ``hyperparams`` record),
  ``controller/window_loss/replica_<r>``, for 'fit' ``controller/step_asked/<name>`` (named as in
  ``plots/controller.png``), for the paper's controller ``controller/weight/replica_<r>``.

  A record's scalars go out as one event (one ``add_summary`` with many values), not as one
  ``add_scalar`` call (each an event of its own) per scalar. A resumed run starts a
  new event file that purges the steps from the resume step on (TensorBoard's ``purge_step``), so steps a
  killed run logged after its last checkpoint are shown once, as with ``metrics.jsonl``.
  """

  _opened = 0  # writers opened by this process

  def __init__(self, logdir: str):
    import tensorboardX  # the trainer extra; only imported when TensorBoard output is on
    from tensorboardX.proto import event_pb2, summary_pb2

    self._logdir = logdir
    # tensorboardX names a file by the second and the host and opens it with 'wb': a suffix keeps two
    # writers of one second (a quick restart) from overwriting each other, in the order they started.
    TensorBoardWriter._opened += 1
    suffix = f'.{os.getpid()}-{TensorBoardWriter._opened:04d}'
    self._open = lambda: tensorboardX.FileWriter(logdir, max_queue=100, flush_secs=60, filename_suffix=suffix)
    self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
    self._w = None
    self.names: list[str] = ['learning_rate']
    self.controller: str | None = None

  def _writer(self, purge_step: int | None = None):
    if self._w is None:
      self._w = self._open()
      if purge_step is not None:
        e = self._event_pb2
        self._w.add_event(e.Event(step=purge_step, file_version='brain.Event:2'))
        self._w.add_event(e.Event(step=purge_step, session_log=e.SessionLog(status=e.SessionLog.START)))
    return self._w

  def _add(self, step: int, scalars: dict[str, float]) -> None:
    value = self._summary_pb2.Summary.Value
    summary = self._summary_pb2.Summary(value=[value(tag=k, simple_value=v) for k, v in scalars.items()])
    self._writer().add_summary(summary, global_step=int(step))

  def write(self, kind: str, record: dict) -> None:
    step = record.get('step')
    if kind == 'event' and record.get('event') in ('start', 'resume'):
      self._writer(purge_step=int(step) if record['event'] == 'resume' else None)
      return
    if kind == 'hyperparams':
      self.names = list(record['names'])
      self.controller = record.get('controller')
      return
    out = self._scalars(kind, record)
    if out and step is not None:
      self._add(step, {k: float(v) for k, v in out.items()})

  def _scalars(self, kind: str, record: dict) -> dict[str, float]:
    """The tags and values of one record (none for a kind TensorBoard does not show)."""
    if kind not in _SHOWN:
      return {}
    tags = _FIT_TAGS if self.controller == 'fit' else _TAGS
    labels = {'r': lambda i: f'replica_{i}', 'g': lambda i: self.names[i] if i < len(self.names) else None}
    out = {}
    for key, value in record.items():
      shown = tags.get((kind, key), (f'{kind}/{key}', ''))
      if key == 'step' or shown is None:
        continue
      tag, axes, f = (*shown, None)[:3]
      x = np.asarray(value, np.float64)
      x = f(x) if f is not None else x
      for at in np.ndindex(x.shape):
        parts = [labels.get(a, str)(i) for a, i in zip(axes.ljust(x.ndim), at)]
        if None not in parts:
          out['/'.join([tag, *parts])] = float(x[at])
      if (kind, key) in _MEANS:
        out[_MEANS[kind, key]] = float(np.mean(x))
    return out

  def flush(self) -> None:
    if self._w is not None:
      self._w.flush()

  def close(self) -> None:
    if self._w is not None:
      self._w.close()
      self._w = None


class MetricsWriter:
  """Appends records to a JSONL file (only where ``enabled``, i.e. on process 0).

  With ``tensorboard`` the scalars also go to TensorBoard event files in the same directory.
  """

  def __init__(self, path: str, enabled: bool = True, tensorboard: bool = False):
    self.path = path
    self.enabled = enabled
    if enabled:
      _drop_partial_last_line(path)
    self._f = open(path, 'a', encoding='utf-8') if enabled else None
    self._tb = TensorBoardWriter(os.path.dirname(os.path.abspath(path))) if enabled and tensorboard else None

  def write(self, kind: str, **record: Any) -> None:
    if self._f is not None:
      self._f.write(json.dumps(to_json_safe({'kind': kind, **record})) + '\n')
    if self._tb is not None:
      self._tb.write(kind, record)

  def flush(self) -> None:
    for out in (self._f, self._tb):
      if out is not None:
        out.flush()

  def close(self) -> None:
    for out in (self._f, self._tb):
      if out is not None:
        out.close()
    self._f = self._tb = None


# The records' keys that are no program's metric, or are written only where they tell something: kept as the records
# have always had them (any other key is written as a program emits it, programs.py).
_AFTER = {  # (record, key) -> (the key written after it, its value from (sync, the step's records))
  ('train', 'base_lr'): ('sync', lambda sync, records: sync),  # whether this step averaged the replicas
  ('controller', 'velocity'): ('base_lr', lambda sync, records: records['train']['base_lr']),  # the step's, again
}
_WHERE = {  # (record, key) -> whether the record holds it, from the record's values
  # the back-off's window loss (NaN without hdet.backoff)
  ('controller', 'train_loss'): lambda c: np.isfinite(c['train_loss']),
  ('controller', 'train_loss_se'): lambda c: np.isfinite(c['train_loss']),
  ('controller', 'backed_off'): lambda c: c['backed_off'],  # (``true`` where it fired)
  ('controller', 'settled'): lambda c: np.any(c['settled']),  # (once any climb has settled)
}


def write_step(writer: MetricsWriter, step: int, sync: bool, records: dict) -> None:
  """One step's records, ``{record: {key: value}}`` as the programs emit them (``programs.py``: a step's 'train', a
  sync's 'controller' and 'distance'): each key under its own name, in the order emitted, but for :data:`_AFTER`
  and :data:`_WHERE`."""
  for kind, values in records.items():
    out = {}
    for key, value in values.items():
      if (kind, key) in _WHERE and not _WHERE[kind, key](values):
        continue
      out[key] = value
      if (kind, key) in _AFTER:
        after, read = _AFTER[kind, key]
        out[after] = read(sync, records)
    writer.write(kind, step=step, **out)


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

      self._bar = tqdm(
        total=total,
        initial=initial,
        unit='step',
        dynamic_ncols=True,
        smoothing=0.1,
        bar_format='{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]',
      )

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
