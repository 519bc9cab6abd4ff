"""Cached trainer runs for the studies: one JSON record a finished run, reused while its config holds.

A record is what an experiment's report needs from one run of the trainer's ``train_and_evaluate``,
made by the experiment's ``make_record(name, config, summary, workdir, wall_s)`` from the trainer's
summary and ``metrics.jsonl``. Records are small and committed with the project (``results/<experiment>/runs/``),
so a later session resumes where this one stopped; a run's workdir is deleted once its record is written
(unless kept: a warm start reads its checkpoint).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shutil
import sys
import time
from typing import Any, Callable


def lr_tag(lr: float, digits: int) -> str:
  """A peak LR as it appears in run names (``digits`` significant digits)."""
  return f'{lr:.{digits}g}'


def finite_or_none(x: Any) -> float | None:
  """``x`` as a float, or None when it is not a finite number (JSON has no NaN)."""
  try:
    x = float(x)
  except (TypeError, ValueError):
    return None
  return x if math.isfinite(x) else None


# The fields removed from the trainer in hdet-jax 1.0 (``hdet_jax.trainer.compat.REMOVED``), at the values every
# run trained with unless it set them (0.x's defaults; ``log_noise_scale`` only steered logging): a record written
# before 1.0 holds them, and where it holds these values its run is the one today's config trains.
REMOVED_DEFAULTS = {
  'hdet.fan': 'linear',
  'hdet.score_tail': 0.0,
  'hdet.score_anneal': 0.0,
  'hdet.early_sync_every': 0,
  'hdet.early_sync_steps': 0,
  'hdet.overshoot': 1.0,
  'optim.anneal_at_step': 0,
  'optim.anneal_steps': 0,
  'bracket.anneal': 0.0,
}
REMOVED_RUN_FIELDS = frozenset({'log_noise_scale'})


def without_removed(flat: dict) -> dict:
  """A record's flattened config less the removed fields it holds at :data:`REMOVED_DEFAULTS` (and the removed run
  fields): what today's trainer reads. A removed field at another value stays, so the record differs from every
  config today's trainer takes (its run needs the removed knob)."""
  return {
    k: v
    for k, v in flat.items()
    if k not in REMOVED_RUN_FIELDS and not (k in REMOVED_DEFAULTS and v == REMOVED_DEFAULTS[k])
  }


def write_json(path: str, obj: Any, **dump_kwargs) -> None:
  """Writes ``obj`` to ``path`` (its folder made) through a temporary file and a rename: a reader, or a run killed
  midway, sees the old file or the whole new one."""
  from hdet_jax.trainer import process  # (imported here: a report that only reads records needs no jax)

  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  process.write_json_atomic(path, obj, **dump_kwargs)


def write_record(path: str, rec: dict, **dump_kwargs) -> None:
  """Writes a run's record as :func:`write_json` does, naming the machine that trained it (``machine``, from
  ``process.machine()``, unless ``rec`` has one): XLA rounds differently by CPU model, so records compare bit for bit
  only where it matches."""
  from hdet_jax.trainer import process

  write_json(path, {**rec, 'machine': rec.get('machine') or process.machine()}, **dump_kwargs)


def mean_or_none(values: list) -> float | None:
  """The mean of ``values``, or None where there are none or one is missing (None)."""
  import numpy as np

  return None if not values or any(v is None for v in values) else float(np.mean(values))


def best_lr(grid: dict) -> Any:
  """The sweep's best LR: the key of ``grid`` (LR -> its finals over the seeds) with the lowest mean final; a
  diverged seed (None) makes its LR's mean inf; ties go to the first."""
  import numpy as np

  return min(grid, key=lambda lr: np.inf if None in grid[lr] else float(np.mean(grid[lr])))


def pct(x: float | None) -> str:
  """A relative gap as a signed percentage ('+1.2%'); '-' for None."""
  return '-' if x is None else f'{100 * x:+.1f}%'


RESOLVE_SE = 2.0  # a miss is resolved where gap - RESOLVE_SE * se > 1%


def verdict(gap: dict | None) -> str:
  """A paired gap (``{'gap', 'se'}``) read against 1%: 'within' (gap <= 1%), 'miss' (gap - RESOLVE_SE se > 1%) or
  'not resolved'; '-' for none."""
  if gap is None or gap['gap'] is None:
    return '-'
  if gap['gap'] <= 0.01:
    return 'within'
  return 'miss' if gap['se'] is not None and gap['gap'] - RESOLVE_SE * gap['se'] > 0.01 else 'not resolved'


