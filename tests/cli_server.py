"""The server behind :func:`cli_testing.run`: imports what ``python train.py`` imports, once, then forks a child for
each command it is sent, which runs the script as ``python SCRIPT ARGS`` would (``runpy``, ``__main__``), with the
command's folder, environment and output files, and exits with the script's status.

A train.py subprocess spends most of a bad input's ~2.8 s importing jax, flax, optax and orbax (ml_dtypes alone about
0.8 s); the suite starts dozens. The child of a fork has those modules already, and nothing else of this process: no
JAX backend has started here (checked before every fork), so the child's JAX starts as a fresh process's does.

Protocol (one JSON object per line): the client writes ``{"argv", "cwd", "env", "stdout", "stderr"}`` (the output
files' paths; ``"stderr": null`` sends stderr into stdout; with ``"append": true`` they are appended to, else
truncated); the server answers ``{"pid": PID}`` once the child runs and ``{"returncode": CODE}`` when it has ended
(negative: killed by that signal, as :mod:`subprocess` reports it). Its first line is ``{"ready": true}``, or
``{"ready": false, "why": ...}`` when it cannot fork safely (the client then starts real subprocesses).
"""

import json
import os
import sys

_PROTOCOL = os.fdopen(os.dup(1), 'w', buffering=1)  # the replies; fd 1 itself goes to stderr (an import's print)
os.dup2(2, 1)
_PATH = list(sys.path)


def _preload() -> str | None:
  """Imports train.py's modules (and the tests' wrappers of it); why forking is unsafe, or None."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/: trainer_testing (tests/tuned_train.py)
  from absl import app, flags, logging  # noqa: F401
  from ml_collections import config_flags  # noqa: F401

  import hdet_jax  # noqa: F401
  import hdet_jax.trainer  # noqa: F401
  from hdet_jax.trainer import bracket, compat, config_lib, schema, trainer  # noqa: F401
  import trainer_testing  # noqa: F401
  from jax._src import xla_bridge

  if xla_bridge._backends:  # (a module built an array at import: the backend's threads would not survive a fork)
    return 'a JAX backend started while importing'
  return None


def _child(request: dict) -> None:
  """Runs the script in this (forked) process and exits with its status; never returns."""
  code = 1
  try:
    _PROTOCOL.close()
    os.chdir(request['cwd'])
    os.environ.clear()
    os.environ.update(request['env'])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    mode = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request.get('append') else os.O_TRUNC)
    os.dup2(os.open(request['stdout'], mode), 1)
    os.dup2(os.open(request['stderr'], mode) if request['stderr'] else 1, 2)  # None: into stdout (2>&1)
    argv = request['argv']
    sys.argv = list(argv)
    sys.path[:] = [os.path.dirname(os.path.abspath(argv[0]))] + _PATH[1:]  # as `python SCRIPT` sets it
    import runpy

    try:
      runpy.run_path(argv[0], run_name='__main__')
      code = 0
    except SystemExit as e:  # as the interpreter reports it
      if e.code is None or isinstance(e.code, int):
        code = e.code or 0
      else:
        print(e.code, file=sys.stderr)
        code = 1
    except BaseException:  # an uncaught exception: the traceback and status 1, as `python SCRIPT` gives
      import traceback

      traceback.print_exc()
      code = 1
    import atexit
    import threading

    threading._shutdown()  # the interpreter's exit: non-daemon threads first, then the atexit functions
    atexit._run_exitfuncs()
  except BaseException:
    import traceback

    traceback.print_exc()
  finally:
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:
        pass
    os._exit(code if 0 <= code < 256 else 1)


def main() -> None:
  why = _preload()
  _PROTOCOL.write(json.dumps({'ready': why is None, **({'why': why} if why else {})}) + '\n')
  if why:
    return
  for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      _child(request)
    _PROTOCOL.write(json.dumps({'pid': pid}) + '\n')
    _, status = os.waitpid(pid, 0)
    _PROTOCOL.write(json.dumps({'returncode': os.waitstatus_to_exitcode(status)}) + '\n')


if __name__ == '__main__':
  main()
