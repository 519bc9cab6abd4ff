"""train.py with the tests' tuning in Python: ``python tests/tuned_train.py [--tuning.NAME=VALUE ...] ARGS``.

configs/tiny.py's controller tuning left the config after 1.0 (issue 75); the tests keep the scenarios they were built
on (:data:`trainer_testing.TINY_TUNING`) by giving it in Python, in process (``trainer_testing.tiny``) and, through
this wrapper, to the train.py subprocesses they compare with. Everything else is train.py's own ``main``, as
``tests/fault_testing.py`` runs it.
"""

import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(os.path.dirname(HERE), 'train.py')


def install(tuning):
  """Every ``train_and_evaluate`` and LR bracket train.py starts gets ``tuning`` (what the call gives wins)."""
  import hdet_jax.trainer as trainer
  from hdet_jax.trainer import bracket

  train, run_bracket = trainer.train_and_evaluate, bracket.run_bracket

  def tuned_train(config, workdir, **kwargs):
    return train(config, workdir, **{**kwargs, 'tuning': {**tuning, **(kwargs.get('tuning') or {})}})

  def tuned_bracket(config, workdir, **kwargs):
    return run_bracket(config, workdir, **{**kwargs, 'tuning': {**tuning, **(kwargs.get('tuning') or {})}})

  trainer.train_and_evaluate, bracket.run_bracket = tuned_train, tuned_bracket


if __name__ == '__main__':
  sys.path.insert(0, HERE)
  import trainer_testing

  import json

  given = [a for a in sys.argv[1:] if a.startswith('--tuning.')]  # (a value as JSON, else as text)
  more = {}
  for arg in given:
    name, _, value = arg[len('--tuning.') :].partition('=')
    try:
      more[name] = json.loads(value)
    except json.JSONDecodeError:
      more[name] = value
  install({**trainer_testing.TINY_TUNING, **more})
  sys.argv = [TRAIN] + [a for a in sys.argv[1:] if a not in given]
  runpy.run_path(TRAIN, run_name='__main__')
