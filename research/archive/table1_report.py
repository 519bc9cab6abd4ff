"""Writes ``table1.md``, ``table1.json`` and the figures from the run records of :mod:`research.table1`.

Everything here is computed from the records (and the experiment's settings, passed in); the only
hand-written text is the discussion in ``table1_discussion.md`` next to this file (written after
reading a full run; it is copied in only for the full run, whose numbers it refers to).
"""

from __future__ import annotations

import json
import math
import os
from typing import Iterator

import numpy as np

from hdet_jax.trainer.plots import save_figure

ROWS = ('baseline_low', 'baseline_high', 'warm_init', 'hdet_no_auto_lr', 'hdet_cold', 'hdet_full')
PAPER = {  # Table 1 of arXiv 2604.24708: (description, avg LR, train loss, crashed)
  'baseline_low': ('Standard DDP, alpha=0', '0.0001', 3.294, False),
  'baseline_high': ('Standard DDP, alpha=0', '0.0009', 4.169, True),
  'warm_init': ('Perturbed init, alpha=0', '0.0009', 4.674, True),
  'hdet_no_auto_lr': ('LR spread + warm init, no auto-LR', '0.0009', 3.280, False),
  'hdet_cold': ('LR spread + auto-LR, cold start', '0.0009', 3.281, False),
  'hdet_full': ('LR spread + warm init + auto-LR', '0.0009', 3.277, False),
}
TITLES = {
  'baseline_low': 'Baseline-Low',
  'baseline_high': 'Baseline-High',
  'warm_init': 'Warm-Init',
  'hdet_no_auto_lr': 'HDET w/o auto-LR',
  'hdet_cold': 'HDET w/o warm init',
  'hdet_full': 'HDET (full)',
  'avg_no_spread': 'Averaging, no spread',
  'spread_no_avg': 'Spread, no averaging',
  'hdet_cold_no_auto_lr': 'Spread + averaging (cold, no auto-LR)',
  'baseline_low_warm': 'Baseline-Low from the warm checkpoint',
}


def _lr(lr: float) -> str:
  return f'{lr:.3g}'


def _vals(runs, key):
  return [r[key] for r in runs]


def _fin(xs):
  return [x for x in xs if x is not None and math.isfinite(x)]


def _ms(xs, digits=3):
  """'mean ± std' over the finite values (sample std), with the count when some are missing."""
  f = _fin(xs)
  if not f:
    return 'n/a'
  s = f'{np.mean(f):.{digits}f}'
  if len(f) > 1:
    s += f' ± {np.std(f, ddof=1):.{digits}f}'
  if len(f) < len(xs):
    s += f' ({len(f)}/{len(xs)} finite)'
  return s


def _crashes(runs):
  c = sum(r['crashed'] for r in runs)
  nf = sum(r['nonfinite'] for r in runs)
  return f'{c}/{len(runs)}' + (f' ({nf} NaN)' if nf else '')


def _blowups(runs, log):
  worst = []
  for r in runs:
    loss = np.asarray(r['loss_mean'], dtype=np.float64)
    k = len(loss) // log
    w = loss[: k * log].reshape(k, log).mean(1) if k else loss
    if np.any(~np.isfinite(w)) or np.nanmax(w) > math.log(256):
      worst.append(float(np.nanmax(w)))
  return f'{len(worst)}/{len(runs)}' + (f' (worst {max(worst):.1f} nats)' if worst else '')


def _paired(a_runs, b_runs, key='val_bpb'):
  """Mean and std over seeds of a - b (same seeds), and whether |mean| > 2 standard errors."""
  d = [
    x[key] - y[key]
    for x, y in zip(a_runs, b_runs)
    if x[key] is not None and y[key] is not None and math.isfinite(x[key]) and math.isfinite(y[key])
  ]
  if not d:
    return math.nan, math.nan, False, 0
  m = float(np.mean(d))
  s = float(np.std(d, ddof=1)) if len(d) > 1 else math.nan
  sig = len(d) > 1 and abs(m) > 2 * s / math.sqrt(len(d))
  return m, s, sig, len(d)


