"""The trainer's config: every field declared once, with its default, type and range, role and help.

A field is one line in its section, with its help on the comment line(s) above it::

  # Steps whose batches go to the devices in one transfer (fewer: less device memory).
  chunk_steps: int = field(25, valid(lambda v: v >= 1, 'an integer >= 1'), role=LOOP_PROGRAMS)

- the type is the annotation (``X | None``: None is a valid value, overridable as an X);
- the range is ``valid(ok, what)`` or ``one_of(...)``: a value outside it stops the run with one line,
  '``chunk_steps must be an integer >= 1, got 0.``';
- the role says what a resume may change (the default, ``RUN``: nothing):
    RUN            defines the run: part of its recorded training fields, read by the compiled programs;
    LOOP_PROGRAMS  steers the loop only (may change on resume), but the compiled programs read it;
    LOOP           steers the loop only, and no program reads it;
- ``legacy``: the value records made before the field existed trained with (a config that lacks the field reads
  as it; a run at it leaves the field out of its recorded training fields, so older workdirs still resume).

:func:`get_config` is the main job's config (``configs/default.py``); ``--config.x=`` overrides any field.
``schema.py`` reads the rows off these classes. Adding a field is its line here and its use in the part that
reads it (CONTRIBUTING.md shows ``chunk_steps``).
"""

import dataclasses
import types
from typing import Any, Callable, NamedTuple

import ml_collections
from ml_collections import config_dict

from hdet_jax.arguments import is_spread
from hdet_jax.settings import DEFAULT_INITIAL_SCALE
from hdet_jax.trainer.optimizer import OPTIMIZERS
from hdet_jax.sync import NUM_SYNCS

RUN, LOOP_PROGRAMS, LOOP = 'run', 'loop_programs', 'loop'
ABSENT = object()  # no legacy value: no record predates the field


class Range(NamedTuple):
  """A field's range: ``ok(value)`` for a value of the field's type, and what a valid value is, for the error."""

  ok: Callable[[Any], bool]
  what: str
  choice: bool = False


def valid(ok: Callable[[Any], bool], what: str) -> Range:
  return Range(ok, what)


def one_of(*choices: Any) -> Range:
  return Range(lambda v: v in choices, f'one of {", ".join(map(repr, choices))}', choice=True)


ANY_PATH = Range(lambda v: True, 'a path (a string) or None')


def field(default: Any, check: Range | None = None, *, role: str = RUN, legacy: Any = ABSENT) -> Any:
  """A config field: its default, its range (None: its type is ml_collections', unchecked here), its role and its
  value in older records."""
  return dataclasses.field(default=default, metadata={'check': check, 'role': role, 'legacy': legacy})


def section(cls: type) -> Any:
  """A sub-config (``config.data``, ``config.hdet``, ...)."""
  return dataclasses.field(default_factory=cls, metadata={'section': True})


INT_AT_LEAST_1 = valid(lambda v: v >= 1, 'an integer >= 1')
_POSITIVE = valid(lambda v: v > 0, 'a number > 0')
_UNIT = valid(lambda v: 0 <= v < 1, 'in [0, 1)')
OPEN_UNIT = valid(lambda v: 0 < v < 1, 'in (0, 1)')


@dataclasses.dataclass(frozen=True)
class Data:
  """``data.*``: the LM task's corpus and windows (another task declares its own in its module: Mnist1dData)."""

  # A local UTF-8 text file; None: the built-in data.corpus.
  path: str | None = field(None, ANY_PATH)
  # Without data.path: 'kjv' (King James Bible) or 'wyc' (Wycliffe Bible).
  corpus: str = field('kjv', legacy='kjv')
  # The corpus's last fraction of bytes is held out for validation.
  val_fraction: float = field(0.05, OPEN_UNIT)
  # Bytes of context per training window.
  seq_len: int = field(64, INT_AT_LEAST_1)
  # Windows per replica per step (the global batch is num_replicas times this).
  batch_size: int = field(8, INT_AT_LEAST_1)


