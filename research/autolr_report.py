"""The auto-LR report: ``results/autolr.json``, ``results/autolr.md`` and its figures, from cached runs.

Everything here is recomputed from the run records that :mod:`research.autolr` collects by stage, so
the tables regenerate from the same records whenever a run is added.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from hdet_jax.trainer.plots import save_figure


def _stats(records: list[dict], key: str = 'val_bpb') -> dict:
  vals = [r[key] if r[key] is not None and r.get('diverged_at') is None else math.inf for r in records]
  finite = [v for v in vals if math.isfinite(v)]
  if not vals:
    return {'val_bpb': None, 'sd': None, 'n': 0}
  mean = float(np.mean(vals)) if len(finite) == len(vals) else None
  sd = float(np.std(finite, ddof=1)) if len(finite) > 1 and mean is not None else None
  return {'val_bpb': mean, 'sd': sd, 'n': len(vals), 'diverged': len(vals) - len(finite)}


def lr_index(record: dict) -> int:
  """Index of the LR that the report follows: the weight matrices' group if there are groups."""
  names = record.get('hyperparams') or []
  return names.index('learning_rate/weights') if 'learning_rate/weights' in names else 0


def lr_path(record: dict) -> tuple[np.ndarray, np.ndarray]:
  i = lr_index(record)
  steps = np.asarray([t['step'] for t in record['trajectory']])
  lrs = np.asarray([t['bases'][i] if t['bases'][i] is not None else np.nan for t in record['trajectory']], float)
  return steps, lrs


def _mean_of(records, fn):
  vals = [fn(r) for r in records]
  vals = [v for v in vals if v is not None and math.isfinite(v)]
  return float(np.exp(np.mean(np.log(vals)))) if vals else None


def _final_lr(r):
  return lr_path(r)[1][-1] if r['trajectory'] else None


def _peak_lr(r):
  return float(np.nanmax(lr_path(r)[1])) if r['trajectory'] else None


def signal_per_sync(record: dict) -> list[dict]:
  """Per sync: the least-squares slope of the compared losses on the followed LR's offset u = rho - 1,
  and its standard error from the residuals (the signal and its noise). A window after the followed LR
  settled (hdet.settle: its replicas trained at one LR) carries no signal and is left out, as does one of a run
  without a spread (its replicas' LRs all equal: e.g. the ensemble's spread-0 control)."""
  out = []
  i = lr_index(record)
  unspread = False  # whether the window ending at this sync trained after the LR settled
  for c in record.get('controller', []):
    values = np.asarray(c.get('values', []), float)
    losses = np.asarray(c.get('window_losses', []), float)
    was_unspread, unspread = unspread, unspread or bool(c.get('settled', [False] * (i + 1))[i])
    if was_unspread or values.ndim != 2 or losses.size != values.shape[1] or not np.all(np.isfinite(losses)):
      continue
    u = values[i] / np.mean(values[i]) - 1.0
    if not np.ptp(u) > 0:
      continue
    x = np.stack([np.ones_like(u), u - u.mean()], 1)
    coef, *_ = np.linalg.lstsq(x, losses, rcond=None)
    resid = losses - x @ coef
    dof = max(len(u) - 2, 1)
    se = math.sqrt(float(resid @ resid) / dof / float(((u - u.mean()) ** 2).sum()))
    # The loss difference across the spread (slope x range of u) and its noise.
    span = float(u.max() - u.min())
    out.append({'step': c['step'], 'diff': float(coef[1]) * span, 'noise': se * span})
  return out


HORIZONS = (25, 100)  # the window lengths whose line-search splits the report compares


