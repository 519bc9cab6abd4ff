"""Plots of a training run from its ``WORKDIR/metrics.jsonl``.

    python -m hdet_jax.trainer.plots WORKDIR

writes ``WORKDIR/plots/loss.png`` (each replica's training loss and the averaged model's
validation loss), ``lr.png`` (each replica's LR with the sync points marked, and the base LR:
the paper's Fig. 3), ``controller.png`` (the auto-LR controller at each sync: for 'fit', the LR it trains
with against the schedule, the step asked and taken, the slope with its standard error and the gain; for the
paper's, its delta, velocity and softmax weights) and ``hyperparams.png`` (every explored hyperparameter, one panel
each: the per-group LR schedules and any regularizer). train.py draws them at the end of a run; this redraws them.
:func:`save_figure` is the one way figures are written, here and in ``research/``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from hdet_jax.trainer.metrics import read_metrics


def save_figure(fig: Any, folder: str, name: str, dpi: float | None = 110) -> str:
  """Lays ``fig`` out, writes it to ``folder/name`` and closes it; returns the path.

  ``dpi=None`` keeps the figure's own resolution.
  """
  import matplotlib.pyplot as plt

  path = os.path.join(folder, name)
  fig.tight_layout()
  fig.savefig(path, dpi=dpi)
  plt.close(fig)
  return path


def _smooth(y: np.ndarray, width: int) -> np.ndarray:
  if width <= 1 or len(y) < width:
    return y
  kernel = np.ones(width) / width
  return np.convolve(y, kernel, mode='valid')


class _RunArrays:
  """The arrays every figure reads from the records of one run."""

  def __init__(self, recs: dict, plt: Any):
    train = recs['train']
    self.recs = recs
    self.train = train
    self.evals, self.ctrl = recs.get('eval', []), recs.get('controller', [])
    self.steps = np.array([r['step'] for r in train])
    self.loss = np.array([r['loss'] for r in train], dtype=float)  # [S, N]
    self.lrs = np.array([r['lr'] for r in train], dtype=float)  # [S, N]
    self.base = np.array([r['base_lr'] for r in train], dtype=float)
    self.syncs = self.steps[np.array([bool(r.get('sync')) for r in train])]
    self.colors = plt.cm.viridis(np.linspace(0, 0.9, self.loss.shape[1]))


def plot_workdir(workdir: str) -> list[str]:
  """Draws the PNGs into ``workdir/plots`` and returns their paths."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  recs = read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  out_dir = os.path.join(workdir, 'plots')
  os.makedirs(out_dir, exist_ok=True)
  if not recs.get('train'):
    return []
  run = _RunArrays(recs, plt)
  figures = [
    (_loss_figure, 'loss.png'),
    (_lr_figure, 'lr.png'),
    (_controller_figure, 'controller.png'),
    (_hyperparams_figure, 'hyperparams.png'),
  ]
  paths = []
  for draw, name in figures:
    fig = draw(run, plt)
    if fig is not None:
      paths.append(save_figure(fig, out_dir, name))
  return paths


