"""The trainer's config fields, each declared once: default, type and range, role, value in older records, help.

Everything the trainer knows about a field is its row in :data:`FIELDS`; the rest is derived from the rows:
- the values a config lacks (:func:`complete`: a field added after the config was written reads as it trained
  then, its ``legacy`` value, else as its default);
- each field's check (:func:`check_fields`; the rules across fields are ``run_settings``');
- what defines a run (:func:`defines_a_run`: what a resume compares) and what the compiled programs read
  (:func:`not_in_programs`: the programs' cache key leaves the rest out);
- the values of records made before a field existed (:func:`legacy_values`: a run at such a value leaves the
  field out of its recorded training fields, so older workdirs still resume).

``configs/default.py`` (and a task's config, for the task's own fields) stays the file a user reads;
``tests/test_schema.py`` checks that it agrees with :data:`FIELDS`: every field, its default and its help line.

Roles:
  RUN            defines the run (part of its training fields; read by the compiled programs);
  LOOP_PROGRAMS  loop-only (may change on resume) but part of the programs' cache key;
  LOOP           loop-only and read by no program.
(The LR bracket's fields, ``bracket.*``, sit outside every run's training fields: :func:`defines_a_run`.)

Adding a field: one row here, one line in ``configs/default.py``, and its use in the part that reads it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

import hdet_jax as H
from hdet_jax.trainer.optimizer import OPTIMIZERS

RUN, LOOP_PROGRAMS, LOOP = 'run', 'loop_programs', 'loop'
_ABSENT = object()

SCHEDULES = ('one_cycle', 'warmup_cosine', 'constant')
CONTROLLERS = ('paper', 'fit')
SCORES = ('window', 'common')
AFTER_STOP = ('hold', 'rise')


class Check(NamedTuple):
  """A field's type and range: ``kind`` ('int', 'real', 'bool', 'choice' or 'path'), ``ok(value)`` within the
  kind, and what a valid value is, for the error."""

  kind: str
  ok: Callable[[Any], bool]
  what: str
  none_resolves: bool = False  # None is valid: the field resolves where it applies (run_settings.guard)


def integer(ok: Callable[[Any], bool], what: str, *, none_resolves: bool = False) -> Check:
  return Check('int', ok, what, none_resolves)


def real(ok: Callable[[Any], bool], what: str, *, none_resolves: bool = False) -> Check:
  """A finite number (an int is one too)."""
  return Check('real', ok, what, none_resolves)


def one_of(*choices: Any) -> Check:
  return Check('choice', lambda v: v in choices, f'one of {", ".join(map(repr, choices))}')


BOOLEAN = Check('bool', lambda v: True, 'True or False')
# A controller setting's type; its range is the core's (hdet_jax.settings.check_auto_lr; run_settings' check).
CONTROLLER_NUMBER = Check('real', lambda v: True, 'a number')
CONTROLLER_NUMBER_OR_NONE = Check('real', lambda v: True, 'a number or None', none_resolves=True)
PATH = Check('path', lambda v: True, 'a path (a string) or None')


def _is_int(v: Any) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_real(v: Any) -> bool:
  return (
    isinstance(v, (int, float, np.integer, np.floating))
    and not isinstance(v, (bool, np.bool_))
    and math.isfinite(float(v))
  )


_KINDS = {
  'int': _is_int,
  'real': _is_real,
  'bool': lambda v: isinstance(v, (bool, np.bool_)),
  'choice': lambda v: True,
  'path': lambda v: v is None or isinstance(v, str),
}


@dataclasses.dataclass(frozen=True)
class Field:
  """One config field. ``legacy``: its value in records made before it existed (absent: none older lack it); such
  records trained as with this value, so a run at it leaves the field out of its recorded training fields, and a
  config that lacks the field reads as it. It may differ from ``default`` on purpose (e.g. ``hdet.after_stop``:
  'hold' in old records, 'rise' today). ``check``: its type and range (None: not checked here). ``task``: the
  task whose config declares the field (None: configs/default.py)."""

  name: str
  default: Any
  role: str
  help: str
  legacy: Any = _ABSENT
  task: str | None = None
  check: Check | None = None
  python: bool = False  # research's: given in Python (train_and_evaluate's tuning=), not in configs/default.py

  def __init__(
    self,
    name: str,
    default: Any,
    role: str,
    help: str = '',
    *,
    legacy: Any = _ABSENT,
    task: str | None = None,
    check: Check | None = None,
    python: bool = False,
  ):
    fields = dict(
      name=name, default=default, role=role, help=help, legacy=legacy, task=task, check=check, python=python
    )
    for k, v in fields.items():
      object.__setattr__(self, k, v)

  @property
  def has_legacy(self) -> bool:
    return self.legacy is not _ABSENT

  @property
  def absent(self) -> Any:
    """What a config that lacks the field (written before it existed) reads as: its legacy value, else its default."""
    return self.legacy if self.has_legacy else self.default

  def error(self, value: Any) -> str | None:
    """Why ``value`` is not a valid value of the field (one line naming it), or None."""
    c = self.check
    if c is None or (value is None and c.none_resolves) or (_KINDS[c.kind](value) and c.ok(value)):
      return None
    return f'{self.name} must be {c.what}, got {value!r}.'


# The core's AutoLR defaults: the controller's rows take theirs from here, never restating them.
AUTO_LR_DEFAULTS = _AUTO_LR = {
  f.name: f.default for f in dataclasses.fields(H.AutoLR) if f.default is not dataclasses.MISSING
}

FIELDS: tuple[Field, ...] = (
  Field(
    'task', 'lm', RUN, "The workload (docs/tasks.md): 'lm' (this file) or 'mnist1d' (configs/mnist1d.py).", legacy='lm'
  ),
  Field(
    'seed',
    0,
    RUN,
    'Seeds everything random: model init, data order, permutations, warm-init noise.',
    check=integer(lambda v: 0 <= v < 2**32, 'an integer in [0, 2**32)'),
  ),
  Field(
    'num_train_steps',
    1500,
    RUN,
    'S: total optimizer steps; the schedule and the controller span them.',
    check=integer(lambda v: v >= 2, 'an integer >= 2'),
  ),
  Field('init_from', None, RUN, 'A workdir to warm-start from (eq. 10); None: random init.', check=PATH),
  Field('data.path', None, RUN, 'A local UTF-8 text file; None: the built-in data.corpus.', check=PATH),
  Field(
    'data.corpus', 'kjv', RUN, "Without data.path: 'kjv' (King James Bible) or 'wyc' (Wycliffe Bible).", legacy='kjv'
  ),
  Field(
    'data.val_fraction',
    0.05,
    RUN,
    "The corpus's last fraction of bytes is held out for validation.",
    check=real(lambda v: 0 < v < 1, 'in (0, 1)'),
  ),
  Field(
    'data.seq_len', 64, RUN, 'Bytes of context per training window.', check=integer(lambda v: v >= 1, 'an integer >= 1')
  ),
  Field(
    'data.batch_size',
    8,
    RUN,
    'Windows per replica per step (the global batch is num_replicas times this).',
    check=integer(lambda v: v >= 1, 'an integer >= 1'),
  ),
  Field(
    'model.d_model',
    64,
    RUN,
    'Width of the residual stream (and of the byte embedding).',
    check=integer(lambda v: v >= 1, 'an integer >= 1'),
  ),
  Field('model.num_layers', 2, RUN, 'Transformer blocks.', check=integer(lambda v: v >= 1, 'an integer >= 1')),
  Field(
    'model.num_heads',
    4,
    RUN,
    'Attention heads per block (must divide d_model).',
    check=integer(lambda v: v >= 1, 'an integer >= 1'),
  ),
  Field(
    'model.mlp_ratio', 4, RUN, 'MLP hidden width as a multiple of d_model.', check=real(lambda v: v > 0, 'a number > 0')
  ),
  Field(
    'model.dropout',
    0.0,
    RUN,
    'Dropout rate on attention and MLP outputs (the base value if explored).',
    check=real(lambda v: 0 <= v < 1, 'in [0, 1)'),
  ),
  Field(
    'model.attn_temperature',
    1.0,
    RUN,
    'Attention logits are divided by this (the base value if explored).',
    check=real(lambda v: v > 0, 'a number > 0'),
  ),
  Field(
    'optim.name',
    'adamw',
    RUN,
    "The optax optimizer HDET wraps: 'adamw', 'adam' or 'sgd' (b1 = momentum).",
    check=one_of(*OPTIMIZERS),
  ),
  Field(
    'optim.max_lr',
    0.03,
    RUN,
    'Peak of the schedule; the guarded climb starts at a tenth of it and rises.',
    check=real(lambda v: v > 0, 'a number > 0'),
  ),
  Field(
    'optim.schedule',
    'one_cycle',
    RUN,
    "'one_cycle' (torch's OneCycleLR), 'warmup_cosine' or 'constant'.",
    check=one_of(*SCHEDULES),
  ),
  Field(
    'optim.pct_start',
    0.3,
    RUN,
    'Fraction of the steps spent warming the LR up to max_lr.',
    check=real(lambda v: 0 < v < 1, 'in (0, 1)'),
  ),
  Field(
    'optim.div_factor',
    25.0,
    RUN,
    'The schedule starts at max_lr / div_factor ...',
    check=real(lambda v: v > 0, 'a number > 0'),
  ),
  Field(
    'optim.final_div_factor',
    10.0,
    RUN,
    '... and ends at max_lr / (div_factor * final_div_factor).',
    check=real(lambda v: v > 0, 'a number > 0'),
  ),
  Field('optim.b1', 0.9, RUN, "Adam's beta1 (SGD's momentum).", check=real(lambda v: 0 <= v < 1, 'in [0, 1)')),
  Field('optim.b2', 0.95, RUN, "Adam's beta2.", check=real(lambda v: 0 <= v < 1, 'in [0, 1)')),
  Field(
    'optim.weight_decay',
    0.1,
    RUN,
    "AdamW's decoupled weight decay, on matrices only (not biases or norms).",
    check=real(lambda v: v >= 0, 'a number >= 0'),
  ),
  Field(
    'optim.grad_clip_norm',
    0.0,
    RUN,
    'Clip the all-reduced gradient to this global norm (0: no clipping).',
    check=real(lambda v: v >= 0, 'a number >= 0 (0: no clipping)'),
  ),
  Field(
    'optim.label_smoothing',
    0.0,
    RUN,
    'Label smoothing of the training loss (the base value if explored).',
    check=real(lambda v: 0 <= v < 1, 'in [0, 1)'),
  ),
  Field(
    'optim.runtime_lr_scale',
    False,
    RUN,
    "Apply max_lr's power of two at run time (the LR bracket sets it).",
    legacy=False,
    check=BOOLEAN,
    python=True,
  ),
  Field(
    'hdet.num_replicas',
    8,
    RUN,
    'N replicas on however many devices (N a multiple of them); 0: one per device.',
    check=integer(lambda v: v >= 0, 'an integer >= 0 (0: all devices)'),
  ),
  Field(
    'hdet.spread',
    0.25,
    RUN,
    'alpha of eq. 1: LRs span base * [1 - alpha, 1 + alpha]; 0: plain data parallel.',
    check=real(lambda v: 0 <= v < 1, 'in [0, 1) (the lowest multiplier 1 - spread stays positive)'),
  ),
  Field(
    'hdet.sync_every',
    0,
    RUN,
    'T: average the replicas every T steps; 0: T from num_syncs.',
    check=integer(lambda v: v >= 0, 'an integer >= 0 (0: never)'),
  ),
  Field(
    'hdet.num_syncs',
    15,
    RUN,
    'With sync_every 0: T = round(num_train_steps / num_syncs), at most 100; both 0: never.',
    legacy=0,
    check=integer(lambda v: v >= 0, 'an integer >= 0 (used where hdet.sync_every is 0)'),
  ),
  Field(
    'hdet.longest_window',
    100,
    RUN,
    '... at most this many steps (0: no cap). Both 0: never average.',
    legacy=100,
    check=integer(lambda v: v >= 0, 'an integer >= 0 (0: no cap on the windows of hdet.num_syncs)'),
    python=True,
  ),
  Field('hdet.auto_lr', True, RUN, 'The controller moves the base LR at each sync.'),
  Field(
    'hdet.controller',
    'fit',
    RUN,
    "'fit' (the guarded climb, a line search) or 'paper' (eqs. 4-9).",
    check=one_of(*CONTROLLERS),
  ),
  Field(
    'hdet.score',
    'common',
    RUN,
    "Compare replicas on one 'common' batch at each sync, or on their 'window' losses.",
    check=one_of(*SCORES),
    python=True,
  ),
  Field(
    'hdet.probe_windows',
    16,
    RUN,
    'Windows in the common batch (fresh at each sync).',
    check=integer(lambda v: v >= 1, 'an integer >= 1'),
    python=True,
  ),
  Field(
    'hdet.warmup_steps',
    _AUTO_LR['warmup_steps'],
    RUN,
    'The controller starts at the first sync at or after this step.',
    check=integer(lambda v: v >= 0, 'an integer >= 0'),
    python=True,
  ),
  Field(
    'hdet.stop_fraction',
    0.0,
    RUN,
    "After this fraction of the run the controller holds ('fit': see after_stop).",
    check=real(lambda v: 0 <= v <= 1, 'in [0, 1] (0: from the first sync; 1: never stop)'),
    python=True,
  ),
  # Rows whose legacy value differs from their default on purpose: records made before the field trained so.
  Field(
    'hdet.after_stop',
    _AUTO_LR['after_stop'],
    RUN,
    "'fit' after stop_fraction: 'rise' (take only steps up) or 'hold'.",
    legacy='hold',
    check=one_of(*AFTER_STOP),
    python=True,
  ),
  Field(
    'hdet.trust',
    _AUTO_LR['trust'],
    RUN,
    "'fit': the largest change of log(LR correction) per sync (1.0: x2.7).",
    check=CONTROLLER_NUMBER,
    python=True,
  ),
  Field(
    'hdet.memory',
    _AUTO_LR['memory'],
    RUN,
    "'fit': forgetting factor of the line search's statistics across syncs.",
    check=CONTROLLER_NUMBER,
    python=True,
  ),
  Field(
    'hdet.initial_scale',
    0.1,
    RUN,
    "'fit': start at this multiple of the schedule (< 1: a cautious start).",
    legacy=1.0,
    check=CONTROLLER_NUMBER,
  ),
  Field(
    'hdet.step_growth',
    _AUTO_LR['step_growth'],
    RUN,
    "'fit': the step's gain grows by this factor while steps keep one sign (1: off).",
    legacy=1.0,
    check=CONTROLLER_NUMBER,
    python=True,
  ),
  Field(
    'hdet.max_gain',
    _AUTO_LR['max_gain'],
    RUN,
    "'fit': the largest gain.",
    legacy=4.0,
    check=CONTROLLER_NUMBER,
    python=True,
  ),
  Field('hdet.backoff', None, RUN, 'Step the LR down on such a window.', legacy=False, python=True),
  Field(
    'hdet.backoff_stderrs',
    None,
    RUN,
    'Margin in standard errors (None: 2).',
    legacy=0.0,
    check=CONTROLLER_NUMBER_OR_NONE,
    python=True,
  ),
  Field(
    'hdet.backoff_fraction',
    None,
    RUN,
    'Margin as a fraction of the loss (None: 0.05).',
    legacy=0.0,
    check=CONTROLLER_NUMBER_OR_NONE,
    python=True,
  ),
  Field('hdet.rollback', None, RUN, "Undo a window whose loss blew up (None: where 'fit' guards).", legacy=False),
  Field('hdet.settle', None, RUN, "'fit': stop spreading once the climb has ended.", legacy=False, python=True),
  Field(
    'hdet.temperature',
    _AUTO_LR['temperature'],
    RUN,
    "'paper': sigma of eq. 4, in nats.",
    check=CONTROLLER_NUMBER,
    python=True,
  ),
  Field(
    'hdet.lr_of_lr',
    _AUTO_LR['lr_of_lr'],
    RUN,
    "'paper': lambda of eq. 7, the step size of the base-LR update.",
    check=CONTROLLER_NUMBER,
    python=True,
  ),
  Field(
    'hdet.momentum',
    _AUTO_LR['momentum'],
    RUN,
    "'paper': beta of eq. 7, the momentum of the base-LR velocity.",
    check=CONTROLLER_NUMBER,
    python=True,
  ),
  Field(
    'hdet.smooth_decay',
    _AUTO_LR['smooth_decay'],
    RUN,
    "'paper': decay the base continuously within a window (False: hold it).",
    python=True,
  ),
  Field('hdet.param_groups', False, RUN, 'Per-group LRs (embedding, no_decay, weights), each with its own controller.'),
  Field(
    'hdet.explore.weight_decay',
    0.0,
    RUN,
    "Multiplicative spread of AdamW's weight decay, in [0, 1).",
    check=real(lambda v: 0 <= v < 1, 'in [0, 1) (0: off)'),
  ),
  Field(
    'hdet.explore.dropout',
    0.0,
    RUN,
    'Additive half-width of the dropout rate (clipped to [0, 0.9]).',
    check=real(lambda v: v >= 0, 'a number >= 0 (0: off)'),
  ),
  Field(
    'hdet.explore.label_smoothing',
    0.0,
    RUN,
    'Additive half-width of label smoothing (clipped to [0, 0.5]).',
    check=real(lambda v: v >= 0, 'a number >= 0 (0: off)'),
  ),
  Field(
    'hdet.explore.attn_temperature',
    0.0,
    RUN,
    'Multiplicative spread of the attention temperature, in [0, 1).',
    check=real(lambda v: 0 <= v < 1, 'in [0, 1) (0: off)'),
  ),
  Field(
    'hdet.low_communication',
    False,
    RUN,
    'Replicas step on their own gradients; the sync is their only all-reduce.',
    legacy=False,
  ),
  Field(
    'hdet.average_opt_state',
    False,
    RUN,
    'Low-communication mode: a sync also averages the optimizer state.',
    legacy=False,
  ),
  Field(
    'mesh.replicas',
    0,
    RUN,
    'N replica groups on a grouped mesh (0: devices / (fsdp x tensor)).',
    legacy=0,
    check=integer(lambda v: v >= 0, 'an integer >= 0 (0: devices / mesh.fsdp)'),
  ),
  Field(
    'mesh.fsdp',
    1,
    RUN,
    'Devices per group sharding it FSDP-style (data.batch_size must divide by it).',
    legacy=1,
    check=integer(lambda v: v >= 1, 'an integer >= 1 (1: no FSDP inside a group)'),
  ),
  Field(
    'mesh.tensor',
    1,
    RUN,
    'Devices per group splitting its kernels (tensor parallel).',
    legacy=1,
    check=integer(lambda v: v >= 1, 'an integer >= 1 (1: no tensor parallelism inside a group)'),
  ),
  Field(
    'mesh.devices',
    0,
    LOOP_PROGRAMS,
    'Train on the first D devices (1-D meshes); 0: as many as N needs.',
    check=integer(lambda v: v >= 0, 'an integer >= 0 (0: every visible device)'),
  ),
  # The LR bracket's fields (hdet_jax.trainer.bracket), as records made before it existed read them
  # (bracket.rungs: the rungs those records' brackets ran): outside every run's training fields (defines_a_run).
  Field(
    'bracket.points',
    0,
    RUN,
    'Plain runs at peak LRs max_lr * factor ** (k - (points - 1) / 2); 0: off.',
    legacy=0,
    check=integer(lambda v: v == 0 or v >= 2, 'an integer >= 2, or 0 (off: one run)'),
  ),
  Field(
    'bracket.factor',
    2.0,
    RUN,
    "The ratio of neighbouring points' peak LRs.",
    legacy=2.0,
    check=real(lambda v: v > 1, 'a number > 1'),
  ),
  Field(
    'bracket.rungs',
    '0.1:5,0.3:1',
    RUN,
    "'fraction:kept,...': at each fraction the best `kept` runs go on.",
    legacy='0.1:4,0.3:1',
  ),
  Field(
    'bracket.compare_steps',
    10,
    RUN,
    'A rung ranks runs by their mean training loss over this many steps.',
    legacy=10,
    check=integer(lambda v: v >= 1, 'an integer >= 1'),
    python=True,
  ),
  Field(
    'warm_init.nu',
    0.01,
    RUN,
    'nu of eq. 10: noise std is nu * ||theta_0|| / sqrt(d) (with init_from).',
    check=real(lambda v: v >= 0, 'a number >= 0'),
  ),
  Field(
    'log_every',
    25,
    LOOP_PROGRAMS,
    'Steps between metric flushes (JSONL, progress bar); also the NaN check interval.',
    check=integer(lambda v: v >= 1, 'an integer >= 1'),
  ),
  Field(
    'chunk_steps',
    25,
    LOOP_PROGRAMS,
    'Steps whose batches go to the devices in one transfer (fewer: less device memory).',
    check=integer(lambda v: v >= 1, 'an integer >= 1'),
  ),
  Field(
    'eval_every',
    250,
    LOOP,
    'Steps between validations of the averaged model (and one at the end); 0: at the end.',
    check=integer(lambda v: v >= 0, 'an integer >= 0 (0: only at the end)'),
  ),
  Field(
    'eval_windows',
    512,
    LOOP_PROGRAMS,
    'Validation windows per evaluation (0: the whole validation split).',
    check=integer(lambda v: v >= 0, 'an integer >= 0 (0: the whole split)'),
  ),
  Field(
    'checkpoint_every',
    500,
    LOOP,
    'Steps between checkpoints (and one at the end); 0: only at the end.',
    check=integer(lambda v: v >= 0, 'an integer >= 0 (0: only at the end)'),
  ),
  Field(
    'max_checkpoints',
    2,
    LOOP,
    'Checkpoints kept in WORKDIR/checkpoints (0: all).',
    check=integer(lambda v: v >= 0, 'an integer >= 0 (0: keep all)'),
  ),
  Field(
    'stop_at_step',
    0,
    LOOP,
    'Stop (with a checkpoint) after this many steps, as if preempted; 0: run to the end.',
    check=integer(lambda v: v >= 0, 'an integer >= 0 (0: run to the end)'),
    python=True,
  ),
  Field('stop_on_nan', True, LOOP, "Stop once every replica's loss is NaN/inf (False: record it, keep going)."),
  Field('plots', True, LOOP, 'Draw the PNG plots into WORKDIR/plots at the end.'),
  Field('tensorboard', True, LOOP, 'TensorBoard event files beside metrics.jsonl in the workdir.'),
  Field('progress_bar', True, LOOP, 'Show the tqdm progress bar.'),
  Field(
    'num_cpu_devices',
    8,
    LOOP_PROGRAMS,
    'Simulated CPU devices on a CPU-only machine (JAX_NUM_CPU_DEVICES wins).',
    check=integer(lambda v: v >= 0, 'an integer >= 0'),
  ),
  # legacy True: no effect without CUDA, where every record before the field was made.
  Field(
    'deterministic_gpu',
    True,
    LOOP_PROGRAMS,
    "XLA's deterministic GPU ops: the same config and seed, the same numbers.",
    legacy=True,
  ),
  Field('compilation_cache', '~/.cache/hdet_jax/xla', LOOP, "JAX's persistent compilation cache ('': off)."),
  # The mnist1d task's own fields (configs/mnist1d.py, which also sets some of default.py's).
  Field(
    'data.num_samples',
    100000,
    RUN,
    "MNIST-1D's make_dataset arguments (the rest at get_dataset_args' defaults: 40-sample signals, "
    '10 classes). 20x the published 5,000, so that the test cross-entropy varies less from seed to seed '
    "(research/workloads_discussion.md, 'The noise floor'). Generated once per process.",
    task='mnist1d',
    check=integer(lambda v: v >= 20, 'an integer >= 20'),
  ),
  Field(
    'data.train_split',
    0.8,
    RUN,
    'The first 80% of the generated examples train, the rest test.',
    task='mnist1d',
    check=real(lambda v: 0 < v < 1, 'in (0, 1)'),
  ),
  Field(
    'data.dataset_seed',
    42,
    RUN,
    "The generator's seed (the package's default): the same data for every config.seed.",
    task='mnist1d',
    check=integer(lambda v: 0 <= v < 2**32, 'an integer in [0, 2**32)'),
  ),
  Field(
    'model.kind',
    'cnn',
    RUN,
    "'cnn': the reference CNN below; 'mlp': two ReLU layers of model.hidden units.",
    legacy='cnn',
    task='mnist1d',
  ),
  Field(
    'model.hidden',
    128,
    RUN,
    "Units of each of the MLP's two hidden layers (model.kind='mlp' only).",
    legacy=128,
    task='mnist1d',
    check=integer(lambda v: v >= 1, 'an integer >= 1'),
  ),
  Field(
    'model.channels',
    25,
    RUN,
    "Channels of each of the three convolutions (the reference CNN's 25).",
    task='mnist1d',
    check=integer(lambda v: v >= 1, 'an integer >= 1'),
  ),
  Field(
    'model.num_classes',
    10,
    RUN,
    'Output classes (labels must lie in [0, num_classes)).',
    task='mnist1d',
    check=integer(lambda v: v >= 2, 'an integer >= 2'),
  ),
)

BY_NAME = {f.name: f for f in FIELDS}
assert len(BY_NAME) == len(FIELDS), 'a field declared twice'


def tuning_fields() -> tuple[str, ...]:
  """The fields research sets in Python (``train_and_evaluate(config, workdir, tuning={name: value})``): the
  controller's tuning, the probe, the windows' cap, the bracket's compare steps, the LR's run-time power of two and a
  stop as if preempted. They are not in ``configs/default.py``; a run records them in ``config.json`` as before."""
  return tuple(f.name for f in FIELDS if f.python)


# hdet.controller='paper' (eqs. 4-9) at the paper's values where research sets none of these: its replicas scored on
# their window losses, its controller acting to the end (``hdet_jax.AutoLR.paper``'s ``stop_steps=None``).
PAPER_TUNING = {'hdet.score': 'window', 'hdet.stop_fraction': 1.0}


def loop_only() -> frozenset[str]:
  """The fields that only steer a run (they may change when it resumes)."""
  return frozenset(f.name for f in FIELDS if f.role in (LOOP, LOOP_PROGRAMS))


RUN_FIELDS = loop_only()


def not_in_programs() -> tuple[str, ...]:
  """The fields no compiled program reads (``program_cache.programs_key`` leaves them out)."""
  return tuple(f.name for f in FIELDS if f.role == LOOP)


def legacy_values() -> dict[str, Any]:
  """Each field's value in records made before it existed."""
  return {f.name: f.legacy for f in FIELDS if f.has_legacy}


