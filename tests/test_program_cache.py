"""program_cache: runs in one process that build the same programs share them, bit for bit; others build their own."""

import json

import numpy as np
import pytest

from hdet_jax.trainer import program_cache, setup
from hdet_jax.trainer import mesh as mesh_lib
from trainer_testing import compiled, tiny
import trainer_testing

# A short HDET run: spread, averaging every 4 steps and (unless turned off) the fit controller from the first sync.
_RUN = {
  'num_train_steps': 12,
  'log_every': 4,
  'eval_every': 0,
  'checkpoint_every': 0,
  'plots': False,
  'eval_windows': 16,
  'hdet.sync_every': 4,
  'hdet.warmup_steps': 0,
}

pytestmark = pytest.mark.own_programs  # every test here counts what it compiles


def _run(tmp_path, name, **overrides):
  from trainer_testing import train_and_evaluate

  summary, built = compiled(lambda: train_and_evaluate(tiny(**_RUN, **overrides), str(tmp_path / name)))
  losses = [r['loss'] for r in map(json.loads, open(tmp_path / name / 'metrics.jsonl')) if r['kind'] == 'train']
  return summary['final_metric'], losses, built


def test_a_run_that_builds_the_same_programs_takes_the_last_runs_and_ends_the_same(tmp_path):
  """With the LR's power of two set at run time (as an LR bracket's runs are), a run at 0.04 after one at 0.01 (4x)
  builds nothing; it ends bit for bit as the same run built on its own (the cache cleared first)."""
  program_cache.clear()
  _, _, first = _run(tmp_path, 'a', **{'hdet.auto_lr': False, 'optim.runtime_lr_scale': True})
  assert first > 0
  kept = _run(tmp_path, 'b', **{'hdet.auto_lr': False, 'optim.runtime_lr_scale': True, 'optim.max_lr': 0.04})
  assert kept[2] == 0
  program_cache.clear()
  alone = _run(tmp_path, 'c', **{'hdet.auto_lr': False, 'optim.runtime_lr_scale': True, 'optim.max_lr': 0.04})
  assert alone[2] > 0
  assert kept[:2] == alone[:2]
  assert np.isfinite(kept[0])


def test_a_run_whose_programs_differ_builds_its_own(tmp_path, monkeypatch):
  """A run that differs in a field the programs read (the spread) after another builds its own programs, and ends
  bit for bit as it does alone. Alone here: stopped at step 8 and resumed to 12, which builds the loop's programs once
  (stop_at_step is the loop's; the resume's restore compiles its own) and ends as the straight run."""
  program_cache.clear()
  first = _run(tmp_path, 'a', **{'hdet.spread': 0.25})
  other = _run(tmp_path, 'b', **{'hdet.spread': 0.5})
  assert other[2] > 0 and other[0] != first[0]
  program_cache.clear()
  builds, build = [], setup.build_programs
  monkeypatch.setattr(setup, 'build_programs', lambda *a: builds.append(1) or build(*a))
  _run(tmp_path, 'c', **{'hdet.spread': 0.5, 'stop_at_step': 8})
  assert len(builds) == 1
  alone = _run(tmp_path, 'c', **{'hdet.spread': 0.5})
  assert len(builds) == 1 and other[:2] == alone[:2]


def test_the_key_leaves_out_only_the_loops_fields_and_the_lrs_power_of_two():
  mesh = mesh_lib.make_mesh(8, 1)

  def key(**o):
    run = trainer_testing.resolve(tiny(**o))
    return program_cache.programs_key(run.given, run.loop.lr_unit, 8, mesh, 'data')

  scaled = {'optim.runtime_lr_scale': True, 'hdet.auto_lr': False}
  assert key(**scaled) == key(**scaled, **{'optim.max_lr': 0.01 * 2**5})  # the power of two is a run-time value
  assert key(**scaled) != key(**scaled, **{'optim.max_lr': 0.03})  # another mantissa: another schedule
  assert key() != key(**{'optim.max_lr': 0.02})  # without run-time scaling the LR is the programs' own
  for field, value in (
    ('stop_at_step', 7),
    ('plots', False),
    ('progress_bar', True),
    ('tensorboard', False),
    ('compilation_cache', '/elsewhere'),
    ('checkpoint_every', 3),
    ('max_checkpoints', 0),
    ('eval_every', 5),
    ('stop_on_nan', False),
  ):
    assert key() == key(**{field: value}), field
  for field, value in (
    ('seed', 1),
    ('hdet.spread', 0.3),
    ('optim.weight_decay', 0.2),
    ('model.d_model', 16),
    ('num_train_steps', 41),
    ('hdet.controller', 'paper'),
    ('log_every', 3),
  ):
    assert key() != key(**{field: value}), field
  given = trainer_testing.resolve(tiny()).given
  base = program_cache.programs_key(given, 1.0, 8, mesh, 'data')
  assert base != program_cache.programs_key(given, 1.0, 8, mesh, 'other data')
  assert base != program_cache.programs_key(given, 1.0, 8, mesh_lib.make_mesh(8, 1, devices=4), 'data')


def test_only_the_last_configs_are_kept():
  program_cache.clear()
  built = []
  for k in range(program_cache.KEPT_CONFIGS + 1):
    program_cache.get(f'config {k}', 'step', lambda k=k: built.append(k) or k)
  assert program_cache.get('config 1', 'step', lambda: -1) == 1 and built == list(range(program_cache.KEPT_CONFIGS + 1))
  assert program_cache.get('config 0', 'step', lambda: -1) == -1  # the least recently used went first
  assert program_cache.get('config 2', 'other', lambda: 'new') == 'new'
  program_cache.clear()
  assert program_cache.get('config 1', 'step', lambda: -1) == -1
