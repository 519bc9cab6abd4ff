"""The trainer's wall time outside the compiled step (data, metrics, evaluation, checkpoints).

Runs ``train_and_evaluate`` on configs/default.py (shortened to ``steps`` steps, the default
cadence of logging, evaluation and checkpoints kept) twice:

1. as it is: the loop's wall time (the run's wall time minus its setup of building and
   compiling; the evaluations and checkpoints, the last ones too, are in it);
2. instrumented: every call of a compiled step program is timed until its outputs are ready,
   and the host work around it is timed by phase (data, metrics, evaluation, checkpoints):

       outside = (loop wall time - time inside the compiled steps) / loop wall time

The instrumented run waits for each step, so nothing of the host's work hides behind an
asynchronous step: its figure is what the loop spends outside the compiled step, measured in
the same run rather than estimated from a step timed separately.

:func:`smoke` times the smoke run, ``python train.py --config configs/tiny.py`` (40 steps), as a
user starts it: the summary's wall time, its setup and the process's wall time. Until 2026-12
tests/test_trainer.py asserted its wall time under 300 s (:data:`SMOKE_BOUND_S`), a timed test;
the figure is printed here instead (``python -m benchmarks.trainer_overhead --smoke``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault('JAX_NUM_CPU_DEVICES', '8')

import jax  # noqa: E402

from benchmarks import common as C  # noqa: E402

PHASES = ('step', 'data', 'metrics', 'eval', 'checkpoint')


class _Clock:
  """Wall time per phase; a call inside another timed call counts for the outer one only."""

  def __init__(self):
    self.seconds = {p: 0.0 for p in PHASES}
    self.calls = {p: 0 for p in PHASES}
    self.depth = 0

  def wrap(self, phase, fn, wait=False):
    def timed(*args, **kwargs):
      if self.depth:
        return fn(*args, **kwargs)
      self.depth += 1
      start = time.perf_counter()
      try:
        out = fn(*args, **kwargs)
        if wait:
          jax.block_until_ready(out)
        return out
      finally:
        self.seconds[phase] += time.perf_counter() - start
        self.calls[phase] += 1
        self.depth -= 1

    return timed


class _Compiled:
  """Stands in for ``make_*_step(...)``: ``.lower(...).compile()`` gives a timed program."""

  def __init__(self, jitted, clock, phase):
    self.jitted, self.clock, self.phase = jitted, clock, phase

  def __call__(self, *args):  # a direct call (the first anchor, at setup) is not the loop's: untimed
    return self.jitted(*args)

  def lower(self, *args):
    lowered = self.jitted.lower(*args)
    clock, phase = self.clock, self.phase

    class _Lowered:
      def compile(self):
        return clock.wrap(phase, lowered.compile(), wait=True)

    return _Lowered()


@contextlib.contextmanager
def _instrumented(clock):
  from hdet_jax.trainer import checkpoints, mesh as mesh_lib, metrics, programs as programs_lib
  from hdet_jax.trainer.tasks import lm_input_pipeline as input_pipeline

  patches = [
    (programs_lib, 'make_train_step', lambda *a, **k: _Compiled(original['make_train_step'](*a, **k), clock, 'step')),
    (programs_lib, 'make_window_end', lambda *a, **k: _Compiled(original['make_window_end'](*a, **k), clock, 'step')),
    # The rollback's first anchor (hdet.rollback), taken at setup by a direct call: untimed. After each sync the window
    # end returns the next (the library's rollback), so the loop runs no anchor program.
    (programs_lib, 'make_anchor', lambda *a, **k: _Compiled(original['make_anchor'](*a, **k), clock, 'step')),
    (programs_lib, 'make_eval_step', lambda *a, **k: _Compiled(original['make_eval_step'](*a, **k), clock, 'eval')),
    (mesh_lib, 'put_stacked', None),
    (input_pipeline.TrainBatches, 'batch', None),
    (mesh_lib, 'fetch', None),
    (metrics.MetricsWriter, 'write', None),
    (metrics.MetricsWriter, 'flush', None),
    (checkpoints.Checkpointer, 'save', None),
    (checkpoints.Checkpointer, 'wait', None),
    (checkpoints.Checkpointer, 'close', None),
  ]
  phase_of = {
    'put_stacked': 'data',
    'batch': 'data',
    'fetch': 'metrics',
    'write': 'metrics',
    'flush': 'metrics',
    'save': 'checkpoint',
    'wait': 'checkpoint',
    'close': 'checkpoint',
  }
  original = {name: getattr(owner, name) for owner, name, _ in patches}
  for owner, name, replacement in patches:
    setattr(owner, name, replacement or clock.wrap(phase_of[name], original[name]))
  try:
    yield
  finally:
    for owner, name, _ in patches:
      setattr(owner, name, original[name])


def _config(steps):
  spec = importlib.util.spec_from_file_location('hdet_default_config', C.REPO / 'configs' / 'default.py')
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  config = mod.get_config()
  config.num_train_steps = steps
  config.progress_bar = False
  config.plots = False
  config.compilation_cache = ''
  return config


def measure(steps: int = 500) -> dict:
  from hdet_jax.trainer import program_cache, run_settings, trainer

  config = _config(steps)
  with tempfile.TemporaryDirectory() as workdir:
    plain = trainer.train_and_evaluate(config, workdir)
  clock = _Clock()
  # The instrumented run builds its own (timed) programs, which no later run may take (trainer.program_cache).
  program_cache.clear()
  try:
    with tempfile.TemporaryDirectory() as workdir, _instrumented(clock):
      summary = trainer.train_and_evaluate(config, workdir)
  finally:
    program_cache.clear()
  loop_async = plain['wall_s'] - plain['setup_s']
  loop_s = summary['wall_s'] - summary['setup_s']
  sec = clock.seconds
  outside = (loop_s - sec['step']) / loop_s
  other = loop_s - sum(sec.values())
  parts = ', '.join(f'{p} {sec[p]:.2f} s ({sec[p] / loop_s * 100:.1f}%)' for p in PHASES[1:])
  period = run_settings.resolve(config).optimizer.windows[-1]  # T (hdet.sync_every 0: counted per run)
  layout = (
    f'{summary["num_replicas"]} replicas on {summary["num_devices"]} {jax.devices()[0].platform.upper()} device(s)'
  )
  head = (
    f'trainer[default config, {layout}, {steps} steps, T={period}, log every {config.log_every}, '
    f'eval every {config.eval_every}, checkpoint every {config.checkpoint_every}]'
  )
  lines = [
    f'{head}: loop {loop_s:.2f} s (setup {summary["setup_s"]:.1f} s), inside the compiled steps {sec["step"]:.2f} s '
    f'({clock.calls["step"]} calls of the step and window-end programs); outside '
    f'{outside * 100:.1f}% of the loop: {parts}, other {other:.2f} s ({other / loop_s * 100:.1f}%)',
    f'{head}: uninstrumented run (asynchronous steps): loop {loop_async:.2f} s = '
    f'{loop_async / loop_s:.3f} x the instrumented loop',
  ]
  rows = [
    '| run | loop wall (s) | inside the compiled steps (s) | outside | data | metrics | eval | checkpoints | other | '
    'uninstrumented loop (s) |',
    '|---|---|---|---|---|---|---|---|---|---|',
    f'| configs/default.py, {layout}, {steps} steps (T={period}, log every {config.log_every}, eval every '
    f'{config.eval_every}, checkpoint every {config.checkpoint_every}) | {loop_s:.2f} | {sec["step"]:.2f} '
    f'| **{outside * 100:.1f}%** | '
    + ' | '.join(f'{sec[p] / loop_s * 100:.1f}%' for p in PHASES[1:])
    + f' | {other / loop_s * 100:.1f}% | {loop_async:.2f} |',
    '',
    'Instrumented run: each compiled step call is timed until its outputs are ready; data (batch assembly and '
    'host-to-device), metrics (fetching the packed per-step metrics and writing metrics.jsonl), eval (the compiled '
    'evaluation), checkpoints (orbax saves, fingerprints, waiting for them) are timed around their calls; other = '
    'the rest of the loop. Loop wall = `wall_s - setup_s` of the run (the last evaluation and checkpoint '
    'included). The uninstrumented run is the same config as it normally runs (asynchronous steps). '
    'Target: under 5% outside.',
  ]
  return {'lines': lines, 'rows': rows, 'outside': outside, 'calls': dict(clock.calls)}


SMOKE_BOUND_S = 300.0  # the bound on the smoke run's wall_s that tests/test_trainer.py held until 2026-12.


def smoke(workdir: str | None = None, flags: tuple[str, ...] = ()) -> dict:
  """The smoke run's wall time: ``python train.py --config configs/tiny.py`` in a subprocess (imports included).

  Args:
    workdir: the run's work directory (its summary.json is read back); None: a temporary one.
    flags: more of train.py's flags (``--config.num_train_steps=8``).

  Returns:
    ``{'wall_s', 'setup_s', 'process_s', 'steps', 'line'}``: the summary's wall time (setup included) and setup
    (building and compiling), the process's wall time from start to exit, the steps run, and the figure's line.
  """
  with tempfile.TemporaryDirectory() as tmp:
    workdir = workdir or tmp
    cmd = [sys.executable, 'train.py', '--config', 'configs/tiny.py', '--workdir', workdir, *flags]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=C.REPO, capture_output=True, text=True)
    process_s = time.perf_counter() - start
    if proc.returncode:
      raise RuntimeError(f'{" ".join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}')
    with open(os.path.join(workdir, 'summary.json')) as f:
      summary = json.load(f)
  wall, setup = summary['wall_s'], summary['setup_s']
  extra = (' ' + ' '.join(flags)) if flags else ''
  line = (
    f'smoke[python train.py --config configs/tiny.py{extra}, {summary["step"]} steps]: wall_s {wall:.1f} s '
    f'(setup {setup:.1f} s, loop {wall - setup:.1f} s), process {process_s:.1f} s from start to exit; '
    f'{wall / SMOKE_BOUND_S:.3f} of the {SMOKE_BOUND_S:.0f} s that tests/test_trainer.py held until 2026-12'
  )
  return {'wall_s': wall, 'setup_s': setup, 'process_s': process_s, 'steps': summary['step'], 'line': line}


if __name__ == '__main__':
  if sys.argv[1:] == ['--smoke']:
    print(smoke()['line'])
  else:
    print('\n'.join(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 500)['lines']))