def _fmt_paired(a, b, key='val_bpb'):
  m, s, sig, n = _paired(a, b, key)
  if n == 0:
    return 'n/a'
  if n == 1:
    return f'{m:+.3f} (1 seed)'
  return f'{m:+.3f} ± {s:.3f} ({"beyond" if sig else "within"} 2 s.e.)'


def _rel_dist(r, after=0):
  """Per sync: mean over replicas of ||theta_r - mean|| / ||mean||, for syncs at steps >= after."""
  out = []
  for step, d, norm in r['dists']:
    if step >= after and norm:
      out.append((step, float(np.mean(d)) / norm))
  return out


def _schedule(config):
  """The one-cycle base schedule of a recorded config (what the rows without auto-LR follow)."""
  from hdet_jax import schedules

  o = config['optim']
  return schedules.one_cycle(
    max_lr=o['max_lr'],
    total_steps=config['num_train_steps'],
    pct_start=o['pct_start'],
    div_factor=o['div_factor'],
    final_div_factor=o['final_div_factor'],
  )


def _schedule_lr(config, step):
  return float(_schedule(config)(step))


def write(out_dir, settings, sweep, choice, named, records, *, quick=False):
  """``out_dir/table1.md``, ``out_dir/table1.json`` and ``out_dir/figures/table1_*.png``; their paths."""
  fig_dir = os.path.join(out_dir, 'figures')
  os.makedirs(fig_dir, exist_ok=True)
  figs = _figures(fig_dir, settings, sweep, choice, named)
  md = _markdown(settings, sweep, choice, named, records, figs, quick)
  path, jpath = os.path.join(out_dir, 'table1.md'), os.path.join(out_dir, 'table1.json')
  with open(path, 'w', encoding='utf-8') as f:
    f.write(md)
  with open(jpath, 'w', encoding='utf-8') as f:
    json.dump(summary(settings, sweep, choice, named, records), f, indent=1, sort_keys=True)
    f.write('\n')
  return [path, jpath] + figs


def _finite(x):
  return x if x is not None and math.isfinite(x) else None


def _per_seed(runs) -> dict:
  """A row's or sweep point's numbers, one entry per seed (in the seeds' order)."""
  keys = ('val_bpb', 'final_train_loss', 'max_rise', 'crashed', 'wall_s')
  return {'seeds': [r['config']['seed'] for r in runs], **{k: [_finite(r[k]) for r in runs] for k in keys}}


def summary(settings, sweep, choice, named, records) -> dict:
  """The page's numbers as JSON: the sweep per peak LR, the LRs it chose, each row and mechanism run per seed."""
  lr = lambda x: f'{x:.{settings["lr_digits"]}g}'
  return {
    'steps': settings['steps'],
    'seeds': list(settings['seeds']),
    'sweep': {lr(x): _per_seed(runs) for x, runs in sorted(sweep.items())},
    'choice': {
      'best': choice['best'],
      'baseline_high': choice['high'],
      'baseline_low': choice['low'],
      'found_edge': choice['found_edge'],
      'mean_val_bpb': {lr(x): _finite(v) for x, v in sorted(choice['mean_bpb'].items())},
      'reasons': {lr(x): why for x, why in sorted(choice['reasons'].items())},
    },
    'rows': {row: {'peak_lr': runs[0]['config']['optim']['max_lr'], **_per_seed(runs)} for row, runs in named.items()},
    'runs': len(records),
    'run_time_s': sum(r['wall_s'] for r in records.values()),
  }


def _markdown(settings, sweep, choice, named, records, figs, quick):
  sections = (
    _intro(settings, named, records, quick),
    _sweep_section(settings, sweep, choice, named, figs),
    _rows_section(named, figs),
    _claims_section(named),
    _mechanism_section(settings, choice, named, figs),
    _controller_lr_section(settings, named),
    _discussion(quick),
  )
  return '\n'.join(line for section in sections for line in section) + '\n'