def paired_gap(values: list, reference: list) -> tuple[float | None, float | None]:
  """``values`` against ``reference``, seed by seed: the gap of their means, ``mean(values) / mean(reference) - 1``,
  and the standard error of the per-seed gaps ``v_s / r_s - 1`` (``sd / sqrt(n)``, ddof 1; None under 2 seeds).
  Both None where a value is missing (None)."""
  import numpy as np

  if not values or len(values) != len(reference) or any(v is None for v in list(values) + list(reference)):
    return None, None
  v, r = np.asarray(values, float), np.asarray(reference, float)
  per_seed = v / r - 1
  se = float(np.std(per_seed, ddof=1) / np.sqrt(len(v))) if len(v) > 1 else None
  return float(v.mean() / r.mean() - 1), se


def load_config(path: str) -> Any:
  """A product config file (e.g. configs/default.py) as a study's configs hold it: with the trainer's tuning fields
  (``schema.tuning_fields``: what research varies, given to the trainer in Python) at their defaults, in their places,
  so that a study sets them like any other field and its records keep the configs they always held."""
  from hdet_jax.trainer import config_lib, run_settings

  return run_settings.recorded_config(config_lib.load_config_file(path))


def trainer_arguments(config: Any) -> tuple[Any, dict]:
  """(config, keyword arguments) of the trainer's ``train_and_evaluate`` for a study's ``config``: its tuning fields
  given in Python (``tuning``), and an LR-free peer's ``optim.name`` (``research.peers.baselines``) as a base
  optimizer, the config keeping the product's optimizer. The study's config (its record's ``config``) keeps them all.
  """
  from hdet_jax.trainer import run_settings
  from research import peers as peers_lib

  product, tuning = run_settings.split(config)
  kwargs = {'tuning': tuning}
  peers = peers_lib.baselines()
  if product.optim.name in peers:
    kwargs['optimizer'] = peers[product.optim.name]
    product.optim.name = 'adamw'
  return product, kwargs


def resolve(config: Any) -> Any:
  """The trainer's ``run_settings.resolve`` of a study's ``config`` (:func:`trainer_arguments`)."""
  from hdet_jax.trainer import run_settings

  product, kwargs = trainer_arguments(config)
  return run_settings.resolve(product, kwargs.get('optimizer'), kwargs['tuning'])


def run_bracket(config: Any, workdir: str) -> dict:
  """The trainer's LR bracket of a study's ``config`` (``bracket.points > 0``) in ``workdir``, its tuning in Python."""
  from hdet_jax.trainer import bracket, run_settings

  product, tuning = run_settings.split(config)
  return bracket.run_bracket(product, workdir, tuning=tuning)


def train_run(name: str, config: Any, workdir: str) -> dict:
  """Trains ``config`` in ``workdir``, in this process (an LR bracket where ``config.bracket.points`` > 0); the
  record's common fields: name, peak LR, final metric (None: not finite), divergence, wall seconds, parameters, and a
  bracket's LRs, rungs and kept LR. A preempted run exits with status 143 (rerunning resumes it)."""
  from hdet_jax import trainer

  trainer.setup_jax(config)
  t0 = time.time()
  if config.bracket.points:
    summary = run_bracket(config, workdir)
  else:
    product, kwargs = trainer_arguments(config)
    summary = trainer.train_and_evaluate(product, workdir, **kwargs)
  if summary['preempted']:
    sys.exit(143)
  rec = {
    'name': name,
    'lr': config.optim.max_lr,
    'final_metric': finite_or_none(summary['final_metric']),
    'diverged_at': summary['diverged_at'],
    'wall_s': time.time() - t0,
    'num_params': summary['num_params'],
    'machine': summary['machine'],
  }
  if 'bracket' in summary:
    rec.update(
      kept_lr=summary['bracket']['winner']['lr'], lrs=summary['bracket']['lrs'], rungs=summary['bracket']['rungs']
    )
  return rec


