"""The trainer's config fields, each declared once: its default, its role, its value in older records, its help.

``configs/default.py`` (and a task's config, for the task's own fields) stays the file a user reads; the test
``tests/test_schema.py`` checks that it agrees with :data:`FIELDS` (every field, its default and its help line).
From the rows come :data:`config_lib.RUN_FIELDS` (the fields that do not define a run),
:data:`config_lib.QUIET_DEFAULTS` (the values of records made before a field existed) and
:data:`program_cache.NOT_IN_PROGRAMS` (the fields no compiled program reads).

Roles:
  RUN            defines the run (part of its training fields; read by the compiled programs);
  LOOP_PROGRAMS  loop-only (may change on resume) but part of the programs' cache key;
  LOOP           loop-only and read by no program.
(The LR bracket's fields, ``bracket.*``, sit outside every run's training fields: ``config_lib.defines_a_run``.)
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

RUN, LOOP_PROGRAMS, LOOP = 'run', 'loop_programs', 'loop'
_ABSENT = object()


@dataclasses.dataclass(frozen=True)
class Field:
  """One config field. ``legacy``: its value in records made before it existed (absent: none older lack it); such
  records trained as with this value, so a run at it leaves the field out of its recorded training fields. It may
  differ from ``default`` on purpose (e.g. ``hdet.after_stop``: 'hold' in old records, 'rise' today). ``task``: the
  task whose config declares the field (None: configs/default.py)."""
  name: str
  default: Any
  role: str
  help: str
  legacy: Any = _ABSENT
  task: str | None = None

  def __init__(self, name: str, default: Any, role: str, help: str = '', *, legacy: Any = _ABSENT,
               task: str | None = None):
    for k, v in dict(name=name, default=default, role=role, help=help, legacy=legacy, task=task).items():
      object.__setattr__(self, k, v)

  @property
  def has_legacy(self) -> bool:
    return self.legacy is not _ABSENT


FIELDS: tuple[Field, ...] = (
    Field('task', 'lm', RUN,
          "The workload (docs/tasks.md): 'lm' (this file) or 'mnist1d' (configs/mnist1d.py).", legacy='lm'),
    Field('seed', 0, RUN,
          'Seeds everything random: model init, data order, permutations, warm-init noise.'),
    Field('num_train_steps', 1500, RUN,
          'S: total optimizer steps; the schedule and the controller span them.'),
    Field('init_from', None, RUN,
          'A workdir to warm-start from (eq. 10); None: random init.'),
    Field('data.path', None, RUN,
          'A local UTF-8 text file; None: the built-in data.corpus.'),
    Field('data.corpus', 'kjv', RUN,
          "Without data.path: 'kjv' (King James Bible) or 'wyc' (Wycliffe Bible).", legacy='kjv'),
    Field('data.val_fraction', 0.05, RUN,
          "The corpus's last fraction of bytes is held out for validation."),
    Field('data.seq_len', 64, RUN,
          'Bytes of context per training window.'),
    Field('data.batch_size', 8, RUN,
          'Windows per replica per step (the global batch is num_replicas times this).'),
    Field('model.d_model', 64, RUN,
          'Width of the residual stream (and of the byte embedding).'),
    Field('model.num_layers', 2, RUN,
          'Transformer blocks.'),
    Field('model.num_heads', 4, RUN,
          'Attention heads per block (must divide d_model).'),
    Field('model.mlp_ratio', 4, RUN,
          'MLP hidden width as a multiple of d_model.'),
    Field('model.dropout', 0.0, RUN,
          'Dropout rate on attention and MLP outputs (the base value if explored).'),
    Field('model.attn_temperature', 1.0, RUN,
          'Attention logits are divided by this (the base value if explored).'),
    Field('optim.name', 'adamw', RUN,
          "The optax optimizer HDET wraps: 'adamw', 'adam', 'sgd' (b1 = momentum), or, as baselines, an LR-free one: 'prodigy', 'dog', 'dadapt_adamw', 'mechanize_adam', 'schedule_free_adamw', 'adam_plateau'."),
    Field('optim.max_lr', 0.03, RUN,
          'Peak of the schedule; the guarded climb starts at a tenth of it and rises.'),
    Field('optim.schedule', 'one_cycle', RUN,
          "'one_cycle' (torch's OneCycleLR), 'warmup_cosine' or 'constant'."),
    Field('optim.pct_start', 0.3, RUN,
          'Fraction of the steps spent warming the LR up to max_lr.'),
    Field('optim.div_factor', 25.0, RUN,
          'The schedule starts at max_lr / div_factor ...'),
    Field('optim.final_div_factor', 10.0, RUN,
          '... and ends at max_lr / (div_factor * final_div_factor).'),
    Field('optim.b1', 0.9, RUN,
          "Adam's beta1 (SGD's momentum)."),
    Field('optim.b2', 0.95, RUN,
          "Adam's beta2."),
    Field('optim.weight_decay', 0.1, RUN,
          "AdamW's decoupled weight decay, on matrices only (not biases or norms)."),
    Field('optim.grad_clip_norm', 0.0, RUN,
          'Clip the all-reduced gradient to this global norm (0: no clipping).'),
    Field('optim.label_smoothing', 0.0, RUN,
          'Label smoothing of the training loss (the base value if explored).'),
    Field('optim.runtime_lr_scale', False, RUN,
          "Apply max_lr's power of two at run time (the LR bracket sets it).", legacy=False),
    Field('hdet.num_replicas', 8, RUN,
          'N replicas on however many devices (N a multiple of them); 0: one per device.'),
    Field('hdet.spread', 0.25, RUN,
          'alpha of eq. 1: LRs span base * [1 - alpha, 1 + alpha]; 0: plain data parallel.'),
    Field('hdet.sync_every', 0, RUN,
          'T: average the replicas every T steps; 0: T from num_syncs.'),
    Field('hdet.num_syncs', 15, RUN,
          'With sync_every 0: T = round(num_train_steps / num_syncs) ...', legacy=0),
    Field('hdet.longest_window', 100, RUN,
          '... at most this many steps (0: no cap). Both 0: never average.', legacy=100),
    Field('hdet.auto_lr', True, RUN,
          'The controller moves the base LR at each sync.'),
    Field('hdet.controller', 'fit', RUN,
          "'fit' (the guarded climb, a line search) or 'paper' (eqs. 4-9)."),
    Field('hdet.score', 'common', RUN,
          "Compare replicas on one 'common' batch at each sync, or on their 'window' losses."),
    Field('hdet.probe_windows', 16, RUN,
          'Windows in the common batch (fresh at each sync).'),
    Field('hdet.warmup_steps', 0, RUN,
          'The controller starts at the first sync at or after this step.'),
    Field('hdet.stop_fraction', 0.0, RUN,
          "After this fraction of the run the controller holds ('fit': see after_stop)."),
    # Rows whose legacy value differs from their default on purpose: records made before the field trained so.
    Field('hdet.after_stop', 'rise', RUN,
          "'fit' after stop_fraction: 'rise' (take only steps up) or 'hold'.", legacy='hold'),
    Field('hdet.trust', 1.0, RUN,
          "'fit': the largest change of log(LR correction) per sync (1.0: x2.7)."),
    Field('hdet.memory', 0.5, RUN,
          "'fit': forgetting factor of the line search's statistics across syncs."),
    Field('hdet.initial_scale', 0.1, RUN,
          "'fit': start at this multiple of the schedule (< 1: a cautious start).", legacy=1.0),
    Field('hdet.step_growth', 2.0, RUN,
          "'fit': the step's gain grows by this factor while steps keep one sign (1: off).", legacy=1.0),
    Field('hdet.max_gain', 4.0, RUN,
          "'fit': the largest gain.", legacy=4.0),
    Field('hdet.backoff', None, RUN,
          'Step the LR down on such a window.', legacy=False),
    Field('hdet.backoff_stderrs', None, RUN,
          'Margin in standard errors (None: 2).', legacy=0.0),
    Field('hdet.backoff_fraction', None, RUN,
          'Margin as a fraction of the loss (None: 0.05).', legacy=0.0),
    Field('hdet.rollback', None, RUN,
          'Also return the replicas to the sync before it.', legacy=False),
    Field('hdet.settle', None, RUN,
          "'fit': stop spreading once the climb has ended.", legacy=False),
    Field('hdet.temperature', 0.1, RUN,
          "'paper': sigma of eq. 4, in nats."),
    Field('hdet.lr_of_lr', 0.5, RUN,
          "'paper': lambda of eq. 7, the step size of the base-LR update."),
    Field('hdet.momentum', 0.9, RUN,
          "'paper': beta of eq. 7, the momentum of the base-LR velocity."),
    Field('hdet.smooth_decay', True, RUN,
          "'paper': decay the base continuously within a window (False: hold it)."),
    Field('hdet.param_groups', False, RUN,
          'Per-group LRs (embedding, no_decay, weights), each with its own controller.'),
    Field('hdet.explore.weight_decay', 0.0, RUN,
          "Multiplicative spread of AdamW's weight decay, in [0, 1)."),
    Field('hdet.explore.dropout', 0.0, RUN,
          'Additive half-width of the dropout rate (clipped to [0, 0.9]).'),
    Field('hdet.explore.label_smoothing', 0.0, RUN,
          'Additive half-width of label smoothing (clipped to [0, 0.5]).'),
    Field('hdet.explore.attn_temperature', 0.0, RUN,
          'Multiplicative spread of the attention temperature, in [0, 1).'),
    Field('hdet.low_communication', False, RUN,
          'Replicas step on their own gradients; the sync is their only all-reduce.', legacy=False),
    Field('hdet.average_opt_state', False, RUN,
          'Low-communication mode: a sync also averages the optimizer state.', legacy=False),
    Field('mesh.replicas', 0, RUN,
          'N replica groups on a grouped mesh (0: devices / (fsdp x tensor)).', legacy=0),
    Field('mesh.fsdp', 1, RUN,
          'Devices per group sharding it FSDP-style (data.batch_size must divide by it).', legacy=1),
    Field('mesh.tensor', 1, RUN,
          'Devices per group splitting its kernels (tensor parallel).', legacy=1),
    Field('mesh.devices', 0, LOOP_PROGRAMS,
          'Train on the first D devices (1-D meshes); 0: as many as N needs.'),
    # The LR bracket's fields (hdet_jax.trainer.bracket), as records made before it existed read them (its rungs'
    # legacy value was the default until 8-5-1): outside every run's training fields (config_lib.defines_a_run).
    Field('bracket.points', 0, RUN,
          'Plain runs at peak LRs max_lr * factor ** (k - (points - 1) / 2); 0: off.', legacy=0),
    Field('bracket.factor', 2.0, RUN,
          "The ratio of neighbouring points' peak LRs.", legacy=2.0),
    Field('bracket.rungs', '0.1:5,0.3:1', RUN,
          "'fraction:kept,...': at each fraction the best `kept` runs go on.", legacy='0.1:4,0.3:1'),
    Field('bracket.compare_steps', 10, RUN,
          'A rung ranks runs by their mean training loss over this many steps.', legacy=10),
    Field('warm_init.nu', 0.01, RUN,
          'nu of eq. 10: noise std is nu * ||theta_0|| / sqrt(d) (with init_from).'),
    Field('log_every', 25, LOOP_PROGRAMS,
          'Steps between metric flushes (JSONL, progress bar); also the NaN check interval.'),
    Field('eval_every', 250, LOOP,
          'Steps between validations of the averaged model (and one at the end); 0: at the end.'),
    Field('eval_windows', 512, LOOP_PROGRAMS,
          'Validation windows per evaluation (0: the whole validation split).'),
    Field('checkpoint_every', 500, LOOP,
          'Steps between checkpoints (and one at the end); 0: only at the end.'),
    Field('max_checkpoints', 2, LOOP,
          'Checkpoints kept in WORKDIR/checkpoints (0: all).'),
    Field('stop_at_step', 0, LOOP,
          'Stop (with a checkpoint) after this many steps, as if preempted; 0: run to the end.'),
    Field('stop_on_nan', True, LOOP,
          "Stop once every replica's loss is NaN/inf (False: record it, keep going)."),
    Field('plots', True, LOOP,
          'Draw the PNG plots into WORKDIR/plots at the end.'),
    Field('tensorboard', True, LOOP,
          'TensorBoard event files beside metrics.jsonl in the workdir.'),
    Field('progress_bar', True, LOOP,
          'Show the tqdm progress bar.'),
    Field('num_cpu_devices', 8, LOOP_PROGRAMS,
          'Simulated CPU devices on a CPU-only machine (JAX_NUM_CPU_DEVICES wins).'),
    # legacy True: no effect without CUDA, where every record before the field was made.
    Field('deterministic_gpu', True, LOOP_PROGRAMS,
          "XLA's deterministic GPU ops: the same config and seed, the same numbers.", legacy=True),
    Field('compilation_cache', '~/.cache/hdet_jax/xla', LOOP,
          "JAX's persistent compilation cache ('': off)."),
    # The mnist1d task's own fields (configs/mnist1d.py, which also sets some of default.py's).
    Field('data.num_samples', 100000, RUN,
          "MNIST-1D's make_dataset arguments (the rest at get_dataset_args' defaults: 40-sample signals, 10 classes). 20x the published 5,000: measured at the AdamW sweep's 0.03, 3 seeds, the test cross-entropy's sd is 3.4% of its mean here (0.0538 +- 0.0018), 6% with 20,000 samples (0.0694 +- 0.0041). Generating it takes ~40 s (once per process).", task='mnist1d'),
    Field('data.train_split', 0.8, RUN,
          'The first 80% of the generated examples train, the rest test.', task='mnist1d'),
    Field('data.dataset_seed', 42, RUN,
          "The generator's seed (the package's default): the same data for every config.seed.", task='mnist1d'),
    Field('model.kind', 'cnn', RUN,
          "'cnn': the reference CNN below; 'mlp': two ReLU layers of model.hidden units.", legacy='cnn', task='mnist1d'),
    Field('model.hidden', 128, RUN,
          "Units of each of the MLP's two hidden layers (model.kind='mlp' only).", legacy=128, task='mnist1d'),
    Field('model.channels', 25, RUN,
          "Channels of each of the three convolutions (the reference CNN's 25).", task='mnist1d'),
    Field('model.num_classes', 10, RUN,
          'Output classes (labels must lie in [0, num_classes)).', task='mnist1d'),
)

BY_NAME = {f.name: f for f in FIELDS}
assert len(BY_NAME) == len(FIELDS), 'a field declared twice'


def loop_only() -> frozenset[str]:
  """The fields that only steer a run (they may change when it resumes): config_lib.RUN_FIELDS."""
  return frozenset(f.name for f in FIELDS if f.role in (LOOP, LOOP_PROGRAMS))


def not_in_programs() -> tuple[str, ...]:
  """The fields no compiled program reads: program_cache.NOT_IN_PROGRAMS."""
  return tuple(f.name for f in FIELDS if f.role == LOOP)


def legacy_values() -> dict[str, Any]:
  """Each field's value in records made before it existed: config_lib.QUIET_DEFAULTS."""
  return {f.name: f.legacy for f in FIELDS if f.has_legacy}


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
