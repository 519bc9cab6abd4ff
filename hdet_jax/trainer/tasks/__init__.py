"""The workloads the trainer runs, chosen by ``config.task``: each one's data, model, loss and metric.

- ``lm``: the byte-level transformer LM on a text corpus (the main job; the fine-tuning task is this
  task on the Wycliffe Bible from an LM checkpoint, ``configs/finetune.py``);
- ``mnist1d``: a 1-D CNN classifier on MNIST-1D or a user's ``.npz`` (``configs/mnist1d.py``).

A new task is a module here whose ``TASK`` is an instance of a :class:`base.Task` subclass, and a config that
names it: nothing registers it (:func:`names` finds every module of this package with a ``TASK``).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from hdet_jax.trainer.tasks.base import Regularization, Section, Task, TaskData, TaskError, TaskSettings, eval_record


@functools.cache
def _registry() -> dict[str, Task]:
  found = {}
  for module in pkgutil.iter_modules(__path__):
    task = getattr(importlib.import_module(f'{__name__}.{module.name}'), 'TASK', None)
    if isinstance(task, Task):
      if task.name in found:
        raise TaskError(f'two task modules name their task {task.name!r}; give each TASK its own name.')
      found[task.name] = task
  return dict(sorted(found.items()))


def names() -> tuple[str, ...]:
  """Every task's name (``config.task``), sorted: the modules of this package that define ``TASK``."""
  return tuple(_registry())


def get(name: str = 'lm') -> Task:
  """The task named ``name`` (``config.task``)."""
  task = _registry().get(name)
  if task is None:
    raise TaskError(f'task must be one of {", ".join(map(repr, names()))}, got {name!r}.')
  return task


def __getattr__(attr: str):
  if attr == 'TASKS':  # the names, found on first use (the task modules import this package)
    return names()
  raise AttributeError(f'module {__name__!r} has no attribute {attr!r}')


__all__ = ['Regularization', 'Section', 'TASKS', 'Task', 'TaskData', 'TaskError', 'TaskSettings', 'eval_record', 'get']
__all__ += ['names']
