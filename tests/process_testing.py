"""Shared helper of the multi-process tests: train.py as 2 processes x 4 CPU devices over jax.distributed."""

import os
import re
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def process_env(devices: int) -> dict:
  """This environment for a train.py subprocess with ``devices`` CPU devices: the device count left out of XLA_FLAGS
  (JAX_NUM_CPU_DEVICES sets it; the flag would win), XLA's other flags (the suite's, conftest.py) kept."""
  env = {k: v for k, v in os.environ.items() if k != 'JAX_NUM_CPU_DEVICES'}
  env['XLA_FLAGS'] = re.sub(r'--xla_force_host_platform_device_count=\d+', '', env.get('XLA_FLAGS', '')).strip()
  env['JAX_NUM_CPU_DEVICES'] = str(devices)
  return env


def run_pair(argv, timeout: int = 300) -> list[str]:
  """Runs ``argv(i, port)`` as processes 0 and 1 of 2 on localhost (4 CPU devices each); returns their outputs
  once both exit 0 (a process still running at the timeout is killed)."""
  port = free_port()
  env = process_env(4)
  procs = [
    subprocess.Popen(argv(i, port), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for i in range(2)
  ]
  try:
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
  return outs


def run_two_processes(
  config: str, workdir: str, extra_args=(), timeout: int = 300, train: str | None = None
) -> list[str]:
  """Runs train.py (or ``train``, e.g. tests/tuned_train.py) as processes 0 and 1 of 2 on localhost (4 CPU devices
  each); returns their outputs."""
  outs = run_pair(
    lambda i, port: [
      sys.executable,
      train or os.path.join(ROOT, 'train.py'),
      '--config',
      config,
      '--workdir',
      workdir,
      *extra_args,
      f'--coordinator_address=127.0.0.1:{port}',
      '--num_processes=2',
      f'--process_id={i}',
    ],
    timeout,
  )
  assert '(2 process(es))' in outs[0]
  return outs
