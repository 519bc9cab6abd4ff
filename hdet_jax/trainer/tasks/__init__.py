"""The workloads the trainer runs, chosen by ``config.task``: each one's data, model, loss and metric.

- ``lm``: the byte-level transformer LM on a text corpus (the main job; the fine-tuning task is this
  task on the Wycliffe Bible from an LM checkpoint, ``configs/finetune.py``);
- ``mnist1d``: a 1-D CNN classifier on MNIST-1D or a user's ``.npz`` (``configs/mnist1d.py``).

A new task is a module here with a :class:`base.Task` subclass, registered in :data:`TASKS`, and a config.
"""

from __future__ import annotations

from hdet_jax.trainer.tasks.base import Regularization, Section, Task, TaskData, TaskError, TaskSettings, eval_record

TASKS = ('lm', 'mnist1d')


def get(name: str = 'lm') -> Task:
  """The task named ``name`` (``config.task``)."""
  if name == 'lm':
    from hdet_jax.trainer.tasks import lm

    return lm.TASK
  if name == 'mnist1d':
    from hdet_jax.trainer.tasks import mnist1d

    return mnist1d.TASK
  raise TaskError(f'task must be one of {", ".join(map(repr, TASKS))}, got {name!r}.')


__all__ = ['Regularization', 'Section', 'TASKS', 'Task', 'TaskData', 'TaskError', 'TaskSettings', 'eval_record', 'get']