@dataclasses.dataclass(frozen=True)
class Model:
  """``model.*``: the LM task's byte-level transformer."""

  # Width of the residual stream (and of the byte embedding).
  d_model: int = field(64, INT_AT_LEAST_1)
  # Transformer blocks.
  num_layers: int = field(2, INT_AT_LEAST_1)
  # Attention heads per block (must divide d_model).
  num_heads: int = field(4, INT_AT_LEAST_1)
  # MLP hidden width as a multiple of d_model.
  mlp_ratio: float = field(4, _POSITIVE)
  # Dropout rate on attention and MLP outputs (the base value if explored).
  dropout: float = field(0.0, _UNIT)
  # Attention logits are divided by this (the base value if explored).
  attn_temperature: float = field(1.0, _POSITIVE)


@dataclasses.dataclass(frozen=True)
class Optim:
  """``optim.*``: the base optimizer HDET wraps, and its LR schedule."""

  # The optax optimizer HDET wraps: 'adamw', 'adam' or 'sgd' (b1 = momentum).
  name: str = field('adamw', one_of(*OPTIMIZERS))
  # Peak of the schedule; the guarded climb starts at a tenth of it and rises.
  max_lr: float = field(0.03, _POSITIVE)
  # 'one_cycle' (torch's OneCycleLR), 'warmup_cosine' or 'constant'.
  schedule: str = field('one_cycle', one_of('one_cycle', 'warmup_cosine', 'constant'))
  # Fraction of the steps spent warming the LR up to max_lr.
  pct_start: float = field(0.3, OPEN_UNIT)
  # The schedule starts at max_lr / div_factor ...
  div_factor: float = field(25.0, _POSITIVE)
  # ... and ends at max_lr / (div_factor * final_div_factor).
  final_div_factor: float = field(10.0, _POSITIVE)
  # Adam's beta1 (SGD's momentum).
  b1: float = field(0.9, _UNIT)
  # Adam's beta2.
  b2: float = field(0.95, _UNIT)
  # AdamW's decoupled weight decay, on matrices only (not biases or norms).
  weight_decay: float = field(0.1, valid(lambda v: v >= 0, 'a number >= 0'))
  # Clip the all-reduced gradient to this global norm (0: no clipping).
  grad_clip_norm: float = field(0.0, valid(lambda v: v >= 0, 'a number >= 0 (0: no clipping)'))
  # Label smoothing of the training loss (the base value if explored).
  label_smoothing: float = field(0.0, _UNIT)


@dataclasses.dataclass(frozen=True)
class Explore:
  """``hdet.explore.*``: more hyperparameters spread across the replicas, as the LR is; 0: off."""

  # Multiplicative spread of AdamW's weight decay, in [0, 1).
  weight_decay: float = field(0.0, valid(is_spread, 'in [0, 1) (0: off)'))
  # Additive half-width of the dropout rate (clipped to [0, 0.9]).
  dropout: float = field(0.0, valid(lambda v: v >= 0, 'a number >= 0 (0: off)'))
  # Additive half-width of label smoothing (clipped to [0, 0.5]).
  label_smoothing: float = field(0.0, valid(lambda v: v >= 0, 'a number >= 0 (0: off)'))
  # Multiplicative spread of the attention temperature, in [0, 1).
  attn_temperature: float = field(0.0, valid(is_spread, 'in [0, 1) (0: off)'))


