"""Config helpers: loading sibling config files, checking values, comparing runs."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import math
import os
import traceback
from typing import Any

import ml_collections
import numpy as np

from hdet_jax.trainer import schema

# Fields that only steer a run (logging, evaluation, checkpoint cadence, where caches live): they may change when a
# run resumes. Every other field defines the training trajectory. Declared by role in schema.FIELDS.
RUN_FIELDS = schema.loop_only()


# Fields added after runs were already on disk, left out of a run's recorded training fields while at these values
# (which train exactly as those runs did), so such workdirs still resume: each row's ``legacy`` in schema.FIELDS.
QUIET_DEFAULTS = schema.legacy_values()


# Fields removed in hdet-jax 1.0 (measured, not adopted: research/README.md), each with what to use instead. A
# config or a workdir that names one stops with one line saying so (:func:`check_removed`).
REMOVED = {
    'hdet.fan': "the learning rates fan out linearly (eq. 1, hdet.spread in [0, 1)); remove the field",
    'hdet.score_tail': "the common batch scores each replica's last iterate; remove the field",
    'hdet.score_anneal': "the common batch scores each replica's last iterate; remove the field",
    'hdet.early_sync_every': "windows are hdet.sync_every steps, or hdet.num_syncs per run; remove the field",
    'hdet.early_sync_steps': "windows are hdet.sync_every steps, or hdet.num_syncs per run; remove the field",
    'hdet.overshoot': "the 'fit' controller aims at the fitted best (an overshoot of 1); remove the field",
    'optim.anneal_at_step': "the LR follows optim.schedule to the last step; remove the field",
    'optim.anneal_steps': "the LR follows optim.schedule to the last step; remove the field",
    'bracket.anneal': "the LR bracket's last rung ranks the runs' own training losses; remove the field",
    'log_noise_scale': "the gradient noise scale is no longer logged; remove the field",
}
REMOVED_IN = '1.0'


def removed_message(field: str) -> str:
  """One line: ``field`` (a key of :data:`REMOVED`) was removed in 1.0, and what to use instead."""
  return f'{field} was removed in hdet-jax {REMOVED_IN}: {REMOVED[field]} (CHANGELOG.md, 1.0.0).'


def check_removed(config: Any) -> None:
  """Raises ConfigError naming the first field of :data:`REMOVED` that ``config`` (a ConfigDict, or a flattened
  dict of a workdir's recorded fields) still has."""
  flat = config if isinstance(config, dict) else flatten(config)
  for field in REMOVED:
    if field in flat:
      raise ConfigError(removed_message(field))


class ConfigError(ValueError):
  """A bad config, corpus, workdir or device setup, found before training; one clear line."""


def load_config_file(path: str, *args: str) -> ml_collections.ConfigDict:
  """``get_config(*args)`` of a config file: train.py's ``--config`` (``FILE:ARG`` passes ARG), tests, and configs
  that build on another (:func:`sibling`).

  A file that gives no ConfigDict raises ConfigError naming it and the fix, never the Python error itself: no such
  file, a directory, not Python (a syntax error, a binary file), an error running it (an import that fails), no
  ``get_config``, a ``get_config`` that raises or returns something else.
  """
  where = f'--config {path}'
  example = 'e.g. --config configs/default.py'
  if not path:
    raise ConfigError(f'--config is empty; pass a config file ({example}).')
  if os.path.isdir(path):
    raise ConfigError(f'{where} is a directory; pass a config file ({example}).')
  if not os.path.exists(path):
    raise ConfigError(f'{where}: no such file; pass a config file ({example}).')
  name = 'hdet_config_' + os.path.splitext(os.path.basename(path))[0]
  loader = importlib.machinery.SourceFileLoader(name, path)  # any file name, as ml_collections' config_flags reads it
  try:
    code = loader.source_to_code(loader.get_data(path), path)
  except OSError as e:
    raise ConfigError(f'{where} cannot be read ({e.strerror or e}); check its permissions.') from None
  except (SyntaxError, ValueError) as e:
    line = f' at line {e.lineno}' if getattr(e, 'lineno', None) else ''
    raise ConfigError(f'{where} is not Python source ({_one_line(getattr(e, "msg", None) or e)}{line}); fix the file '
                      f'(a config file defines get_config(), as configs/default.py does).') from None
  module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
  try:
    exec(code, module.__dict__)
  except ConfigError:
    raise  # a config it builds on (sibling) already names that file and the fix
  except Exception as e:  # anything the file runs: a failing import, a NameError, ...
    fix = 'install the package or fix the import' if isinstance(e, ImportError) else 'fix the file'
    raise ConfigError(f'{where}: running it raised {_raised(e, path)}; {fix}.') from None
  get_config = getattr(module, 'get_config', None)
  if not callable(get_config):
    raise ConfigError(f'{where} defines no get_config(); a config file defines get_config() returning an '
                      'ml_collections.ConfigDict (as configs/default.py does).')
  try:
    config = get_config(*args)
  except ConfigError:
    raise
  except Exception as e:
    raise ConfigError(f'{where}: get_config({", ".join(map(repr, args))}) raised {_raised(e, path)}; fix the file.') from None
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f'{where}: get_config() returned {type(config).__name__} {_one_line(repr(config))[:60]}, not an '
                      'ml_collections.ConfigDict; return one (as configs/default.py does).')
  return config


