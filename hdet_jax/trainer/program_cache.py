"""The compiled programs of a run, kept for the next run in the same process that builds the same ones.

An LR bracket trains its runs one after another in one process (8 points, then the survivors resumed), a sweep or
an experiment trains many, and a resumed run builds again what it built before. Each run traces, lowers and
compiles its programs up front (``setup.compile_programs``). The persistent compilation cache spares XLA's compile, but
not the tracing and lowering before it, which on a small model are most of a run's setup
(results/bracket_compiles.md, 'configs/default.py: 8 plain runs a factor 2 apart, 40 steps each'). Here a run whose
programs would be the same takes the last run's compiled programs instead, and builds nothing.

When two runs build the same programs: their key (:func:`programs_key`) is the whole config, but for the fields
that never enter a program (:data:`NOT_IN_PROGRAMS`) and ``optim.max_lr`` taken as the programs' own peak (under
``optim.runtime_lr_scale`` its power of two is a run-time value: ``run_settings.lr_unit``), with the replicas, the
mesh's devices, the process, the data's description and the JAX and XLA settings that change a program. A program
is then looked up under that key by its name and the shapes, dtypes and shardings of its arguments. A kept
program is the very executable the first run compiled, so a run's numbers are the same bit for bit
(``tests/test_program_cache.py``).

At most :data:`KEPT_CONFIGS` keys are kept (the least recently used goes first): the programs hold device memory
for their code, and a sweep of unlike configs would otherwise keep every one. :func:`clear` drops them all.
"""

from __future__ import annotations

import collections
import json
import os
from typing import Any, Callable

import jax

from hdet_jax.trainer import schema

# Fields the loop reads and no program does (role LOOP in schema.FIELDS): runs that differ only in them build the
# same programs.
NOT_IN_PROGRAMS = schema.not_in_programs()
# JAX settings a compiled program depends on (its numerics or its checks).
_JAX_SETTINGS = (
  'jax_enable_x64',
  'jax_debug_nans',
  'jax_debug_infs',
  'jax_default_matmul_precision',
  'jax_threefry_partitionable',
  'jax_default_prng_impl',
  'jax_numpy_rank_promotion',
)
KEPT_CONFIGS = 4

_kept: collections.OrderedDict[str, dict] = collections.OrderedDict()


def programs_key(given: dict[str, Any], lr_unit: float, num_replicas: int, mesh: Any, data_description: str) -> str:
  """The key of the programs a run builds on ``mesh`` (see the module's docstring): ``given``, the run's fields as
  given (``RunSettings.given``); ``lr_unit``, its ``optim.runtime_lr_scale`` factor (``run_settings.lr_unit``)."""
  fields = {k: v for k, v in given.items() if k not in NOT_IN_PROGRAMS}
  fields['optim.max_lr'] = given['optim.max_lr'] / lr_unit  # exact: a power of two
  place = {
    'replicas': num_replicas,
    'mesh': dict(mesh.shape),
    'devices': [d.id for d in mesh.devices.flat],
    'platform': mesh.devices.flat[0].platform,
    'process': [jax.process_index(), jax.process_count()],
  }
  settings = {name: str(getattr(jax.config, name, None)) for name in _JAX_SETTINGS}
  settings['XLA_FLAGS'] = os.environ.get('XLA_FLAGS', '')
  return json.dumps([fields, place, settings, data_description], sort_keys=True, default=repr)


def signature(*args: Any) -> str:
  """The shapes, dtypes and shardings of ``args`` (pytrees of arrays): what a compiled program was built for."""
  leaves, treedef = jax.tree.flatten(args)
  return repr((str(treedef), [(x.shape, str(x.dtype), str(getattr(x, 'sharding', None))) for x in leaves]))


def get(key: str, name: str, build: Callable[[], Any]) -> Any:
  """The program ``name`` kept under ``key``, or ``build()``'s, kept from now on."""
  programs = _kept.get(key)
  if programs is None:
    programs = _kept[key] = {}
    while len(_kept) > KEPT_CONFIGS:
      _kept.popitem(last=False)
  _kept.move_to_end(key)
  if name not in programs:
    programs[name] = build()
  return programs[name]


def clear() -> None:
  """Forgets every kept program (the next run builds its own)."""
  _kept.clear()