def _loss_figure(run: _RunArrays, plt: Any) -> Any:
  steps, loss = run.steps, run.loss
  width = max(1, len(steps) // 60)
  fig, ax = plt.subplots(figsize=(8, 5))
  for r in range(loss.shape[1]):
    ax.plot(
      steps[width - 1 :] if width > 1 and len(steps) >= width else steps,
      _smooth(loss[:, r], width),
      color=run.colors[r],
      lw=0.8,
      alpha=0.8,
      label=f'replica {r} (train)',
    )
  if run.evals:
    ax.plot(
      [e['step'] for e in run.evals],
      [e['val_loss'] for e in run.evals],
      'k-o',
      ms=4,
      lw=1.8,
      label='averaged model (validation)',
    )
  ax.set_xlabel('step')
  ax.set_ylabel('loss (nats / byte)')
  ax.set_title(f'Loss (train: moving mean over {width} steps)')
  finite = loss[np.isfinite(loss)]
  if finite.size:
    ax.set_ylim(max(0.0, np.percentile(finite, 0.5) - 0.1), np.percentile(finite, 99.5) + 0.1)
  ax.legend(fontsize=7, ncol=2)
  ax.grid(alpha=0.3)
  return fig


def _lr_figure(run: _RunArrays, plt: Any) -> Any:
  """Learning rates (the paper's Fig. 3): linear and log scale."""
  steps, base, syncs = run.steps, run.base, run.syncs
  fig, axes = plt.subplots(2, 1, figsize=(8, 8), sharex=True)
  for ax, scale in zip(axes, ('linear', 'log')):
    for r in range(run.lrs.shape[1]):
      ax.plot(steps, run.lrs[:, r], color=run.colors[r], lw=0.7, alpha=0.8, label=f'replica {r}')
    ax.plot(steps, base, 'k--', lw=1.5, label='base LR')
    if len(syncs) and len(syncs) <= 400:
      for s in syncs:
        ax.axvline(s, color='tab:red', lw=0.3, alpha=0.4)
    if len(syncs):
      ax.plot(syncs, base[np.isin(steps, syncs)], 'r|', ms=8, label='sync (average)')
    ax.set_yscale(scale)
    ax.set_ylabel(f'learning rate ({scale})')
    ax.grid(alpha=0.3)
  axes[0].set_title('Per-replica learning rates, base LR and sync points')
  axes[0].legend(fontsize=7, ncol=2)
  axes[1].set_xlabel('step')
  return fig


def _controller_figure(run: _RunArrays, plt: Any) -> Any:
  """The controller at each sync: the 'fit' controller's own quantities, or the paper's (eqs. 4-7)."""
  hyper = run.recs.get('hyperparams', [{}])[-1]
  if hyper.get('controller') == 'fit' and run.ctrl and 'asks' in run.ctrl[0]:
    return _fit_controller_figure(run, plt, hyper.get('names') or ['learning_rate'])
  return _paper_controller_figure(run, plt)


def _fit_controller_figure(run: _RunArrays, plt: Any, names: list[str]) -> Any:
  """The line search's quantities: the LR it trains with against the user's schedule (log scale), the step it
  asked for and the one it took (log units), the fitted slope with two standard errors (where the band crosses
  zero the line search has turned), and the Rprop gain; dotted lines mark the syncs that backed off, dashed ones
  where a climb settled (its ask, slope and gain are not drawn after it: nothing new is fitted)."""
  fit = _fit_arrays(run.ctrl, len(names))
  fig, axes = plt.subplots(4, 1, figsize=(8, 10), sharex=True)
  _correction_panel(axes[0], run, fit, names[0])
  colors = plt.cm.tab10(np.arange(len(names)) % 10)
  for g, name in enumerate(names):
    label = name.replace('learning_rate', 'LR')
    axes[1].plot(
      fit['cs'], fit['asked'][:, g], 'o-', ms=3, lw=0.8, color=colors[g], alpha=0.6, label=f'asked ({label})'
    )
    axes[1].plot(fit['cs'], fit['taken'][:, g], 'x-', ms=5, lw=1.4, color=colors[g], label=f'taken ({label})')
    axes[2].errorbar(
      fit['cs'],
      fit['slope'][:, g],
      yerr=2 * fit['stderr'][:, g],
      fmt='o-',
      ms=3,
      lw=1.0,
      capsize=2,
      color=colors[g],
      label=f'slope b ± 2 se ({label})',
    )
    axes[3].plot(fit['cs'], fit['gain'][:, g], 'o-', ms=3, color=colors[g], label=f'gain ({label})')
  axes[1].set_ylabel('log-step')
  axes[2].set_ylabel('d loss / d u')
  axes[3].set_ylabel('gain (signed)')
  axes[3].set_xlabel('step')
  _mark_backoffs_and_settles(axes, run.ctrl, fit, names, colors)
  for a in axes[1:]:
    a.axhline(0, color='k', lw=0.5)
    a.legend(fontsize=7, ncol=2)
  for a in axes:
    a.grid(alpha=0.3)
  return fig


def _fit_arrays(ctrl: list[dict], num_groups: int) -> dict:
  """The 'fit' controller's records as arrays, [num_syncs, num_groups] each (``cs``: the syncs' steps). After the
  sync where a climb settled its replicas train unspread, so the line search fits nothing new: its ask, slope,
  standard error and gain there would repeat a stale fit and are NaN (the step taken stays)."""
  out = {'cs': np.array([c['step'] for c in ctrl])}
  for key, field in (
    ('corr', 'corrections'),
    ('taken', 'deltas'),
    ('asked', 'asks'),
    ('slope', 'velocities'),
    ('stderr', 'stderrs'),
    ('gain', 'gains'),
  ):
    out[key] = np.array([c[field] for c in ctrl], float)
  out['settled'] = np.array([c.get('settled', [False] * num_groups) for c in ctrl], bool)
  stale = np.cumsum(out['settled'], axis=0) > 1
  for key in ('asked', 'slope', 'stderr', 'gain'):
    out[key] = np.where(stale, np.nan, out[key])
  return out


def _correction_panel(ax: Any, run: _RunArrays, fit: dict, name: str) -> None:
  """The base LR against the schedule alone (log), and the correction after each sync on a twin axis."""
  cs, corr = fit['cs'], fit['corr']
  # The correction in effect during a window is the one before its closing sync's step: after minus taken.
  before = corr - fit['taken']
  window = np.searchsorted(cs, run.steps, side='left')  # the sync that closes each step's window
  factor = np.exp(np.where(window < len(cs), before[np.minimum(window, len(cs) - 1), 0], corr[-1, 0]))
  ax.plot(run.steps, run.base, 'k-', lw=1.5, label=f'base {name} (schedule x correction)')
  ax.plot(run.steps, run.base / factor, 'k--', lw=1.0, alpha=0.6, label='the schedule alone')
  ax.set_yscale('log')
  ax.set_ylabel('learning rate (log)')
  twin = ax.twinx()
  twin.plot(cs, np.exp(corr[:, 0]), 'o', ms=3, color='tab:red', label='correction after the sync')
  twin.set_yscale('log')
  twin.set_ylabel('LR correction (x schedule)', color='tab:red')
  ax.legend(fontsize=7, loc='upper left')
  twin.legend(fontsize=7, loc='lower right')
  ax.set_title("The 'fit' controller at each sync: a line search along the replicas' line")


def _mark_backoffs_and_settles(axes: Any, ctrl: list[dict], fit: dict, names: list[str], colors: Any) -> None:
  """Dotted lines where the back-off stepped the LR down (hdet.backoff), dashed ones where each climb settled
  (hdet.settle); labelled once, on the second panel."""
  backed = [c['step'] for c in ctrl if c.get('backed_off')]
  for a in axes:
    for i, b in enumerate(backed):
      a.axvline(b, color='tab:red', lw=0.8, ls=':', label='back-off' if i == 0 and a is axes[1] else None)
  for g, name in enumerate(names):
    if fit['settled'][:, g].any():
      at = fit['cs'][np.argmax(fit['settled'][:, g])]
      for a in axes:
        a.axvline(
          at,
          color=colors[g],
          lw=0.8,
          ls='--',
          label=f'settled ({name.replace("learning_rate", "LR")}): no spread after' if a is axes[1] else None,
        )


def _paper_controller_figure(run: _RunArrays, plt: Any) -> Any:
  ctrl = run.ctrl
  fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
  if ctrl:
    cs = np.array([c['step'] for c in ctrl])
    axes[0].plot(cs, [c['delta'] for c in ctrl], 'o-', ms=2, label='delta (eq. 6)')
    axes[0].axhline(0, color='k', lw=0.5)
    axes[1].plot(cs, [c['velocity'] for c in ctrl], 'o-', ms=2, color='tab:orange', label='velocity (eq. 7)')
    axes[1].axhline(0, color='k', lw=0.5)
    w = np.array([c['weights'] for c in ctrl], dtype=float)
    for r in range(w.shape[1]):
      axes[2].plot(cs, w[:, r], color=run.colors[r % len(run.colors)], lw=0.8, label=f'w{r}')
  else:
    axes[0].text(0.5, 0.5, 'no sync steps', ha='center', transform=axes[0].transAxes)
  axes[0].set_ylabel('delta')
  axes[1].set_ylabel('velocity')
  axes[2].set_ylabel('softmax weight (eq. 4)')
  axes[2].set_xlabel('step')
  axes[0].set_title('Auto-LR controller at each sync (zero before its warmup)')
  for ax in axes:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=4)
  return fig


