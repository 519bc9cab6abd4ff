"""The rows (hdet_jax/trainer/schema.py) are read off the one typed config a user reads (hdet_jax/trainer/fields.py),
and the tables derived from them are the ones records were made with."""

import dataclasses
import json
import math
import os
import re

from configs import default

import numpy as np
import pytest

from hdet_jax.trainer import compat, config_lib, fields, program_cache, run_settings, schema

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# 95f9714's rows, written out before they were read off the typed config: each row's default (and its type), role,
# legacy value, task, check, help, and which of a set of probe values its check rejects.
ROWS_BEFORE = json.load(open(os.path.join(ROOT, 'tests', 'data', 'schema_rows_95f9714.json')))
RENAMED_HELP = {'task'}  # its help said "'lm' (this file)" in configs/default.py; fields.py is not that file


def _row(f, probes):
  c = f.check
  return dict(
    name=f.name,
    default=repr(f.default),
    default_type=type(f.default).__name__,
    role=f.role,
    help=f.help,
    legacy=repr(f.legacy) if f.has_legacy else None,
    task=f.task,
    python=f.python,
    check=None if c is None else dict(kind=c.kind, what=c.what, none_resolves=c.none_resolves),
    rejects=[i for i, p in enumerate(probes) if f.error(p) is not None],
  )


# Rows added since the table was taken (each with a legacy value: records lack them).
ADDED_SINCE = {'hdet.anneal_fraction'}


def test_the_rows_read_off_the_typed_config_are_the_ones_they_replaced():
  """Every row, in order, as the hand-written rows had it: defaults, roles, legacy values, checks (each probed at the
  same values) and help lines; only the task's help reads differently."""
  probes = [eval(p, {'inf': math.inf}) for p in ROWS_BEFORE['probes']]
  before = ROWS_BEFORE['rows']
  fields = [f for f in schema.FIELDS if f.name not in ADDED_SINCE]
  assert [f.name for f in fields] == [r['name'] for r in before]
  for f, old in zip(fields, before):
    new = _row(f, probes)
    if f.name in RENAMED_HELP:
      assert new.pop('help') != old.pop('help')
    assert new == old, f.name


def test_default_py_is_the_typed_config_and_every_field_is_one_line_with_its_help():
  """configs/default.py returns fields.Config as a ConfigDict: one field per declared row, none declared twice, each
  with a help line; a None default overrides as its annotated type."""
  flat = config_lib.flatten(default.get_config())
  declared = schema.declared()
  assert sorted(flat) == sorted(f.name for f in declared) and len(flat) == len(declared) == 62
  assert all(flat[f.name] == f.default and type(flat[f.name]) is type(f.default) for f in declared)
  assert all(f.help and not f.python for f in declared)
  config = default.get_config()
  config.init_from, config.hdet.rollback = 'workdirs/a', True
  with pytest.raises(TypeError):
    config.data.path = 3


def test_a_field_is_its_line_in_the_typed_config():
  """What adding a field takes: one annotated line under its help comment gives the row (name, default, kind and
  range, role, legacy, help) and the ConfigDict field; its check rejects out-of-range values with one line."""

  @dataclasses.dataclass(frozen=True)
  class Section:
    # Steps between two prints.
    # (a second help line)
    print_every: int = fields.field(10, fields.valid(lambda v: v >= 1, 'an integer >= 1'), role=fields.LOOP)
    # A ratio, or None: as the task picks.
    ratio: float | None = fields.field(None, fields.valid(lambda v: v > 0, 'a number > 0'), legacy=1.0)
    mode: str = fields.field('a', fields.one_of('a', 'b'))  # (no help above)

  @dataclasses.dataclass(frozen=True)
  class Root:
    # The first field.
    first: bool = fields.field(True)
    part: Section = fields.section(Section)

  rows = {f.name: f for f in schema.declared(Root)}
  assert list(rows) == ['first', 'part.print_every', 'part.ratio', 'part.mode']
  every = rows['part.print_every']
  assert (every.default, every.role, every.has_legacy, every.check.kind) == (10, schema.LOOP, False, 'int')
  assert every.help == 'Steps between two prints. (a second help line)' and rows['part.mode'].help == ''
  assert every.error(0) == 'part.print_every must be an integer >= 1, got 0.' and every.error(2.0) is not None
  ratio = rows['part.ratio']
  assert (ratio.check.kind, ratio.check.none_resolves, ratio.legacy, ratio.error(None)) == ('real', True, 1.0, None)
  assert ratio.error(-1) == 'part.ratio must be a number > 0, got -1.'
  assert rows['part.mode'].check.kind == 'choice' and rows['part.mode'].error('c') is not None
  assert rows['first'].check is None and rows['first'].role == schema.RUN
  built = fields.config_dict_of(Root)
  assert config_lib.flatten(built) == {'first': True, 'part.print_every': 10, 'part.ratio': None, 'part.mode': 'a'}
  built.part.ratio = 0.5


