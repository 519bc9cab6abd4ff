"""Every ``>>>`` example in the core's docstrings (the top-level modules hdet_jax/*.py) runs and shows its output.

The examples run in this process, so on conftest.py's 8 simulated CPU devices (the replica examples' meshes use
them). The trainer's modules with examples (hdet_jax/trainer: the schema, the process helpers) run too.
"""

import doctest
import importlib
import pathlib

import pytest

import hdet_jax

CORE = sorted(p.stem for p in pathlib.Path(hdet_jax.__file__).parent.glob('*.py'))
MODULES = ['hdet_jax' if stem == '__init__' else f'hdet_jax.{stem}' for stem in CORE]
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# The examples each module holds (`>>>` lines, each a doctest example): a module may gain more, never lose them
# unnoticed, and a finder that found none would fail here rather than pass.
EXAMPLES = {
  'hdet_jax.accumulate': 4,
  'hdet_jax.arguments': 3,
  'hdet_jax.auto_lr': 10,
  'hdet_jax.axes': 6,
  'hdet_jax.flax_utils': 14,
  'hdet_jax.multipliers': 2,
  'hdet_jax.packing': 17,
  'hdet_jax.param_groups': 4,
  'hdet_jax.pmap_utils': 33,
  'hdet_jax.replicas': 39,
  'hdet_jax.schedules': 8,
  'hdet_jax.settings': 6,
  'hdet_jax.shardings': 17,
  'hdet_jax.sync': 34,
  'hdet_jax.transform': 11,
  'hdet_jax.views': 12,
}


def _examples(module) -> int:
  return sum(len(t.examples) for t in doctest.DocTestFinder().find(module))


# Core modules whose examples build flax models: the module imports without flax (it imports flax when called),
# so the core-only install (.ci/newest_jax) skips only their examples.
NEEDS_FLAX = {'hdet_jax.flax_utils'}


@pytest.mark.parametrize('name', MODULES)
def test_docstring_examples_run(name):
  if name in NEEDS_FLAX:
    pytest.importorskip('flax')
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=FLAGS, report=True)
  assert result.failed == 0, f"{result.failed} of {name}'s {result.attempted} doctest examples failed (see stdout)"
  assert result.attempted == _examples(module) >= EXAMPLES.get(name, 0)


def test_every_module_with_examples_is_counted():
  counts = {name: _examples(importlib.import_module(name)) for name in MODULES}
  assert {name for name, n in counts.items() if n} == set(EXAMPLES)
  assert sum(counts.values()) >= sum(EXAMPLES.values())


# The trainer's modules that hold examples, and how many.
TRAINER_EXAMPLES = {'hdet_jax.trainer.schema': 2, 'hdet_jax.trainer.process': 1}


@pytest.mark.parametrize('name', sorted(TRAINER_EXAMPLES))
def test_the_trainers_docstring_examples_run(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=FLAGS, report=True)
  assert result.failed == 0 and result.attempted == TRAINER_EXAMPLES[name], result
  trainer = pathlib.Path(hdet_jax.__file__).parent / 'trainer'
  holding = {
    'hdet_jax.' + '.'.join(p.relative_to(trainer.parent).with_suffix('').parts)
    for p in trainer.rglob('*.py')
    if '>>> ' in p.read_text()
  }
  assert holding == set(TRAINER_EXAMPLES)
