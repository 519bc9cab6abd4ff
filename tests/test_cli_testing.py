"""tests/cli_testing.run, which the suite's train.py commands go through, against a real subprocess of the same
command: the same exit status, stdout and stderr; a timeout kills the command."""

import os
import subprocess
import sys

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
