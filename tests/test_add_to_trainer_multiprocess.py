"""The add-to-trainer example past one machine (issue 74, item 5): examples/add_to_trainer/hdet_linen.py's own
``train()``, unchanged, run as 2 processes x 4 CPU devices over ``jax.distributed`` on localhost, against the same
run as 1 process x 8 devices (docs/scaling.md, "Several processes and hosts").

A first pair of processes trains to step 10 and its orbax ``CheckpointManager`` saves there (every process writing
its shards into the one workdir); a second pair restores that checkpoint and continues to step 20, feeding each
process only its own rows of every batch (``jax.make_array_from_process_local_data``, as a per-host input pipeline
does) where the example puts the global batch. Both pairs together give the one-process run's losses, parameters,
optimizer state and evaluation within stated bounds; the one-process trainer also resumes the first pair's
checkpoint. Skipped unless HDET_MULTIPROCESS_TESTS=1, like the trainer's multi-process tests.

``python tests/test_add_to_trainer_multiprocess.py PROCESS_ID PORT WORKDIR STEPS OUT [--local-rows]`` is one
process of a pair (the test starts them).
"""

import importlib.util
import os
import pathlib
import shutil
import sys
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / 'examples' / 'add_to_trainer' / 'hdet_linen.py'
STEPS, SAVED = 20, 10  # optimizer steps; the example checkpoints every 10


