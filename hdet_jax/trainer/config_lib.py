"""Config helpers: loading sibling config files, checking values, comparing runs."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

import ml_collections

# Fields that only steer a run (logging, evaluation, checkpoint cadence, where caches live):
# they may change when a run resumes. Every other field defines the training trajectory.
RUN_FIELDS = frozenset({
    'stop_at_step', 'log_every', 'eval_every', 'eval_windows', 'checkpoint_every',
    'max_checkpoints', 'stop_on_nan', 'plots', 'progress_bar', 'num_cpu_devices',
    'compilation_cache',
})


class ConfigError(ValueError):
  """A bad config, corpus, workdir or device setup, found before training; one clear line."""


def load_config_file(path: str) -> ml_collections.ConfigDict:
  """``get_config()`` of a config file (for tests and for configs that build on another)."""
  name = 'hdet_config_' + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def sibling(file: str, name: str) -> ml_collections.ConfigDict:
  """``get_config()`` of ``name.py`` next to ``file`` (e.g. an ablation building on default.py)."""
  return load_config_file(os.path.join(os.path.dirname(os.path.abspath(file)), name + '.py'))


def flatten(config: Any, prefix: str = '') -> dict[str, Any]:
  d = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else config
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(flatten(v, f'{prefix}{k}.'))
    else:
      out[f'{prefix}{k}'] = v
  return out


def training_fields(config: Any, num_replicas: int) -> dict[str, Any]:
  """The fields that define the trajectory (JSON-normalised), with N resolved."""
  flat = {k: v for k, v in flatten(config).items() if k not in RUN_FIELDS}
  flat['hdet.num_replicas'] = int(num_replicas)
  return json.loads(json.dumps(flat, default=str))


def differences(old: dict, new: dict, limit: int = 4) -> str:
  """'a.b: 1 -> 2, ...' for the keys whose values differ."""
  keys = sorted(set(old) | set(new))
  diffs = [f'{k}: {old.get(k, "<absent>")!r} -> {new.get(k, "<absent>")!r}'
           for k in keys if old.get(k, '<absent>') != new.get(k, '<absent>')]
  more = f' (and {len(diffs) - limit} more)' if len(diffs) > limit else ''
  return ', '.join(diffs[:limit]) + more


def check_values(config: Any) -> None:
  """Range checks that name the field and the fix (the core checks the HDET settings)."""
  def need(cond, msg):
    if not cond:
      raise ConfigError(msg)
  need(config.num_train_steps >= 2, f'num_train_steps must be >= 2, got {config.num_train_steps}.')
  need(config.data.seq_len >= 1, f'data.seq_len must be >= 1, got {config.data.seq_len}.')
  need(config.data.batch_size >= 1, f'data.batch_size must be >= 1, got {config.data.batch_size}.')
  need(config.model.d_model % config.model.num_heads == 0,
       f'model.d_model={config.model.d_model} must be divisible by model.num_heads={config.model.num_heads}.')
  need(config.model.num_layers >= 1, f'model.num_layers must be >= 1, got {config.model.num_layers}.')
  need(config.log_every >= 1, f'log_every must be >= 1, got {config.log_every}.')
  for f in ('eval_every', 'eval_windows', 'checkpoint_every', 'max_checkpoints', 'stop_at_step'):
    need(config[f] >= 0, f'{f} must be >= 0, got {config[f]}.')
  need(config.hdet.num_replicas >= 0, f'hdet.num_replicas must be >= 0 (0: all devices), got {config.hdet.num_replicas}.')
  need(config.hdet.sync_every >= 0, f'hdet.sync_every must be >= 0 (0: never), got {config.hdet.sync_every}.')
  need(config.warm_init.nu >= 0, f'warm_init.nu must be >= 0, got {config.warm_init.nu}.')
  need(config.optim.max_lr > 0, f'optim.max_lr must be > 0, got {config.optim.max_lr}.')
