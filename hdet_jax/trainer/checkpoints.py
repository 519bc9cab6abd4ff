"""Checkpoints with orbax: the full training state, the averaged model and a JSON record.

A checkpoint (``WORKDIR/checkpoints/<step>/``) holds three items:

- ``state``: every replica's parameters (stacked ``[N, ...]``, as they are, even mid-fan-out),
  the HDET optimizer state (inner optimizer, controller, permutation and its PRNG key) and the
  run's PRNG key, restored with their shardings and NamedTuple types;
- ``avg_params``: the exact replica average, the model to evaluate, export, or warm-start from;
- ``meta``: JSON with the step, the data position, the config, the number of replicas and a
  fingerprint of every array of ``state`` and ``avg_params``.

What a kill at any moment can leave, and what is loaded:

- orbax writes a step into ``<step>.orbax-checkpoint-tmp-*`` and renames it to ``<step>`` only
  once every item is written, so a save cut short is never listed as a step; those leftovers are
  removed when the next run opens the directory;
- old steps beyond ``max_checkpoints`` are first renamed into ``checkpoints/trash/`` (atomic) and
  deleted from there (at the next save, at the end, and when a run starts), so a deletion cut short
  never leaves a half-deleted step behind;
- restoring checks the fingerprint (a position-weighted wrapping sum of each array's bits, see
  :func:`fingerprint`) of what was read against the one recorded at save time. A step whose meta,
  state or fingerprint does not check out (a truncated or altered file, a disk error) is moved
  into ``checkpoints/corrupt/`` and the next older step is tried (:meth:`Checkpointer.restore_latest`).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from hdet_jax.trainer import mesh as mesh_lib

STATE, AVG, META = 'state', 'avg_params', 'meta'
TRASH, CORRUPT = 'trash', 'corrupt'  # subdirectories of checkpoints/ (not step names: orbax ignores them)


class _ReadOnlyNotice(logging.Filter):
  """Drops orbax's warning that a manager opened read-only is read-only: every read of a checkpoint (a resume, a
  warm start, a bracket's rungs) opens one, and 'WARNING ... read only' at each would read as a fault."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith('Given directory is read only')


logging.getLogger('absl').addFilter(_ReadOnlyNotice())


class CorruptCheckpoint(Exception):
  """A checkpoint step that cannot be read back, or reads back other bits than were saved."""


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(os.path.expanduser(workdir)), 'checkpoints')


def _manager(
  directory: str, max_to_keep: int | None = None, *, read_only: bool = False, whole: bool = False
) -> ocp.CheckpointManager:
  """An orbax manager of a workdir's checkpoints; ``whole``: the arrays go through :class:`_WholeArrays`."""
  options = ocp.CheckpointManagerOptions(
    max_to_keep=max_to_keep,
    create=not read_only,
    read_only=read_only,
    save_interval_steps=0 if read_only else 1,  # (orbax sets 0 itself when read-only, with a warning)
    # Unfinished saves of an earlier, killed run (``<step>.orbax-checkpoint-tmp-*``) go away.
    cleanup_tmp_directories=not read_only,
    # Old steps are renamed into trash/ (atomic) before being deleted.
    todelete_subdir=None if read_only else TRASH,
    # Saving blocks until the arrays are on the host; the writes then finish in the background.
    enable_async_checkpointing=True,
  )
  if whole:
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item, handler, save, restore in (
      (STATE, _WholeArrays(), ocp.args.StandardSave, ocp.args.StandardRestore),
      (AVG, _WholeArrays(), ocp.args.StandardSave, ocp.args.StandardRestore),
      (META, ocp.JsonCheckpointHandler(), ocp.args.JsonSave, ocp.args.JsonRestore),
    ):
      registry.add(item, save, handler)
      registry.add(item, restore, handler)
    return ocp.CheckpointManager(directory, options=options, handler_registry=registry)
  return ocp.CheckpointManager(directory, options=options, item_names=(STATE, AVG, META))


# ---- Fingerprints. ----

