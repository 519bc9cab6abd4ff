"""The task interface: a workload's data, model, loss and metric, behind one seam.

The trainer (``trainer.py``, ``programs.py``, ``optimizer.py``, ``mesh.py``) never names a task: it
asks :func:`hdet_jax.trainer.tasks.get` for the one ``config.task`` names and calls only what
:class:`Task` declares. A task author writes one module under ``tasks/`` (its data and model may live
beside it) and a config under ``configs/``; nothing else changes. AlgoPerf's ``workloads/`` is the model.

A batch is any pytree of arrays whose leaves share their leading dimensions: the LM's is one
``uint8`` array of byte windows, a classifier's a dict ``{'x', 'y'}``. The trainer stacks it per
replica ``[N, ...]``, per chunk of steps ``[N, K, B, ...]``, and never looks inside.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Regularization(NamedTuple):
  """Per-call model hyperparameters (HDET explores them per replica); a task ignores what its model lacks."""

  dropout_rate: Any = 0.0  # [] float: dropout rate of the model's dropout layers.
  dropout_key: Any = None  # PRNG key, or None for no dropout (evaluation).
  attn_temperature: Any = 1.0  # [] float: attention logits are divided by it (attention models only).


def dropout(x: jax.Array, rate: jax.Array | float, key: jax.Array | None) -> jax.Array:
  """Inverted dropout with a (possibly traced, per-replica) rate; identity without a key."""
  if key is None:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


def smoothed_cross_entropy(logits: jax.Array, labels: jax.Array, label_smoothing: Any) -> tuple[jax.Array, jax.Array]:
  """(training loss, plain cross-entropy), both means in nats, of ``logits [..., C]`` against integer ``labels [...]``.

  The training loss uses label smoothing ``eps``: targets ``(1 - eps) onehot + eps / C``. The plain
  cross-entropy is what replicas are compared on: a replica with more smoothing would otherwise look
  worse by definition.
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
  smooth = -logp.mean(-1)  # cross-entropy against the uniform distribution
  eps = jnp.asarray(label_smoothing, jnp.float32)
  return ((1.0 - eps) * nll + eps * smooth).mean(), nll.mean()


class Section(Mapping):
  """A read-only section of a task's resolved fields (``data.*`` or ``model.*``), read as attributes:
  ``settings.model.d_model``."""

  def __init__(self, fields: Mapping[str, Any]):
    object.__setattr__(self, '_fields', dict(fields))

  def __getattr__(self, name: str) -> Any:
    try:
      return self._fields[name]
    except KeyError:
      raise AttributeError(f'no field {name!r} in this section (it has {", ".join(self._fields)})') from None

  def __setattr__(self, name: str, value: Any) -> None:
    raise AttributeError("a task's settings are read-only")

  def __getitem__(self, name: str) -> Any:
    return self._fields[name]

  def __iter__(self):
    return iter(self._fields)

  def __len__(self) -> int:
    return len(self._fields)

  def __repr__(self) -> str:
    return f'Section({self._fields!r})'


class TaskSettings(NamedTuple):
  """A task's own fields, resolved (``run_settings.resolve``; those a config lacks at the schema's values): what
  every :class:`Task` method reads. The trainer's fields are the trainer's."""

  name: str  # config.task
  data: Section  # data.*: path, batch_size and the task's own
  model: Section  # model.*
  eval_windows: int  # validation examples per evaluation (0: the whole split)
  probe_windows: int  # hdet.probe_windows: examples in a sync's common batch


class TaskError(ValueError):
  """Data or settings a task cannot use; the message names the field and the fix (the trainer makes it a
  ConfigError)."""


@dataclasses.dataclass(frozen=True, eq=False)
class TaskData:
  """What a task's data gives the trainer, all host numpy, for N replicas.

  ``batches.chunk(first, K)`` is K consecutive steps' batches ``[N, K, B, ...]`` (a pure function of the
  seed and the step: a resumed run reads the same), ``batches.position(step)`` the data position a
  checkpoint records. ``eval_batch`` is ``[N, k, ...]``: each replica evaluates its own k examples of the
  held-out split. ``probe(index)`` is the common batch ``[W, ...]`` of sync ``index``.
  """

  batches: Any  # .chunk(first_step, steps), .position(step)
  eval_batch: Any  # pytree, leaves [N, k, ...]
  probe: Callable[[int], Any]  # sync index -> pytree, leaves [W, ...]
  description: str  # one line for the run's start message, e.g. '4,000 train / 1,000 test examples'


