"""Every config file loads, passes validation, builds its optimizer, and starts its docstring with its command."""

import ast
import glob
import os

import pytest

from hdet_jax.trainer import config_lib
from hdet_jax.trainer import optimizer as optimizer_lib
import trainer_testing

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), '..', 'configs', '*.py')))


def test_the_configs_are_there():
  names = {os.path.basename(p)[:-3] for p in CONFIGS}
  # The user's configs; the Table 1 ablation's rows are research's (research/configs/).
  assert names == {'default', 'tiny', 'mnist1d', 'bracket', 'finetune', 'hdet_explore'}


@pytest.mark.parametrize('path', CONFIGS, ids=lambda p: os.path.basename(p))
def test_config_is_valid_and_documented(path):
  name = os.path.basename(path)
  doc = ast.get_docstring(ast.parse(open(path).read()))
  assert doc.startswith(f'python train.py --config configs/{name}'), doc.splitlines()[0]
  config = config_lib.load_config_file(path)
  run = trainer_testing.resolve(config)
  tx = optimizer_lib.make_optimizer(run.optimizer, 8, seed=run.seed)
  assert callable(tx.update)
