"""Trains HDET on a byte-level transformer LM: ``python train.py`` runs the main job.

    python train.py --config configs/default.py --workdir workdirs/default
    python train.py --config configs/hdet_explore.py --config.hdet.spread=0.2 --workdir workdirs/hdet_explore
    python train.py --config configs/bracket.py --workdir workdirs/bracket   # an LR bracket: 8 plain runs, halved

Rerunning a command with the same workdir resumes from its latest complete, verified checkpoint
(SIGTERM or Ctrl-C writes one before exiting with status 143; see results/reliability.md). Several processes
(or hosts) run the same command with --coordinator_address, --num_processes and --process_id;
under SLURM (srun with several tasks) JAX reads them from the environment.
"""

import os
import re
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

FLAGS = flags.FLAGS


def _bad_override(e: Exception) -> None:
  """Reports a --config.* override that names no field (or cannot be parsed) as one line; exits 2."""
  m = re.search(r'Did you mean "(\w+)" instead of "(\w+)"', str(e))
  text = ' '.join(re.sub(r"\\[nt]|['\"\\]", ' ', str(e)).split())
  bad = m.group(2) if m else text
  given = [
    a.split('=', 1)[0] for a in sys.argv[1:] if re.match(r'--?config\.', a) and bad in a.split('=', 1)[0].split('.')
  ]
  where = f' {given[0]}' if given else ''
  field = given[0].lstrip('-')[len('config.') :] if given else ''
  from hdet_jax.trainer import compat  # (only on this error path)

  if field in compat.REMOVED:
    print(f'error: bad --config override{where}: {compat.removed_message(field)}', file=sys.stderr)
    sys.exit(2)
  from hdet_jax.trainer import schema

  if field in schema.tuning_fields():
    print(
      f'error: bad --config override{where}: {field} is research tuning, not a config field: give it in Python, '
      f"train_and_evaluate(config, workdir, tuning={{'{field}': ...}}) (docs/trainer.md).",
      file=sys.stderr,
    )
    sys.exit(2)
  detail = (
    f'no field named {bad!r}; did you mean {m.group(1)!r}?'
    if m
    else f'no field named {text!r}.'
    if isinstance(e, (AttributeError, KeyError))
    else text
  )
  print(
    f'error: bad --config override{where}: {detail} The fields, each with its help, are in hdet_jax/trainer/fields.py.',
    file=sys.stderr,
  )
  sys.exit(2)


# Without --config, ml_collections loads the default file and applies the --config.* overrides right
# here, when the flag is defined (at import, before parse_flags runs), so a bad override raises here.
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs', 'default.py')
try:
  config_flags.DEFINE_config_file(
    'config',
    DEFAULT_CONFIG,
    'Training configuration file (a get_config() Python file); default: configs/default.py.',
    lock_config=True,
  )
except (AttributeError, KeyError, TypeError, ValueError) as _e:
  _bad_override(_e)


class _ConfigFileParser(flags.ArgumentParser):
  """--config FILE[:ARG] read as ml_collections' parser reads it (get_config(ARG), locked), but through
  config_lib.load_config_file: a file that gives no config (missing, not Python, no get_config, ...) raises its
  ConfigError here, which parse_flags reports as one line, not a traceback (nor ml_collections' error deferred
  to the config's first use)."""

  def parse(self, argument):
    from hdet_jax.trainer import config_lib  # (every config imports it too)

    config = config_lib.load_config_file(*argument.split(':', 1))
    missing = config_lib.missing_fields(config, config_lib.load_config_file(DEFAULT_CONFIG))
    if missing:
      more = f' and {len(missing) - 4} more' if len(missing) > 4 else ''
      raise config_lib.ConfigError(
        f'--config {argument}: its config lacks {", ".join(missing[:4])}{more}; build it on configs/default.py '
        "(config = sibling(__file__, 'default'), then set fields, as configs/tiny.py does)."
      )
    config.lock()  # (lock_config=True)
    return config

  def flag_type(self):
    return 'config object'


FLAGS['config'].parser = _ConfigFileParser()  # (the default file above was read at the definition)
flags.DEFINE_string('workdir', 'workdirs/default', 'Where metrics, checkpoints and plots go; reusing it resumes.')
flags.DEFINE_string('coordinator_address', None, 'host:port of process 0, for multi-process runs.')
flags.DEFINE_integer('num_processes', None, 'Number of processes, for multi-process runs.')
flags.DEFINE_integer('process_id', None, "This process's index in [0, num_processes).")
flags.DEFINE_integer(
  'heartbeat_timeout',
  20,
  'Multi-process runs: seconds after which the other processes give up on one that stopped '
  'responding (killed, lost host) and exit with an error instead of hanging.',
)