def ask_threshold(points: list[tuple[float, bool]]) -> dict:
  """Where syncs switch from asking up to asking down: ``points`` are (LR as a multiple of a reference,
  whether the sync's line search asked for a larger LR). Returns the split of the sorted LRs that misplaces
  the fewest points (an up above it or a down below it): ``{'low', 'high'}`` bracket it (the neighbouring
  LRs; None past the ends, when every sync asked one way; when several splits tie, the bracket spans them
  all), with ``misplaced``, ``n`` and ``up`` counts."""
  pts = sorted(points)
  xs = [x for x, _ in pts]
  errors = [sum(up for _, up in pts[k:]) + sum(not up for _, up in pts[:k]) for k in range(len(pts) + 1)]
  best = [k for k, e in enumerate(errors) if e == min(errors)]  # split k: pts[:k] below it, pts[k:] above
  return {
    'low': xs[best[0] - 1] if best[0] > 0 else None,
    'high': xs[best[-1]] if best[-1] < len(xs) else None,
    'misplaced': int(min(errors)),
    'n': len(pts),
    'up': int(sum(up for _, up in pts)),
  }


def distinct_runs(records: list[dict]) -> list[dict]:
  """The records with each run once: a variant that trained another's run bit for bit (e.g. one whose extra rule
  never fired, or the same windows set another way) has the same compared losses and LRs at every sync, and would
  count that run twice."""
  seen, out = set(), []
  for r in records:
    key = json.dumps([(c['step'], c.get('window_losses'), c.get('values')) for c in r.get('controller', [])])
    if key not in seen:
      seen.add(key)
      out.append(r)
  return out


def compares_after(record: dict, window: int) -> bool:
  """Whether the run compared its replicas on a common batch, at their last iterates, after fixed windows of
  ``window`` steps, trained on the shared gradient (the records :func:`ask_thresholds` reads)."""
  from hdet_jax.trainer import config_lib, run_settings, schema

  h = record['config']['hdet']
  # however T was set (an old record's fields, completed as the schema reads them; not validated)
  windows = run_settings.sync_windows(schema.complete(config_lib.flatten(record['config'])))
  # (records written before 1.0 may hold fields removed then, read here as data: a tail's mean, or an annealed
  # copy, is another point than the last iterate, so other asks; early windows are other windows)
  return (
    h.get('score') == 'common'
    and windows == (window,)
    and not h.get('early_sync_every', 0)
    and not h.get('score_tail', 0)
    and not h.get('score_anneal', 0)
    and not h.get('low_communication', False)
  )  # (replicas on their own gradients: another regime)


def ask_thresholds(records: list[dict], reference, window: int = 100, min_runs: int = 6) -> list[dict]:
  """Per sync step shared by at least ``min_runs`` records that compared the replicas on a common batch after
  windows of ``window`` steps, at their last iterates (the asks depend on the horizon and on the point scored):
  :func:`ask_threshold` of their LRs as multiples
  of ``reference(step)`` (the sweep's best schedule), with a sync asking up when its losses fall with the LR
  offset (the slope of :func:`signal_per_sync`)."""
  by_step = {}
  for r in distinct_runs([r for r in records if compares_after(r, window)]):
    lrs = {
      c['step']: float(np.mean(np.asarray(c['values'], float)[lr_index(r)]))
      for c in r.get('controller', [])
      if c.get('values')
    }
    for sig in signal_per_sync(r):
      by_step.setdefault(sig['step'], []).append((lrs[sig['step']] / reference(sig['step']), sig['diff'] < 0))
  return [{'step': step, **ask_threshold(pts)} for step, pts in sorted(by_step.items()) if len(pts) >= min_runs]


def mean_bpb(records: list[dict]) -> float:
  """Mean final val bits/byte; a diverged or non-finite run counts as infinitely bad."""
  vals = [r['val_bpb'] if r['val_bpb'] is not None and r['diverged_at'] is None else math.inf for r in records]
  return float(np.mean(vals)) if vals else math.nan


def grid_best(grid: dict[float, list[dict]]) -> tuple[float, float]:
  """(peak LR, mean val bits/byte) of the grid point with the lowest mean over its seeds."""
  complete = {lr: rs for lr, rs in grid.items() if rs}
  lr = min(complete, key=lambda k: mean_bpb(complete[k]))
  return lr, mean_bpb(complete[lr])