def _one_line(text: Any) -> str:
  return ' '.join(str(text).split())


def _raised(e: Exception, path: str) -> str:
  """'KeyError: 'x' (line 7)': an exception with the last line of ``path`` it passed through."""
  lines = [f.lineno for f in traceback.extract_tb(e.__traceback__)
           if os.path.abspath(f.filename) == os.path.abspath(path)]
  detail = _one_line(e)
  return f'{type(e).__name__}{": " + detail if detail else ""}' + (f' (line {lines[-1]})' if lines else '')


def sibling(file: str, name: str) -> ml_collections.ConfigDict:
  """``get_config()`` of ``name.py`` next to ``file`` (e.g. an ablation building on default.py)."""
  return load_config_file(os.path.join(os.path.dirname(os.path.abspath(file)), name + '.py'))


def with_overrides(config: ml_collections.ConfigDict, overrides: dict[str, Any]) -> ml_collections.ConfigDict:
  """Sets dotted fields in place, as ``--config.a.b=v`` would: ``{'hdet.spread': 0.2}``; returns config."""
  for key, value in overrides.items():
    node = config
    *path, last = key.split('.')
    for part in path:
      node = node[part]
    node[last] = value
  return config


def flatten(config: Any, prefix: str = '') -> dict[str, Any]:
  d = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else config
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(flatten(v, f'{prefix}{k}.'))
    else:
      out[f'{prefix}{k}'] = v
  return out


def settles(hdet: Any) -> bool:
  """Whether ``hdet.settle`` is on: as set, or where it is left at None (the default), wherever it applies (the
  'fit' controller's rise-only climb: ``auto_lr``, ``controller='fit'``, ``after_stop='rise'``)."""
  if hdet.get('settle') is not None:
    return bool(hdet.get('settle'))
  return _settle_applies(hdet)


def _settle_applies(hdet: Any) -> bool:
  """Whether hdet.settle can act: the 'fit' controller's rise-only climb."""
  return bool(hdet.get('auto_lr')) and hdet.get('controller') == 'fit' and hdet.get('after_stop') == 'rise'


# The back-off guard where its fields are left at None (configs/default.py): wherever the back-off applies, it
# fires on a rise of the window's training loss beyond 2 standard errors and 5% and rolls back; elsewhere it is off.
GUARD_ON = {'backoff': True, 'rollback': True, 'backoff_stderrs': 2.0, 'backoff_fraction': 0.05}
GUARD_OFF = {'backoff': False, 'rollback': False, 'backoff_stderrs': 0.0, 'backoff_fraction': 0.0}


