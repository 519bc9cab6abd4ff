"""The trainer's wall time outside the compiled step (data, metrics, evaluation, checkpoints).

Runs ``train_and_evaluate`` on configs/default.py (shortened to ``steps`` steps, the default
cadence of logging, evaluation and checkpoints kept) with the compiled step programs wrapped
to count their calls, then times the same compiled programs back to back on the final state.

    outside = (loop wall time - steps x compiled step time) / loop wall time

where the loop wall time is the run's wall time minus its setup (building and compiling), so it
includes every evaluation and checkpoint and the final ones.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import tempfile
import time

os.environ.setdefault('JAX_NUM_CPU_DEVICES', '8')

import jax  # noqa: E402

from benchmarks import common as C  # noqa: E402


_LAST: list = [None]  # the latest outputs and batch of either program (the others are donated).


class _Counted:
  """A compiled step that counts its calls and keeps the latest outputs and batch."""

  def __init__(self, compiled, sync):
    self.compiled, self.sync, self.calls = compiled, sync, 0

  def __call__(self, params, opt_state, batch):
    out = self.compiled(params, opt_state, batch)
    self.calls += 1
    _LAST[0] = (out, batch)
    return out


def measure(steps: int = 500, reps: int = 5, k: int = 20) -> dict:
  from hdet_jax.trainer import train_step as ts
  from hdet_jax.trainer import trainer

  spec = importlib.util.spec_from_file_location('hdet_default_config', C.REPO / 'configs' / 'default.py')
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  config = mod.get_config()
  config.num_train_steps = steps
  config.hdet.warmup_steps = min(config.hdet.warmup_steps, steps // 2)
  config.progress_bar = False
  config.plots = False
  config.compilation_cache = ''

  wrapped: dict[bool, _Counted] = {}
  original = ts.make_train_step

  class _Lowerable:
    def __init__(self, fn, sync):
      self.fn, self.sync = fn, sync

    def lower(self, *args):
      lowered = self.fn.lower(*args)
      sync = self.sync

      class _L:
        def compile(self_inner):
          wrapped[sync] = _Counted(lowered.compile(), sync)
          return wrapped[sync]
      return _L()

  def patched(graphdef, tx, mesh, *, sync, **kwargs):
    return _Lowerable(original(graphdef, tx, mesh, sync=sync, **kwargs), sync)

  ts.make_train_step = patched
  try:
    with tempfile.TemporaryDirectory() as workdir:
      summary = trainer.train_and_evaluate(config, workdir)
  finally:
    ts.make_train_step = original
  loop_s = summary['wall_s'] - summary['setup_s']
  n_sync, n_plain = wrapped[True].calls, wrapped[False].calls

  # The compiled step alone: the same programs, back to back on the final state.
  (params, opt_state, _), batch = _LAST[0]
  per = {False: [], True: []}
  for _ in range(reps):
    for sync in (False, True):
      fn = wrapped[sync].compiled
      jax.block_until_ready((params, opt_state))
      t = time.perf_counter()
      for _ in range(k):
        params, opt_state, _m = fn(params, opt_state, batch)
      jax.block_until_ready((params, opt_state))
      per[sync].append((time.perf_counter() - t) / k)
  t_ns, t_s = statistics.median(per[False]), statistics.median(per[True])
  step_s = n_plain * t_ns + n_sync * t_s
  outside = (loop_s - step_s) / loop_s
  lines = [
      f'trainer[default config, {steps} steps, T={config.hdet.sync_every}, log every {config.log_every}, '
      f'eval every {config.eval_every}, checkpoint every {config.checkpoint_every}]: setup (build + compile) '
      f'{summary["setup_s"]:.1f} s, loop {loop_s:.1f} s; compiled step alone {t_ns * 1e3:.1f} ms '
      f'(sync {t_s * 1e3:.1f} ms) x {n_plain}+{n_sync} = {step_s:.1f} s; outside the compiled step '
      f'{outside * 100:.1f}% of the loop wall time',
  ]
  rows = [
      '| run | setup (s) | loop wall (s) | steps (non-sync + sync) | compiled step alone (ms) | '
      'time outside the compiled step |',
      '|---|---|---|---|---|---|',
      f'| configs/default.py, {steps} steps (T={config.hdet.sync_every}, eval every {config.eval_every}, '
      f'checkpoint every {config.checkpoint_every}, log every {config.log_every}) | {summary["setup_s"]:.1f} | '
      f'{loop_s:.1f} | {n_plain} + {n_sync} | {t_ns * 1e3:.1f} (sync {t_s * 1e3:.1f}) | {outside * 100:.1f}% |',
      '',
      'Loop wall = `wall_s - setup_s` of the run\'s summary (it includes the evaluations and checkpoints, '
      'the last ones too). Compiled step alone = the run\'s own compiled programs timed back to back '
      f'afterwards ({reps} blocks of {k} steps each, median). Target: under 5%.',
  ]
  return {'lines': lines, 'rows': rows, 'outside': outside}


if __name__ == '__main__':
  import sys
  print('\n'.join(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 500)['lines']))
