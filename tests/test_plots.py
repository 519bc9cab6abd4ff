"""The run's plots, drawn from metrics.jsonl alone: ``python -m hdet_jax.trainer.plots WORKDIR``."""

import os
import subprocess
import sys

import numpy as np

from hdet_jax.trainer import metrics, plots

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ['learning_rate/embedding', 'learning_rate/no_decay', 'learning_rate/weights']


def _write_run(workdir, steps=30, n=8, sync_every=10):
  """A metrics.jsonl as the trainer writes it (per-group LRs, a sync every ``sync_every`` steps, two evals)."""
  rng = np.random.default_rng(0)
  w = metrics.MetricsWriter(os.path.join(workdir, 'metrics.jsonl'))
  w.write('event', step=0, event='start', init_from=None)
  w.write('hyperparams', step=0, names=NAMES)
  rho = np.linspace(0.75, 1.25, n)
  for s in range(steps):
    base = 1e-3 * (1 + s)
    sync = (s + 1) % sync_every == 0
    w.write('train', step=s, loss=5.5 - 0.05 * s + 0.01 * rng.random(n), lr=base * rho, base_lr=base, sync=sync,
            values=np.outer([base, 2 * base, 3 * base], rho), bases=[base, 2 * base, 3 * base])
    if sync:
      w.write('controller', step=s, weights=np.full(n, 1 / n), window_losses=rng.random(n), delta=0.1,
              velocity=0.2, base_lr=base, deltas=[0.1] * 3, velocities=[0.2] * 3)
  for s in (15, 30):
    w.write('eval', step=s, val_loss=5.0 - 0.02 * s, val_bits_per_byte=(5.0 - 0.02 * s) / np.log(2))
  w.close()


def test_plot_cli_redraws_from_metrics(tmp_path):
  _write_run(str(tmp_path))
  proc = subprocess.run([sys.executable, '-m', 'hdet_jax.trainer.plots', str(tmp_path)], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  drawn = [os.path.basename(p) for p in proc.stdout.split()]
  assert drawn == ['loss.png', 'lr.png', 'controller.png', 'hyperparams.png'], drawn
  for name in drawn:
    path = tmp_path / 'plots' / name
    assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and path.stat().st_size > 10_000
  missing = subprocess.run([sys.executable, '-m', 'hdet_jax.trainer.plots', str(tmp_path / 'nothing')], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
  assert missing.returncode == 1 and 'no metrics file' in missing.stderr
  usage = subprocess.run([sys.executable, '-m', 'hdet_jax.trainer.plots'], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
  assert usage.returncode == 2 and 'usage: python -m hdet_jax.trainer.plots WORKDIR' in usage.stderr


def test_a_run_without_training_steps_draws_nothing(tmp_path):
  w = metrics.MetricsWriter(str(tmp_path / 'metrics.jsonl'))
  w.write('event', step=0, event='start', init_from=None)
  w.close()
  assert plots.plot_workdir(str(tmp_path)) == []


def test_save_figure_writes_at_the_figures_own_resolution_or_the_given_one(tmp_path):
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  sizes = {}
  for name, dpi in (('own.png', None), ('given.png', 50)):
    fig, ax = plt.subplots(figsize=(4, 3), dpi=90)
    ax.plot([0, 1], [1, 0])
    path = plots.save_figure(fig, str(tmp_path), name, dpi=dpi)
    assert path == str(tmp_path / name) and not plt.fignum_exists(fig.number)  # written and closed
    sizes[name] = matplotlib.image.imread(path).shape[:2]
  assert sizes == {'own.png': (270, 360), 'given.png': (150, 200)}
