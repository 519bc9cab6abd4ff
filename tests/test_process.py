"""Process-level setup: XLA's deterministic GPU ops."""

import os

from hdet_jax.trainer import process, schema

from trainer_testing import tiny


def test_gpu_runs_get_xla_deterministic_ops_unless_told_otherwise(monkeypatch):
  flag = '--xla_gpu_deterministic_ops=true'
  # The pure rule: only with a GPU, appended to what is there, never over the user's own setting.
  assert process.deterministic_xla_flags('', gpu=False) == ''
  assert process.deterministic_xla_flags('', gpu=True) == flag
  assert process.deterministic_xla_flags('--xla_dump_to=d', gpu=True) == f'--xla_dump_to=d {flag}'
  assert process.deterministic_xla_flags('--xla_gpu_deterministic_ops=false', gpu=True) == (
    '--xla_gpu_deterministic_ops=false'
  )
  # setup_jax applies it on a CUDA install (faked here), before the backend reads XLA_FLAGS ...
  monkeypatch.setattr(process, 'cuda_installed', lambda: True)
  monkeypatch.setenv('XLA_FLAGS', '--xla_dump_to=d')
  process.setup_jax(tiny())
  assert os.environ['XLA_FLAGS'] == f'--xla_dump_to=d {flag}'
  # ... and not with deterministic_gpu=False, or without CUDA (this CPU machine's own answer).
  monkeypatch.setenv('XLA_FLAGS', '')
  process.setup_jax(tiny(deterministic_gpu=False))
  assert os.environ['XLA_FLAGS'] == ''
  monkeypatch.undo()
  assert not process.cuda_installed()
  # A resumed run may change it (it steers rounding on GPUs only): not a training field.
  assert 'deterministic_gpu' in schema.RUN_FIELDS