def guard(hdet: Any, optimizer: str | None = None) -> dict[str, Any]:
  """``hdet``'s back-off fields (``backoff``, ``rollback``, ``backoff_stderrs``, ``backoff_fraction``) with those
  left at None resolved: the back-off on wherever it applies (the 'fit' controller with ``auto_lr``), and the other
  three at :data:`GUARD_ON` where it is on, at :data:`GUARD_OFF` where not; the rollback only where the replicas
  share their optimizer state (:func:`shared_opt_state`; ``optimizer``: ``optim.name``, None for one that does).
  A field a config lacks (written before it existed) reads as off. Example:
  ``guard(get_config().hdet)['rollback']`` is True."""
  backoff = hdet.get('backoff', False)
  backoff = _backoff_applies(hdet) if backoff is None else bool(backoff)
  fallback = GUARD_ON if backoff else GUARD_OFF
  if backoff and not shared_opt_state(hdet, optimizer):  # no one copy of the optimizer state to return to
    fallback = {**GUARD_ON, 'rollback': False}
  out = {'backoff': backoff}
  for field in ('rollback', 'backoff_stderrs', 'backoff_fraction'):
    value = hdet.get(field, GUARD_OFF[field])
    out[field] = fallback[field] if value is None else type(GUARD_OFF[field])(value)
  return out


def _backoff_applies(hdet: Any) -> bool:
  """Whether hdet.backoff can act: the 'fit' controller with auto-LR."""
  return bool(hdet.get('auto_lr')) and hdet.get('controller') == 'fit'


# The optimizers whose state is a function of the gradients alone (moments, momentum), so that the shared gradient
# gives every replica the same state. The LR-free ones keep LR-dependent estimates (Prodigy's and D-Adaptation's d,
# DoG's distance, Mechanize's scale, schedule-free's z), which the replicas' own LRs set apart.
SHARED_STATE_OPTIMIZERS = ('adamw', 'adam', 'sgd')


def shared_opt_state(hdet: Any, optimizer: str | None = None) -> bool:
  """Whether every replica holds the same wrapped optimizer state after a sync, so that the rollback's one copy
  of it (its anchor) is every replica's: an optimizer of :data:`SHARED_STATE_OPTIMIZERS` (None: assumed one) on
  the shared gradient, or in the low-communication mode averaging the state."""
  if optimizer is not None and optimizer not in SHARED_STATE_OPTIMIZERS:
    return False
  return not hdet.get('low_communication', False) or bool(hdet.get('average_opt_state', False))


def resolved(flat: dict[str, Any]) -> dict[str, Any]:
  """A flattened config with the fields left at None ("wherever it applies") written as what they resolve to, so
  a run, a resumed run and a cached record compare what trains (``hdet.settle``: :func:`settles`; the back-off's
  fields: :func:`guard`)."""
  hdet = {k[len('hdet.'):]: v for k, v in flat.items() if k.startswith('hdet.')}
  out = dict(flat)
  if 'hdet.settle' in flat and flat['hdet.settle'] is None:
    out['hdet.settle'] = settles(hdet)
  if any(f'hdet.{f}' in flat and flat[f'hdet.{f}'] is None for f in GUARD_OFF):
    out.update({f'hdet.{k}': v for k, v in guard(hdet, flat.get('optim.name')).items() if f'hdet.{k}' in flat})
  return out


def with_quiet_defaults(recorded: dict[str, Any], fields) -> dict[str, Any]:
  """A recorded (flattened) config with each of ``fields`` it lacks, added since it was written, at its
  :data:`QUIET_DEFAULTS` value: what the record's run trained with. Only ``fields``: QUIET_DEFAULTS also names
  other tasks' fields (mnist1d's model.kind), which a record of this task never had."""
  return {**{k: QUIET_DEFAULTS[k] for k in fields if k in QUIET_DEFAULTS}, **recorded}


