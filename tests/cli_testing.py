"""``python SCRIPT ARGS`` for the tests (train.py and its test wrappers), without each command paying the imports.

:func:`run` is ``subprocess.run([sys.executable, SCRIPT, *ARGS], capture_output=True, text=True, ...)``: the same
exit status, stdout and stderr. The command runs in a child forked from a server process (tests/cli_server.py) that
has imported train.py's modules once, so a bad input's check costs its own work, not ~2.4 s of importing jax. Where
the command's environment differs from the server's in a variable read at import (``JAX_*``, ``XLA_*``, ...), a
server started with that environment runs it. ``HDET_TESTS_FORK=0`` (or a platform without ``os.fork``) starts a
real subprocess for every command.
"""

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# Environment variables read while the server imports (jax's config reads JAX_*; XLA, TF and the BLAS libraries
# read theirs when they load): a command whose values differ gets a server of its own.
_AT_IMPORT = ('JAX_', 'XLA_', 'TF_', 'TPU_', 'CUDA', 'NVIDIA', 'PYTHON', 'LD_', 'OMP_', 'OPENBLAS', 'MKL_')
_servers: dict = {}


def _key(env: dict) -> tuple:
  return tuple(sorted((k, v) for k, v in env.items() if k.startswith(_AT_IMPORT)))


def _server(env: dict):
  """The server for ``env`` (started on first use), or None where it cannot fork safely."""
  key = _key(env)
  if key not in _servers:
    proc = subprocess.Popen(
      [sys.executable, os.path.join(HERE, 'cli_server.py')],
      cwd=ROOT,
      env=env,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
    )
    proc.pending = b''  # what was read of its replies past the last line taken
    ready = _reply(proc, None) or {'ready': False}
    if not ready['ready']:
      proc.kill()
      proc.wait()
      proc = None
    _servers[key] = proc
  return _servers[key]


def _reply(proc, timeout):
  """The server's next reply (a dict); None if none came within ``timeout`` seconds (None: no limit) or it ended."""
  fd = proc.stdout.fileno()
  while b'\n' not in proc.pending:
    if not select.select([fd], [], [], timeout)[0]:
      return None
    chunk = os.read(fd, 65536)
    if not chunk:
      return None
    proc.pending += chunk
  line, _, proc.pending = proc.pending.partition(b'\n')
  return json.loads(line)


@atexit.register
def _stop_servers():
  for proc in _servers.values():
    if proc is not None and proc.poll() is None:
      proc.stdin.close()
      proc.wait(timeout=30)


def run(argv, *, cwd=ROOT, env=None, timeout=120) -> subprocess.CompletedProcess:
  """``subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)``
  for a Python script ``argv[0]`` (see the module docstring); raises ``subprocess.TimeoutExpired`` past ``timeout``
  seconds, the command killed."""
  env = dict(os.environ if env is None else env)
  cmd = [sys.executable, *map(str, argv)]
  server = _server(env) if hasattr(os, 'fork') and os.environ.get('HDET_TESTS_FORK', '1') != '0' else None
  if server is None:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
  with tempfile.TemporaryDirectory(prefix='hdet-cli-') as out:
    paths = {name: os.path.join(out, name) for name in ('stdout', 'stderr')}
    request = {'argv': cmd[1:], 'cwd': os.path.abspath(str(cwd)), 'env': env, **paths}
    server.stdin.write((json.dumps(request) + '\n').encode())
    server.stdin.flush()
    pid = _reply(server, None)['pid']
    ended = _reply(server, timeout)
    if ended is None:  # past the timeout: killed, as subprocess.run kills it
      os.kill(pid, signal.SIGKILL)
      _reply(server, None)
    returncode = ended['returncode'] if ended else -signal.SIGKILL
    read = lambda name: open(paths[name], encoding='utf-8', errors='replace').read()
    stdout, stderr = read('stdout'), read('stderr')
  if ended is None:
    raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
  return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)