def summarize(runs: dict, anchor_lr: float | None, default_variant: str) -> dict:
  grid = runs['grid']
  res = {'grid': {f'{lr:.4g}': _stats(rs) for lr, rs in grid.items()}, 'anchor_lr': anchor_lr}
  complete = {lr: rs for lr, rs in grid.items() if rs}
  if complete:
    best_lr, best = grid_best(complete)
    res['grid_best'] = {
      'lr': best_lr,
      'val_bpb': best,
      'n_seeds': len(complete[best_lr]),
      'sd': _stats(complete[best_lr])['sd'],
    }

  def hdet_block(by_start):
    block = {}
    for st, rs in by_start.items():
      if not rs:
        continue
      s = _stats(rs)
      s['final_lr'] = _mean_of(rs, _final_lr)
      s['peak_lr'] = _mean_of(rs, _peak_lr)
      s['start_lr'] = rs[0]['config']['optim']['max_lr']
      if res.get('grid_best') and s['val_bpb'] is not None:
        s['vs_grid_best_pct'] = 100.0 * (s['val_bpb'] / res['grid_best']['val_bpb'] - 1.0)
      block[st] = s
    return block

  res['variants'] = {v: hdet_block(b) for v, b in runs['hdet'].items() if any(b.values())}
  res['hdet'] = res['variants'].get(default_variant, {})
  res['default_variant'] = default_variant
  res['peers'] = {p: _stats(rs) for p, rs in runs['peers'].items() if rs}
  return res


def write(
  out_dir: str, runs: dict, anchors: dict, *, default_variant: str, quick: bool = False, task: dict | None = None
) -> list[str]:
  """The report from the records of each optimizer by stage (``runs[optim]``: see ``autolr.collect``) and
  each optimizer's anchor LR (None before it is fixed); optimizers without grid records are left out.

  ``task``: the ``--config.*`` overrides of a task other than the default one (named in the report,
  which then leaves out the hand-written reading of the default task)."""
  os.makedirs(out_dir, exist_ok=True)
  results, all_runs = {}, {}
  for optim, by_stage in runs.items():
    if not any(by_stage['grid'].values()):
      continue
    results[optim] = summarize(by_stage, anchors.get(optim), default_variant)
    best = _best_schedule(by_stage['grid'], results[optim].get('grid_best'))
    if best is not None:
      reference = lambda step, best=best: float(best[min(int(step), len(best) - 1)])
      records = [r for by_start in by_stage['hdet'].values() for rs in by_start.values() for r in rs]
      results[optim]['ask_thresholds'] = {str(t): ask_thresholds(records, reference, window=t) for t in HORIZONS}
    all_runs[optim] = by_stage
  paths = []
  jpath = os.path.join(out_dir, 'autolr.json')
  with open(jpath, 'w', encoding='utf-8') as f:
    json.dump(results, f, indent=1)
  paths.append(jpath)
  fig_dir = os.path.join(out_dir, 'figures')
  paths += _figures(fig_dir, results, all_runs, shown=(default_variant, 'paper'))
  mpath = os.path.join(out_dir, 'autolr.md')
  with open(mpath, 'w', encoding='utf-8') as f:
    f.write(_markdown(results, all_runs, quick, task or {}))
  paths.append(mpath)
  return paths


def _best_schedule(grid: dict, grid_best: dict | None) -> np.ndarray | None:
  """[S] the grid-best run's scheduled LR at every step (its own config's schedule), or None without one."""
  if not grid_best or not grid.get(grid_best['lr']):
    return None
  import jax
  from hdet_jax.trainer import config_lib, run_settings, schema

  f = schema.complete(config_lib.flatten(grid[grid_best['lr']][0]['config']))  # (a record's: not validated)
  return np.asarray(jax.jit(jax.vmap(run_settings.schedule(f)))(np.arange(int(f['num_train_steps']))), float)


def _fmt(s: dict | None, digits=3) -> str:
  if not s or s.get('val_bpb') is None:
    return 'diverged' if s and s.get('diverged') else '-'
  sd = f' ± {s["sd"]:.{digits}f}' if s.get('sd') is not None else ''
  return f'{s["val_bpb"]:.{digits}f}{sd} (n={s["n"]})'


def _g(x) -> str:
  return '-' if x is None else f'{x:.3g}'


