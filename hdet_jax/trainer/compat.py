"""What older configs, workdirs and records need to keep working: the fields removed in 1.0 and the values of
fields added after records were written.

- :data:`REMOVED`: a config or a workdir that names one stops with one line saying what to use instead
  (:func:`check_removed`);
- :data:`QUIET_DEFAULTS`: fields added after runs were already on disk, left out of a run's recorded training fields
  while at these values (which train exactly as those runs did), so such workdirs still resume; each is a row's
  ``legacy`` value in ``schema.FIELDS``.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from hdet_jax.trainer import schema

QUIET_DEFAULTS = schema.legacy_values()

# Fields removed in hdet-jax 1.0 (measured, not adopted: research/README.md), each with what to use instead.
REMOVED = {
  'hdet.fan': 'the learning rates fan out linearly (eq. 1, hdet.spread in [0, 1)); remove the field',
  'hdet.score_tail': "the common batch scores each replica's last iterate; remove the field",
  'hdet.score_anneal': "the common batch scores each replica's last iterate; remove the field",
  'hdet.early_sync_every': 'windows are hdet.sync_every steps, or hdet.num_syncs per run; remove the field',
  'hdet.early_sync_steps': 'windows are hdet.sync_every steps, or hdet.num_syncs per run; remove the field',
  'hdet.overshoot': "the 'fit' controller aims at the fitted best (an overshoot of 1); remove the field",
  'optim.anneal_at_step': 'the LR follows optim.schedule to the last step; remove the field',
  'optim.anneal_steps': 'the LR follows optim.schedule to the last step; remove the field',
  'bracket.anneal': "the LR bracket's last rung ranks the runs' own training losses; remove the field",
  'log_noise_scale': 'the gradient noise scale is no longer logged; remove the field',
}
REMOVED_IN = '1.0'


def removed_message(field: str) -> str:
  """One line: ``field`` (a key of :data:`REMOVED`) was removed in 1.0, and what to use instead."""
  return f'{field} was removed in hdet-jax {REMOVED_IN}: {REMOVED[field]} (CHANGELOG.md, 1.0.0).'


def first_removed(flat: Iterable[str]) -> str | None:
  """The first field of :data:`REMOVED` among ``flat``'s (dotted) fields, or None."""
  return next((field for field in REMOVED if field in flat), None)


def quiet(fields: Mapping[str, Any]) -> dict[str, Any]:
  """``fields`` less those at their :data:`QUIET_DEFAULTS` value (a run at it trains as records without it did)."""
  return {k: v for k, v in fields.items() if k not in QUIET_DEFAULTS or v != QUIET_DEFAULTS[k]}
