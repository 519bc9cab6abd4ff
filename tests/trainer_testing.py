"""Helpers the trainer's end-to-end tests share: the tiny config, and a checkpoint read back as plain arrays."""

import importlib.util
import os

import numpy as np

from hdet_jax.trainer import config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, 'configs', 'tiny.py')
_spec = importlib.util.spec_from_file_location('hdet_chaos', os.path.join(ROOT, 'scripts', 'chaos.py'))
chaos = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chaos)
restore_raw = chaos.read_checkpoint  # a checkpoint's items as plain arrays (no target: enough to compare bits)


def tiny(**overrides):
  return config_lib.with_overrides(config_lib.load_config_file(TINY), overrides)


def leaves(tree):
  import jax

  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def compiled(fn):
  """(what ``fn()`` returns, how many XLA programs it compiled or loaded from the persistent compilation cache)."""
  import jax

  count, active = [0], [True]

  def on_compile(event, duration, **kwargs):
    del duration, kwargs
    if active[0] and event == '/jax/core/compile/backend_compile_duration':
      count[0] += 1

  def on_cache(event, **kwargs):  # a program loaded from the persistent cache counts too
    del kwargs
    if active[0] and event == '/jax/compilation_cache/cache_hits':
      count[0] += 1

  jax.monitoring.register_event_duration_secs_listener(on_compile)
  jax.monitoring.register_event_listener(on_cache)
  try:
    return fn(), count[0]
  finally:
    active[0] = False