def _load_example():
  spec = importlib.util.spec_from_file_location('add_to_trainer_hdet_linen', EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _feed_process_local_rows(jax):
  """``jax.device_put(global_batch, sharding)`` made from this process's rows only: a batch that spans processes is
  built with ``jax.make_array_from_process_local_data`` from the rows this process's devices hold (a contiguous
  block: the mesh's devices are in process order), the rest of the global array never read. Returns the count of
  batches so built."""
  device_put, built = jax.device_put, []

  def put(x, sharding=None, *args, **kwargs):
    if not (isinstance(x, np.ndarray) and hasattr(sharding, 'is_fully_addressable')) or sharding.is_fully_addressable:
      return device_put(x, sharding, *args, **kwargs)
    rows = {
      (i[0].start or 0, x.shape[0] if i[0].stop is None else i[0].stop)
      for i in sharding.addressable_devices_indices_map(x.shape).values()
    }
    start, stop = min(r[0] for r in rows), max(r[1] for r in rows)
    assert sum(b - a for a, b in rows) == stop - start, rows  # contiguous
    built.append(1)
    return jax.make_array_from_process_local_data(sharding, x[start:stop], x.shape)

  jax.device_put = put
  return built


def _worker(process_id, port, workdir, steps, out, local_rows):
  import jax
  from jax.experimental import multihost_utils

  jax.distributed.initialize(f'127.0.0.1:{port}', num_processes=2, process_id=process_id)
  assert jax.process_count() == 2 and jax.local_device_count() == 4 and jax.device_count() == 8
  built = _feed_process_local_rows(jax) if local_rows else []
  example = _load_example()
  start = time.time()
  state, losses, eval_loss = example.train(workdir, steps)
  seconds = time.time() - start
  leaves = multihost_utils.process_allgather(jax.tree.leaves(state), tiled=True)  # the global arrays, on the host
  np.savez(
    os.path.join(out, f'p{process_id}.npz'),
    losses=np.array(losses),
    eval_loss=eval_loss,
    seconds=seconds,
    local_batches=len(built),
    **{f'leaf{i:03d}': np.asarray(x) for i, x in enumerate(leaves)},
  )


def _run_pair(workdir, steps, out, local_rows=False, timeout=300):
  """This file's worker as processes 0 and 1 of 2 on localhost, 4 CPU devices each; each process's results."""
  from process_testing import run_pair

  os.makedirs(out, exist_ok=True)
  flag = ['--local-rows'] if local_rows else []
  run_pair(lambda i, port: [sys.executable, __file__, str(i), str(port), workdir, str(steps), out, *flag], timeout)
  results = [dict(np.load(os.path.join(out, f'p{i}.npz'))) for i in range(2)]
  for key in results[0]:  # every process reports the same global run
    if key != 'seconds':
      np.testing.assert_array_equal(results[0][key], results[1][key], err_msg=key)
  return results[0]


def _leaves(result):
  return [result[k] for k in sorted(k for k in result if k.startswith('leaf'))]


@pytest.mark.skipif(
  not os.environ.get('HDET_MULTIPROCESS_TESTS'),
  reason='two pairs of 2 processes x 4 CPU devices and a 1 x 8 run: about a minute and a half; '
  'set HDET_MULTIPROCESS_TESTS=1',
)
def test_two_processes_save_restore_and_match_one(tmp_path):
  import jax

  import hdet_jax

  example = _load_example()
  t0 = time.time()
  ref_state, ref_losses, ref_eval = example.train(str(tmp_path / 'one'), STEPS)  # 1 process x 8 devices
  t1 = time.time()
  workdir = str(tmp_path / 'two')
  first = _run_pair(workdir, SAVED, str(tmp_path / 'first'))  # trains 0-9, saves at 10
  assert sorted(os.listdir(workdir)) == [str(SAVED)]
  shutil.copytree(workdir, tmp_path / 'cross')  # (for the one-process resume below)
  t2 = time.time()
  second = _run_pair(workdir, STEPS, str(tmp_path / 'second'), local_rows=True)  # restores 10, trains 10-19
  t3 = time.time()
  assert sorted(os.listdir(workdir), key=int) == [str(SAVED), str(STEPS)]
  example_batches = (STEPS - SAVED) * example.ACCUM + 1  # the micro-batches and the evaluation batch
  assert int(first['local_batches']) == 0 and int(second['local_batches']) == example_batches
  losses = np.concatenate([first['losses'], second['losses']])
  assert losses.shape == (STEPS,)

  # The same data, initial state and programs; only the all-reduces that cross processes (gloo) may sum in
  # another order (run to run as well), and a controller that reads the losses carries that rounding on.
  loss_diff = float(np.max(np.abs(losses - ref_losses) / np.abs(ref_losses)))
  eval_diff = abs(float(second['eval_loss']) - ref_eval) / ref_eval
  paths, treedef = jax.tree_util.tree_flatten_with_path(ref_state)
  leaves = _leaves(second)
  assert [x.shape for x in leaves] == [np.shape(x) for _, x in paths]
  model, stats = 0.0, 0.0  # the parameters and the optimizer's moments; HDET's own statistics (sums of squares)
  for (path, ref), x in zip(paths, leaves):
    ref = np.asarray(ref)
    if not np.issubdtype(ref.dtype, np.floating):  # step counters, flags: the same
      np.testing.assert_array_equal(x, ref, err_msg=jax.tree_util.keystr(path))
      continue
    diff = float(np.max(np.abs(x.astype(np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-30))
    if any(k in jax.tree_util.keystr(path) for k in ('.params', 'built_optimizer_state', 'acc_grads')):
      model = max(model, diff)
    else:
      stats = max(stats, diff)
  lrs = [
    np.asarray(hdet_jax.hyperparams(s.opt_state.inner_opt_state)['lr_scale'])
    for s in (ref_state, jax.tree.unflatten(treedef, leaves))
  ]
  lr_diff = float(np.max(np.abs(lrs[1] - lrs[0]) / lrs[0]))
  print(
    f'2 x 4 against 1 x 8 over {STEPS} steps: losses {loss_diff:.2g} relative '
    f"({int(np.sum(losses == np.asarray(ref_losses)))} of {STEPS} bit for bit), replicas' LR factors {lr_diff:.2g}, "
    f'params and moments {model:.2g} of each leaf max, HDET statistics {stats:.2g}, eval loss {eval_diff:.2g}; '
    f'wall: 1 x 8 {t1 - t0:.0f} s, first pair {t2 - t1:.0f} s, second pair {t3 - t2:.0f} s '
    f'(training in the processes {float(first["seconds"]):.0f} s, {float(second["seconds"]):.0f} s)'
  )
  # Measured over 3 runs: losses 1.2e-7 (1-2 float32 ulp), LR factors 0, params and moments 1.0e-6, HDET's
  # statistics 2.6e-6 (a sum of squared loss deviations), eval loss 1.2e-7. The bounds are about ten times those.
  assert loss_diff <= 2e-6 and lr_diff <= 3e-6 and eval_diff <= 2e-6, (loss_diff, lr_diff, eval_diff)
  assert model <= 1e-5 and stats <= 3e-5, (model, stats)

  # The two processes' checkpoint resumes in one process of 8 devices, to the same bounds.
  cross_state, cross_losses, cross_eval = example.train(str(tmp_path / 'cross'), STEPS)
  cross_diff = float(np.max(np.abs(np.array(cross_losses) - ref_losses[SAVED:]) / np.abs(ref_losses[SAVED:])))
  print(
    f'1 x 8 resumed from the 2 x 4 checkpoint: losses {cross_diff:.2g} relative, eval loss {cross_eval - ref_eval:.2g}'
  )
  assert cross_diff <= 2e-6 and abs(cross_eval - ref_eval) / ref_eval <= 2e-6, (cross_diff, cross_eval, ref_eval)


if __name__ == '__main__':
  _args = sys.argv[1:]
  _worker(int(_args[0]), int(_args[1]), _args[2], int(_args[3]), _args[4], '--local-rows' in _args)