def _intro(settings, named, records, quick) -> Iterator[str]:
  """The title, the commands, the setup and the metrics."""
  c0 = named['hdet_full'][0]['config']
  names = named['hdet_full'][0]['hyperparam_names']
  total_s = sum(r['wall_s'] for r in records.values())
  n_runs = len(records)
  yield '# Table 1 of the HDET paper on the KJV byte-level LM\n'
  if quick:
    yield '**`--quick` smoke run: a tiny model and a few steps; these numbers mean nothing.**\n'
  yield (
    'Regenerate (runs whose record exists under `results/table1/runs/` are reused; `--report-only` redraws this '
    'page, `results/table1.json` and the figures byte for byte from those records alone):\n'
  )
  yield (
    '```bash\npython -m research.table1                # full: '
    f'{n_runs} runs\n'
    'python -m research.table1 --report-only  # redraw the report from the records, train nothing\n'
    'python -m research.table1 --quick        # smoke run of every stage on a tiny model\n```\n'
  )
  m = c0['model']
  yield (
    f"**Setup.** The trainer's byte-level transformer (d_model {m['d_model']}, {m['num_layers']} "
    f'layer{"s" if m["num_layers"] > 1 else ""}, '
    f'{m["num_heads"]} heads), sequence {c0["data"]["seq_len"]} bytes, {c0["data"]["batch_size"]} windows per '
    f'replica, N = {c0["hdet"]["num_replicas"] or 8} replicas on 8 simulated CPU devices, AdamW '
    f'(b2 {c0["optim"]["b2"]}, weight decay {c0["optim"]["weight_decay"]}), one-cycle base schedule '
    f'(pct_start {c0["optim"]["pct_start"]}, div {c0["optim"]["div_factor"]}, final div '
    f'{c0["optim"]["final_div_factor"]}: the schedule ends at max_lr / '
    f'{c0["optim"]["div_factor"] * c0["optim"]["final_div_factor"]:g}). Every run: '
    f'**{settings["steps"]} steps**, seeds {", ".join(map(str, settings["seeds"]))}. HDET rows: spread alpha = '
    f'{c0["hdet"]["spread"]}, sync every T = {c0["hdet"]["sync_every"]} steps, auto-LR from step '
    f'{settings["warmup"]} (sigma {c0["hdet"]["temperature"]}, lambda {c0["hdet"]["lr_of_lr"]}, beta '
    f'{c0["hdet"]["momentum"]}), **per-group LRs** ({", ".join(names)}; each group its own base LR, '
    f"velocity and permutation, like the paper's per-group runs, which had four groups). Warm rows start "
    f'from the averaged final model '
    f'of one Baseline-Low run (seed {settings["pretrain_seed"]}, {settings["steps"]} steps) plus eq. 10 noise '
    f'(nu = {c0["warm_init"]["nu"]}), then train {settings["steps"]} steps like every row. '
    f'Total: {n_runs} runs, {total_s / 60:.1f} min of run time (setup, compile and eval included) on a 2-core '
    'CPU shared with other jobs.\n'
  )
  yield (
    "**Metrics.** *Train loss*: mean over replicas of each replica's loss on its own batch, over the last "
    f"{settings['log']} steps (the trainer's summary; the paper's metric), in nats per byte; HDET replicas are "
    "measured at their spread points, not at their average. *Val bits/byte*: the replicas' averaged model "
    f"(the model HDET exports) on {c0['eval_windows']} held-out windows of the KJV's last 5%. *Crashed*: "
    f"a non-finite loss, or a final train loss more than {settings['blowup_nats']} nats above the run's best "
    f'{settings["log"]}-step mean ("loss grew unboundedly"). *Max rise*: the largest rise of the '
    f'{settings["log"]}-step mean '
    'loss above its running minimum (0 for a monotone run). Mean ± sample std over seeds. Paired '
    'differences use the same seed (same data order; cold rows also the same init).\n'
  )


