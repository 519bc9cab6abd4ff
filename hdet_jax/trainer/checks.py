"""Everything that can be wrong before a run writes anything: the config's fields and rules (``run_settings.resolve``),
then the task's data, the devices, the workdir and ``init_from`` (:func:`check_run`); each reported as one
:class:`ConfigError` line. Reads, never writes.

``train_and_evaluate`` runs them first; :func:`check` runs them alone, for callers that write first (the LR bracket).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax

from hdet_jax.trainer import checkpoints
from hdet_jax.trainer import compat
from hdet_jax.trainer import config_lib
from hdet_jax.trainer import mesh as mesh_lib
from hdet_jax.trainer import optimizer as optimizer_lib
from hdet_jax.trainer import run_settings
from hdet_jax.trainer import schema
from hdet_jax.trainer import tasks as tasks_lib
from hdet_jax.trainer.config_lib import ConfigError
from hdet_jax.trainer.setup import Run


def check(
  config: Any, workdir: str, *, optimizer: optimizer_lib.Base | None = None, tuning: dict | None = None
) -> None:
  """Every check ``train_and_evaluate`` makes before it writes anything (the config, the task's data, the devices,
  the workdir, init_from); raises ConfigError, writes nothing. For callers that write first (the LR bracket)."""
  check_output_paths(config, workdir)
  check_run(run_settings.resolve(config, optimizer, tuning), os.path.abspath(os.path.expanduser(workdir)))


def check_run(settings: run_settings.RunSettings, workdir: str) -> Run:
  """Every check of the task's data, devices, workdir and init_from (the config's are ``run_settings.resolve``'s);
  reads, never writes. Returns the run's first fields: what the checks found (the records and programs come in
  ``setup``)."""
  task, task_settings = settings.task, settings.task_settings
  run_settings.check_controller_acts(schema.complete(settings.given, task.name))
  n, devices = _resolve_replicas(settings)
  try:
    data = task.load(task_settings, n, settings.seed)
  except tasks_lib.TaskError as e:
    raise ConfigError(str(e)) from None
  try:
    tx = optimizer_lib.make_optimizer(settings.optimizer, n, seed=settings.seed, rollback=settings.guard.rollback)
  except ValueError as e:
    raise ConfigError(f'config: {e}') from None
  fields = settings.training_fields(n)
  resume = check_workdir(workdir, fields)
  graphdef, abstract_params = task.abstract_model(task_settings)
  init_src = _check_init_from(settings.init_from, abstract_params) if not resume else None
  # Every process has read the workdir before process 0 creates checkpoints/ in it: a process that got
  # here late would otherwise see that directory, open it, and run orbax's collectives out of step.
  mesh_lib.barrier('hdet_workdir_checked')
  return Run(
    settings=settings,
    workdir=workdir,
    n=n,
    devices=devices,
    data=data,
    tx=tx,
    fields=fields,
    resume=resume,
    graphdef=graphdef,
    abstract_params=abstract_params,
    init_src=init_src,
    tokens_per_step=n * settings.mesh.batch_size * task.predictions_per_example(task_settings),
  )


def _resolve_replicas(settings: run_settings.RunSettings) -> tuple[int, int]:
  """(N, D): the replicas (device groups of ``mesh.fsdp`` x ``mesh.tensor`` devices each on a grouped mesh)
  and the devices of the replica axis (N / D replicas on each; one per group on a grouped mesh)."""
  m, visible = settings.mesh, jax.device_count()
  if m.fsdp * m.tensor > 1:
    n = _resolve_groups(settings, visible)
    return n, n
  wanted = m.devices
  if wanted > visible:
    raise ConfigError(
      f'mesh.devices={wanted} but only {visible} devices are visible; set --config.mesh.devices=0 '
      f'(all of them) or run on {wanted} devices (on CPU: JAX_NUM_CPU_DEVICES={wanted}).'
    )
  n = m.num_replicas or wanted or visible
  devices = wanted or min(n, visible)
  if jax.process_count() > 1 and devices != visible:
    raise ConfigError(
      f'hdet.num_replicas={n} on mesh.devices={devices} but {jax.process_count()} processes hold {visible} devices; '
      f'with several processes every device trains replicas: set --config.mesh.devices=0 and hdet.num_replicas '
      f'to a multiple of {visible}.'
    )
  if n % devices:
    lower = max(d for d in range(1, devices + 1) if n % d == 0)
    raise ConfigError(
      f'hdet.num_replicas={n} is not a multiple of the {devices} devices it would run on: set '
      f'--config.hdet.num_replicas to a multiple of {devices} (e.g. {(n // devices + 1) * devices}) or '
      f'--config.mesh.devices to a divisor of {n} (e.g. {lower}).'
    )
  return n, devices


def _resolve_groups(settings: run_settings.RunSettings, devices: int) -> int:
  """N on a grouped mesh: ``mesh.replicas`` (0: every device in some group), checked against the devices."""
  m = settings.mesh
  fsdp, tensor, size = m.fsdp, m.tensor, m.fsdp * m.tensor
  # One replica per group: mesh.replicas groups, or as many as the devices hold (at most hdet.num_replicas).
  n = m.replicas or min(m.num_replicas or devices, devices // size) or 1
  shape = f'mesh.replicas={n} x mesh.fsdp={fsdp}' + (f' x mesh.tensor={tensor}' if tensor > 1 else '')
  if n * size > devices or (jax.process_count() > 1 and n * size != devices):
    raise ConfigError(
      f'{shape} needs {n * size} devices, {devices} are visible'
      f'{" (with several processes it must use them all)" if jax.process_count() > 1 else ""}: '
      f'set mesh.replicas=0 (all devices) or run on {n * size} devices (on CPU: JAX_NUM_CPU_DEVICES).'
    )
  if m.num_replicas not in (0, n, schema.BY_NAME['hdet.num_replicas'].default):  # (the default: as many as fit)
    raise ConfigError(
      f'hdet.num_replicas={m.num_replicas} but {shape} trains {n} replicas (one per group of {size} devices; '
      f'hdet.num_replicas only caps the groups): set --config.mesh.replicas to the groups you want and '
      f'hdet.num_replicas=0, or run on {m.num_replicas * size} devices.'
    )
  if m.batch_size % fsdp:
    raise ConfigError(
      f'data.batch_size={m.batch_size} (windows per replica group) must be divisible by '
      f"mesh.fsdp={fsdp}, which splits them over the group's devices."
    )
  try:
    settings.task.check_tensor_parallel(settings.task_settings, tensor)
  except ValueError as e:
    raise ConfigError(f'mesh.tensor={tensor}: {e}') from None
  return n


# What marks a folder as a project's (its sources, its build files): a run writes nothing into one.
_PROJECT_MARKERS = ('pyproject.toml', 'setup.py', 'setup.cfg', '.git', 'train.py', 'hdet_jax')
_SOURCE_SUFFIXES = ('.py', '.toml', '.cfg', '.md', '.rst', '.ipynb')
_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))  # (above hdet_jax/)


def output_path_error(path: str, what: str, example: str = 'workdirs/NAME') -> str | None:
  """Why ``path`` (where ``what``, a flag or field, writes) must not be written into, or None: it resolves to the
  current folder, to a folder above it or above this project, or to a folder that holds a project's files
  (pyproject.toml, .git, train.py, hdet_jax/, sources such as .py or .md files), where a run's files would land
  among them."""
  full = os.path.realpath(os.path.abspath(os.path.expanduser(path)))
  fix = f'pass a folder of its own, e.g. {what}={example} (nothing was written)'
  cwd = os.path.realpath(os.getcwd())
  if full == cwd:
    return f"{what} {path!r} is the current folder ({full}): the run's files would land among the files there; {fix}."
  for inner, name in ((cwd, 'the current folder'), (_PROJECT_ROOT, "this project's folder")):
    if inner.startswith(full.rstrip(os.sep) + os.sep):
      return f"{what} {path!r} ({full}) holds {name} ({inner}): the run's files would land beside it; {fix}."
  if not os.path.isdir(full):
    return None
  try:
    names = sorted(os.listdir(full))
  except OSError:
    return None
  found = [n for n in names if n in _PROJECT_MARKERS] or [n for n in names if n.endswith(_SOURCE_SUFFIXES)]
  if found:
    held = ', '.join(found[:3])
    return f"{what} {path!r} ({full}) holds a project's files ({held}): the run's files would land among them; {fix}."
  return None


def check_output_paths(config: Any, workdir: str) -> None:
  """The folders a run writes into, refused (one ConfigError line naming the flag or field) where they resolve to
  the current folder or to a project's folder (:func:`output_path_error`): ``--workdir``, and ``compilation_cache``
  (JAX's persistent cache). Nothing is read or written; train.py calls it before JAX is set up."""
  error = output_path_error(workdir, '--workdir')
  cache = dict(config_lib.flatten(config)).get('compilation_cache') or ''
  if not error and cache:
    error = output_path_error(cache, '--config.compilation_cache', schema.BY_NAME['compilation_cache'].default)
  if error:
    raise ConfigError(error)


def check_workdir(workdir: str, fields: dict) -> bool:
  """Whether the workdir holds checkpoints to resume from; raises if it holds another config's run.

  The config is compared with the newest checkpoint whose meta record reads back (a corrupt newer
  one is set aside when the state is restored).
  """
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError(f'--workdir {workdir} exists and is not a directory; pick another --workdir.')
  step, meta, _ = checkpoints.latest_readable_meta(workdir)
  saved, what = None, None
  if meta is not None:
    saved, what = meta['config'], f'a checkpoint (step {step})'
    fmt = meta.get('state_format', 1)
    if fmt != checkpoints.STATE_FORMAT:
      raise ConfigError(
        f'workdir {workdir} holds checkpoints of state format {fmt} (step {step}), written by another version '
        f'of hdet-jax whose saved state has other fields; this version reads format {checkpoints.STATE_FORMAT}. '
        'Pass a new --workdir (nothing in this one was changed), or resume it with the version that wrote it.'
      )
  elif os.path.exists(os.path.join(workdir, 'config.json')):
    try:
      with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
        saved, what = json.load(f).get('training_fields'), 'a run'
    except (OSError, ValueError, AttributeError):
      saved = None  # unreadable (cut short by a kill in an older version): the checkpoints decide
  if saved is not None:  # (a version before bracket.* left a run's identity wrote them where not at their defaults)
    saved = schema.run_identity(saved)
    gone = [k for k in saved if k in compat.REMOVED]
    if gone:
      raise ConfigError(
        f'workdir {workdir} holds {what} that set {gone[0]}={saved[gone[0]]!r}: '
        f'{compat.removed_message(gone[0])} Resume it with the version that wrote it, or pass a '
        'new --workdir (nothing in this one was changed).'
      )
  if saved is not None and saved != fields:
    raise ConfigError(
      f'workdir {workdir} holds {what} of a different config ({schema.differences(saved, fields)}); '
      'rerun with the same config to resume it, or pass a new --workdir.'
    )
  return bool(checkpoints.all_steps(workdir))


def _check_init_from(init_from: str | None, abstract_params: Any) -> str | None:
  if not init_from:
    return None
  src = os.path.abspath(os.path.expanduser(init_from))
  step = checkpoints.latest_step(src) if os.path.isdir(src) else None
  if step is None:
    raise ConfigError(
      f'init_from={init_from!r} holds no checkpoint; point --config.init_from at the workdir of an '
      'earlier run (e.g. run `python train.py --workdir workdirs/default` first), or unset it for a random init.'
    )
  try:
    meta = checkpoints.read_meta(src, step)
  except checkpoints.CorruptCheckpoint as e:
    raise ConfigError(f'init_from={init_from!r}: its latest checkpoint is corrupt ({e}).') from None
  want = jax.tree.map(lambda s: list(s.shape), abstract_params)
  if meta.get('param_shapes') != json.loads(json.dumps(want)):
    raise ConfigError(
      f'init_from={init_from!r} (step {step}) holds a model of another shape than model.* and '
      'data.seq_len describe; use the same model settings as that run or another init_from.'
    )
  return src