_MULT = np.uint32(2654435761)  # Knuth's multiplicative hash constant: position weights 1 + i * _MULT (mod 2**32).


def _as_uint32(x: jax.Array) -> jax.Array:
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  x = jnp.ravel(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = jnp.dtype(x.dtype).itemsize
  if size == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size == 8:
    return jnp.ravel(jax.lax.bitcast_convert_type(x, jnp.uint32))
  unsigned = {1: jnp.uint8, 2: jnp.uint16}[size]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _leaf_fingerprint(x: jax.Array) -> jax.Array:
  u = _as_uint32(x)
  w = jnp.arange(u.size, dtype=jnp.uint32) * _MULT + jnp.uint32(1)
  # Wrapping uint32 sums: exact, so the result does not depend on the reduction order or sharding.
  return jnp.stack([jnp.sum(u * w, dtype=jnp.uint32), jnp.sum(u ^ (u >> 13), dtype=jnp.uint32), jnp.uint32(u.size)])


@jax.jit
def _fingerprints(tree: Any) -> jax.Array:
  leaves = jax.tree.leaves(tree)
  # One (leaves, 3) array: one transfer to the host per call, not one per leaf.
  return jnp.stack([_leaf_fingerprint(x) for x in leaves]) if leaves else jnp.zeros((0, 3), jnp.uint32)


def fingerprint(tree: Any) -> list[list[int]]:
  """[sum of bits x position weight, sum of mixed bits, number of words] (uint32) per leaf.

  Every process calls it together (it is one jitted program over the global arrays); any change
  to any bit of any array changes the first number unless it happens to cancel modulo 2**32.
  """
  return np.asarray(_fingerprints(tree).addressable_data(0)).astype(np.int64).tolist()


# ---- Reading. ----


def all_steps(workdir: str) -> list[int]:
  """The complete (finalized) checkpoint steps in ``workdir``, oldest first."""
  directory = checkpoint_dir(workdir)
  if not os.path.isdir(directory):
    return []
  with _manager(directory, read_only=True) as mngr:
    return sorted(mngr.all_steps())


def latest_step(workdir: str) -> int | None:
  """The newest complete checkpoint's step in ``workdir``, or None (its content is not checked)."""
  steps = all_steps(workdir)
  return steps[-1] if steps else None


def _read_meta(mngr: ocp.CheckpointManager, step: int) -> dict:
  try:
    meta = mngr.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
  except Exception as e:  # noqa: BLE001 - any failure to read means the step cannot be trusted
    raise CorruptCheckpoint(f'step {step}: its meta record cannot be read ({_one_line(e)})') from None
  if not isinstance(meta, dict) or meta.get('step') != step:
    raise CorruptCheckpoint(f'step {step}: its meta record is not the one written for this step')
  return dict(meta)


def read_meta(workdir: str, step: int | None = None) -> dict | None:
  """The JSON record of a checkpoint (the latest by default), or None if there is none.

  Raises CorruptCheckpoint if the record cannot be read.
  """
  directory = checkpoint_dir(workdir)
  if not os.path.isdir(directory):
    return None
  with _manager(directory, read_only=True) as mngr:
    step = mngr.latest_step() if step is None else step
    if step is None:
      return None
    return _read_meta(mngr, step)


def latest_readable_meta(workdir: str) -> tuple[int | None, dict | None, list[str]]:
  """(step, meta) of the newest step whose meta record reads back, and why newer ones were skipped."""
  skipped = []
  for step in reversed(all_steps(workdir)):
    try:
      return step, read_meta(workdir, step), skipped
    except CorruptCheckpoint as e:
      skipped.append(str(e))
  return None, None, skipped


def _verify(name: str, tree: Any, meta: dict, step: int) -> None:
  want = (meta.get('fingerprint') or {}).get(name)
  if want is None:
    return  # a checkpoint written before fingerprints existed: nothing to compare with
  got = fingerprint(tree)
  if got != want:
    bad = sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want))
    raise CorruptCheckpoint(
      f'step {step}: {bad} of the {len(want)} arrays of {name!r} read back other bits than were saved'
    )