def defines_a_run(field: str) -> bool:
  """Whether a (dotted) field can change one run's trajectory: not a run field, not the LR bracket's (a bracket's
  runs are one-run configs that never read ``bracket.*``; ``bracket.json`` records the bracket's own fields)."""
  return field not in RUN_FIELDS and not field.startswith('bracket.')


def run_identity(fields: dict[str, Any]) -> dict[str, Any]:
  """The (dotted) fields of ``fields`` that define a run (:func:`defines_a_run`): what a resume compares, also for
  fields a workdir recorded before a version that left some out."""
  return {k: v for k, v in fields.items() if defines_a_run(k)}


def training_fields(config: Any, num_replicas: int) -> dict[str, Any]:
  """The fields that define the trajectory (JSON-normalised), with N and the fields left at None resolved."""
  flat = run_identity(resolved(flatten(config)))
  flat = {k: v for k, v in flat.items() if k not in QUIET_DEFAULTS or v != QUIET_DEFAULTS[k]}
  flat['hdet.num_replicas'] = int(num_replicas)
  return json.loads(json.dumps(flat, default=str))


def differences(old: dict, new: dict, limit: int = 4) -> str:
  """'a.b: 1 -> 2, ...' for the keys whose values differ."""
  keys = sorted(set(old) | set(new))
  diffs = [f'{k}: {old.get(k, "<absent>")!r} -> {new.get(k, "<absent>")!r}'
           for k in keys if old.get(k, '<absent>') != new.get(k, '<absent>')]
  more = f' (and {len(diffs) - limit} more)' if len(diffs) > limit else ''
  return ', '.join(diffs[:limit]) + more


def _get(config: Any, field: str) -> tuple[bool, Any]:
  node = config
  for part in field.split('.'):
    try:
      if part not in node:
        return False, None
      node = node[part]
    except TypeError:
      return False, None
  return True, node


def _is_int(v: Any) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_real(v: Any) -> bool:
  return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)) \
      and math.isfinite(float(v))


