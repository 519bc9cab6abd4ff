"""Loading configs: config files, sibling files, overrides, flattening and its inverse.

(What a config's fields resolve to, and the rules across them: tests/test_run_settings.py; the fields removed in
1.0: tests/test_compat.py.)"""

import json
import os

import ml_collections
import pytest

from configs import default, mnist1d
from hdet_jax.trainer import config_lib

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs')


def _tiny():
  return config_lib.load_config_file(os.path.join(CONFIGS, 'tiny.py'))


def test_overrides_set_dotted_fields_and_flatten_reads_them_back():
  c = config_lib.with_overrides(_tiny(), {'hdet.spread': 0.2, 'seed': 3, 'model.d_model': 48})
  flat = config_lib.flatten(c)
  assert (flat['hdet.spread'], flat['seed'], flat['model.d_model']) == (0.2, 3, 48)
  assert flat['hdet.explore.dropout'] == 0.0  # nested two deep
  assert config_lib.flatten({'a': {'b': 1}, 'c': 2}) == {'a.b': 1, 'c': 2}


def test_sibling_loads_the_named_config_next_to_a_file():
  c = config_lib.sibling(os.path.join(CONFIGS, 'anything.py'), 'tiny')
  assert isinstance(c, ml_collections.ConfigDict) and c.num_train_steps == 40
  assert config_lib.sibling(os.path.join(CONFIGS, 'x.py'), 'default').num_train_steps == 1500


@pytest.mark.parametrize(
  'source,says',
  [
    (None, 'no such file'),
    ('def get_config(:\n', 'is not Python source (invalid syntax at line 1)'),
    ('import hdet_no_such_module\n', "raised ModuleNotFoundError: No module named 'hdet_no_such_module' (line 1)"),
    ('X = 1\n', 'defines no get_config()'),
    ('def get_config():\n  return {}[0]\n', 'get_config() raised KeyError: 0 (line 2)'),
    ('def get_config():\n  return [1]\n', 'get_config() returned list [1], not an ml_collections.ConfigDict'),
    (
      'from hdet_jax.trainer.config_lib import sibling\ndef get_config():\n  return sibling(__file__, "gone")\n',
      'gone.py: no such file',
    ),  # a config building on a missing one names that one
  ],
)
def test_a_config_file_that_gives_no_config_is_one_config_error(tmp_path, source, says):
  """train.py reads --config through load_config_file (its ConfigError is one error line, exit 2)."""
  path = tmp_path / 'mine.py'
  if source is not None:
    path.write_text(source)
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.load_config_file(str(path))
  assert says in str(e.value) and '\n' not in str(e.value)
  assert str(e.value).startswith(f'--config {tmp_path / ("gone.py" if "gone" in says else "mine.py")}')


def test_load_config_file_passes_get_config_its_argument(tmp_path):
  """--config FILE:ARG calls get_config(ARG), as ml_collections' config_flags does."""
  path = tmp_path / 'arg.py'
  path.write_text('import ml_collections\ndef get_config(size):\n  return ml_collections.ConfigDict({"size": size})\n')
  assert config_lib.load_config_file(str(path), 'big').size == 'big'


def _ordered(d):
  """``d`` as nested lists of (key, value) pairs: equal only where the keys come in the same order too."""
  return [(k, _ordered(v) if isinstance(v, dict) else v) for k, v in d.items()]


@pytest.mark.parametrize('module', [default, mnist1d], ids=['default', 'mnist1d'])
def test_unflatten_undoes_flatten_in_the_same_order(module):
  """config.json records a run's config as unflatten(its flat fields as given): the config itself, in its order."""
  given = json.loads(module.get_config().to_json())
  back = config_lib.unflatten(config_lib.flatten(given))
  assert back == given
  assert _ordered(back) == _ordered(given)