def _sweep_section(settings, sweep, choice, named, figs) -> Iterator[str]:
  """Section 1: the plain data-parallel sweep and the LRs it picks."""
  high, low = choice['high'], choice['low']
  c0 = named['hdet_full'][0]['config']
  yield '## 1. Choosing the LRs: plain data-parallel sweep\n'
  yield (
    f'Plain data parallel (`research/configs/baseline_high.py`: no spread, no averaging, no controller) at '
    f'{len(sweep)} peak LRs (log grid, ratio 3). Rule, fixed before the sweep ran: `baseline_high` is the '
    f'lowest grid LR above the best one where some seed crashed or the mean val bits/byte is more than '
    f"{settings['degrade_bpb']} above the best LR's; `baseline_low` = `baseline_high` / 9 (two grid points "
    'lower, '
    "the paper's ratio).\n"
  )
  yield (
    '| peak LR | final train loss | val bits/byte | crashed | max rise | transient blow-ups | '
    'per-seed val bits/byte | '
    'verdict |'
  )
  yield '|---|---|---|---|---|---|---|---|'
  for lr in sorted(sweep):
    runs = sweep[lr]
    verdict = []
    if lr == choice['best']:
      verdict.append('best')
    if lr in choice['reasons']:
      verdict.append(('bad: ' if lr > choice['best'] else 'below the best LR: ') + choice['reasons'][lr])
    if math.isclose(lr, high):
      verdict.append('**= baseline_high**')
    if math.isclose(lr, low, rel_tol=1e-6):
      verdict.append('**= baseline_low**')
    per = ', '.join('NaN' if v is None else f'{v:.3f}' for v in _vals(runs, 'val_bpb'))
    yield (
      f'| {_lr(lr)} | {_ms(_vals(runs, "final_train_loss"))} | {_ms(_vals(runs, "val_bpb"))} | '
      f'{_crashes(runs)} | {_ms(_vals(runs, "max_rise"), 2)} | {_blowups(runs, settings["log"])} | {per} | '
      f'{"; ".join(verdict)} |'
    )
  yield ''
  yield (
    f'*Transient blow-ups* (added after the sweep ran, to describe what the crash rule above does not catch; it '
    f'changes no choice): seeds whose {settings["log"]}-step mean loss went above ln 256 = 5.55 nats (worse '
    'than a uniform '
    'guess over bytes) at some point, with the worst such mean; the crash rule does not count them when the '
    'loss came back to within 0.5 nats of its best.\n'
  )
  if not choice['found_edge']:
    yield "**No LR in the grid crashed or clearly degraded**: `baseline_high` is the grid's largest LR.\n"
  yield (
    f'Chosen: **baseline_high = {_lr(high)}**, **baseline_low = {_lr(low)}**; the HDET rows '
    f"use peak LR {_lr(high)} (the mean replica's LR; replicas span [{1 - c0['hdet']['spread']:g}, "
    f'{1 + c0["hdet"]["spread"]:g}] times it).\n'
  )
  yield f'![LR sweep](figures/{os.path.basename(figs[0])})\n'


def _rows_section(named, figs) -> Iterator[str]:
  """Section 2: the paper's six rows."""
  yield "## 2. The paper's six rows\n"
  yield (
    '| row | description | peak LR | paper: train loss | train loss | val bits/byte | crashed | max rise | wall s/run |'
  )
  yield '|---|---|---|---|---|---|---|---|---|'
  for row in ROWS:
    runs = named[row]
    desc, plr, ploss, pcrash = PAPER[row]
    lr = runs[0]['config']['optim']['max_lr']
    yield (
      f'| {TITLES[row]} | {desc} | {_lr(lr)} | {ploss:.3f}{"†" if pcrash else ""} (LR {plr}) | '
      f'{_ms(_vals(runs, "final_train_loss"))} | {_ms(_vals(runs, "val_bpb"))} | {_crashes(runs)} | '
      f'{_ms(_vals(runs, "max_rise"), 2)} | {np.mean(_vals(runs, "wall_s")):.0f} |'
    )
  yield "\n† the paper's crashed runs. Baseline-Low and Baseline-High are the sweep's runs at those LRs.\n"
  yield f'![Loss against step](figures/{os.path.basename(figs[1])})\n'
  yield f'![LR schedules per group](figures/{os.path.basename(figs[2])})\n'


