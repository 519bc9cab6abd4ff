"""What older configs and workdirs need (hdet_jax/trainer/compat.py): the fields removed in 1.0."""

import os

import pytest

from hdet_jax.trainer import compat
from hdet_jax.trainer import config_lib
from hdet_jax.trainer import run_settings

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs')


def _tiny():
  return config_lib.load_config_file(os.path.join(CONFIGS, 'tiny.py'))


REMOVED_1_0 = ['hdet.fan', 'hdet.score_tail', 'hdet.score_anneal', 'hdet.early_sync_every', 'hdet.early_sync_steps',
               'hdet.overshoot', 'optim.anneal_at_step', 'optim.anneal_steps', 'bracket.anneal', 'log_noise_scale']


def test_the_fields_removed_in_1_0_are_listed_and_gone_from_every_config():
  """The knobs measured and not adopted left the product in 1.0: no shipped config has one, and each is listed with
  what to use instead."""
  assert sorted(compat.REMOVED) == sorted(REMOVED_1_0)
  for name in sorted(os.listdir(CONFIGS)):
    if name.endswith('.py'):
      flat = config_lib.flatten(config_lib.load_config_file(os.path.join(CONFIGS, name)))
      assert not set(flat) & set(REMOVED_1_0), name


@pytest.mark.parametrize('field', REMOVED_1_0)
def test_a_config_naming_a_removed_field_stops_with_one_line_saying_so(field):
  """A config of an older version (a user's copy of default.py) that still sets a removed field: one line, naming
  the field, the version and what to use instead, before anything runs."""
  config = _tiny()
  node, *path = [config] + field.split('.')[:-1]
  for part in path:
    node = node[part]
  with config.unlocked():
    node[field.split('.')[-1]] = 0
  with pytest.raises(config_lib.ConfigError) as e:
    run_settings.resolve(config)
  message = str(e.value)
  assert message.startswith(f'{field} was removed in hdet-jax 1.0: ') and 'remove the field' in message
  assert '\n' not in message