# (field, kind, test, what a valid value is). kind 'int' or 'real' (a finite number); fields a config
# lacks are skipped (configs written for older versions).
_RULES = (
    ('seed', 'int', lambda v: 0 <= v < 2**32, 'an integer in [0, 2**32)'),
    ('num_train_steps', 'int', lambda v: v >= 2, 'an integer >= 2'),
    ('data.val_fraction', 'real', lambda v: 0 < v < 1, 'in (0, 1)'),
    ('data.seq_len', 'int', lambda v: v >= 1, 'an integer >= 1'),
    ('data.num_samples', 'int', lambda v: v >= 20, 'an integer >= 20'),
    ('data.train_split', 'real', lambda v: 0 < v < 1, 'in (0, 1)'),
    ('data.dataset_seed', 'int', lambda v: 0 <= v < 2**32, 'an integer in [0, 2**32)'),
    ('model.channels', 'int', lambda v: v >= 1, 'an integer >= 1'),
    ('model.hidden', 'int', lambda v: v >= 1, 'an integer >= 1'),
    ('model.num_classes', 'int', lambda v: v >= 2, 'an integer >= 2'),
    ('data.batch_size', 'int', lambda v: v >= 1, 'an integer >= 1'),
    ('model.d_model', 'int', lambda v: v >= 1, 'an integer >= 1'),
    ('model.num_layers', 'int', lambda v: v >= 1, 'an integer >= 1'),
    ('model.num_heads', 'int', lambda v: v >= 1, 'an integer >= 1'),
    ('model.mlp_ratio', 'real', lambda v: v > 0, 'a number > 0'),
    ('model.dropout', 'real', lambda v: 0 <= v < 1, 'in [0, 1)'),
    ('model.attn_temperature', 'real', lambda v: v > 0, 'a number > 0'),
    ('optim.max_lr', 'real', lambda v: v > 0, 'a number > 0'),
    ('optim.pct_start', 'real', lambda v: 0 < v < 1, 'in (0, 1)'),
    ('optim.div_factor', 'real', lambda v: v > 0, 'a number > 0'),
    ('optim.final_div_factor', 'real', lambda v: v > 0, 'a number > 0'),
    ('optim.b1', 'real', lambda v: 0 <= v < 1, 'in [0, 1)'),
    ('optim.b2', 'real', lambda v: 0 <= v < 1, 'in [0, 1)'),
    ('optim.weight_decay', 'real', lambda v: v >= 0, 'a number >= 0'),
    ('optim.grad_clip_norm', 'real', lambda v: v >= 0, 'a number >= 0 (0: no clipping)'),
    ('optim.label_smoothing', 'real', lambda v: 0 <= v < 1, 'in [0, 1)'),
    ('hdet.num_replicas', 'int', lambda v: v >= 0, 'an integer >= 0 (0: all devices)'),
    ('mesh.replicas', 'int', lambda v: v >= 0, 'an integer >= 0 (0: devices / mesh.fsdp)'),
    ('mesh.fsdp', 'int', lambda v: v >= 1, 'an integer >= 1 (1: no FSDP inside a group)'),
    ('mesh.tensor', 'int', lambda v: v >= 1, 'an integer >= 1 (1: no tensor parallelism inside a group)'),
    ('hdet.spread', 'real', lambda v: 0 <= v < 1, 'in [0, 1) (the lowest multiplier 1 - spread stays positive)'),
    ('hdet.sync_every', 'int', lambda v: v >= 0, 'an integer >= 0 (0: never)'),
    ('hdet.num_syncs', 'int', lambda v: v >= 0, 'an integer >= 0 (used where hdet.sync_every is 0)'),
    ('hdet.longest_window', 'int', lambda v: v >= 0, 'an integer >= 0 (0: no cap on the windows of hdet.num_syncs)'),
    ('hdet.warmup_steps', 'int', lambda v: v >= 0, 'an integer >= 0'),
    ('hdet.temperature', 'real', lambda v: v > 0, 'a number > 0'),
    ('hdet.lr_of_lr', 'real', lambda v: v >= 0, 'a number >= 0'),
    ('hdet.momentum', 'real', lambda v: 0 <= v < 1, 'in [0, 1)'),
    ('hdet.trust', 'real', lambda v: v > 0, 'a number > 0'),
    ('hdet.memory', 'real', lambda v: 0 <= v < 1, 'in [0, 1)'),
    ('hdet.initial_scale', 'real', lambda v: v > 0, 'a number > 0 (1: start at the schedule)'),
    ('hdet.step_growth', 'real', lambda v: v >= 1, 'a number >= 1 (1: no acceleration)'),
    ('hdet.max_gain', 'real', lambda v: v >= 1, 'a number >= 1'),
    ('hdet.backoff_stderrs', 'real', lambda v: v >= 0, 'a number >= 0 (0: any rise backs off)'),
    ('hdet.backoff_fraction', 'real', lambda v: 0 <= v < 1, 'a number in [0, 1) (0: off)'),
    ('hdet.stop_fraction', 'real', lambda v: 0 <= v <= 1, 'in [0, 1] (0: from the first sync; 1: never stop)'),
    ('hdet.probe_windows', 'int', lambda v: v >= 1, 'an integer >= 1'),
    ('hdet.explore.weight_decay', 'real', lambda v: 0 <= v < 1, 'in [0, 1) (0: off)'),
    ('hdet.explore.dropout', 'real', lambda v: v >= 0, 'a number >= 0 (0: off)'),
    ('hdet.explore.label_smoothing', 'real', lambda v: v >= 0, 'a number >= 0 (0: off)'),
    ('hdet.explore.attn_temperature', 'real', lambda v: 0 <= v < 1, 'in [0, 1) (0: off)'),
    ('warm_init.nu', 'real', lambda v: v >= 0, 'a number >= 0'),
    ('log_every', 'int', lambda v: v >= 1, 'an integer >= 1'),
    ('eval_every', 'int', lambda v: v >= 0, 'an integer >= 0 (0: only at the end)'),
    ('eval_windows', 'int', lambda v: v >= 0, 'an integer >= 0 (0: the whole split)'),
    ('checkpoint_every', 'int', lambda v: v >= 0, 'an integer >= 0 (0: only at the end)'),
    ('max_checkpoints', 'int', lambda v: v >= 0, 'an integer >= 0 (0: keep all)'),
    ('stop_at_step', 'int', lambda v: v >= 0, 'an integer >= 0 (0: run to the end)'),
    ('num_cpu_devices', 'int', lambda v: v >= 0, 'an integer >= 0'),
    ('mesh.devices', 'int', lambda v: v >= 0, 'an integer >= 0 (0: every visible device)'),
    ('bracket.points', 'int', lambda v: v == 0 or v >= 2, 'an integer >= 2, or 0 (off: one run)'),
    ('bracket.factor', 'real', lambda v: v > 1, 'a number > 1'),
    ('bracket.compare_steps', 'int', lambda v: v >= 1, 'an integer >= 1'),
)
CHECKED_FIELDS = tuple(r[0] for r in _RULES)
# Checked fields whose None means a resolved default (:func:`guard`).
_NONE_RESOLVES = frozenset({'hdet.backoff_stderrs', 'hdet.backoff_fraction'})