def _claims_section(named) -> Iterator[str]:
  """Section 3: the paper's claims as paired differences."""
  yield "## 3. The paper's claims, measured here\n"
  yield (
    'Paired differences of val bits/byte (negative: the first is better), mean ± std over seeds; "beyond 2 '
    's.e." means |mean| > 2 std / sqrt(seeds).\n'
  )
  yield '| claim (paper §4) | comparison | val bits/byte difference | train loss difference |'
  yield '|---|---|---|---|'

  def cmp(claim, a, b):
    return (
      f'| {claim} | {TITLES[a]} - {TITLES[b]} | {_fmt_paired(named[a], named[b])} | '
      f'{_fmt_paired(named[a], named[b], "final_train_loss")} |'
    )

  yield f'| Baseline-High crashes | crashes | {_crashes(named["baseline_high"])} | |'
  yield f'| Warm-Init crashes too | crashes | {_crashes(named["warm_init"])} | |'
  yield (
    '| every HDET variant trains stably at that LR | crashes | '
    + ', '.join(f'{TITLES[r]} {_crashes(named[r])}' for r in ('hdet_no_auto_lr', 'hdet_cold', 'hdet_full'))
    + ' | |'
  )
  yield cmp('HDET w/o auto-LR beats Baseline-Low', 'hdet_no_auto_lr', 'baseline_low')
  yield cmp('HDET (full) beats Baseline-Low', 'hdet_full', 'baseline_low')
  yield cmp('HDET (full) beats Baseline-High', 'hdet_full', 'baseline_high')
  yield cmp('auto-LR helps (full < w/o auto-LR)', 'hdet_full', 'hdet_no_auto_lr')
  yield cmp('warm init helps (full < w/o warm init)', 'hdet_full', 'hdet_cold')
  yield cmp('warm init helps without HDET (control)', 'baseline_low_warm', 'baseline_low')
  yield cmp('HDET (full) beats the warm control', 'hdet_full', 'baseline_low_warm')
  yield ''


def _mechanism_section(settings, choice, named, figs) -> Iterator[str]:
  """Section 4: where any stability comes from."""
  high, low = choice['high'], choice['low']
  yield '## 4. Where any stability comes from\n'
  yield (
    'All at peak LR ' + _lr(high) + ' from a cold start unless stated; the control is at '
    f"{_lr(low)}. *Distance*: each replica's L2 distance from the replicas' mean just before a sync "
    f'(for runs that never average: every {settings["log"]} steps), relative to the norm of the mean, '
    'averaged over '
    'replicas; given as the mean over all syncs and at the last one.\n'
  )
  yield (
    '| run | spread | averaging | auto-LR | init | train loss | val bits/byte | crashed | max rise | '
    'distance (mean / last) | val bits/byte vs plain DP, same LR and init |'
  )
  yield '|---|---|---|---|---|---|---|---|---|---|---|'
  mech_rows = [
    'baseline_high',
    'avg_no_spread',
    'spread_no_avg',
    'hdet_cold_no_auto_lr',
    'hdet_cold',
    'warm_init',
    'hdet_no_auto_lr',
    'hdet_full',
    'baseline_low',
    'baseline_low_warm',
  ]
  for row in mech_rows:
    runs = named[row]
    c = runs[0]['config']
    h = c['hdet']
    T_ = h['sync_every']
    avg = f'every {T_}' if 0 < T_ <= c['num_train_steps'] else 'never'
    warm = 'warm' if row in ('warm_init', 'hdet_no_auto_lr', 'hdet_full', 'baseline_low_warm') else 'cold'
    dm = [np.mean([d for _, d in _rel_dist(r)]) for r in runs if _rel_dist(r)]
    dl = [_rel_dist(r)[-1][1] for r in runs if _rel_dist(r)]
    dist = f'{np.mean(dm):.2e} / {np.mean(dl):.2e}' if dm and np.mean(dm) > 1e-6 else '0 (identical)' if dm else 'n/a'
    ref = {
      'warm_init': None,
      'hdet_no_auto_lr': 'warm_init',
      'hdet_full': 'warm_init',
      'baseline_low': None,
      'baseline_low_warm': None,
      'baseline_high': None,
    }.get(row, 'baseline_high')
    vs = f'{_fmt_paired(runs, named[ref])} vs {TITLES[ref]}' if ref else ''
    yield (
      f'| {TITLES[row]} | {h["spread"]} | {avg} | {"on" if h["auto_lr"] else "off"} | {warm} | '
      f'{_ms(_vals(runs, "final_train_loss"))} | {_ms(_vals(runs, "val_bpb"))} | {_crashes(runs)} | '
      f'{_ms(_vals(runs, "max_rise"), 2)} | {dist} | {vs} |'
    )
  yield ''
  yield f'![Replica distance before each sync](figures/{os.path.basename(figs[3])})\n'


