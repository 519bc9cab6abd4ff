"""Loading configs: a config file's ``get_config()``, configs built on a sibling file, overrides, flattening.

What a field means, its default, type and range are its line in ``fields.py`` (the typed config); a config is
checked and resolved into each part's settings by ``run_settings.resolve``, the last function that takes the
ConfigDict.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import traceback
from typing import Any

import ml_collections


class ConfigError(ValueError):
  """A bad config, corpus, workdir or device setup, found before training; one clear line."""


def load_config_file(path: str, *args: str) -> ml_collections.ConfigDict:
  """``get_config(*args)`` of a config file: train.py's ``--config`` (``FILE:ARG`` passes ARG), tests, and configs
  that build on another (:func:`sibling`).

  A file that gives no ConfigDict raises ConfigError naming it and the fix, never the Python error itself: no such
  file, a directory, not Python (a syntax error, a binary file), an error running it (an import that fails), no
  ``get_config``, a ``get_config`` that raises or returns something else.
  """
  where = f'--config {path}'
  example = 'e.g. --config configs/default.py'
  if not path:
    raise ConfigError(f'--config is empty; pass a config file ({example}).')
  if os.path.isdir(path):
    raise ConfigError(f'{where} is a directory; pass a config file ({example}).')
  if not os.path.exists(path):
    raise ConfigError(f'{where}: no such file; pass a config file ({example}).')
  name = 'hdet_config_' + os.path.splitext(os.path.basename(path))[0]
  loader = importlib.machinery.SourceFileLoader(name, path)  # any file name, as ml_collections' config_flags reads it
  try:
    code = loader.source_to_code(loader.get_data(path), path)
  except OSError as e:
    raise ConfigError(f'{where} cannot be read ({e.strerror or e}); check its permissions.') from None
  except (SyntaxError, ValueError) as e:
    line = f' at line {e.lineno}' if getattr(e, 'lineno', None) else ''
    raise ConfigError(
      f'{where} is not Python source ({_one_line(getattr(e, "msg", None) or e)}{line}); fix the file '
      f'(a config file defines get_config(), as configs/default.py does).'
    ) from None
  module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
  try:
    exec(code, module.__dict__)
  except ConfigError:
    raise  # a config it builds on (sibling) already names that file and the fix
  except Exception as e:  # anything the file runs: a failing import, a NameError, ...
    fix = 'install the package or fix the import' if isinstance(e, ImportError) else 'fix the file'
    raise ConfigError(f'{where}: running it raised {_raised(e, path)}; {fix}.') from None
  get_config = getattr(module, 'get_config', None)
  if not callable(get_config):
    raise ConfigError(
      f'{where} defines no get_config(); a config file defines get_config() returning an '
      'ml_collections.ConfigDict (as configs/default.py does).'
    )
  try:
    config = get_config(*args)
  except ConfigError:
    raise
  except Exception as e:
    raise ConfigError(
      f'{where}: get_config({", ".join(map(repr, args))}) raised {_raised(e, path)}; fix the file.'
    ) from None
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(
      f'{where}: get_config() returned {type(config).__name__} {_one_line(repr(config))[:60]}, not an '
      'ml_collections.ConfigDict; return one (as configs/default.py does).'
    )
  return config


def _one_line(text: Any) -> str:
  return ' '.join(str(text).split())


def _raised(e: Exception, path: str) -> str:
  """'KeyError: 'x' (line 7)': an exception with the last line of ``path`` it passed through."""
  lines = [
    f.lineno for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename) == os.path.abspath(path)
  ]
  detail = _one_line(e)
  return f'{type(e).__name__}{": " + detail if detail else ""}' + (f' (line {lines[-1]})' if lines else '')


def sibling(file: str, name: str) -> ml_collections.ConfigDict:
  """``get_config()`` of ``name.py`` next to ``file`` (e.g. an ablation building on default.py)."""
  return load_config_file(os.path.join(os.path.dirname(os.path.abspath(file)), name + '.py'))


def with_overrides(config: ml_collections.ConfigDict, overrides: dict[str, Any]) -> ml_collections.ConfigDict:
  """Sets dotted fields in place, as ``--config.a.b=v`` would: ``{'hdet.spread': 0.2}``; returns config."""
  for key, value in overrides.items():
    node = config
    *path, last = key.split('.')
    for part in path:
      node = node[part]
    node[last] = value
  return config


def flatten(config: Any, prefix: str = '') -> dict[str, Any]:
  d = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else config
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(flatten(v, f'{prefix}{k}.'))
    else:
      out[f'{prefix}{k}'] = v
  return out


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
  """:func:`flatten` undone: ``{'a.b': 1}`` -> ``{'a': {'b': 1}}``, in the same order."""
  out: dict[str, Any] = {}
  for key, value in flat.items():
    *path, last = key.split('.')
    node = out
    for part in path:
      node = node.setdefault(part, {})
    node[last] = value
  return out


def missing_fields(config: Any, reference: Any) -> list[str]:
  """The trainer's fields (all but the task's own ``data.*`` and ``model.*``) that ``reference`` (configs/default.py's
  config) has and ``config`` lacks: a config not built on the default one."""

  def keys(c, prefix=''):
    out = set()
    for k, v in c.items():
      out |= keys(v, f'{prefix}{k}.') if isinstance(v, ml_collections.ConfigDict) else {prefix + k}
    return out

  return sorted(k for k in keys(reference) - keys(config) if not k.startswith(('data.', 'model.')))
