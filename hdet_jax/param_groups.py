"""Parameter groups: each parameter belongs to the one group whose regex matches its path.

Paths read like ``'blocks/0/attn/kernel'`` (see :func:`path_string`), as in big_vision and nanodo.
``hdet(..., param_groups={group: regex})`` gives each group its own base learning rate.
"""

from __future__ import annotations

import re
from typing import Any

import jax


def path_string(path) -> str:
  """'a/b/0/kernel' for a pytree key path (dict keys, attributes, sequence indices)."""
  parts = []
  for k in path:
    for attr in ('key', 'name', 'idx'):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return '/'.join(parts)


def group_labels(params: Any, groups: dict[str, str]) -> Any:
  """Labels every leaf with the one group whose regex matches its path (``re.search``).

  Raises a ValueError naming the problem when a leaf matches no group or several, or when a
  group matches no leaf.

  Example:
    >>> import jax.numpy as jnp
    >>> from hdet_jax.param_groups import group_labels
    >>> params = {'emb': {'w': jnp.ones((10, 4))}, 'head': {'w': jnp.ones((4, 2))}}
    >>> group_labels(params, {'embed': '^emb', 'rest': '^head'})
    {'emb': {'w': 'embed'}, 'head': {'w': 'rest'}}
  """
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  paths = [path_string(p) for p, _ in leaves]
  labels, used = [], set()
  for path in paths:
    hits = [g for g, pattern in groups.items() if re.search(pattern, path)]
    if len(hits) != 1:
      what = 'no group' if not hits else f'several groups {hits}'
      raise ValueError(
        f'param_groups: parameter {path!r} matches {what}; make the regexes '
        f'{dict(groups)} match each parameter exactly once.'
      )
    labels.append(hits[0])
    used.add(hits[0])
  unused = [g for g in groups if g not in used]
  if unused:
    raise ValueError(f'param_groups: {unused} match no parameter (paths look like {paths[:3]}); fix or drop them.')
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), labels)