def _controller_lr_section(settings, named) -> Iterator[str]:
  """The LR the controller ended at, against the schedule."""
  yield '### The LR the controller ended at\n'
  yield (
    "Final base LR of each group (the mean replica's LR at the last step), against the one-cycle "
    "schedule's final value that the rows without auto-LR end at, and the largest base LR the controller set.\n"
  )
  yield (
    '| row | group | schedule final LR | controller final LR (per seed) | ratio to schedule | max base LR after '
    'warmup |'
  )
  yield '|---|---|---|---|---|---|'
  for row in ('hdet_cold', 'hdet_full'):
    runs = named[row]
    c = runs[0]['config']
    sched_end = _schedule_lr(c, c['num_train_steps'] - 1)
    for g, name in enumerate(runs[0]['hyperparam_names']):
      finals = [r['bases'][-1][g] for r in runs if r['bases']]
      peaks = [
        max(b[g] for b in r['bases'][settings['warmup'] :]) for r in runs if len(r['bases']) > settings['warmup']
      ]
      yield (
        f'| {TITLES[row]} | {name} | {sched_end:.2e} | {", ".join(f"{x:.2e}" for x in finals)} | '
        f'{np.mean(finals) / sched_end:.2f}x | {", ".join(f"{x:.2e}" for x in peaks)} |'
      )
  yield ''


def _discussion(quick) -> Iterator[str]:
  """The hand-written reading of the full run (not for --quick)."""
  disc = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'table1_discussion.md')  # research/
  if not quick and os.path.exists(disc):
    with open(disc, encoding='utf-8') as f:
      yield f.read()


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------

COLORS = {
  'baseline_low': '#999999',
  'baseline_high': '#555555',
  'warm_init': '#1b9e9e',
  'hdet_full': '#08306b',
  'hdet_cold': '#4a90d9',
  'hdet_no_auto_lr': '#9b59b6',
  'spread_no_avg': '#d95f02',
  'hdet_cold_no_auto_lr': '#66a61e',
  'avg_no_spread': '#e7298a',
  'baseline_low_warm': '#bbbbbb',
}


def _smooth(y, w):
  y = np.asarray(y, dtype=np.float64)
  if len(y) < w:
    return np.arange(len(y)), y
  k = np.ones(w) / w
  return np.arange(w - 1, len(y)), np.convolve(y, k, mode='valid')


def _figures(fig_dir, settings, sweep, choice, named):
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  figures = [
    (_sweep_figure(plt, settings, sweep, choice), 'table1_sweep.png'),
    (_loss_figure(plt, settings, named), 'table1_loss.png'),
    (_lr_figure(plt, settings, named), 'table1_lr.png'),
    (_distance_figure(plt, named), 'table1_distance.png'),
  ]
  return [save_figure(fig, fig_dir, name, dpi=None) for fig, name in figures]


def _sweep_figure(plt, settings, sweep, choice):
  """The sweep: each seed's val bits/byte against the peak LR, and the chosen LRs."""
  fig, ax = plt.subplots(figsize=(7, 4), dpi=90)
  lrs = sorted(sweep)
  for lr in lrs:
    for r in sweep[lr]:
      v = r['val_bpb']
      if r['crashed'] or v is None:
        ax.plot(lr, v if v is not None else np.nan, 'rx', ms=8)
      else:
        ax.plot(lr, v, 'o', color='#555555', ms=4, alpha=0.6)
  means = [np.mean(_fin(_vals(sweep[lr], 'val_bpb'))) if _fin(_vals(sweep[lr], 'val_bpb')) else np.nan for lr in lrs]
  ax.plot(lrs, means, '-', color='k', label='mean over seeds')
  for lr, lab, col in ((choice['high'], 'baseline_high', 'r'), (choice['low'], 'baseline_low', 'g')):
    ax.axvline(lr, color=col, ls='--', lw=1, label=f'{lab} = {_lr(lr)}')
  ax.set_xscale('log')
  ax.set_xlabel('peak LR (plain data parallel)')
  ax.set_ylabel('val bits/byte (averaged model)')
  ax.set_title(f'LR sweep, {settings["steps"]} steps; x = crashed')
  finite = _fin([r['val_bpb'] for lr in lrs for r in sweep[lr]])
  if finite:
    ax.set_ylim(min(finite) - 0.05, min(max(finite) + 0.05, min(finite) + 2.0))
  ax.legend(fontsize=8)
  return fig