def eval_record(task: 'Task', means: dict[str, float]) -> dict[str, float]:
  """An 'eval' record's fields from the replicas' mean :meth:`Task.eval_metrics`: ``val_loss``, the loss in
  the task's other units, then the task's other metrics (``val_accuracy``, ...)."""
  return {
    'val_loss': means['loss'],
    **{f'val_{k}': v for k, v in task.loss_units(means['loss']).items()},
    **{f'val_{k}': v for k, v in means.items() if k != 'loss'},
  }


class Task:
  """A workload. Subclasses set the class attributes and implement the methods.

  Every method taking ``settings`` reads only the task's own fields (:class:`TaskSettings`).
  """

  name: str = ''
  # The primary metric: the key of the 'eval' records and of the summary's ``final_val_*``; lower is better.
  metric: str = 'val_loss'
  # What one example's prediction counts as in the throughput (``tokens_per_s``): e.g. a byte for the LM.
  unit: str = 'tokens'
  # Regexes on parameter paths for ``hdet.param_groups`` (the paper's per-group LRs).
  param_groups: dict = {}
  # The model hyperparameters HDET may explore per replica (``hdet.explore.*``) besides optimizer ones.
  explorable: tuple[str, ...] = ()
  # Replica groups: tensor-parallel rules and FSDP exceptions (see hdet_jax.stacked_shardings); () : none.
  tensor_rules: tuple = ()
  fsdp_rules: tuple = ()
  # The task's own config sections, typed as hdet_jax/trainer/fields.py's: {'data': ..., 'model': ...}; a section
  # left out is the trainer's (fields.Data, fields.Model: the LM's).
  sections: dict = {}

  def unread(self, fields: dict[str, Any]) -> list[tuple[str, tuple[str, ...]]]:
    """``(why, names)`` for the task's fields that ``fields`` (the run's flattened, completed fields) leaves
    unread, e.g. a generator's settings under ``data.path``: the run warns about those set away from their
    default (``run_settings.ignored``)."""
    return []

  def check(self, settings: TaskSettings) -> None:
    """Raises TaskError for a task field that cannot work (before anything is read or written)."""

  def check_tensor_parallel(self, settings: TaskSettings, tensor: int) -> None:
    """Raises ValueError unless the model splits over ``tensor`` devices (tasks without rules: only 1)."""
    if tensor > 1:
      raise ValueError(f'the {self.name} task has no tensor-parallel layout; use mesh.tensor=1.')

  def load(self, settings: TaskSettings, num_replicas: int, seed: int) -> TaskData:
    raise NotImplementedError

  def abstract_model(self, settings: TaskSettings) -> tuple[Any, Any]:
    """(graphdef, one replica's parameter shapes) without computing anything."""
    raise NotImplementedError

  def init_model(self, settings: TaskSettings, key: jax.Array) -> tuple[Any, Any]:
    """(graphdef, one replica's parameters as a pure dict) from ``key``; jitted by the trainer."""
    raise NotImplementedError

  def losses(
    self, graphdef: Any, params: Any, batch: Any, reg: Regularization = Regularization(), label_smoothing: Any = 0.0
  ) -> tuple[jax.Array, jax.Array]:
    """(training loss, plain cross-entropy) of one replica's batch; the controller compares the second."""
    raise NotImplementedError

  def loss(self, graphdef: Any, params: Any, batch: Any, reg: Regularization = Regularization()) -> jax.Array:
    """The plain cross-entropy (what the common batch scores and the gradient's loss is compared on)."""
    return self.losses(graphdef, params, batch, reg)[1]

  def eval_metrics(self, graphdef: Any, params: Any, batch: Any) -> dict[str, jax.Array]:
    """Means over one replica's eval examples (every replica holds as many): ``{'loss': ..., ...}``."""
    return {'loss': self.loss(graphdef, params, batch)}

  def loss_units(self, nats: float) -> dict[str, float]:
    """A loss in other units worth recording beside it (the LM's bits per byte); keys without a prefix."""
    return {}

  def predictions_per_example(self, settings: TaskSettings) -> int:
    """How many predictions (``unit``) one example of a batch holds."""
    return 1


def stack_examples(tree: Any, num_replicas: int, per_replica: int) -> Any:
  """The first ``num_replicas * per_replica`` examples of every leaf as ``[N, per_replica, ...]``."""
  return jax.tree.map(
    lambda a: np.asarray(a)[: num_replicas * per_replica].reshape((num_replicas, per_replica) + np.shape(a)[1:]), tree
  )