def missing_fields(config: Any, reference: Any) -> list[str]:
  """The trainer's fields (all but the task's own ``data.*`` and ``model.*``) that ``reference`` (configs/default.py's
  config) has and ``config`` lacks: a config not built on the default one."""
  def keys(c, prefix=''):
    out = set()
    for k, v in c.items():
      out |= keys(v, f'{prefix}{k}.') if isinstance(v, ml_collections.ConfigDict) else {prefix + k}
    return out
  return sorted(k for k in keys(reference) - keys(config) if not k.startswith(('data.', 'model.')))


def check_values(config: Any) -> None:
  """Every field's type and range, then the cross-field rules; raises ConfigError naming the field.

  Runs before anything touches JAX, so a bad value never surfaces as a traceback from inside it.
  """
  check_removed(config)
  for field, kind, ok, what in _RULES:
    present, v = _get(config, field)
    if not present or (v is None and field in _NONE_RESOLVES):
      continue
    good = _is_int(v) if kind == 'int' else _is_real(v)
    if not good or not ok(v):
      raise ConfigError(f'{field} must be {what}, got {v!r}.')
  optim = config.optim.name
  if optim not in OPTIMIZERS:
    raise ConfigError(f'optim.name must be one of {", ".join(map(repr, OPTIMIZERS))}, got {optim!r}.')
  for field, choices in (('optim.schedule', SCHEDULES), ('hdet.controller', CONTROLLERS), ('hdet.score', SCORES),
                         ('hdet.after_stop', AFTER_STOP)):
    present, v = _get(config, field)
    if present and v not in choices:
      raise ConfigError(f'{field} must be one of {", ".join(map(repr, choices))}, got {v!r}.')
  from hdet_jax.trainer import tasks  # the task's own fields (flax: imported only here)
  try:
    tasks.get(config).check(config)
  except tasks.TaskError as e:
    raise ConfigError(str(e)) from None
  _check_schedule(config)
  _check_bracket(config)
  _check_runtime_lr_scale(config)
  if config.hdet.auto_lr and config.hdet.spread > 0 and config.hdet.warmup_steps >= config.num_train_steps:
    raise ConfigError(f'hdet.warmup_steps={config.hdet.warmup_steps} must be < num_train_steps='
                      f'{config.num_train_steps} (the controller would never start); lower it or set hdet.auto_lr=False.')
  _check_num_syncs(config)
  _check_guard(config.hdet, config.optim.get('name'))
  if config.hdet.get('settle', False) and not _settle_applies(config.hdet):
    raise ConfigError("hdet.settle=True ends the 'fit' controller's rise-only climb: it needs hdet.auto_lr=True, "
                      f"hdet.controller='fit' and hdet.after_stop='rise' (got {config.hdet.get('controller')!r}, "
                      f"{config.hdet.get('after_stop')!r}), or set hdet.settle=False.")
  for field in ('init_from', 'data.path'):
    present, v = _get(config, field)
    if present and v is not None and not isinstance(v, str):
      raise ConfigError(f'{field} must be a path (a string) or None, got {v!r}.')