def _loss_figure(plt, settings, named):
  """The counterpart of the paper's Fig. 2: loss against step."""
  fig, ax = plt.subplots(figsize=(8, 4.5), dpi=90)
  lo = []
  for row, ls in (
    ('baseline_low', '--'),
    ('baseline_high', '-'),
    ('warm_init', '-'),
    ('hdet_cold', '-'),
    ('hdet_full', '-'),
  ):
    for i, r in enumerate(named[row]):
      x, y = _smooth(r['loss_mean'], settings['log'])
      lo += list(y[np.isfinite(y)])
      ax.plot(
        x,
        y,
        ls,
        color=COLORS[row],
        lw=1.2,
        alpha=0.85,
        label=f'{TITLES[row]} (LR {_lr(r["config"]["optim"]["max_lr"])})' if i == 0 else None,
      )
  if lo:
    ax.set_ylim(min(lo) - 0.05, min(max(lo), min(lo) + 1.5))
  ax.set_xlabel('step')
  ax.set_ylabel(f'train loss, nats/byte ({settings["log"]}-step mean, mean over replicas)')
  ax.set_title("Counterpart of the paper's Fig. 2 (one line per seed)")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  return fig


def _lr_figure(plt, settings, named):
  """The counterpart of the paper's Fig. 3: per-group LRs."""
  names = named['hdet_full'][0]['hyperparam_names']
  fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.8), dpi=90, sharey=True)
  axes = np.atleast_1d(axes)
  c = named['baseline_high'][0]['config']
  steps = np.arange(c['num_train_steps'])
  sched = _schedule(c)
  sched_y = np.asarray([float(sched(s)) for s in steps])
  for g, (ax, name) in enumerate(zip(axes, names)):
    ax.plot(steps, sched_y, color='#555555', lw=2, label='one-cycle (baselines, w/o auto-LR)')
    for row in ('hdet_cold', 'hdet_full'):
      for i, r in enumerate(named[row]):
        b = np.asarray([x[g] for x in r['bases']])
        ax.plot(np.arange(len(b)), b, color=COLORS[row], lw=1, label=f'{TITLES[row]}: base' if i == 0 else None)
    r = named['hdet_full'][0]
    vmin = np.asarray([x[g] for x in r['values_min']])
    vmax = np.asarray([x[g] for x in r['values_max']])
    ax.fill_between(
      np.arange(len(vmin)),
      vmin,
      vmax,
      color=COLORS['hdet_full'],
      alpha=0.15,
      label="HDET (full) seed 0: replicas' range",
    )
    ax.axvline(settings['warmup'], color='k', ls=':', lw=1)
    ax.set_yscale('log')
    ax.set_title(f'group {name.split("/")[-1]}')
    ax.set_xlabel('step')
    ax.grid(alpha=0.3)
  axes[0].set_ylabel('learning rate')
  axes[0].legend(fontsize=7, loc='lower left')
  fig.suptitle("Counterpart of the paper's Fig. 3: per-group LRs (dotted: auto-LR starts)", fontsize=10)
  return fig


def _distance_figure(plt, named):
  """Mechanism: the replicas' distance from their mean before each sync."""
  fig, ax = plt.subplots(figsize=(8, 4.5), dpi=90)
  for row in ('spread_no_avg', 'warm_init', 'hdet_cold_no_auto_lr', 'hdet_cold', 'hdet_no_auto_lr', 'hdet_full'):
    for i, r in enumerate(named[row]):
      d = _rel_dist(r)
      if not d:
        continue
      ax.plot(
        [s for s, _ in d],
        [v for _, v in d],
        '.-',
        color=COLORS.get(row, 'k'),
        lw=1,
        ms=3,
        label=TITLES[row] if i == 0 else None,
      )
  ax.set_yscale('log')
  ax.set_xlabel('step')
  ax.set_ylabel('||theta_r - mean|| / ||mean|| (mean over replicas)')
  ax.set_title("Replicas' distance from their mean just before each sync")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  return fig
