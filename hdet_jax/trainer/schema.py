"""The trainer's config fields as rows: each field's default, type and range, role, value in older records and help.

The config's fields are declared once, in ``fields.py`` (the typed config a user reads); :data:`FIELDS` reads them
off it, beside the rows of what research sets in Python (:func:`tuning_fields`) and of a task's own fields. The rest
is derived from the rows:
- the values a config lacks (:func:`complete`: a field added after the config was written reads as it trained
  then, its ``legacy`` value, else as its default);
- each field's check (:func:`check_fields`; the rules across fields are ``run_settings``');
- what defines a run (:func:`defines_a_run`: what a resume compares) and what the compiled programs read
  (:func:`not_in_programs`: the programs' cache key leaves the rest out);
- the values of records made before a field existed (:func:`legacy_values`: a run at such a value leaves the
  field out of its recorded training fields, so older workdirs still resume).

Roles (``fields.py`` says what each means): RUN, LOOP_PROGRAMS, LOOP. (The LR bracket's fields, ``bracket.*``, sit
outside every run's training fields: :func:`defines_a_run`.)
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import re
import textwrap
import types
import typing
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

import hdet_jax as H
from hdet_jax.trainer import fields as fields_lib
from hdet_jax.trainer.fields import LOOP, LOOP_PROGRAMS, RUN
from hdet_jax.trainer import tasks as tasks_lib

_ABSENT = fields_lib.ABSENT


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
  return Check('choice', *fields_lib.one_of(*choices)[:2])


BOOLEAN = Check('bool', lambda v: True, 'True or False')
# A controller setting's type; its range is the core's (hdet_jax.settings.check_auto_lr; run_settings' check).
CONTROLLER_NUMBER = Check('real', lambda v: True, 'a number')
CONTROLLER_NUMBER_OR_NONE = Check('real', lambda v: True, 'a number or None', none_resolves=True)


def _is_real(v: Any) -> bool:
  return H.arguments.is_number(v) and math.isfinite(float(v))


_KINDS = {
  'int': H.arguments.is_int,
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
  task whose config declares the field (None: fields.py)."""

  name: str
  default: Any
  role: str
  help: str
  legacy: Any = _ABSENT
  task: str | None = None
  check: Check | None = None
  python: bool = False  # research's: given in Python (train_and_evaluate's tuning=), not a config field

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


def declared(cls: type = fields_lib.Config, prefix: str = '') -> tuple[Field, ...]:
  """The rows of a typed config (``fields.Config``): each field's dotted name, default, role, legacy value and check
  (its kind from its annotation), and its help (the comment lines above it)."""
  helps = _comments_above(cls)
  hints = typing.get_type_hints(cls)
  rows = []
  for f in dataclasses.fields(cls):
    if f.metadata.get('section'):
      rows += declared(f.default_factory, f'{prefix}{f.name}.')
      continue
    m = f.metadata
    if 'role' not in m:  # a task section's line for a trainer's field: the task's value, declared by the trainer
      continue
    check = None if m['check'] is None else _check(hints[f.name], m['check'])
    rows.append(Field(prefix + f.name, f.default, m['role'], helps[f.name], legacy=m['legacy'], check=check))
  return tuple(rows)


def _check(annotation: Any, valid: fields_lib.Range) -> Check:
  """A declared range with its kind: the annotation's type (``str | None``: a path)."""
  optional = isinstance(annotation, types.UnionType) and type(None) in annotation.__args__
  base = fields_lib.optional_type(annotation) if optional else annotation
  kind = 'choice' if valid.choice else {int: 'int', float: 'real', bool: 'bool', str: 'path'}[base]
  return Check(kind, valid.ok, valid.what, none_resolves=optional and kind != 'path')


def _comments_above(cls: type) -> dict[str, str]:
  """Each annotated field of ``cls`` with the comment lines just above it, joined."""
  lines = textwrap.dedent(inspect.getsource(cls)).split('\n')
  out = {}
  for node in ast.parse('\n'.join(lines)).body[0].body:
    if isinstance(node, ast.AnnAssign):
      above, at = [], node.lineno - 2
      while at >= 0 and lines[at].strip().startswith('#'):
        above.insert(0, lines[at].strip()[1:].strip())
        at -= 1
      out[node.target.id] = ' '.join(above)
  return out


# The core's AutoLR defaults: the controller's tuning rows take theirs from here, never restating them.
AUTO_LR_DEFAULTS = _AUTO_LR = {
  f.name: f.default for f in dataclasses.fields(H.AutoLR) if f.default is not dataclasses.MISSING
}

