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
from typing import Any, Iterable

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


class TensorBoardWriter:
  """The scalars of the ``train``, ``controller``, ``eval`` and ``throughput`` records as TensorBoard events.

  Tags (N replicas; ``<name>`` from the ``hyperparams`` record, e.g. ``learning_rate/weights``):

  - every step: ``train/loss/replica_<r>``, ``train/loss/mean``, ``train/<name>/replica_<r>`` (each
    replica's learning rates and explored values) and ``train/base/<name>`` (the base values);
  - every sync: ``controller/window_loss/replica_<r>``; for the paper's controller
    ``controller/weight/replica_<r>``, ``controller/delta/<name>``, ``controller/velocity/<name>``; for 'fit'
    its own quantities, named as in ``plots/controller.png``: ``controller/lr_correction/<name>`` (the factor
    on the schedule), ``controller/step_asked/<name>``, ``controller/step_taken/<name>``,
    ``controller/slope/<name>``, ``controller/slope_stderr/<name>``, ``controller/gain/<name>``;
    ``distance/replica_<r>`` and
    ``distance/mean_norm`` (also at each log interval of a run that never averages);
  - ``eval/val_loss``, ``eval/val_bits_per_byte``; ``throughput/tokens_per_s``, ``throughput/steps_per_s``.

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
    per_replica = lambda prefix, xs: {
      f'{prefix}/replica_{r}': x for r, x in enumerate(np.asarray(xs, np.float64).ravel().tolist())
    }
    per_name = lambda prefix, xs: dict(zip((f'{prefix}/{n}' for n in self.names), np.asarray(xs, np.float64).tolist()))
    if kind == 'train':
      loss = np.asarray(record['loss'], np.float64)
      out = {**per_replica('train/loss', loss), 'train/loss/mean': float(np.mean(loss))}
      for name, row in zip(self.names, np.asarray(record['values'], np.float64).tolist()):
        out.update(per_replica(f'train/{name}', row))
      return {**out, **per_name('train/base', record['bases'])}
    if kind == 'controller' and self.controller == 'fit' and 'asks' in record:
      return {
        **per_replica('controller/window_loss', record['window_losses']),
        **per_name('controller/lr_correction', np.exp(np.asarray(record['corrections'], np.float64))),
        **per_name('controller/step_asked', record['asks']),
        **per_name('controller/step_taken', record['deltas']),
        **per_name('controller/slope', record['velocities']),
        **per_name('controller/slope_stderr', record['stderrs']),
        **per_name('controller/gain', record['gains']),
      }
    if kind == 'controller':
      return {
        **per_replica('controller/window_loss', record['window_losses']),
        **per_replica('controller/weight', record['weights']),
        **per_name('controller/delta', record['deltas']),
        **per_name('controller/velocity', record['velocities']),
      }
    if kind == 'distance':
      return {**per_replica('distance', record['distance']), 'distance/mean_norm': record['mean_norm']}
    if kind == 'eval':
      return {f'eval/{k}': v for k, v in record.items() if k.startswith('val_')}
    if kind == 'throughput':
      return {'throughput/tokens_per_s': record['tokens_per_s'], 'throughput/steps_per_s': record['steps_per_s']}
    return {}

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

  def write_many(self, kind: str, records: Iterable[dict]) -> None:
    for r in records:
      self.write(kind, **r)

  def flush(self) -> None:
    for out in (self._f, self._tb):
      if out is not None:
        out.flush()

  def close(self) -> None:
    for out in (self._f, self._tb):
      if out is not None:
        out.close()
    self._f = self._tb = None


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
