"""Process-level setup: XLA's deterministic GPU ops."""

import importlib.metadata
import os
import re
import sys

from hdet_jax.trainer import process, schema

from trainer_testing import tiny


def _cuda_plugin_distributions() -> list[str]:
  """The installed distributions of jax's CUDA plugins (jax-cuda12-plugin, jax-cuda13-pjrt, ...), read from their
  metadata: an oracle independent of the module look-up cuda_installed makes."""
  names = {(d.metadata['Name'] or '').lower().replace('_', '-') for d in importlib.metadata.distributions()}
  return sorted(n for n in names if re.fullmatch(r'jax-cuda\d+-(plugin|pjrt)', n))


def test_cuda_installed_says_whether_a_cuda_plugin_of_jax_is_installed(tmp_path, monkeypatch):
  # This machine's answer, whether it has a CUDA plugin (a GPU machine) or not (a CPU one): what pip installed.
  assert process.cuda_installed() == bool(_cuda_plugin_distributions()), _cuda_plugin_distributions()
  # A plugin's module on the path is found (without importing it, which would start loading CUDA).
  (tmp_path / 'jax_cuda13_plugin').mkdir()
  (tmp_path / 'jax_cuda13_plugin' / '__init__.py').write_text('raise ImportError("not to be imported")\n')
  monkeypatch.syspath_prepend(str(tmp_path))
  assert process.cuda_installed()
  assert 'jax_cuda13_plugin' not in sys.modules


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
  # ... and not with deterministic_gpu=False ...
  monkeypatch.setenv('XLA_FLAGS', '')
  process.setup_jax(tiny(deterministic_gpu=False))
  assert os.environ['XLA_FLAGS'] == ''
  monkeypatch.undo()
  # ... and, unfaked, as this machine's install says: with a CUDA plugin of jax (a GPU machine), without one (a CPU).
  monkeypatch.setenv('XLA_FLAGS', '')
  process.setup_jax(tiny())
  assert os.environ['XLA_FLAGS'] == (flag if _cuda_plugin_distributions() else '')
  # A resumed run may change it (it steers rounding on GPUs only): not a training field.
  assert 'deterministic_gpu' in schema.LOOP_FIELDS