# Research's fields (given in Python: train_and_evaluate's tuning=), each after the config field it follows in the
# records (config.json keeps them in these places).
_TUNING = {
  'optim.label_smoothing': (
    Field(
      'optim.runtime_lr_scale',
      False,
      RUN,
      "Apply max_lr's power of two at run time (the LR bracket sets it).",
      legacy=False,
      check=BOOLEAN,
    ),
  ),
  'hdet.num_syncs': (
    Field(
      'hdet.longest_window',
      H.sync.LONGEST_WINDOW,
      RUN,
      '... at most this many steps (0: no cap). Both 0: never average.',
      legacy=100,
      check=integer(lambda v: v >= 0, 'an integer >= 0 (0: no cap on the windows of hdet.num_syncs)'),
    ),
  ),
  'hdet.controller': (
    Field(
      'hdet.score',
      'common',
      RUN,
      "Compare replicas on one 'common' batch at each sync, or on their 'window' losses.",
      check=one_of('window', 'common'),
    ),
    Field(
      'hdet.probe_windows',
      16,
      RUN,
      'Windows in the common batch (fresh at each sync).',
      check=integer(lambda v: v >= 1, 'an integer >= 1'),
    ),
    Field(
      'hdet.warmup_steps',
      _AUTO_LR['warmup_steps'],
      RUN,
      'The controller starts at the first sync at or after this step.',
      check=integer(lambda v: v >= 0, 'an integer >= 0'),
    ),
    Field(
      'hdet.stop_fraction',
      0.0,
      RUN,
      "After this fraction of the run the controller holds ('fit': see after_stop).",
      check=real(lambda v: 0 <= v <= 1, 'in [0, 1] (0: from the first sync; 1: never stop)'),
    ),
    # Rows whose legacy value differs from their default on purpose: records made before the field trained so.
    Field(
      'hdet.after_stop',
      _AUTO_LR['after_stop'],
      RUN,
      "'fit' after stop_fraction: 'rise' (take only steps up) or 'hold'.",
      legacy='hold',
      check=one_of('hold', 'rise'),
    ),
    Field(
      'hdet.trust',
      _AUTO_LR['trust'],
      RUN,
      "'fit': the largest change of log(LR correction) per sync (1.0: x2.7).",
      check=CONTROLLER_NUMBER,
    ),
    Field(
      'hdet.memory',
      _AUTO_LR['memory'],
      RUN,
      "'fit': forgetting factor of the line search's statistics across syncs.",
      check=CONTROLLER_NUMBER,
    ),
  ),
  'hdet.initial_scale': (
    Field(
      'hdet.step_growth',
      _AUTO_LR['step_growth'],
      RUN,
      "'fit': the step's gain grows by this factor while steps keep one sign (1: off).",
      legacy=1.0,
      check=CONTROLLER_NUMBER,
    ),
    Field('hdet.max_gain', _AUTO_LR['max_gain'], RUN, "'fit': the largest gain.", legacy=4.0, check=CONTROLLER_NUMBER),
    Field('hdet.backoff', None, RUN, 'Step the LR down on such a window.', legacy=False),
    Field(
      'hdet.backoff_stderrs',
      None,
      RUN,
      'Margin in standard errors (None: 2).',
      legacy=0.0,
      check=CONTROLLER_NUMBER_OR_NONE,
    ),
    Field(
      'hdet.backoff_fraction',
      None,
      RUN,
      'Margin as a fraction of the loss (None: 0.05).',
      legacy=0.0,
      check=CONTROLLER_NUMBER_OR_NONE,
    ),
  ),
  'hdet.rollback': (
    Field('hdet.settle', None, RUN, "'fit': stop spreading once the climb has ended.", legacy=False),
    Field(
      'hdet.anneal_fraction',
      None,
      RUN,
      "'fit': no rise of the LR's factor once the schedule is below this fraction of its peak (None: off).",
      # A record or workdir made before the field reads as None: the core's default, off, as every such run trained.
      legacy=None,
      check=CONTROLLER_NUMBER_OR_NONE,
    ),
    Field(
      'hdet.temperature', _AUTO_LR['temperature'], RUN, "'paper': sigma of eq. 4, in nats.", check=CONTROLLER_NUMBER
    ),
    Field(
      'hdet.lr_of_lr',
      _AUTO_LR['lr_of_lr'],
      RUN,
      "'paper': lambda of eq. 7, the step size of the base-LR update.",
      check=CONTROLLER_NUMBER,
    ),
    Field(
      'hdet.momentum',
      _AUTO_LR['momentum'],
      RUN,
      "'paper': beta of eq. 7, the momentum of the base-LR velocity.",
      check=CONTROLLER_NUMBER,
    ),
    Field(
      'hdet.smooth_decay',
      _AUTO_LR['smooth_decay'],
      RUN,
      "'paper': decay the base continuously within a window (False: hold it).",
    ),
  ),
  'bracket.rungs': (
    Field(
      'bracket.compare_steps',
      10,
      RUN,
      'A rung ranks runs by their mean training loss over this many steps.',
      legacy=10,
      check=integer(lambda v: v >= 1, 'an integer >= 1'),
    ),
  ),
  'max_checkpoints': (
    Field(
      'stop_at_step',
      0,
      LOOP,
      'Stop (with a checkpoint) after this many steps, as if preempted; 0: run to the end.',
      check=integer(lambda v: v >= 0, 'an integer >= 0 (0: run to the end)'),
    ),
  ),
}

# A task's own fields (its ``Task.sections``, tasks/<task>.py): its rows carry the task's name.
_TASK_FIELDS = tuple(
  dataclasses.replace(row, task=task.name)
  for task in map(tasks_lib.get, tasks_lib.names())
  for name, cls in task.sections.items()
  for row in declared(cls, f'{name}.')
)


def _all_rows() -> tuple[Field, ...]:
  rows = []
  for row in declared():
    rows.append(row)
    rows += [dataclasses.replace(t, python=True) for t in _TUNING.get(row.name, ())]
  return (*rows, *_TASK_FIELDS)


FIELDS: tuple[Field, ...] = _all_rows()
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


LOOP_FIELDS = loop_only()  # (the fields outside a run's identity)


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
  return field not in LOOP_FIELDS and not field.startswith('bracket.')


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