def test_the_tuning_fields_are_research_s_and_the_controller_s_defaults_are_the_core_s():
  """The 22 fields research gives in Python (issue 75; hdet.anneal_fraction since issue 86): none in default.py (62
  fields there), each with its help and its legacy value kept; the controller's defaults are hdet_jax.AutoLR's (the
  guarded climb's), read off the core."""
  import hdet_jax

  tuning = set(schema.tuning_fields())
  assert len(tuning) == 22 and not tuning & set(config_lib.flatten(default.get_config()))
  assert all(schema.BY_NAME[n].help for n in tuning)
  core = hdet_jax.AutoLR(total_steps=1500)
  for name in ('warmup_steps', 'after_stop', 'trust', 'memory', 'step_growth', 'max_gain', 'temperature', 'lr_of_lr'):
    assert schema.BY_NAME[f'hdet.{name}'].default == getattr(core, name), name
  assert schema.BY_NAME['hdet.anneal_fraction'].default is None  # (the core's wherever it applies: run_settings)
  assert (schema.BY_NAME['hdet.momentum'].default, schema.BY_NAME['hdet.smooth_decay'].default) == (0.9, True)


# The hand-kept tables the schema replaced, as of 1b9826f: records and workdirs were made against these.
_LOOP_FIELDS = {
  'stop_at_step',
  'log_every',
  'eval_every',
  'eval_windows',
  'checkpoint_every',
  'max_checkpoints',
  'stop_on_nan',
  'plots',
  'progress_bar',
  'num_cpu_devices',
  'compilation_cache',
  'tensorboard',
  'mesh.devices',
  'deterministic_gpu',
}
_QUIET_DEFAULTS = {
  'task': 'lm',
  'data.corpus': 'kjv',
  'model.kind': 'cnn',
  'model.hidden': 128,
  'mesh.replicas': 0,
  'mesh.fsdp': 1,
  'mesh.tensor': 1,
  'hdet.low_communication': False,
  'hdet.average_opt_state': False,
  'hdet.initial_scale': 1.0,
  'hdet.after_stop': 'hold',
  'hdet.step_growth': 1.0,
  'hdet.max_gain': 4.0,
  'hdet.backoff': False,
  'hdet.backoff_stderrs': 0.0,
  'hdet.backoff_fraction': 0.0,
  'hdet.rollback': False,
  'hdet.settle': False,
  'hdet.num_syncs': 0,
  'hdet.longest_window': 100,
  'optim.runtime_lr_scale': False,
  'deterministic_gpu': True,
  'bracket.points': 0,
  'bracket.factor': 2.0,
  'bracket.rungs': '0.1:4,0.3:1',
  'bracket.compare_steps': 10,
}
_NOT_IN_PROGRAMS = {
  'stop_at_step',
  'plots',
  'progress_bar',
  'tensorboard',
  'compilation_cache',
  'checkpoint_every',
  'max_checkpoints',
  'eval_every',
  'stop_on_nan',
}


def test_the_derived_tables_are_the_ones_records_were_made_with():
  assert schema.LOOP_FIELDS == _LOOP_FIELDS | {'chunk_steps'}  # (added since: loop-only, so in no record)
  assert compat.QUIET_DEFAULTS == _QUIET_DEFAULTS | {'hdet.anneal_fraction': None}  # (added since: issue 86's rule)
  assert set(program_cache.NOT_IN_PROGRAMS) == _NOT_IN_PROGRAMS
  assert set(program_cache.NOT_IN_PROGRAMS) <= schema.LOOP_FIELDS


def test_every_default_passes_its_own_check_and_the_checked_fields_are_the_old_rules():
  for f in schema.FIELDS:
    assert f.error(f.default) is None, f.name
  # config_lib._RULES (63 rows) as of 1b9826f, its five choices, optim.runtime_lr_scale's bool and the two paths.
  # (and chunk_steps and hdet.anneal_fraction, added since)
  assert sum(f.check is not None for f in schema.FIELDS) == 63 + 5 + 1 + 2 + 1 + 1


# (field, values a row must reject, values it must take): the ranges config_lib._RULES held, each at its edges.
EDGES = [
  ('seed', [-1, 2**32, 1.0, True, '0'], [0, 2**32 - 1, np.int64(5)]),
  ('num_train_steps', [1, 2.0], [2]),
  ('data.val_fraction', [0, 1, math.nan, math.inf, None], [0.5, 1e-9]),
  ('optim.b1', [1.0, -0.1], [0.0, 0.999]),
  ('hdet.spread', [1.0, -1e-9], [0.0, 0.999]),
  ('hdet.stop_fraction', [1.0001, -0.1], [0, 1]),
  ('hdet.backoff_fraction', ['0.5', True], [None, 0.0, 0.5]),  # (its type here; its range is the core's)
  ('bracket.points', [1, -2], [0, 2, 8]),
  ('bracket.factor', [1.0], [1.0001]),
  ('optim.name', ['adamx', None, 'adam_plateau'], ['adamw', 'sgd']),
  ('hdet.controller', ['Fit'], ['fit', 'paper']),
  ('optim.runtime_lr_scale', [0, 1, 'True'], [True, False, np.bool_(True)]),
  ('init_from', [3, b'x'], [None, 'workdirs/a']),
]