@dataclasses.dataclass(frozen=True)
class Hdet:
  """``hdet.*``: the replicas, their spread and sync, and the auto-LR controller (its range is hdet_jax.AutoLR's)."""

  # N replicas on however many devices (N a multiple of them); 0: one per device.
  num_replicas: int = field(8, valid(lambda v: v >= 0, 'an integer >= 0 (0: all devices)'))
  # alpha of eq. 1: LRs span base * [1 - alpha, 1 + alpha]; 0: plain data parallel.
  spread: float = field(0.25, valid(is_spread, 'in [0, 1) (the lowest multiplier 1 - spread stays positive)'))
  # T: average the replicas every T steps; 0: T from num_syncs.
  sync_every: int = field(0, valid(lambda v: v >= 0, 'an integer >= 0 (0: never)'))
  # With sync_every 0: T = round(num_train_steps / num_syncs), at most 100; both 0: never.
  num_syncs: int = field(
    NUM_SYNCS, valid(lambda v: v >= 0, 'an integer >= 0 (used where hdet.sync_every is 0)'), legacy=0
  )
  # The controller moves the base LR at each sync.
  auto_lr: bool = field(True)
  # 'fit' (the guarded climb, a line search) or 'paper' (eqs. 4-9).
  controller: str = field('fit', one_of('paper', 'fit'))
  # 'fit': start at this multiple of the schedule (< 1: a cautious start).
  initial_scale: float = field(DEFAULT_INITIAL_SCALE, valid(lambda v: True, 'a number'), legacy=1.0)
  # Undo a window whose loss blew up (None: where 'fit' guards).
  rollback: bool | None = field(None, legacy=False)
  # Per-group LRs (embedding, no_decay, weights), each with its own controller.
  param_groups: bool = field(False)
  # More hyperparameters spread across replicas; 0: off.
  explore: Explore = section(Explore)
  # Replicas step on their own gradients; the sync is their only all-reduce.
  low_communication: bool = field(False, legacy=False)
  # Low-communication mode: a sync also averages the optimizer state.
  average_opt_state: bool = field(False, legacy=False)


@dataclasses.dataclass(frozen=True)
class Mesh:
  """``mesh.*``: replica groups, each replica sharded over fsdp x tensor devices."""

  # N replica groups on a grouped mesh (0: devices / (fsdp x tensor)).
  replicas: int = field(0, valid(lambda v: v >= 0, 'an integer >= 0 (0: devices / mesh.fsdp)'), legacy=0)
  # Devices per group sharding it FSDP-style (data.batch_size must divide by it).
  fsdp: int = field(1, valid(lambda v: v >= 1, 'an integer >= 1 (1: no FSDP inside a group)'), legacy=1)
  # Devices per group splitting its kernels (tensor parallel).
  tensor: int = field(1, valid(lambda v: v >= 1, 'an integer >= 1 (1: no tensor parallelism inside a group)'), legacy=1)
  # Train on the first D devices (1-D meshes); 0: as many as N needs.
  devices: int = field(0, valid(lambda v: v >= 0, 'an integer >= 0 (0: every visible device)'), role=LOOP_PROGRAMS)


@dataclasses.dataclass(frozen=True)
class Bracket:
  """``bracket.*``: an LR bracket instead of one run (configs/bracket.py). Outside every run's training fields (a
  bracket's runs never read them); ``legacy``: as records made before the bracket read them."""

  # Plain runs at peak LRs max_lr * factor ** (k - (points - 1) / 2); 0: off.
  points: int = field(0, valid(lambda v: v == 0 or v >= 2, 'an integer >= 2, or 0 (off: one run)'), legacy=0)
  # The ratio of neighbouring points' peak LRs.
  factor: float = field(2.0, valid(lambda v: v > 1, 'a number > 1'), legacy=2.0)
  # 'fraction:kept,...': at each fraction the best `kept` runs go on.
  rungs: str = field('0.1:5,0.3:1', legacy='0.1:4,0.3:1')


@dataclasses.dataclass(frozen=True)
class WarmInit:
  """``warm_init.*``: the noisy warm start of eq. 10."""

  # nu of eq. 10: noise std is nu * ||theta_0|| / sqrt(d) (with init_from).
  nu: float = field(0.01, valid(lambda v: v >= 0, 'a number >= 0'))