def _markdown(results: dict, all_runs: dict, quick: bool, task: dict) -> str:
  overrides = ' '.join(f'--config.{k}={v}' for k, v in sorted(task.items()))
  lines = [
    '# Auto-LR against an LR sweep' + (' (quick smoke run)' if quick else ''),
    '',
    f'Generated by `python -m research.autolr{" " + overrides if overrides else ""}` from the run records '
    'in `results/autolr/runs/`; final validation bits/byte of the averaged model, mean ± sd over seeds '
    '(n = seeds run so far).',
    '',
  ]
  for optim, res in results.items():
    lines += [f'## {optim}', '']
    gb = res.get('grid_best')
    if gb:
      lines += [
        f'Grid best: peak LR {gb["lr"]:.4g}, {gb["val_bpb"]:.4f} bits/byte ({gb["n_seeds"]} seeds). '
        f"HDET starts are multiples of the first seed's best, {_g(res['anchor_lr'])}.",
        '',
      ]
    lines += [
      '| method | start (peak LR) | val bits/byte | vs grid best | compute (runs) | final LR | peak LR |',
      '|---|---|---|---|---|---|---|',
    ]
    for lr, s in res['grid'].items():
      lines.append(f'| plain DP grid point | {lr} | {_fmt(s)} | | 1 | | |')
    if gb:
      lines.append(
        f'| **grid best (the sweep)** | {gb["lr"]:.4g} | **{gb["val_bpb"]:.3f}** | 0 | {len(res["grid"])} | | |'
      )
    for v, block in res['variants'].items():
      for st, s in block.items():
        pct = s.get('vs_grid_best_pct')
        lines.append(
          f'| HDET `{v}` | {st} ({s["start_lr"]:.3g}) | {_fmt(s)} | '
          f'{"-" if pct is None else f"{pct:+.1f}%"} | 1 | {_g(s["final_lr"])} | {_g(s["peak_lr"])} |'
        )
    for p, s in res['peers'].items():
      pct = None if not gb or s['val_bpb'] is None else 100 * (s['val_bpb'] / gb['val_bpb'] - 1)
      lines.append(f'| {p} (optax.contrib) | default | {_fmt(s)} | {"-" if pct is None else f"{pct:+.1f}%"} | 1 | | |')
    lines.append('')
    sig_rows = []
    for v, by_start in all_runs[optim]['hdet'].items():
      for st, rs in by_start.items():
        if rs:
          sig = signal_per_sync(rs[0])
          if sig:
            ratio = np.asarray([abs(x['diff']) / x['noise'] for x in sig if x['noise'] > 0])
            sig_rows.append(
              f'| `{v}` | {st} | {len(sig)} | {np.median(np.abs([x["diff"] for x in sig])):.4f} | '
              f'{np.median([x["noise"] for x in sig]):.4f} | {np.median(ratio):.2f} | '
              f'{np.mean(ratio > 2):.0%} |'
            )
    if sig_rows:
      lines += (
        [
          'The signal each controller compares (first seed): per sync, the least-squares slope of the compared '
          'losses on the LR offset, as the loss difference across the spread, against its standard error.',
          '',
          '| variant | start | syncs | median abs difference (nats) | median noise (nats) | median ratio | '
          'syncs with ratio > 2 |',
          '|---|---|---|---|---|---|---|',
        ]
        + sig_rows
        + ['']
      )
    lines += _threshold_lines(res.get('ask_thresholds'))
    for name in (f'autolr_lr_{optim}.png', f'autolr_signal_{optim}.png'):
      lines.append(f'![{name}](figures/{name})')
    lines.append('')
  discussion = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'autolr_discussion.md')
  if not quick and not task and os.path.exists(discussion):
    lines += ['', open(discussion, encoding='utf-8').read()]
  return '\n'.join(lines) + '\n'