def _check_guard(hdet: Any, optimizer: str | None = None) -> None:
  """The back-off's fields set where it cannot act (a field left at None resolves where it can: :func:`guard`)."""
  if hdet.get('backoff') and not _backoff_applies(hdet):
    raise ConfigError(f"hdet.backoff=True steps the 'fit' controller's LR correction down: it needs hdet.auto_lr=True "
                      f"and hdet.controller='fit' (got {hdet.get('controller')!r}), or set hdet.backoff=False.")
  on = guard(hdet, optimizer)['backoff']
  for margin in ('backoff_stderrs', 'backoff_fraction'):
    if (hdet.get(margin) or 0.0) > 0 and not on:
      raise ConfigError(f"hdet.{margin}={hdet[margin]} sets how far the window's training loss must rise for "
                        f"the back-off: it needs hdet.backoff=True (or None, with the 'fit' controller), or set "
                        f"hdet.{margin}=0.")
  if hdet.get('rollback') and not on:
    raise ConfigError("hdet.rollback=True returns to the last sync's state where the back-off fires, so it needs "
                      "hdet.backoff=True or None (with hdet.auto_lr=True and hdet.controller='fit'); or set "
                      "hdet.rollback=False.")
  if hdet.get('rollback') and optimizer is not None and optimizer not in SHARED_STATE_OPTIMIZERS:
    raise ConfigError(f"hdet.rollback=True keeps one copy of the optimizer state for every replica to return to, but "
                      f"optim.name={optimizer!r} keeps LR-dependent state that differs between the replicas: use one of "
                      f"{', '.join(SHARED_STATE_OPTIMIZERS)}, or set hdet.rollback=False.")
  if hdet.get('rollback') and not shared_opt_state(hdet):
    raise ConfigError("hdet.rollback=True keeps one copy of the optimizer state for every replica to return to, but "
                      "with hdet.low_communication=True each replica's state is its own: set "
                      "hdet.average_opt_state=True (the replicas then share it after each sync), or hdet.rollback=False.")


def _check_schedule(config: Any) -> None:
  """The warmup must leave a decay: one-cycle's phases each at least a step, warmup_cosine's warmup ending before
  the last step."""
  o, total = config.optim, config.num_train_steps
  name, pct = o.get('schedule', 'one_cycle'), o.pct_start
  if name == 'warmup_cosine' and not round(pct * total) < total - 1:
    raise ConfigError(f"optim.pct_start={pct} with num_train_steps={total} leaves optim.schedule='warmup_cosine' no "
                      f'step to decay over (its warmup is round(pct_start * num_train_steps) = {round(pct * total)} '
                      'steps, which must end before the last step); lower optim.pct_start or raise num_train_steps.')
  if name == 'one_cycle' and not (pct * total - 1 > 0 and total - 1 > pct * total - 1):
    raise ConfigError(f"optim.pct_start={pct} with num_train_steps={total} leaves optim.schedule='one_cycle' an empty "
                      'phase (its warmup ends at step pct_start * num_train_steps - 1, which must lie inside the run); '
                      'move optim.pct_start away from 0 and 1 or raise num_train_steps.')


def bracket_rungs(text: str) -> list[tuple[float, int]]:
  """``bracket.rungs`` parsed: ``'0.1:4,0.3:1'`` -> ``[(0.1, 4), (0.3, 1)]`` (fraction of the run, runs kept);
  raises ValueError on anything else."""
  rungs = []
  for part in str(text).split(','):
    fraction, sep, kept = part.strip().partition(':')
    if not sep:
      raise ValueError(f'{part.strip()!r} is not fraction:kept')
    rungs.append((float(fraction), int(kept)))
  return rungs