def write_report(out_dir: str, stem: str, results: dict, lines: list[str]) -> list[str]:
  """An experiment's report: ``results`` as ``out_dir/stem.json`` and ``lines`` as ``out_dir/stem.md``; their paths."""
  os.makedirs(out_dir, exist_ok=True)
  jpath, mpath = os.path.join(out_dir, stem + '.json'), os.path.join(out_dir, stem + '.md')
  with open(jpath, 'w', encoding='utf-8') as f:
    json.dump(results, f, indent=1, sort_keys=True)
  with open(mpath, 'w', encoding='utf-8') as f:
    f.write('\n'.join(lines) + '\n')
  return [jpath, mpath]


class RunCache:
  """Finished runs as JSON records under ``records_dir``; each run trains in ``work_root/<name>``."""

  def __init__(
    self,
    records_dir: str,
    work_root: str,
    make_record: Callable[..., dict],
    describe: Callable[[dict], str],
    log: Callable[..., None] = print,
  ):
    self.dir, self.work_root, self.log = records_dir, work_root, log
    self.make_record, self.describe = make_record, describe
    os.makedirs(self.dir, exist_ok=True)

  def path(self, name: str) -> str:
    return os.path.join(self.dir, name + '.json')

  def workdir(self, name: str) -> str:
    return os.path.join(self.work_root, name)

  def get(self, name: str, match: dict | None = None) -> dict | None:
    """The record of run ``name``, if it exists and its config has every (dotted field, value) of ``match``."""
    p = self.path(name)
    if not os.path.exists(p):
      return None
    with open(p, encoding='utf-8') as f:
      rec = json.load(f)
    if match:
      from hdet_jax.trainer import compat, config_lib, run_settings

      # A field added after the record was written matches at the value every run then had; one left at None
      # ("wherever it applies") at what it resolved to.
      recorded = run_settings.resolved({**compat.QUIET_DEFAULTS, **config_lib.flatten(rec['config'])})
      if any(k not in recorded or recorded[k] != v for k, v in match.items()):
        return None
    return rec

  def run(
    self, name: str, config: Any, match: dict | None = None, keep_workdir: bool = False, skip_busy: bool = False
  ) -> dict | None:
    """The record of ``name`` (see :meth:`get`), or trains ``config`` and records it.

    A preempted run (SIGTERM) exits with status 143; rerunning resumes it from its workdir's checkpoint.
    A run another process is training (it holds ``<workdir>.lock``) is never trained twice: with
    ``skip_busy`` this returns None and the caller moves on (so several workers can share one list of
    runs), else it raises.
    """
    rec = self.get(name, match)
    if rec is not None:
      return rec
    with self._claim(name) as claimed:
      if not claimed:
        if skip_busy:
          self.log(f'  {name}: training in another process; skipped here.', flush=True)
          return None
        raise RuntimeError(
          f'run {name!r} is training in another process (it holds {self.workdir(name)}.lock); wait for it, or stop it'
        )
      rec = self.get(name, match)  # it may have finished between the first look and the claim.
      return rec if rec is not None else self._train(name, config, keep_workdir)

  @contextlib.contextmanager
  def _claim(self, name: str):
    """Yields whether this process holds run ``name``'s lock (an advisory ``flock``, released on exit)."""
    path = self.workdir(name) + '.lock'
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'a') as f:
      try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        yield False
        return
      try:
        yield True
      finally:  # no lock file is left behind; a worker that opened it just before re-reads the record.
        with contextlib.suppress(OSError):
          os.remove(path)
        fcntl.flock(f, fcntl.LOCK_UN)

  def write(self, name: str, rec: dict) -> None:
    """Writes run ``name``'s record (atomically: a reader sees the old file or the whole new one)."""
    write_json(self.path(name), rec, indent=None, separators=(',', ':'))

  def _train(self, name: str, config: Any, keep_workdir: bool) -> dict:
    """Trains ``config`` in run ``name``'s workdir and writes its record."""
    from hdet_jax.trainer import process, trainer

    workdir = self.workdir(name)
    t0 = time.time()
    product, kwargs = trainer_arguments(config)
    summary = trainer.train_and_evaluate(product, workdir, **kwargs)
    if summary.get('preempted'):
      self.log(f'  {name}: preempted; rerun to resume.')
      sys.exit(143)
    rec = self.make_record(name, config, summary, workdir, time.time() - t0)
    rec.setdefault('machine', summary.get('machine') or process.machine())  # (records compare bit for bit only there)
    self.write(name, rec)
    if not keep_workdir:
      shutil.rmtree(workdir, ignore_errors=True)  # the record holds what the report needs
    self.log(f'  {name}: {self.describe(rec)}', flush=True)
    return rec
