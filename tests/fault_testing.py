"""A test-only fault: chosen replicas' training losses made non-finite at chosen steps, by construction.

A run that diverges because its LR is too high goes NaN at a step that depends on the last bits of the machine's
arithmetic (XLA's flags, the CPU), so a test built on one can lose its scenario on another machine. The trainer's
response to a divergence (the rollback to the last sync, the stop, the last good checkpoint) does not care what made
the losses non-finite: these tests make them so at the steps they choose, whatever the machine.

:func:`install` wraps the task ``config.task`` names (``hdet_jax.trainer.tasks.get``, which the trainer asks for it):
every training batch carries a ``poison`` factor per example, 1.0, or NaN at a faulted (step, replica); the
faulted replica's training loss and plain cross-entropy are multiplied by it, so they are NaN at that step, and so
is its gradient. The gradient all-reduce leaves a non-finite replica out (``hdet_jax.pmean_finite``): with every
replica faulted at a step the all-reduced gradient is NaN, and every replica's parameters are NaN after the step, as
after a real blow-up (with the shared gradient, a fault on some replicas only gives them a NaN loss at that step).
Without a fault, the loss is the task's times 1.0 (tiny's 40 steps gave the plain task's losses bit for bit here; no
test relies on it: the programs differ). The schedule is data, not a compile-time constant: runs with other faults
share their programs (tests/conftest.py's program cache); the data's description says the task is faulty, so a
plain run never takes a faulty run's programs, nor the reverse.

``python tests/fault_testing.py STEPS TRAIN_ARGS...`` runs train.py with every replica faulted at ``STEPS`` (steps
separated by commas), for the tests that run train.py as a subprocess.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any, Mapping, Sequence

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, 'train.py')

ALL = None  # a fault on every replica


def poison(
  first: int, steps: int, num_replicas: int, batch_size: int, faults: Mapping[int, Sequence[int] | None]
) -> np.ndarray:
  """``[N, steps, B]`` float32 factors of steps ``first ..``: NaN at each faulted (step, replica), else 1.0."""
  out = np.ones((num_replicas, steps, batch_size), np.float32)
  for step, replicas in faults.items():
    if first <= step < first + steps:
      out[slice(None) if replicas is ALL else list(replicas), step - first] = np.nan
  return out


class FaultyBatches:
  """A task's training batches ``b`` as ``{'batch': b, 'poison': [N, K, B]}``; the rest of its interface as is."""

  def __init__(self, batches: Any, num_replicas: int, faults: Mapping[int, Sequence[int] | None]):
    self._batches, self._n, self._faults = batches, num_replicas, dict(faults)

  def chunk(self, first_step: int, steps: int) -> dict:
    import jax

    batch = self._batches.chunk(first_step, steps)
    size = jax.tree.leaves(batch)[0].shape[2]  # [N, K, B, ...]
    return {'batch': batch, 'poison': poison(first_step, steps, self._n, size, self._faults)}

  def __getattr__(self, name):  # position(step), ...
    return getattr(self._batches, name)


def faulty_task(task: Any, faults: Mapping[int, Sequence[int] | None]) -> Any:
  """``task`` (a :class:`hdet_jax.trainer.tasks.Task`) with ``faults``: {step: the replicas faulted there, or
  :data:`ALL`}. Its name, metric, parameter groups and model are ``task``'s."""
  from hdet_jax.trainer import tasks as tasks_lib
  import jax.numpy as jnp

  class Faulty(type(task)):
    def load(self, settings, num_replicas, seed):
      data = task.load(settings, num_replicas, seed)
      return tasks_lib.TaskData(
        batches=FaultyBatches(data.batches, num_replicas, faults),
        eval_batch=data.eval_batch,
        probe=data.probe,
        description=f'{data.description}; test faults',
      )

    def losses(self, graphdef, params, batch, reg=tasks_lib.Regularization(), label_smoothing=0.0):
      if not (isinstance(batch, dict) and 'poison' in batch):  # the eval and common batches: never faulted
        return task.losses(graphdef, params, batch, reg, label_smoothing)
      loss, plain = task.losses(graphdef, params, batch['batch'], reg, label_smoothing)
      factor = jnp.mean(batch['poison'])  # 1.0, or NaN at a fault
      return loss * factor, plain * factor

  faulty = Faulty.__new__(Faulty)
  faulty.__dict__.update(task.__dict__)
  return faulty


def install(faults: Mapping[int, Sequence[int] | None], setattr_=setattr) -> None:
  """Every task the trainer asks for from now on is :func:`faulty_task` with ``faults`` (``setattr_``: a test's
  ``monkeypatch.setattr``, which undoes it after the test)."""
  from hdet_jax.trainer import tasks as tasks_lib

  get = getattr(tasks_lib.get, 'unfaulted', tasks_lib.get)  # (another install's faults replaced, not added to)
  faulty_get = lambda name='lm': faulty_task(get(name), faults)
  faulty_get.unfaulted = get
  setattr_(tasks_lib, 'get', faulty_get)


if __name__ == '__main__':
  steps, sys.argv = sys.argv[1], [TRAIN] + sys.argv[2:]
  install({int(s): ALL for s in steps.split(',')})
  runpy.run_path(TRAIN, run_name='__main__')