def parse_rungs(text: str) -> list[tuple[float, int]]:
  """``bracket.rungs`` parsed: ``'0.1:4,0.3:1'`` -> ``[(0.1, 4), (0.3, 1)]`` (fraction of the run, runs kept);
  raises ValueError on anything else.

  Example:
    >>> parse_rungs('0.1:5,0.3:1')
    [(0.1, 5), (0.3, 1)]
  """
  rungs = []
  for part in str(text).split(','):
    fraction, sep, kept = part.strip().partition(':')
    if not sep:
      raise ValueError(f'{part.strip()!r} is not fraction:kept')
    rungs.append((float(fraction), int(kept)))
  return rungs


def rung_steps(rungs: list[tuple[float, int]], total: int) -> list[int]:
  """The step each rung compares at (and its runs stop at): floor(fraction * total)."""
  return [int(math.floor(f * total + 1e-9)) for f, _ in rungs]


def task_of(given: Mapping[str, Any]) -> str:
  """The task a (flattened) config names; one without the field is the LM's, as configs were before it existed."""
  return given.get('task', BY_NAME['task'].absent)


def complete(given: Mapping[str, Any], task: str | None = None) -> dict[str, Any]:
  """The (flattened) fields ``given`` with every field of the trainer and of ``task`` (default: the one ``given``
  names) it lacks at its :attr:`Field.absent` value: what a run reads. Fields no row declares are kept.

  Example:
    >>> complete({'task': 'mnist1d', 'seed': 3})['model.kind']
    'cnn'
  """
  task = task_of(given) if task is None else task
  out = {f.name: f.absent for f in FIELDS if f.task in (None, task)}
  out.update(given)
  return out


