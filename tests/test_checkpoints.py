"""The trainer's checkpoints: their fingerprints, and orbax settings that stay inside the trainer's own manager.

The trainer writes replicated arrays whole (no eager slices, so no compilations at its first save). It once did
so by overriding orbax's global type handler for jax.Array, which changed how a user's own orbax checkpoints
were written in the same process (no ``array_metadatas/``, other settings). Now the trainer's manager has a
registry of its own and orbax's global registry is never touched. (Corrupt, cut and killed checkpoint writes:
tests/test_reliability.py.)
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hdet_jax.trainer import checkpoints
from trainer_testing import compiled


def _layout(path):
  """Relative file paths of a checkpoint, with the content-addressed data files' names left out."""
  out = set()
  for root, _, files in os.walk(path):
    for f in files:
      rel = os.path.relpath(os.path.join(root, f), path)
      parts = rel.split(os.sep)
      out.add(os.sep.join(parts[:-1] + ['*']) if 'd' in parts[:-1] else rel)
  return out


def _replicated(shape, value=1.0):
  mesh = Mesh(np.array(jax.devices()), ('data',))
  return jax.device_put(jnp.full(shape, value, jnp.float32), NamedSharding(mesh, P()))


def _compilations(fn):
  """How many XLA compilations ``fn()`` triggers (or loads from the persistent compilation cache)."""
  return compiled(fn)[1]


def test_a_plain_orbax_save_is_unaffected_by_the_trainers_checkpoints(tmp_path):
  tree = {'w': _replicated((8, 4), 2.0), 'b': _replicated((4,), -1.0)}
  before = ocp.type_handlers.get_type_handler(jax.Array)
  with ocp.StandardCheckpointer() as ckptr:  # before the trainer wrote anything
    ckptr.save(tmp_path / 'plain_before', tree)

  ckpt = checkpoints.Checkpointer(str(tmp_path / 'workdir'), max_to_keep=2)
  ckpt.save(3, {'params': tree}, tree, {'step': 3})
  ckpt.close()
  assert checkpoints.all_steps(str(tmp_path / 'workdir')) == [3]

  # orbax's global handler for jax.Array is still its own default object, with its default settings.
  after = ocp.type_handlers.get_type_handler(jax.Array)
  assert after is before
  assert after._use_replica_parallel is True and after._array_metadata_store is not None  # orbax's defaults
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(tmp_path / 'plain_after', tree)
    restored = ckptr.restore(tmp_path / 'plain_after')
  layout = _layout(tmp_path / 'plain_after')
  assert layout == _layout(tmp_path / 'plain_before')
  assert os.path.join('array_metadatas', 'process_0') in layout  # what orbax's default ArrayHandler writes
  np.testing.assert_array_equal(np.asarray(restored['w']), np.full((8, 4), 2.0, np.float32))
  np.testing.assert_array_equal(np.asarray(restored['b']), np.full((4,), -1.0, np.float32))


def test_the_trainers_manager_writes_replicated_arrays_whole(tmp_path):
  """Large replicated arrays: orbax's default cuts them with eager slices (compilations); the trainer's does not."""

  def save(whole, rows):
    tree = {f'a{i}': _replicated((rows + i, 1024)) for i in range(4)}  # shapes no other save compiled for
    jax.block_until_ready(tree)

    def run():
      with checkpoints._manager(str(tmp_path / f'whole_{whole}'), whole=whole) as mngr:
        mngr.save(
          1,
          args=ocp.args.Composite(
            **{
              checkpoints.STATE: ocp.args.StandardSave(tree),
              checkpoints.AVG: ocp.args.StandardSave(tree),
              checkpoints.META: ocp.args.JsonSave({'step': 1}),
            }
          ),
        )
        mngr.wait_until_finished()

    return _compilations(run)

  assert save(whole=True, rows=301) == 0
  assert save(whole=False, rows=401) > 0  # orbax's default: the measurement does see the slices
  # What the trainer wrote reads back through a plain, default-configured manager.
  with checkpoints._manager(str(tmp_path / 'whole_True'), read_only=True) as mngr:
    got = mngr.restore(1, args=ocp.args.Composite(**{checkpoints.STATE: ocp.args.StandardRestore()}))
  np.testing.assert_array_equal(np.asarray(got[checkpoints.STATE]['a2']), np.ones((303, 1024), np.float32))


def test_fingerprint_sees_a_single_bit():
  x = np.arange(1000, dtype=np.float32)
  y = x.copy()
  y.view(np.uint32)[517] ^= 1
  tree = {'a': jnp.asarray(x), 'k': jnp.arange(3, dtype=jnp.int32)}
  assert checkpoints.fingerprint(tree) != checkpoints.fingerprint({'a': jnp.asarray(y), 'k': tree['k']})
  swapped = x.copy()
  swapped[[3, 4]] = swapped[[4, 3]]
  assert checkpoints.fingerprint(tree) != checkpoints.fingerprint({'a': jnp.asarray(swapped), 'k': tree['k']})
  assert checkpoints.fingerprint(tree) == checkpoints.fingerprint({'a': jnp.asarray(x.copy()), 'k': tree['k']})


def test_fingerprint_values_match_a_numpy_oracle():
  """Per leaf, in tree order: the wrapping uint32 sum of the words times 1 + i * 2654435761, the wrapping sum of
  u ^ (u >> 13), and the word count (float32 words as their bits; bool and int8 widened to uint32)."""
  rng = np.random.default_rng(0)
  leaves = {
    'a': rng.standard_normal((7, 13)).astype(np.float32),
    'b': rng.random(5) > 0.5,
    'c': rng.integers(-128, 128, 9).astype(np.int8),
    'd': np.zeros((0,), np.float32),
  }

  def oracle(x):
    u = (x.view(np.uint32) if x.dtype == np.float32 else x.astype(np.uint8).astype(np.uint32)).ravel().astype(np.uint64)
    w = (np.arange(u.size, dtype=np.uint64) * 2654435761 + 1) % 2**32
    return [int(np.sum(u * w % 2**32) % 2**32), int(np.sum(u ^ (u >> 13)) % 2**32), u.size]

  got = checkpoints.fingerprint({k: jnp.asarray(v) for k, v in leaves.items()})
  assert got == [oracle(leaves[k]) for k in sorted(leaves)]
  assert checkpoints.fingerprint({}) == []


def test_reading_checkpoints_logs_no_read_only_warnings(tmp_path, caplog):
  """Every read of a workdir's checkpoints opens a read-only orbax manager, for which orbax logged two warnings
  ('... read_only=True, setting save_interval_steps=0.' and 'Given directory is read only=...'): six per warm start.
  Neither is logged now; other absl warnings still are."""
  from absl import logging as absl_logging

  os.makedirs(checkpoints.checkpoint_dir(str(tmp_path)))
  with caplog.at_level('WARNING'):
    assert checkpoints.all_steps(str(tmp_path)) == [] and checkpoints.latest_step(str(tmp_path)) is None
    absl_logging.warning('another warning')
  assert [r.getMessage() for r in caplog.records] == ['another warning']
