"""Every config file loads, passes validation, builds its optimizer, and starts its docstring with its command."""

import ast
import glob
import os

import pytest

from hdet_jax.trainer import config_lib
from hdet_jax.trainer import run_settings
from hdet_jax.trainer import optimizer as optimizer_lib

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), '..', 'configs', '*.py')))


def test_the_configs_are_there():
  names = {os.path.basename(p)[:-3] for p in CONFIGS}
  assert {
    'default',
    'tiny',
    'baseline_low',
    'baseline_high',
    'warm_init',
    'hdet_no_auto_lr',
    'hdet_cold',
    'hdet_full',
  } <= names


@pytest.mark.parametrize('path', CONFIGS, ids=lambda p: os.path.basename(p))
def test_config_is_valid_and_documented(path):
  name = os.path.basename(path)
  doc = ast.get_docstring(ast.parse(open(path).read()))
  assert doc.startswith(f'python train.py --config configs/{name}'), doc.splitlines()[0]
  config = config_lib.load_config_file(path)
  run = run_settings.resolve(config)
  tx = optimizer_lib.make_optimizer(run.optimizer, 8)
  assert callable(tx.update)


def test_ablation_rows_differ_as_the_paper_says():
  load = lambda n: config_lib.load_config_file(os.path.join(os.path.dirname(CONFIGS[0]), n + '.py'))
  full, cold, no_auto, warm, high, low = map(
    load, ['hdet_full', 'hdet_cold', 'hdet_no_auto_lr', 'warm_init', 'baseline_high', 'baseline_low']
  )
  lr = full.optim.max_lr
  assert cold.optim.max_lr == no_auto.optim.max_lr == warm.optim.max_lr == high.optim.max_lr == lr
  assert low.optim.max_lr == pytest.approx(lr / 9)
  assert full.hdet.auto_lr and cold.hdet.auto_lr and not no_auto.hdet.auto_lr
  # The paper's rows run the paper's controller with per-group LRs, whatever the main job runs.
  assert full.hdet.controller == cold.hdet.controller == 'paper' and full.hdet.score == 'window'
  assert full.hdet.param_groups and full.hdet.stop_fraction == 1.0
  # ... averaging every 25 steps from the schedule as given, whatever the main job's T and start.
  assert full.hdet.sync_every == 25 and full.hdet.initial_scale == 1.0 and full.hdet.after_stop == 'hold'
  assert full.hdet.step_growth == 1.0
  assert full.init_from and no_auto.init_from and warm.init_from and not cold.init_from and not high.init_from
  for plain in (warm, high, low):
    assert plain.hdet.spread == 0 and plain.hdet.sync_every == 0 and not plain.hdet.auto_lr
  for hdet in (full, cold, no_auto):
    assert hdet.hdet.spread > 0 and hdet.hdet.sync_every > 0
  assert len({c.num_train_steps for c in (full, cold, no_auto, warm, high, low)}) == 1