# Exit statuses besides 0 (finished, or stopped at --config.stop_at_step) and 2 (bad config or workdir).
EXIT_DIVERGED = 1  # every replica's loss went NaN/inf; the last good checkpoint is kept
EXIT_PREEMPTED = 143  # SIGTERM/SIGINT: a checkpoint was written; rerun the same command to resume (128 + SIGTERM)


def _ignored_settings(config) -> list[str]:
  """The warning lines for ``config``'s fields that the run cannot use (``run_settings.ignored``), and for the
  platform's: a shipped config file's own choices (configs/*.py, e.g. the paper controller's fields that
  hdet_no_auto_lr.py keeps from hdet_full.py) are its own, so only what the command line changes counts there."""
  import jax

  from hdet_jax.trainer import config_lib
  from hdet_jax.trainer import run_settings
  from hdet_jax.trainer import schema

  given = config_flags.get_config_filename(FLAGS['config'])
  path, _, arg = given.partition(':')
  shipped = os.path.dirname(os.path.realpath(path)) == os.path.dirname(os.path.realpath(DEFAULT_CONFIG))
  base = config_lib.load_config_file(path, *([arg] if arg else [])) if shipped else None
  lines = run_settings.ignored(config, base)
  f = schema.complete(config_lib.flatten(config))
  platform = jax.default_backend()
  cpus = f['num_cpu_devices']
  if cpus not in (0, schema.BY_NAME['num_cpu_devices'].default):
    env = [k for k in ('JAX_NUM_CPU_DEVICES',) if k in os.environ]
    env += ['XLA_FLAGS'] if 'xla_force_host_platform_device_count' in os.environ.get('XLA_FLAGS', '') else []
    if platform != 'cpu':
      lines.append(f'num_cpu_devices={cpus} is ignored: JAX trains on {platform}, not on simulated CPU devices.')
    elif env and jax.local_device_count() != max(1, cpus // jax.process_count()):
      lines.append(f'num_cpu_devices={cpus} is ignored: {env[0]} sets the CPU devices (it wins).')
  if not f['deterministic_gpu'] and platform != 'gpu':
    lines.append(f'deterministic_gpu=False is ignored: JAX trains on {platform}, not on a GPU.')
  return lines


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {" ".join(argv[1:])}')
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO.
  from hdet_jax import trainer  # after flag parsing: JAX must start after setup_jax's settings.
  from hdet_jax.trainer import bracket
  from hdet_jax.trainer import trainer as trainer_lib

  config = FLAGS.config
  try:  # where the run writes: before anything starts (JAX's cache included)
    trainer_lib.check_output_paths(config, FLAGS.workdir)
  except trainer.ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  trainer.setup_jax(
    config,
    coordinator_address=FLAGS.coordinator_address,
    num_processes=FLAGS.num_processes,
    process_id=FLAGS.process_id,
    heartbeat_timeout_s=FLAGS.heartbeat_timeout,
  )
  import jax

  try:
    if jax.process_index() == 0:  # fields set where the run cannot use them: one line per cause, once
      for line in _ignored_settings(config):
        print(f'warning: {line}', file=sys.stderr, flush=True)
    if config.bracket.points > 0:  # an LR bracket: several plain runs, the worse stopped early
      summary = bracket.run_bracket(config, FLAGS.workdir)
    else:
      summary = trainer.train_and_evaluate(config, FLAGS.workdir)
  except trainer.ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  if jax.process_index() == 0:
    print(trainer.format_summary(summary), flush=True)
    if 'bracket' in summary:
      print(bracket.format_bracket(summary['bracket']), flush=True)
  if summary['diverged_at'] is not None:
    print(
      f"error: training diverged at step {summary['diverged_at']} (every replica's loss is NaN/inf); "
      'the last good checkpoint is kept.',
      file=sys.stderr,
    )
    sys.exit(EXIT_DIVERGED)
  if summary['preempted']:
    sys.exit(EXIT_PREEMPTED)


def parse_flags(argv):
  """absl's flag parsing, with a bad --config override reported as one line, not a traceback."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    from hdet_jax.trainer import config_lib  # (only on this error path)

    if isinstance(e.__context__, config_lib.ConfigError):  # --config's file (_ConfigFileParser), as absl wraps it
      print(f'error: {e.__context__}', file=sys.stderr)
    else:
      print(f'error: {" ".join(str(e).split())} (python train.py --helpfull lists the flags)', file=sys.stderr)
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    _bad_override(e)
  sys.exit(2)


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