def check_fields(values: Mapping[str, Any]) -> None:
  """Each field's type and range (its row's :attr:`Field.check`), in the rows' order; raises ValueError naming the
  first bad one. Fields ``values`` lacks are not checked."""
  for f in FIELDS:
    if f.name in values:
      error = f.error(values[f.name])
      if error:
        raise ValueError(error)


def defines_a_run(field: str) -> bool:
  """Whether a (dotted) field can change one run's trajectory: not loop-only, not the LR bracket's (a bracket's
  runs are one-run configs that never read ``bracket.*``; ``bracket.json`` records the bracket's own fields)."""
  return field not in RUN_FIELDS and not field.startswith('bracket.')


def run_identity(fields: Mapping[str, Any]) -> dict[str, Any]:
  """The (dotted) fields of ``fields`` that define a run (:func:`defines_a_run`): what a resume compares, also for
  fields a workdir recorded before a version that left some out."""
  return {k: v for k, v in fields.items() if defines_a_run(k)}


def differences(old: Mapping[str, Any], new: Mapping[str, Any], limit: int = 4) -> str:
  """'a.b: 1 -> 2, ...' for the keys whose values differ."""
  keys = sorted(set(old) | set(new))
  diffs = [
    f'{k}: {old.get(k, "<absent>")!r} -> {new.get(k, "<absent>")!r}'
    for k in keys
    if old.get(k, '<absent>') != new.get(k, '<absent>')
  ]
  more = f' (and {len(diffs) - limit} more)' if len(diffs) > limit else ''
  return ', '.join(diffs[:limit]) + more


_ASSIGN = re.compile(r'\s*config\.([\w.]+) = (.*?)(?:  # (.*))?$')


def documented(path: str) -> dict[str, str]:
  """The fields ``path`` (a config file like configs/default.py) assigns, each with its help: the comment on its
  line, or else the comment lines just above it. Sub-dicts (``ml_collections.ConfigDict()``) are not fields."""
  out, above = {}, []
  with open(path) as f:
    for line in f:
      line = line.rstrip('\n')
      if line.strip().startswith('#'):
        above.append(line.strip()[1:].strip())
        continue
      m = _ASSIGN.match(line)
      if m and 'ConfigDict()' not in m.group(2) and 'sibling(' not in m.group(2):
        out[m.group(1)] = m.group(3) or ' '.join(above)
      above = []
  return out
