"""``python SCRIPT ARGS`` for the tests (train.py and its test wrappers), without each command paying the imports.

:func:`run` is ``subprocess.run([sys.executable, SCRIPT, *ARGS], capture_output=True, text=True, ...)``: the same
exit status, stdout and stderr. The command runs in a child forked from a server process (tests/cli_server.py) that
has imported train.py's modules once, so a bad input's check costs its own work, not ~2.4 s of importing jax. Where
the command's environment differs from the server's in a variable read at import (``JAX_*``, ``XLA_*``, ...), a
server started with that environment runs it. ``HDET_TESTS_FORK=0`` (or a platform without ``os.fork``) starts a
real subprocess for every command. :func:`start` is the same for ``subprocess.Popen``: a command that runs while the
test watches it, signals it (SIGTERM, SIGKILL: the forked child is a real process) and waits for its status.
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
_started: dict = {}  # key -> the last command started by start() on that server (it runs one command at a time)


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
  for started in _started.values():  # (a test that failed before its command ended: the server waits for it)
    if started._server.poll() is None and started.poll() is None:
      started.kill()
      started.wait()
  for proc in _servers.values():
    if proc is not None and proc.poll() is None:
      proc.stdin.close()
      proc.wait(timeout=30)


def _forking_server(env: dict):
  """The server for ``env`` once the command it last started has ended, or None: real subprocesses instead."""
  if not hasattr(os, 'fork') or os.environ.get('HDET_TESTS_FORK', '1') == '0':
    return None
  server = _server(env)
  started = _started.pop(_key(env), None)
  if started is not None:
    started.wait()  # its reply comes first; the server takes the next command only then
  return server


def _send(server, argv, cwd, env, stdout, stderr, append=False) -> int:
  """Sends the server a command; its child's pid."""
  request = {'argv': argv, 'cwd': os.path.abspath(str(cwd)), 'env': env, 'stdout': stdout, 'stderr': stderr}
  server.stdin.write((json.dumps({**request, 'append': append}) + '\n').encode())
  server.stdin.flush()
  return _reply(server, None)['pid']


class Started:
  """A command :func:`start` started in a forked child: ``subprocess.Popen``'s ``args``, ``pid``, ``returncode``,
  ``poll``, ``wait``, ``send_signal``, ``terminate`` and ``kill`` (its status: the reply of the server, which reaps
  it)."""

  def __init__(self, server, args, pid):
    self._server, self.args, self.pid, self.returncode = server, args, pid, None

  def _ended(self, timeout):
    if self.returncode is None:
      reply = _reply(self._server, timeout)
      if reply is not None:
        self.returncode = reply['returncode']
      elif self._server.poll() is not None:
        raise RuntimeError(f'the cli_server running {self.args} ended')
    return self.returncode

  def poll(self):
    return self._ended(0)

  def wait(self, timeout=None):
    if self._ended(timeout) is None:
      raise subprocess.TimeoutExpired(self.args, timeout)
    return self.returncode

  def send_signal(self, sig):
    if self.poll() is None:  # (as Popen: never a signal to a pid the child no longer holds)
      os.kill(self.pid, sig)

  def terminate(self):
    self.send_signal(signal.SIGTERM)

  def kill(self):
    self.send_signal(signal.SIGKILL)


def start(argv, *, stdout, stderr=None, append=False, cwd=ROOT, env=None):
  """``subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, ...)`` for a Python script ``argv[0]``, its stdout
  written to the file ``stdout`` and its stderr to the file ``stderr`` (None: into ``stdout``, as
  ``stderr=subprocess.STDOUT``), appended to them if ``append``, else truncating them: a :class:`Started` (or, where
  :func:`run` starts real subprocesses, the ``subprocess.Popen``)."""
  env = dict(os.environ if env is None else env)
  cmd = [sys.executable, *map(str, argv)]
  stdout, stderr = str(stdout), None if stderr is None else str(stderr)
  server = _forking_server(env)
  if server is None:
    mode = 'a' if append else 'w'
    with open(stdout, mode) as out:
      if stderr is None:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
      with open(stderr, mode) as err:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err)
  started = Started(server, cmd, _send(server, cmd[1:], cwd, env, stdout, stderr, append))
  _started[_key(env)] = started
  return started


def run(argv, *, cwd=ROOT, env=None, timeout=120) -> subprocess.CompletedProcess:
  """``subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)``
  for a Python script ``argv[0]`` (see the module docstring); raises ``subprocess.TimeoutExpired`` past ``timeout``
  seconds, the command killed."""
  env = dict(os.environ if env is None else env)
  cmd = [sys.executable, *map(str, argv)]
  server = _forking_server(env)
  if server is None:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
  with tempfile.TemporaryDirectory(prefix='hdet-cli-') as out:
    paths = {name: os.path.join(out, name) for name in ('stdout', 'stderr')}
    pid = _send(server, cmd[1:], cwd, env, paths['stdout'], paths['stderr'])
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