def restore_avg_params(workdir: str, abstract_params: Any, step: int | None = None) -> Any:
  """The averaged model of a checkpoint, onto the shardings in ``abstract_params``, verified.

  Raises CorruptCheckpoint if it cannot be read or does not match its fingerprint.
  """
  directory = checkpoint_dir(workdir)
  with _manager(directory, read_only=True) as mngr:
    step = mngr.latest_step() if step is None else step
    meta = _read_meta(mngr, step)
    try:
      avg = mngr.restore(step, args=ocp.args.Composite(**{AVG: ocp.args.StandardRestore(abstract_params)}))[AVG]
    except Exception as e:  # noqa: BLE001
      raise CorruptCheckpoint(f'step {step}: {AVG!r} cannot be read ({_one_line(e)})') from None
    _verify(AVG, avg, meta, step)
    return avg


def _one_line(e: BaseException, limit: int = 200) -> str:
  text = ' '.join(f'{type(e).__name__}: {e}'.split())
  return text if len(text) <= limit else text[: limit - 3] + '...'


def _agree(ok: bool) -> bool:
  """True on every process iff ``ok`` on every process (a no-op with one process)."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils

  return bool(np.all(multihost_utils.process_allgather(np.array([ok]))))


# The layout of the saved training state. Bump it when the state's structure changes, so that an
# older workdir is refused with a clear message instead of failing to read like a corrupt one.
# 1: before 2026-11-21 (no record); 2: HDETState holds the coming step's values, no constant fields.
# 3: ControllerState gains the 'fit' controller's correction and regression statistics.
# 4: ControllerState gains the Rprop gain of the 'fit' controller's steps.
# 5: the optimizer state is a PackedState: the wrapped optimizer's state and HDET's small fields in one vector.
# 6: ControllerState gains the 'fit' controller's asked step and its slope's standard error (for the plots), and
#    the window's mean training loss (the back-off).
# 7: ControllerState gains whether the last sync backed off; a run with hdet.rollback saves its anchor (the
#    parameters and wrapped optimizer state of the last sync).
# 8: ControllerState gains which hyperparameters have settled (hdet.settle).
# 9: the rollback's anchor is one copy of that state (every replica holds the same), no longer one per replica.
STATE_FORMAT = 9


def _whole_array_registry() -> ocp.type_handlers.TypeHandlerRegistry:
  """orbax's type handlers, except that a jax.Array is written whole, from its first replica.

  By default orbax splits a replicated array (the averaged parameters, the PRNG key) among its
  replicas and cuts the pieces with eager jax slices, which compile one small program per
  shape at the first save. These arrays are small, so each is written whole from one replica,
  which compiles nothing.

  This is a registry of the trainer's own, used only by the trainer's checkpoint manager: orbax's
  global registry (what a user's own ``ocp.StandardCheckpointer`` uses) is left as it is.
  """
  types = (int, float, bytes, np.number, np.ndarray, str)
  return ocp.type_handlers.create_type_handler_registry(
    *[(t, ocp.type_handlers.get_type_handler(t)) for t in types],
    (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False)),
  )


class _WholeArrays(ocp.StandardCheckpointHandler):
  """``StandardCheckpointHandler`` (same arguments, same files) over :func:`_whole_array_registry`.

  orbax 0.12's StandardCheckpointHandler takes no registry; it delegates to a
  PyTreeCheckpointHandler, which does, so that delegate is replaced. Should a later orbax drop the
  delegate, saving falls back to orbax's defaults (correct, one slower first save);
  tests/test_checkpoints.py notices.
  """

  def __init__(self):
    super().__init__()
    if isinstance(getattr(self, '_impl', None), ocp.PyTreeCheckpointHandler):
      self._impl = ocp.PyTreeCheckpointHandler(type_handler_registry=_whole_array_registry())


class Checkpointer:
  """Saves and restores a workdir's checkpoints; every process calls it together."""

  def __init__(self, workdir: str, max_to_keep: int):
    self._directory = checkpoint_dir(workdir)
    self._empty_trash()  # what an earlier run was deleting when it was killed
    self._mngr = _manager(self._directory, max_to_keep=max_to_keep if max_to_keep > 0 else None, whole=True)

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._mngr.all_steps())

  def _empty_trash(self) -> None:
    """Deletes the old steps orbax renamed into trash/ (whole entries only: a rename is atomic)."""
    trash = os.path.join(self._directory, TRASH)
    if jax.process_index() == 0 and os.path.isdir(trash):
      for name in os.listdir(trash):
        shutil.rmtree(os.path.join(trash, name), ignore_errors=True)

  def save(self, step: int, state: Any, avg_params: Any, meta: dict) -> None:
    """Starts writing step ``step``; it becomes visible (listed, restorable) once complete."""
    self._empty_trash()
    meta = dict(meta, fingerprint={STATE: fingerprint(state), AVG: fingerprint(avg_params)}, state_format=STATE_FORMAT)
    self._mngr.save(
      step,
      args=ocp.args.Composite(
        **{STATE: ocp.args.StandardSave(state), AVG: ocp.args.StandardSave(avg_params), META: ocp.args.JsonSave(meta)}
      ),
      force=True,
    )

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    """Step ``step``'s state and meta, verified; raises CorruptCheckpoint (on every process alike)."""
    error = None
    try:
      meta = _read_meta(self._mngr, step)
      out = self._mngr.restore(step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(abstract_state)}))
      state = out[STATE]
    except CorruptCheckpoint as e:
      error = e
    except Exception as e:  # noqa: BLE001 - a truncated or altered file surfaces as many kinds of error
      error = CorruptCheckpoint(f'step {step}: {STATE!r} cannot be read ({_one_line(e)})')
    if not _agree(error is None):
      raise error or CorruptCheckpoint(f'step {step}: another process could not read it')
    _verify(STATE, state, meta, step)  # a jitted program over the global arrays: every process agrees
    return state, meta

  def restore_latest(
    self,
    abstract_state: Any,
    *,
    max_step: int | None = None,
    on_corrupt: Callable[[int, str], None] = lambda step, why: None,
  ) -> tuple[Any, dict] | None:
    """The newest step (at most ``max_step``) that restores and verifies; corrupt ones are set aside.

    Returns None if there is no step at all; raises CorruptCheckpoint if every step is corrupt.
    """
    steps = [s for s in self.all_steps() if max_step is None or s <= max_step]
    reasons = []
    for step in reversed(steps):
      try:
        return self.restore(step, abstract_state)
      except CorruptCheckpoint as e:
        reasons.append(str(e))
        where = self.quarantine(step)
        on_corrupt(step, f'{e}; moved to {where}')
    if reasons:
      raise CorruptCheckpoint(
        f'every checkpoint in {self._directory} is corrupt ({"; ".join(reasons)}); they were moved to '
        f'{os.path.join(self._directory, CORRUPT)}. Rerun to start from scratch, or restore a backup.'
      )
    return None

  def quarantine(self, step: int) -> str:
    """Moves step ``step`` out of the step list into ``checkpoints/corrupt/``; returns where to."""
    src = os.path.join(self._directory, str(step))
    dst = os.path.join(self._directory, CORRUPT, f'{step}-{time.strftime("%Y%m%d-%H%M%S")}')
    if jax.process_index() == 0:
      os.makedirs(os.path.dirname(dst), exist_ok=True)
      suffix = 0
      while os.path.exists(dst + (f'-{suffix}' if suffix else '')):
        suffix += 1
      dst += f'-{suffix}' if suffix else ''
      os.rename(src, dst)
    mesh_lib.barrier(f'hdet_quarantine_{step}')
    self._mngr.reload()
    return dst

  def wait(self) -> None:
    self._mngr.wait_until_finished()

  def close(self) -> None:
    self._mngr.wait_until_finished()
    self._mngr.close()
    self._empty_trash()
