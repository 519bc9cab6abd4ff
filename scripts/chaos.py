"""Preemption chaos: kill train.py with SIGKILL again and again, restart it, check nothing is lost.

    python scripts/chaos.py --kills 20 --steps 100 --seed 0   # about 2-3 minutes on 2 cores
    python scripts/chaos.py --kills 5 --json out.json         # what tests/test_reliability.py runs

It trains one uninterrupted reference run of the tiny config (checkpoint every 2 steps, 3 kept),
then the same command in a fresh workdir, killed with SIGKILL ``--kills`` times and restarted each
time. Kills alternate between two kinds of point:

- ``write``: the moment the 1st to 3rd (at random) orbax temporary directory of this start
  (``<step>.orbax-checkpoint-tmp-*``) appears under ``checkpoints/``, i.e. in the middle of a
  checkpoint write (polled every millisecond);
- ``random``: a uniformly random time into the process's life (setup, compile, training, a
  checkpoint write or deletion: wherever it falls), up to the time a start takes to reach its first
  checkpoint write (measured by the 'write' kills) plus 1.5 / kills of the reference's training
  time, so that the run does not end before every kill has landed.

After the last kill the command runs to the end. The script then compares the final checkpoint
(every replica's parameters, optimizer and controller state, the averaged model) with the
reference's bit for bit, and every per-step training metric with the reference's, and reports
each kill: when, what was on disk, which step the next start resumed from and how long its
restore took. Exit status 0 means every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, 'configs', 'tiny.py')
TMP_MARK = '.orbax-checkpoint-tmp'


def train_cmd(workdir: str, cache: str, config: str = TINY, extra: tuple[str, ...] = ()) -> list[str]:
  """The one command every start runs (checkpoint cadence and the cache are run fields: they do not
  change the trajectory, so the reference may use the same ones)."""
  return [
    sys.executable,
    os.path.join(ROOT, 'train.py'),
    '--config',
    config,
    '--workdir',
    workdir,
    '--config.checkpoint_every=2',
    '--config.max_checkpoints=3',
    '--config.plots=False',
    f'--config.compilation_cache={cache}',
    *extra,
  ]


def _env() -> dict:
  env = dict(os.environ)  # (the device count comes from JAX_NUM_CPU_DEVICES, which that flag would override)
  env['XLA_FLAGS'] = re.sub(r'--xla_force_host_platform_device_count=\d+', '', env.get('XLA_FLAGS', '')).strip()
  env['JAX_NUM_CPU_DEVICES'] = '8'
  env.setdefault('JAX_PLATFORMS', 'cpu')
  return env


def _ckpt_listing(workdir: str) -> list[str]:
  d = os.path.join(workdir, 'checkpoints')
  return sorted(os.listdir(d)) if os.path.isdir(d) else []


def _complete_steps(workdir: str) -> list[int]:
  return sorted(int(n) for n in _ckpt_listing(workdir) if n.isdigit())


def run_once(cmd: list[str], log_path: str, timeout: float = 600, popen=None) -> subprocess.CompletedProcess:
  """Runs ``cmd`` to its end, its output appended to ``log_path``. ``popen``: what starts it, in place of
  ``subprocess.Popen`` (the tests start a child forked from a process that has imported train.py's modules,
  tests/cli_testing.start); None: ``subprocess.run``."""
  with open(log_path, 'a') as log:
    if popen is None:
      return subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    proc = popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
      proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:  # killed, as subprocess.run kills it
      proc.kill()
      proc.wait()
      raise
    return subprocess.CompletedProcess(cmd, proc.returncode)


def start_and_kill(
  cmd: list[str], workdir: str, kind: str, rng: random.Random, log_path: str, expected_life: float, popen=None
) -> dict:
  """Starts ``cmd`` (with ``popen``, default ``subprocess.Popen``; see :func:`run_once`), SIGKILLs it at a ``kind``
  point, returns what happened."""
  before = _complete_steps(workdir)
  stale = {n for n in _ckpt_listing(workdir) if TMP_MARK in n}  # left by an earlier kill; removed at start
  events_before = len(_events(workdir))
  with open(log_path, 'a') as log:
    t0 = time.time()
    proc = (popen or subprocess.Popen)(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    delay = rng.uniform(0.3, expected_life) if kind == 'random' else None
    deadline = t0 + (delay if delay is not None else 10 * expected_life)
    nth_write = rng.randint(1, 3)  # 'write': kill during this start's 1st to 3rd checkpoint write
    seen, hit_write = set(), False
    while proc.poll() is None and time.time() < deadline:
      if kind == 'write':
        seen |= {n for n in _ckpt_listing(workdir) if TMP_MARK in n and n not in stale}
        if len(seen) >= nth_write:
          hit_write = True
          break
      time.sleep(0.001 if kind == 'write' else 0.01)
    finished = proc.poll() is not None
    if not finished:
      proc.send_signal(signal.SIGKILL)
    proc.wait()
    t_kill = time.time() - t0
  listing = _ckpt_listing(workdir)
  started = [e for e in _events(workdir)[events_before:] if e['event'] in ('start', 'resume')]
  return {
    'kind': kind,
    'killed_at_s': round(t_kill, 3),
    'finished_before_kill': finished,
    'returncode': proc.returncode,
    'started_from_step': started[0]['step'] if started else None,  # None: killed before it got that far
    'complete_steps_before': before,
    'complete_steps_after': _complete_steps(workdir),
    # A temporary directory left behind: the kill cut a checkpoint write short.
    'cut_write': [n for n in listing if TMP_MARK in n and n not in stale],
    'seen_write_in_progress': hit_write,
    'trash_left': os.path.isdir(os.path.join(workdir, 'checkpoints', 'trash'))
    and bool(os.listdir(os.path.join(workdir, 'checkpoints', 'trash'))),
  }


def _events(workdir: str) -> list[dict]:
  from hdet_jax.trainer.metrics import read_metrics

  path = os.path.join(workdir, 'metrics.jsonl')
  return read_metrics(path)['event'] if os.path.exists(path) else []


def chaos(
  workdir: str,
  cache: str,
  kills: int,
  seed: int,
  log_path: str,
  setup_s: float,
  train_s: float,
  total_steps: int,
  popen=None,
) -> dict:
  """Kills ``kills`` times (alternating write / random points), then runs to the end (``popen``: :func:`run_once`'s)."""
  rng = random.Random(seed)
  cmd = train_cmd(workdir, cache, extra=(f'--config.num_train_steps={total_steps}',) if total_steps else ())
  records = []
  starts = 0
  warm_setup = setup_s  # refined by the first 'write' kill: how long a (warm-cache) start takes to train
  while len(records) < kills:
    kind = 'write' if len(records) % 2 == 0 else 'random'
    done = _complete_steps(workdir)[-1] if _complete_steps(workdir) else 0
    # Random points up to the setup plus 1.5 / kills of the training: enough kills land before the end.
    life = warm_setup + min(train_s * 1.5 / kills, train_s * (total_steps - done) / total_steps)
    rec = start_and_kill(cmd, workdir, kind, rng, log_path, life, popen)
    if kind == 'write' and rec['seen_write_in_progress']:
      warm_setup = min(warm_setup, rec['killed_at_s'])
    starts += 1
    if rec['finished_before_kill']:  # the run ended before the kill point: nothing was injected
      if rec['returncode'] != 0:
        raise RuntimeError(f'train.py failed without being killed (see {log_path})')
      break
    records.append(rec)
  t0 = time.time()
  final = run_once(cmd, log_path, popen=popen)
  starts += 1
  if final.returncode != 0:
    raise RuntimeError(f'the final run failed with status {final.returncode} (see {log_path})')
  events = _events(workdir)
  return {
    'kills': records,
    'starts': starts,
    'final_run_s': round(time.time() - t0, 2),
    'resumes': [
      {'step': e['step'], 'restore_s': round(e.get('restore_s', float('nan')), 3)}
      for e in events
      if e['event'] == 'resume'
    ],
    'corrupt_events': [e for e in events if e['event'] == 'corrupt_checkpoint'],
  }


def read_checkpoint(workdir: str, step: int) -> tuple[dict, dict, dict]:
  """A checkpoint's items (state, averaged parameters, meta), read without a target; needs 8 devices."""
  import orbax.checkpoint as ocp

  path = os.path.join(workdir, 'checkpoints', str(step))
  with ocp.StandardCheckpointer() as ckptr:
    state = ckptr.restore(os.path.join(path, 'state'))
    avg = ckptr.restore(os.path.join(path, 'avg_params'))
  with open(os.path.join(path, 'meta', 'metadata')) as f:
    meta = json.load(f)
  return state, avg, meta


def load_checkpoint(workdir: str, step: int) -> tuple[list[np.ndarray], list[np.ndarray], dict]:
  """A checkpoint's arrays as flat lists (enough to compare bits), and its meta; needs 8 devices."""
  import jax

  state, avg, meta = read_checkpoint(workdir, step)
  leaves = lambda t: [np.asarray(x) for x in jax.tree.leaves(t)]
  return leaves(state), leaves(avg), meta


def compare(ref: str, got: str) -> dict:
  """Bitwise comparison of the final checkpoints and of every training/eval/controller metric."""
  from hdet_jax.trainer.metrics import read_metrics

  step = _complete_steps(ref)[-1]
  a_state, a_avg, a_meta = load_checkpoint(ref, step)
  b_state, b_avg, b_meta = load_checkpoint(got, step)
  same = lambda xs, ys: (
    len(xs) == len(ys)
    and all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(xs, ys))
  )
  ra, rb = read_metrics(os.path.join(ref, 'metrics.jsonl')), read_metrics(os.path.join(got, 'metrics.jsonl'))
  metric_kinds = ('train', 'controller', 'eval')
  return {
    'final_step': step,
    'state_arrays': len(a_state),
    'state_bitwise_equal': same(a_state, b_state),
    'avg_params_bitwise_equal': same(a_avg, b_avg),
    'fingerprints_equal': a_meta.get('fingerprint') == b_meta.get('fingerprint'),
    'metrics_equal': {k: ra.get(k) == rb.get(k) for k in metric_kinds},
    'train_steps_logged': [len(ra.get('train', [])), len(rb.get('train', []))],
  }