def _threshold_lines(by_horizon: dict | None) -> list[str]:
  """The split table: a row per sync after a multiple of 100 steps, a column per horizon T."""
  if not by_horizon or not any(by_horizon.values()):
    return []

  def where(t):
    if t is None:
      return ''
    if t['low'] is None or t['high'] is None:
      return f'below {t["high"]:.3g}x' if t['low'] is None else f'above {t["low"]:.3g}x'
    low, high = f'{t["low"]:.3g}', f'{t["high"]:.3g}'
    return f'{low}x' if low == high else f'{low}x-{high}x'

  rows = {h: {t['step']: t for t in ts} for h, ts in by_horizon.items()}
  steps = sorted({s for r in rows.values() for s in r if (s + 1) % 100 == 0})
  heads = [f'T={h}: the split (x grid best) | T={h}: up / syncs, misplaced' for h in rows]
  cell = lambda t: f'{where(t)} | ' + ('' if t is None else f'{t["up"]} / {t["n"]}, {t["misplaced"]}')
  return (
    [
      'Where the line search turns: at each sync, every run that compared the replicas on a common batch '
      'after windows of T steps (every such variant, start and seed) places the base LR as a multiple of the '
      "grid best's scheduled LR at that step; the split is where the syncs below it ask for a larger LR and "
      'those above it for a smaller one (misplaced: syncs on the wrong side of it). A controller that follows '
      "the asks tracks this split, not the sweep's best (1x).",
      '',
      '| sync after step | ' + ' | '.join(heads) + ' |',
      '|---|' + '---|---|' * len(rows),
    ]
    + [f'| {s + 1} | ' + ' | '.join(cell(rows[h].get(s)) for h in rows) + ' |' for s in steps]
    + ['']
  )


def _figures(fig_dir: str, results: dict, all_runs: dict, shown: tuple[str, ...]) -> list[str]:
  """The LR-trajectory and signal figures of the ``shown`` variants (the default first; every variant's
  numbers are in the tables)."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  os.makedirs(fig_dir, exist_ok=True)
  paths = []
  colors = {'low': 'tab:blue', 'best': 'tab:green', 'high': 'tab:red'}
  styles = ['-', ':', '--', '-.']
  for optim, runs in all_runs.items():
    res = results[optim]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    gb = res.get('grid_best')
    best = _best_schedule(runs['grid'], gb)
    if best is not None:
      ax.plot(np.arange(len(best)), best, color='k', lw=2, alpha=0.5, label=f'grid best schedule (peak {gb["lr"]:.3g})')
    for style, v, st, rs in _styled_hdet_runs(runs, styles, shown):
      for j, r in enumerate(rs):
        s, lr = lr_path(r)
        ax.plot(s, lr, style, color=colors[st], alpha=0.8, label=f'{v} {st}' if j == 0 else None)
    _label(ax, 'step', 'base LR (weights group)', f'{optim}: HDET base-LR trajectories from three starts')
    paths.append(save_figure(fig, fig_dir, f'autolr_lr_{optim}.png'))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for style, v, st, rs in _styled_hdet_runs(runs, styles, shown):
      sig = signal_per_sync(rs[0])
      if not sig:
        continue
      steps = [x['step'] for x in sig]
      ratio = [abs(x['diff']) / x['noise'] if x['noise'] > 0 else np.nan for x in sig]
      ax.plot(steps, ratio, style, color=colors[st], alpha=0.8, label=f'{v} {st}')
    ax.axhline(2.0, color='k', lw=0.8, ls=':', label='|t| = 2')
    _label(
      ax,
      'step (sync)',
      '|loss difference across the spread| / its noise',
      f"{optim}: the controller's signal per sync (first seed)",
    )
    paths.append(save_figure(fig, fig_dir, f'autolr_signal_{optim}.png'))
  return paths


def _label(ax, xlabel: str, ylabel: str, title: str) -> None:
  """Both figures' axes: a log y scale, the labels, the title and the legend."""
  ax.set_yscale('log')
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.legend(fontsize=7, ncol=2)


def _styled_hdet_runs(runs: dict, styles: list[str], shown: tuple[str, ...]):
  """(line style of the variant, variant, start, records) for every start of the ``shown`` variants that has
  records, styled in ``shown``'s order."""
  for k, v in enumerate(x for x in shown if x in runs['hdet']):
    for st, rs in runs['hdet'][v].items():
      if rs:
        yield styles[k % len(styles)], v, st, rs
