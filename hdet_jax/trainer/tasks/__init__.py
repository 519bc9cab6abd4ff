"""The workloads the trainer runs, chosen by ``config.task``: each one's data, model, loss and metric.

- ``lm``: the byte-level transformer LM on a text corpus (the main job; the fine-tuning task is this
  task on the Wycliffe Bible from an LM checkpoint, ``configs/finetune.py``);
- ``mnist1d``: a 1-D CNN classifier on MNIST-1D or a user's ``.npz`` (``configs/mnist1d.py``).

A new task is a module here with a :class:`base.Task` subclass, registered in :data:`TASKS`, and a config.
"""

from __future__ import annotations

from typing import Any

from hdet_jax.trainer.tasks.base import Regularization, Task, TaskData, TaskError, eval_record

TASKS = ('lm', 'mnist1d')


def get(config: Any = None) -> Task:
  """The task ``config.task`` names (a config without the field, or None: the LM)."""
  name = 'lm' if config is None else config.get('task', 'lm')
  if name == 'lm':
    from hdet_jax.trainer.tasks import lm
    return lm.TASK
  if name == 'mnist1d':
    from hdet_jax.trainer.tasks import mnist1d
    return mnist1d.TASK
  raise TaskError(f'task must be one of {", ".join(map(repr, TASKS))}, got {name!r}.')


__all__ = ['Regularization', 'TASKS', 'Task', 'TaskData', 'TaskError', 'eval_record', 'get']
