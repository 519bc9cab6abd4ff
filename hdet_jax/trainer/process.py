"""Process-level setup and helpers shared by the trainer, the LR bracket, research and benchmarks.

:func:`setup_jax` (before any other JAX call: devices, ``jax.distributed``, the compilation cache, XLA's
deterministic GPU ops), the stop signals a run checks (:class:`StopSignals`, :func:`any_process`), the machine a
run ran on (:func:`machine`, recorded in summaries and research records), atomic JSON writes and returning the
compiler's freed memory to the operating system.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import signal
import threading
from typing import Any

import jax
import numpy as np

from hdet_jax.trainer import config_lib
from hdet_jax.trainer import schema

# XLA's GPU kernels that use atomics (scatter-adds, some reductions) sum in a varying order, so a seed's run ends
# apart run to run; with this flag it repeats bit for bit (results/benchmarks_gpu.md, 'Determinism on the GPU').
DETERMINISTIC_GPU_FLAG = '--xla_gpu_deterministic_ops=true'
_CUDA_PLUGINS = ('jax_cuda13_plugin', 'jax_cuda12_plugin', 'jax_plugins.xla_cuda13', 'jax_plugins.xla_cuda12')


def deterministic_xla_flags(flags: str, gpu: bool) -> str:
  """``flags`` (XLA_FLAGS) with XLA's deterministic GPU ops on: unchanged without a GPU, or where they already set it.

  Example:
    >>> deterministic_xla_flags('--xla_dump_to=dumps', gpu=True)
    '--xla_dump_to=dumps --xla_gpu_deterministic_ops=true'
  """
  if not gpu or 'xla_gpu_deterministic_ops' in flags:
    return flags
  return f'{flags} {DETERMINISTIC_GPU_FLAG}'.strip()


def cuda_installed() -> bool:
  """Whether a CUDA plugin of jax is installed (read before the backend starts, as XLA_FLAGS must be set then)."""

  def found(name):
    try:
      return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # 'jax_plugins' itself absent
      return False

  return any(found(name) for name in _CUDA_PLUGINS)


def setup_jax(
  config: Any,
  *,
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  heartbeat_timeout_s: int = 20,
) -> None:
  """Process-level JAX setup; call before any other JAX call (train.py does).

  Starts ``jax.distributed`` when a coordinator is given, or under a SLURM job step with
  several tasks (JAX reads the rest from SLURM's environment); sets the number of simulated CPU
  devices (``config.num_cpu_devices`` split over the processes, unless JAX_NUM_CPU_DEVICES or
  XLA_FLAGS already say); turns on the persistent compilation cache; on a CUDA install, XLA's
  deterministic GPU ops (``config.deterministic_gpu``), so a seed gives the same numbers run to run.
  """
  f = schema.complete(config_lib.flatten(config))  # (before resolve: JAX must be set up before it starts)
  if f['deterministic_gpu']:
    os.environ['XLA_FLAGS'] = deterministic_xla_flags(os.environ.get('XLA_FLAGS', ''), cuda_installed())
  slurm = int(os.environ.get('SLURM_NTASKS', '1') or 1) > 1 and 'SLURM_JOB_ID' in os.environ
  procs = num_processes or (int(os.environ['SLURM_NTASKS']) if slurm else 1)
  if (
    'JAX_NUM_CPU_DEVICES' not in os.environ
    and 'xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', '')
    and f['num_cpu_devices'] > 0
  ):
    try:
      jax.config.update('jax_num_cpu_devices', max(1, f['num_cpu_devices'] // procs))
    except RuntimeError:
      pass  # the backend is already up (e.g. in a test); keep its device count.
  if coordinator_address:
    jax.distributed.initialize(
      coordinator_address=coordinator_address,
      num_processes=num_processes,
      process_id=process_id,
      heartbeat_timeout_seconds=heartbeat_timeout_s,
    )
  elif slurm:
    jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout_s)
  if f['compilation_cache']:
    jax.config.update('jax_compilation_cache_dir', os.path.expanduser(f['compilation_cache']))
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)


class StopSignals:
  """SIGTERM / SIGINT set a flag that the training loop checks; a second signal acts as usual.

  Installed only from the main thread (signal handlers cannot be set elsewhere), and undone on exit.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.received: str | None = None
    self._old = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in self.SIGNALS:
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    self.received = signal.Signals(signum).name
    # The next one of this signal does what it would have done without us: end the process now.
    signal.signal(signum, self._old.get(signum, signal.SIG_DFL))

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)
    return False


def any_process(flag: bool) -> bool:
  """True on every process iff ``flag`` on some process (a no-op with one process)."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils

  return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


def machine() -> dict:
  """Where a run ran, recorded in its summary (and by the research studies in each record): the CPU model, the first
  device's platform and kind, jax's and jaxlib's versions and XLA_FLAGS (less any path).

  XLA rounds differently by CPU model and by version, so the same config and seed can end apart on two machines
  (results/autolr.md, 'How far apart two runs of one controller land'). So runs are compared bit for bit only
  where this matches.
  """
  import jaxlib

  device = jax.devices()[0]
  return {
    'cpu': cpu_model(),
    'platform': device.platform,
    'device_kind': device.device_kind,
    'jax': jax.__version__,
    'jaxlib': jaxlib.__version__,
    'xla_flags': _xla_flags_without_paths(),
  }


def _xla_flags_without_paths() -> str:
  """XLA_FLAGS less the flags that name a path (``--xla_dump_to=...``): records are committed, and a path is this
  machine's, not a setting that changes the numbers."""
  return ' '.join(flag for flag in os.environ.get('XLA_FLAGS', '').split() if os.sep not in flag)


def cpu_model(cpuinfo: str = '/proc/cpuinfo') -> str:
  """The CPU's model name: the first ``model name`` of ``cpuinfo`` (Linux), else ``platform.processor()`` or
  ``platform.machine()``."""
  import platform

  try:
    with open(cpuinfo, encoding='utf-8', errors='replace') as f:
      for line in f:
        key, _, value = line.partition(':')
        if key.strip() == 'model name' and value.strip():
          return value.strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def write_json_atomic(path: str, obj: Any, **kwargs) -> None:
  """Writes ``path`` via a temporary file and a rename: a kill leaves the old file or the new one."""
  tmp = f'{path}.tmp-{os.getpid()}'
  with open(tmp, 'w', encoding='utf-8') as f:
    json.dump(obj, f, **kwargs)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def release_host_memory() -> None:
  """Returns the memory the compiler freed to the operating system (glibc only; else nothing).

  glibc keeps freed heap memory for reuse, so after compiling the process holds memory the compiler
  no longer uses (on CPU the devices' buffers live on the same heap; results/benchmarks.md, '2. Peak memory').
  """
  try:
    ctypes.CDLL('libc.so.6').malloc_trim(0)
  except (OSError, AttributeError):
    pass
