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
    w.write(
      'train',
      step=s,
      loss=5.5 - 0.05 * s + 0.01 * rng.random(n),
      lr=base * rho,
      base_lr=base,
      sync=sync,
      values=np.outer([base, 2 * base, 3 * base], rho),
      bases=[base, 2 * base, 3 * base],
    )
    if sync:
      w.write(
        'controller',
        step=s,
        weights=np.full(n, 1 / n),
        window_losses=rng.random(n),
        delta=0.1,
        velocity=0.2,
        base_lr=base,
        deltas=[0.1] * 3,
        velocities=[0.2] * 3,
      )
  for s in (15, 30):
    w.write('eval', step=s, val_loss=5.0 - 0.02 * s, val_bits_per_byte=(5.0 - 0.02 * s) / np.log(2))
  w.close()


def test_plot_cli_redraws_from_metrics(tmp_path):
  _write_run(str(tmp_path))
  proc = subprocess.run(
    [sys.executable, '-m', 'hdet_jax.trainer.plots', str(tmp_path)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  drawn = [os.path.basename(p) for p in proc.stdout.split()]
  assert drawn == ['loss.png', 'lr.png', 'controller.png', 'hyperparams.png'], drawn
  for name in drawn:
    path = tmp_path / 'plots' / name
    assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and path.stat().st_size > 10_000
  missing = subprocess.run(
    [sys.executable, '-m', 'hdet_jax.trainer.plots', str(tmp_path / 'nothing')],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert missing.returncode == 1 and 'no metrics file' in missing.stderr
  usage = subprocess.run(
    [sys.executable, '-m', 'hdet_jax.trainer.plots'], cwd=ROOT, capture_output=True, text=True, timeout=120
  )
  assert usage.returncode == 2 and 'usage: python -m hdet_jax.trainer.plots WORKDIR' in usage.stderr


def _fit_run(workdir, n=8, sync_every=10, steps=40, settle_at=39):
  """A 'fit' run's metrics.jsonl: a one-cycle-like schedule times a correction that starts at 0.1 and moves by
  the recorded taken steps at each sync; returns (schedule, asks, taken, slope, stderr, gain) as recorded."""
  w = metrics.MetricsWriter(os.path.join(workdir, 'metrics.jsonl'))
  w.write('event', step=0, event='start', init_from=None)
  w.write('hyperparams', step=0, names=['learning_rate'], controller='fit')
  schedule = 1e-3 + 1e-2 * np.sin(np.pi * np.arange(steps) / steps)
  taken = {9: 1.0, 19: 0.5, 29: 0.0, 39: 0.0}
  asks = {9: 0.6, 19: 0.5, 29: -0.2, 39: -0.4}
  slope, stderr, gain = (
    {9: -0.3, 19: -0.1, 29: 0.02, 39: 0.05},
    {9: 0.01, 19: 0.02, 29: 0.03, 39: 0.01},
    {9: 1.0, 19: 2.0, 29: -1.0, 39: -2.0},
  )
  log_corr, rho = np.log(0.1), np.linspace(0.75, 1.25, n)
  for s in range(steps):
    base = schedule[s] * np.exp(log_corr)  # a window trains at the correction its closing sync started from
    sync = (s + 1) % sync_every == 0
    w.write(
      'train',
      step=s,
      loss=5.0 - 0.01 * s + 0.01 * rho,
      lr=base * rho,
      base_lr=base,
      sync=sync,
      values=[base * rho],
      bases=[base],
    )
    if sync:
      log_corr += taken[s]
      w.write(
        'controller',
        step=s,
        weights=np.full(n, 1 / n),
        window_losses=5.0 + 0.01 * rho,
        delta=taken[s],
        velocity=slope[s],
        base_lr=base,
        deltas=[taken[s]],
        velocities=[slope[s]],
        corrections=[log_corr],
        asks=[asks[s]],
        stderrs=[stderr[s]],
        gains=[gain[s]],
        **({'backed_off': True} if s == 29 else {}),
        **({'settled': [True]} if s >= settle_at else {}),
      )
  w.close()
  return schedule, *(np.array(list(d.values())) for d in (asks, taken, slope, stderr, gain))


def test_fit_controller_figure_shows_its_own_quantities(tmp_path):
  """For 'fit', controller.png draws the schedule (recovered from the base LR and the corrections), the step
  asked and taken, the slope with two standard errors and the gain, not the paper's delta and weights; the syncs
  that backed off and where the climb settled are marked."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  schedule, asks, taken, slope, stderr, gain = _fit_run(str(tmp_path))
  run = plots._RunArrays(metrics.read_metrics(str(tmp_path / 'metrics.jsonl')), plt)  # pylint: disable=protected-access
  fig = plots._controller_figure(run, plt)  # pylint: disable=protected-access
  top, steps_ax, slope_ax, gain_ax = fig.axes[:4]
  lines = {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}
  np.testing.assert_allclose(lines['the schedule alone'].get_ydata(), schedule, rtol=1e-6)
  np.testing.assert_allclose(lines['correction after the sync'].get_ydata(), 0.1 * np.exp(np.cumsum(taken)), rtol=1e-6)
  np.testing.assert_allclose(lines['asked (LR)'].get_ydata(), asks)
  np.testing.assert_allclose(lines['taken (LR)'].get_ydata(), taken)
  np.testing.assert_allclose(lines['gain (LR)'].get_ydata(), gain)
  bars = slope_ax.containers[0]  # the errorbar: the slope, and its +-2 se segments
  np.testing.assert_allclose(bars.lines[0].get_ydata(), slope)
  segments = np.array([seg[:, 1] for seg in bars.lines[2][0].get_segments()])
  np.testing.assert_allclose(segments, np.stack([slope - 2 * stderr, slope + 2 * stderr], 1), rtol=1e-6)
  assert top.get_yscale() == 'log' and steps_ax.get_ylabel() == 'log-step' and gain_ax.get_ylabel() == 'gain (signed)'
  assert not any('eq.' in label for label in lines)
  # The sync that backed off (29) and the one where the climb settled (39) are marked on every panel.
  for ax in (top, steps_ax, slope_ax, gain_ax):
    assert sorted(
      line.get_xdata()[0]
      for line in ax.get_lines()
      if line.get_linestyle() in (':', '--')
      and line.get_xdata()[0] == line.get_xdata()[-1]
      and line.get_label() != 'the schedule alone'
    ) == [29, 39]
  assert lines['back-off'].get_xdata()[0] == 29 and lines['settled (LR): no spread after'].get_xdata()[0] == 39
  plt.close(fig)
  # After a climb settles its replicas no longer spread, so the line search fits nothing new: the asked step,
  # the slope and the gain of the syncs after the settling one are left out (NaN); the taken step stays.
  (tmp_path / 'settled').mkdir()
  _, asks, taken, slope, _, gain = _fit_run(str(tmp_path / 'settled'), settle_at=29)
  run = plots._RunArrays(metrics.read_metrics(str(tmp_path / 'settled' / 'metrics.jsonl')), plt)  # pylint: disable=protected-access
  fig = plots._controller_figure(run, plt)  # pylint: disable=protected-access
  lines = {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}
  stale = np.array([False, False, False, True])  # syncs 9, 19, 29 (settles), 39
  for label, recorded in (('asked (LR)', asks), ('gain (LR)', gain)):
    np.testing.assert_array_equal(np.isnan(lines[label].get_ydata()), stale)
    np.testing.assert_allclose(lines[label].get_ydata()[~stale], recorded[~stale])
  np.testing.assert_array_equal(np.isnan(fig.axes[2].containers[0].lines[0].get_ydata()), stale)
  np.testing.assert_allclose(lines['taken (LR)'].get_ydata(), taken)
  assert lines['settled (LR): no spread after'].get_xdata()[0] == 29
  plt.close(fig)
  # The paper's controller keeps its panels.
  (tmp_path / 'paper').mkdir()
  _write_run(str(tmp_path / 'paper'))
  run = plots._RunArrays(metrics.read_metrics(str(tmp_path / 'paper' / 'metrics.jsonl')), plt)  # pylint: disable=protected-access
  fig = plots._controller_figure(run, plt)  # pylint: disable=protected-access
  assert {'delta (eq. 6)', 'velocity (eq. 7)', 'w7'} <= {line.get_label() for ax in fig.axes for line in ax.get_lines()}
  plt.close(fig)


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