def bracket_steps(rungs: list[tuple[float, int]], total: int) -> list[int]:
  """The step each rung compares at (and its runs stop at): floor(fraction * total)."""
  return [int(math.floor(f * total + 1e-9)) for f, _ in rungs]


def _check_runtime_lr_scale(config: Any) -> None:
  """``optim.runtime_lr_scale`` is a bool, for runs whose learning rates no controller sets."""
  on = config.optim.get('runtime_lr_scale', False)
  if not isinstance(on, (bool, np.bool_)):
    raise ConfigError(f'optim.runtime_lr_scale must be True or False, got {on!r}.')
  if on and config.hdet.auto_lr:
    raise ConfigError('optim.runtime_lr_scale=True applies the learning rate\'s power of two outside the programs, '
                      'where the auto-LR controller would not see it: set hdet.auto_lr=False, or '
                      'optim.runtime_lr_scale=False.')


def _check_bracket(config: Any) -> None:
  """An LR bracket's rungs must fit the run and narrow it down to one run; its runs must train at a fixed LR."""
  b = config.get('bracket')
  if b is None or b.points == 0:
    return
  try:
    rungs = bracket_rungs(b.rungs)
  except ValueError as e:
    raise ConfigError(f"bracket.rungs={b.rungs!r} must be 'fraction:kept,...' (e.g. '0.1:4,0.3:1'): {e}.") from None
  steps, kept = bracket_steps(rungs, config.num_train_steps), [k for _, k in rungs]
  alive = [b.points] + kept
  if not (0 < steps[0] and all(a < c for a, c in zip(steps, steps[1:])) and steps[-1] < config.num_train_steps
          and all(a > c >= 1 for a, c in zip(alive, alive[1:])) and kept[-1] == 1):
    raise ConfigError(
        f'bracket.rungs={b.rungs!r} with bracket.points={b.points} and num_train_steps={config.num_train_steps} '
        f'(rung steps {steps}) must compare at increasing steps inside the run (0 < fraction * num_train_steps < '
        'num_train_steps) and keep fewer runs at each rung, the last keeping 1; e.g. '
        f"'0.1:{max(1, b.points // 2)},0.3:1'.")
  if config.hdet.auto_lr:
    raise ConfigError('bracket.points > 0 looks for the LR by comparing runs trained apart at fixed LRs, but '
                      'hdet.auto_lr=True would move each run\'s LR too: set hdet.auto_lr=False (configs/bracket.py '
                      'trains plain data parallel), or bracket.points=0 for one HDET run.')
  if config.stop_at_step > 0:
    raise ConfigError(f'stop_at_step={config.stop_at_step} cannot stop an LR bracket, which stops its runs at its '
                      'rungs itself: set stop_at_step=0 (a preempted bracket resumes where it stopped).')


def _check_num_syncs(config: Any) -> None:
  k = config.hdet.get('num_syncs', 0)
  if config.hdet.sync_every == 0 and k > config.num_train_steps:  # (a sync_every > 0 sets T instead)
    raise ConfigError(f'hdet.num_syncs={k} windows do not fit in num_train_steps={config.num_train_steps} '
                      '(each window is at least one step): lower hdet.num_syncs, or set it to 0 and use hdet.sync_every.')


# 'adamw', 'adam', 'sgd' take the schedule as their LR; the optax.contrib LR-free and adaptive methods
# take it as the LR their documentation sets (1.0 for prodigy, dog, dadapt_adamw and mechanize's adam).
OPTIMIZERS = ('adamw', 'adam', 'sgd', 'prodigy', 'dog', 'dadapt_adamw', 'mechanize_adam',
              'schedule_free_adamw', 'adam_plateau')
SCHEDULES = ('one_cycle', 'warmup_cosine', 'constant')
CONTROLLERS = ('paper', 'fit')
SCORES = ('window', 'common')
AFTER_STOP = ('hold', 'rise')
