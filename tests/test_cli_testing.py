"""tests/cli_testing.run, which the suite's train.py commands go through, against a real subprocess of the same
command: the same exit status, stdout and stderr; a timeout kills the command. cli_testing.start against
subprocess.Popen: signals and statuses."""

import os
import signal
import subprocess
import sys
import time

import pytest

import cli_testing

ROOT = cli_testing.ROOT
TRAIN = os.path.join(ROOT, 'train.py')


def test_a_forked_command_gives_what_a_subprocess_gives(tmp_path):
  argv = [TRAIN, '--config', os.path.join(ROOT, 'configs', 'tiny.py'), '--workdir', str(tmp_path / 'w')]
  argv.append('--config.hdet.spread=1.0')
  env = dict(os.environ)
  forked = cli_testing.run(argv, env=env)
  real = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)
  assert forked.returncode == 2 and forked.stderr.startswith('error: hdet.spread must be in [0, 1)'), forked.stderr
  assert not (tmp_path / 'w').exists()


def test_a_script_runs_as_main_in_its_folder_with_its_environment_and_a_timeout_kills_it(tmp_path):
  script = tmp_path / 'script.py'
  script.write_text(
    'import os, sys, time\n'
    "print(__name__, os.getcwd(), sys.argv[1:], os.environ['CLI_PROBE'], sys.path[0])\n"
    "print('to stderr', file=sys.stderr)\n"
    'time.sleep(float(sys.argv[1]))\n'
    'sys.exit(3)\n'
  )
  env = dict(os.environ, CLI_PROBE='here')
  got = cli_testing.run([script, '0'], cwd=tmp_path, env=env)
  assert got.returncode == 3 and got.stderr == 'to stderr\n'
  assert got.stdout == f"__main__ {tmp_path} ['0'] here {tmp_path}\n"
  with pytest.raises(subprocess.TimeoutExpired):
    cli_testing.run([script, '60'], cwd=tmp_path, env=env, timeout=1)
  assert cli_testing.run([script, '0'], cwd=tmp_path, env=env).returncode == 3  # the server goes on


def _wait_for(path, text, timeout=60):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if path.exists() and text in path.read_text():
      return
    time.sleep(0.01)
  raise AssertionError(f'{text!r} never reached {path}')


@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_started_command_is_a_process_that_signals_end_as_a_popen_ends(tmp_path, sig):
  """cli_testing.start against subprocess.Popen of the same script: a real process (its pid takes signals) that runs
  until signalled, the same status after SIGTERM (the script's handler exits 143) or SIGKILL (-9), the same output in
  the file; stderr into stdout, or to a file of its own; appended to with append=True."""
  script = tmp_path / 'script.py'
  script.write_text(
    'import signal, sys, time\n'
    'signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))\n'
    "print('out', sys.argv[1:], flush=True)\n"
    "print('err', flush=True, file=sys.stderr)\n"
    'time.sleep(60)\n'
  )
  env = dict(os.environ)
  (tmp_path / 'forked.log').write_text('before\n')
  forked = cli_testing.start([script, 'a'], cwd=tmp_path, env=env, stdout=tmp_path / 'forked.log', append=True)
  with open(tmp_path / 'real.log', 'w') as log:
    real = subprocess.Popen([sys.executable, script, 'a'], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
  for path in ('forked.log', 'real.log'):
    _wait_for(tmp_path / path, 'err\n')
  assert isinstance(forked, cli_testing.Started) or os.environ.get('HDET_TESTS_FORK') == '0'  # (else a Popen)
  assert forked.poll() is None and forked.returncode is None and forked.pid != os.getpid()
  with pytest.raises(subprocess.TimeoutExpired):
    forked.wait(timeout=0.2)
  forked.send_signal(sig)
  real.send_signal(sig)
  assert forked.wait(timeout=30) == real.wait(timeout=30) == (143 if sig == signal.SIGTERM else -signal.SIGKILL)
  assert forked.poll() == forked.returncode == real.returncode
  forked.kill()  # ended: nothing to signal (as Popen)
  assert (tmp_path / 'forked.log').read_text() == 'before\n' + (tmp_path / 'real.log').read_text()
  assert (tmp_path / 'real.log').read_text() == "out ['a']\nerr\n"
  # stderr to its own file, the files truncated; then a command run() sends to the same server.
  forked = cli_testing.start(
    [script, 'b'], cwd=tmp_path, env=env, stdout=tmp_path / 'forked.log', stderr=tmp_path / 'e'
  )
  _wait_for(tmp_path / 'e', 'err\n')
  forked.terminate()
  assert forked.wait(timeout=30) == 143
  assert (tmp_path / 'forked.log').read_text() == "out ['b']\n" and (tmp_path / 'e').read_text() == 'err\n'
  (tmp_path / 'quick.py').write_text('print("done")\n')
  assert cli_testing.run([tmp_path / 'quick.py'], cwd=tmp_path, env=env).stdout == 'done\n'