@dataclasses.dataclass(frozen=True)
class Config:
  """The trainer's config: the main job's values (``configs/default.py``)."""

  # The workload (docs/tasks.md): 'lm' (the main job) or 'mnist1d' (configs/mnist1d.py).
  task: str = field('lm', legacy='lm')
  # Seeds everything random: model init, data order, permutations, warm-init noise.
  seed: int = field(0, valid(lambda v: 0 <= v < 2**32, 'an integer in [0, 2**32)'))
  # S: total optimizer steps; the schedule and the controller span them.
  num_train_steps: int = field(1500, valid(lambda v: v >= 2, 'an integer >= 2'))
  # A workdir to warm-start from (eq. 10); None: random init.
  init_from: str | None = field(None, ANY_PATH)
  data: Data = section(Data)
  model: Model = section(Model)
  optim: Optim = section(Optim)
  hdet: Hdet = section(Hdet)
  mesh: Mesh = section(Mesh)
  bracket: Bracket = section(Bracket)
  warm_init: WarmInit = section(WarmInit)
  # Steps between metric flushes (JSONL, progress bar); also the NaN check interval.
  log_every: int = field(25, INT_AT_LEAST_1, role=LOOP_PROGRAMS)
  # Steps whose batches go to the devices in one transfer (fewer: less device memory).
  chunk_steps: int = field(25, INT_AT_LEAST_1, role=LOOP_PROGRAMS)
  # Steps between validations of the averaged model (and one at the end); 0: at the end.
  eval_every: int = field(250, valid(lambda v: v >= 0, 'an integer >= 0 (0: only at the end)'), role=LOOP)
  # Validation windows per evaluation (0: the whole validation split).
  eval_windows: int = field(512, valid(lambda v: v >= 0, 'an integer >= 0 (0: the whole split)'), role=LOOP_PROGRAMS)
  # Steps between checkpoints (and one at the end); 0: only at the end.
  checkpoint_every: int = field(500, valid(lambda v: v >= 0, 'an integer >= 0 (0: only at the end)'), role=LOOP)
  # Checkpoints kept in WORKDIR/checkpoints (0: all).
  max_checkpoints: int = field(2, valid(lambda v: v >= 0, 'an integer >= 0 (0: keep all)'), role=LOOP)
  # Stop once every replica's loss is NaN/inf (False: record it, keep going).
  stop_on_nan: bool = field(True, role=LOOP)
  # Draw the PNG plots into WORKDIR/plots at the end.
  plots: bool = field(True, role=LOOP)
  # TensorBoard event files beside metrics.jsonl in the workdir.
  tensorboard: bool = field(True, role=LOOP)
  # Show the tqdm progress bar.
  progress_bar: bool = field(True, role=LOOP)
  # Simulated CPU devices on a CPU-only machine (JAX_NUM_CPU_DEVICES wins).
  num_cpu_devices: int = field(8, valid(lambda v: v >= 0, 'an integer >= 0'), role=LOOP_PROGRAMS)
  # XLA's deterministic GPU ops: the same config and seed, the same numbers.
  deterministic_gpu: bool = field(True, role=LOOP_PROGRAMS, legacy=True)  # (older records: made without CUDA)
  # JAX's persistent compilation cache ('': off).
  compilation_cache: str = field('~/.cache/hdet_jax/xla', role=LOOP)


def get_config() -> ml_collections.ConfigDict:
  """The main job's config: every field of :class:`Config` at its default, as an ``ml_collections.ConfigDict`` (a
  field whose default is None is a placeholder of its type, so ``--config.init_from=DIR`` overrides it)."""
  return config_dict_of(Config)


def config_dict_of(cls: type) -> ml_collections.ConfigDict:
  """A typed config section (e.g. a task's ``Mnist1dData``) at its defaults, as an ``ml_collections.ConfigDict``."""
  out = ml_collections.ConfigDict()
  for f in dataclasses.fields(cls):
    if f.metadata.get('section'):
      out[f.name] = config_dict_of(f.default_factory)
    elif f.default is None:
      out[f.name] = config_dict.placeholder(optional_type(f.type))
    else:
      out[f.name] = f.default
  return out


def optional_type(annotation: Any) -> type:
  """``X`` of ``X | None``."""
  assert isinstance(annotation, types.UnionType), annotation
  (kind,) = [t for t in annotation.__args__ if t is not type(None)]
  return kind
