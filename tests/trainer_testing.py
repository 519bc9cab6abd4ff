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
