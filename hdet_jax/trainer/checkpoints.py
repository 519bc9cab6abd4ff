"""Checkpoints with orbax: the full training state, the averaged model and a JSON record.

A checkpoint (``WORKDIR/checkpoints/<step>/``) holds three items:

- ``state``: every replica's parameters (stacked ``[N, ...]``, as they are, even mid-fan-out),
  the HDET optimizer state (inner optimizer, controller, permutation and its PRNG key) and the
  run's PRNG key, restored with their shardings and NamedTuple types;
- ``avg_params``: the exact replica average, the model to evaluate, export, or warm-start from;
- ``meta``: JSON with the step, the data position, the config and the number of replicas.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

STATE, AVG, META = 'state', 'avg_params', 'meta'


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(os.path.expanduser(workdir)), 'checkpoints')


def _manager(directory: str, max_to_keep: int | None = None, *, read_only: bool = False) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, create=not read_only, read_only=read_only,
      # Saving blocks until the arrays are on the host; the writes then finish in the background.
      enable_async_checkpointing=True)
  return ocp.CheckpointManager(directory, options=options, item_names=(STATE, AVG, META))


def latest_step(workdir: str) -> int | None:
  """The newest complete checkpoint's step in ``workdir``, or None."""
  directory = checkpoint_dir(workdir)
  if not os.path.isdir(directory):
    return None
  with _manager(directory, read_only=True) as mngr:
    return mngr.latest_step()


def read_meta(workdir: str, step: int | None = None) -> dict | None:
  """The JSON record of a checkpoint (the latest by default), or None if there is none."""
  directory = checkpoint_dir(workdir)
  if not os.path.isdir(directory):
    return None
  with _manager(directory, read_only=True) as mngr:
    step = mngr.latest_step() if step is None else step
    if step is None:
      return None
    return dict(mngr.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META])


def restore_avg_params(workdir: str, abstract_params: Any, step: int | None = None) -> Any:
  """The averaged model of a checkpoint, onto the shardings in ``abstract_params``."""
  directory = checkpoint_dir(workdir)
  with _manager(directory, read_only=True) as mngr:
    step = mngr.latest_step() if step is None else step
    return mngr.restore(step, args=ocp.args.Composite(**{AVG: ocp.args.StandardRestore(abstract_params)}))[AVG]


class Checkpointer:
  """Saves and restores a workdir's checkpoints; every process calls it together."""

  def __init__(self, workdir: str, max_to_keep: int):
    self._mngr = _manager(checkpoint_dir(workdir), max_to_keep=max_to_keep if max_to_keep > 0 else None)

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def save(self, step: int, state: Any, avg_params: Any, meta: dict) -> None:
    self._mngr.save(step, args=ocp.args.Composite(**{
        STATE: ocp.args.StandardSave(state), AVG: ocp.args.StandardSave(avg_params),
        META: ocp.args.JsonSave(meta)}), force=True)

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    out = self._mngr.restore(step, args=ocp.args.Composite(**{
        STATE: ocp.args.StandardRestore(abstract_state), META: ocp.args.JsonRestore()}))
    return out[STATE], dict(out[META])

  def wait(self) -> None:
    self._mngr.wait_until_finished()

  def close(self) -> None:
    self._mngr.wait_until_finished()
    self._mngr.close()


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs (with shardings) of a tree of arrays."""
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