@pytest.mark.parametrize('name,bad,good', EDGES, ids=[e[0] for e in EDGES])
def test_a_row_rejects_values_outside_its_range_with_one_line_naming_it(name, bad, good):
  field = schema.BY_NAME[name]
  for value in good:
    assert field.error(value) is None, value
  for value in bad:
    assert field.error(value) == f'{name} must be {field.check.what}, got {value!r}.', value
    with pytest.raises(ValueError, match=f'^{name} must be '):
      schema.check_fields({**schema.complete({}), name: value})


# (field, a value outside its range, the core's words for it): hdet_jax.settings.check_auto_lr's ranges, at their edges.
CONTROLLER_EDGES = [
  ('hdet.trust', 0.0, 'must be > 0 (the largest log-step per sync), got 0.0.'),
  ('hdet.memory', 1.0, 'must be in [0, 1), got 1.0.'),
  ('hdet.step_growth', 0.99, 'must be a number >= 1 (1: no acceleration), got 0.99.'),
  ('hdet.max_gain', 0.5, 'must be a number >= 1 (1: no acceleration), got 0.5.'),
  ('hdet.backoff_fraction', 1.0, 'must be a number in [0, 1), and > 0 only with backoff=True; got 1.0.'),
  ('hdet.backoff_stderrs', -0.1, 'must be a number >= 0, and > 0 only with backoff=True; got -0.1.'),
  ('hdet.initial_scale', 0.0, 'must be None or a number > 0 (1: start at the schedule), got 0.0.'),
]


@pytest.mark.parametrize('name,bad,says', CONTROLLER_EDGES, ids=[e[0] for e in CONTROLLER_EDGES])
def test_a_controller_setting_outside_the_cores_range_is_one_line_naming_its_field(name, bad, says):
  """The controller's ranges are hdet_jax.AutoLR's, never restated: the row checks the type only, and resolve's
  check is the core's check_auto_lr of the controller the config builds, its error naming the config field."""
  import hdet_jax

  config = config_lib.load_config_file(os.path.join(ROOT, 'configs', 'default.py'))
  field = {f.name.split('.')[-1]: f.name for f in schema.FIELDS}
  core = dict(total_steps=1500, **{name.split('.')[-1]: bad})
  with pytest.raises(ValueError, match='^auto_lr\\.' + name.split('.')[-1] + ' ' + re.escape(says)):
    hdet_jax.settings.check_auto_lr(hdet_jax.AutoLR(**core), 0.25)
  assert schema.BY_NAME[name].error(bad) is None and field[name.split('.')[-1]] == name
  if name in schema.tuning_fields():
    config, tuning = config, {name: bad}
  else:
    config, tuning = config_lib.with_overrides(config, {name: bad}), None
  named = says.replace(' backoff=True', ' hdet.backoff=True')  # (the core's argument, named as the config's field)
  with pytest.raises(config_lib.ConfigError, match='^' + re.escape(f'{name} {named}') + '$'):
    run_settings.resolve(config, tuning=tuning)
  off = config_lib.with_overrides(config_lib.load_config_file(os.path.join(ROOT, 'configs', 'default.py')), {})
  off.hdet.auto_lr = False  # no controller built: nothing to check (train.py warns the value is ignored)
  if name == 'hdet.trust':  # (the guard's margins keep their own rule: they need the back-off)
    run_settings.resolve(off, tuning={name: bad})


def test_a_field_a_config_lacks_reads_as_its_legacy_value_else_its_default():
  got = schema.complete({'seed': 3, 'my.extra': 1})
  assert got['seed'] == 3 and got['my.extra'] == 1
  assert got['hdet.after_stop'] == 'hold' and got['hdet.initial_scale'] == 1.0  # legacy values, not the defaults
  assert got['optim.max_lr'] == 0.03 and got['hdet.controller'] == 'fit'  # no legacy value: the default
  assert 'model.kind' not in got and schema.complete({'task': 'mnist1d'})['model.kind'] == 'cnn'
  full = config_lib.flatten(run_settings.recorded_config(default.get_config()))
  assert schema.complete(full) == full  # a complete config reads as it is


@pytest.mark.parametrize('example, lines', [('chunk_steps', 4), ('mean_norm', 1)])
def test_contributings_field_and_metric_examples_are_the_source_as_it_is(example, lines):
  """CONTRIBUTING.md's real examples of adding a field (``chunk_steps``) and a metric (``mean_norm``) quote the files
  they name, line for line: each ``# path...`` header is followed by lines that are in that file as written (up to a
  trailing comment)."""
  import pathlib
  import re

  repo = pathlib.Path(__file__).resolve().parents[1]
  text = (repo / 'CONTRIBUTING.md').read_text()
  block = re.search(rf'The real example, `{example}`.*?```text\n(.*?)```', text, re.S).group(1)
  checked, path = 0, None
  for line in block.splitlines():
    if line.startswith('# hdet_jax/'):
      path = repo / line[2:].split(',')[0].split(':')[0]
      source = path.read_text()
    else:
      code = line.strip() if line.lstrip().startswith('#') else line.split('  # ')[0].strip()  # (a help comment whole)
      assert code and code in source, (path.name, code)
      checked += 1
  assert checked == lines