def run(base: str, kills: int, seed: int, steps: int | None = None, *, cache: str | None = None, popen=None) -> dict:
  """The reference run, the chaos run and their comparison, all under ``base``; ``cache``: the compilation cache
  (default ``base``/xla_cache); ``popen``: what starts each train.py command (:func:`run_once`'s)."""
  ref, got = (os.path.join(base, n) for n in ('reference', 'chaos'))
  cache = cache or os.path.join(base, 'xla_cache')
  for d in (ref, got):
    shutil.rmtree(d, ignore_errors=True)
  os.makedirs(base, exist_ok=True)
  log_path = os.path.join(base, 'train.log')
  t0 = time.time()
  r = run_once(
    train_cmd(ref, cache, extra=(f'--config.num_train_steps={steps}',) if steps else ()), log_path, popen=popen
  )
  if r.returncode != 0:
    raise RuntimeError(f'reference run failed (see {log_path})')
  with open(os.path.join(ref, 'summary.json')) as f:
    summary = json.load(f)
  setup_s, train_s = summary['setup_s'], summary['wall_s'] - summary['setup_s']
  report = chaos(got, cache, kills, seed, log_path, setup_s, train_s, steps or summary['num_train_steps'], popen)
  report.update(compare(ref, got), reference_setup_s=round(setup_s, 2), wall_s=round(time.time() - t0, 1), log=log_path)
  report['reference_run_s'] = round(summary['wall_s'], 2)
  return report