def _hyperparams_figure(run: _RunArrays, plt: Any) -> Any | None:
  """Every explored hyperparameter (per-group LRs, then the rest): Fig. 3 per group; None if not logged."""
  names = run.recs.get('hyperparams', [{}])[-1].get('names')
  if not names or not all('values' in r for r in run.train):
    return None
  values = np.array([r['values'] for r in run.train], dtype=float)  # [S, G, N]
  bases = np.array([r['bases'] for r in run.train], dtype=float)  # [S, G]
  fig, axes = plt.subplots(len(names), 1, figsize=(8, 2.6 * len(names) + 0.6), sharex=True, squeeze=False)
  for g, (ax, name) in enumerate(zip(axes[:, 0], names)):
    for r in range(values.shape[2]):
      ax.plot(run.steps, values[:, g, r], color=run.colors[r], lw=0.6, alpha=0.7)
    ax.plot(run.steps, bases[:, g], 'k--', lw=1.4, label=f'base {name}')
    if name.startswith('learning_rate') and np.all(values[:, g] > 0):
      ax.set_yscale('log')
    ax.set_ylabel(name.replace('learning_rate/', 'LR ').replace('_', ' '), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc='upper right')
  axes[0, 0].set_title('Explored hyperparameters: each replica (colours) and the base (dashed)')
  axes[-1, 0].set_xlabel('step')
  return fig


def main(argv: list[str]) -> int:
  if len(argv) != 2 or argv[1] in ('-h', '--help'):
    print('usage: python -m hdet_jax.trainer.plots WORKDIR', file=sys.stderr)
    return 2
  try:
    paths = plot_workdir(argv[1])
  except FileNotFoundError as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  for p in paths:
    print(p)
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))