def main(argv=None) -> int:
  os.environ.setdefault('JAX_NUM_CPU_DEVICES', '8')  # to read the 8-device checkpoints back here
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--kills', type=int, default=20)
  p.add_argument('--seed', type=int, default=0)
  p.add_argument(
    '--steps', type=int, default=None, help="num_train_steps for both runs (default: the tiny config's 40)"
  )
  p.add_argument('--dir', default=None, help='where the two workdirs go (default: a temporary directory)')
  p.add_argument('--json', default=None, help='write the full report here')
  args = p.parse_args(argv)
  base = args.dir or tempfile.mkdtemp(prefix='hdet_chaos_')
  report = run(base, args.kills, args.seed, args.steps)
  ok = (
    report['state_bitwise_equal']
    and report['avg_params_bitwise_equal']
    and all(report['metrics_equal'].values())
    and len(report['kills']) >= args.kills
  )
  report['ok'] = bool(ok)
  for k in report['kills']:
    print(
      f'kill {k["kind"]:6s} at {k["killed_at_s"]:6.2f}s (started from step {k["started_from_step"]}): '
      f'complete steps {k["complete_steps_after"]}, write cut short: {bool(k["cut_write"])}'
    )
  print(f'resumes (step, restore s): {[(x["step"], x["restore_s"]) for x in report["resumes"]]}')
  print(
    f'final state bitwise equal: {report["state_bitwise_equal"]}, averaged model: '
    f'{report["avg_params_bitwise_equal"]}, metrics equal: {report["metrics_equal"]}; {report["wall_s"]}s'
  )
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(report, f, indent=1)
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
