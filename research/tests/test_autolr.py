"""research/autolr: the --quick smoke run of every stage, its cache, its report and its bad input."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from research import autolr as A
from research import autolr_report as R

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_runs_every_stage_and_reuses_its_cache(tmp_path, capsys):
  A.main(['--quick', '--workdir', str(tmp_path)])
  out = json.load(open(tmp_path / 'quick' / 'autolr.json'))
  res = out['adamw']
  assert res['grid_best']['lr'] in A.QUICK_GRIDS['adamw']
  assert set(res['grid']) == {f'{lr:.4g}' for lr in A.QUICK_GRIDS['adamw']}
  high = res['variants']['fit_common_k1']['high']
  assert high['start_lr'] == pytest.approx(10 * res['anchor_lr'])
  assert np.isfinite(high['val_bpb']) and high['final_lr'] > 0
  assert np.isfinite(res['peers']['adam_plateau']['val_bpb'])
  for f in ('autolr.md', 'figures/autolr_lr_adamw.png', 'figures/autolr_signal_adamw.png'):
    assert (tmp_path / 'quick' / f).stat().st_size > 0
  records = sorted((tmp_path / 'quick' / 'records' / 'adamw').glob('*.json'))
  assert len(records) == 5  # 2 grid points, 1 HDET start, 1 peer, the anchor
  before = {p: p.read_bytes() for p in records}
  capsys.readouterr()
  A.main(['--quick', '--workdir', str(tmp_path)])  # every run cached: nothing trains again
  assert 'val ' not in capsys.readouterr().out
  assert {p: p.read_bytes() for p in records} == before


def test_signal_per_sync_matches_a_direct_regression():
  # Losses exactly linear in the LR offset: the difference across the spread is slope x range, noise 0.
  rho = np.array([0.75, 1.25, 1.0, 0.9, 1.1, 0.8, 1.2, 1.05])
  losses = 3.0 - 0.4 * (rho - 1.0)
  rec = {
    'hyperparams': ['learning_rate'],
    'controller': [{'step': 24, 'values': [list(1e-3 * rho)], 'window_losses': list(losses)}],
  }
  (sig,) = R.signal_per_sync(rec)
  assert sig['diff'] == pytest.approx(-0.4 * (rho.max() - rho.min()), rel=1e-6)  # the loss change across the spread
  assert sig['noise'] == pytest.approx(0.0, abs=1e-9)


def test_signal_per_sync_leaves_out_the_windows_after_the_lr_settled():
  """hdet.settle: the sync that settles the LR still read a spread window (kept); the windows after it trained
  every replica at one LR (no slope to fit: left out, not a division by their zero spread)."""
  rho = np.array([0.75, 1.25, 1.0, 0.9, 1.1, 0.8, 1.2, 1.05])
  spread = {'values': [list(1e-3 * rho)], 'window_losses': list(3.0 - 0.4 * (rho - 1.0))}
  flat = {'values': [[1e-3] * 8], 'window_losses': [2.5] * 8, 'settled': [True]}
  rec = {
    'hyperparams': ['learning_rate'],
    'controller': [
      {'step': 24, **spread},
      {'step': 49, **spread, 'settled': [True]},
      {'step': 74, **flat},
      {'step': 99, **flat},
    ],
  }
  assert [s['step'] for s in R.signal_per_sync(rec)] == [24, 49]
  # A run without a spread (the ensemble's spread-0 control): no window has a slope, none flagged settled.
  control = {
    'hyperparams': ['learning_rate'],
    'controller': [{'step': s, 'values': [[1e-3] * 8], 'window_losses': list(2.5 + 0.01 * rho)} for s in (24, 49)],
  }
  assert R.signal_per_sync(control) == []


def test_ask_threshold_splits_where_the_asks_turn():
  """Hand-made cases: a clean split, one misplaced sync (two splits tie: the bracket spans both), and every
  sync asking one way."""
  clean = [(0.1, True), (0.3, True), (0.5, False), (2.0, False)]
  assert R.ask_threshold(clean) == {'low': 0.3, 'high': 0.5, 'misplaced': 0, 'n': 4, 'up': 2}
  noisy = [(0.1, True), (0.2, False), (0.3, True), (0.5, False), (2.0, False)]
  assert R.ask_threshold(noisy) == {'low': 0.1, 'high': 0.5, 'misplaced': 1, 'n': 5, 'up': 2}
  one_off = [(0.1, True), (0.2, True), (0.3, False), (0.4, True), (0.5, False), (0.6, False), (2.0, False)]
  assert R.ask_threshold(one_off) == {'low': 0.2, 'high': 0.5, 'misplaced': 1, 'n': 7, 'up': 3}
  down = [(0.1, False), (0.4, False)]
  assert R.ask_threshold(down)['low'] is None and R.ask_threshold(down)['high'] == 0.1
  up = [(0.1, True), (0.4, True)]
  assert R.ask_threshold(up)['high'] is None and R.ask_threshold(up)['low'] == 0.4


def test_ask_thresholds_read_each_runs_slope_against_the_reference_schedule():
  """Synthetic records on the bowl loss (log(lr / 2 ref))^2: a run below twice the reference asks up, above
  it down, so the split at every sync sits between the runs around 2x; a window-scored, T=25 or tail-scored run
  is left out."""
  ref = lambda step: 1e-3 * (1 + step / 100)

  def record(scale, score='common', sync_every=100, tail=0.0):
    rows = []
    for step in (99, 199):
      lrs = scale * ref(step) * np.linspace(0.75, 1.25, 8)
      rows.append(
        {'step': step, 'values': [lrs.tolist()], 'window_losses': (np.log(lrs / (2 * ref(step))) ** 2).tolist()}
      )
    return {
      'hyperparams': ['learning_rate'],
      'config': {'hdet': {'score': score, 'sync_every': sync_every, 'score_tail': tail}},
      'controller': rows,
    }

  records = [record(s) for s in (0.5, 1.0, 1.5, 3.0, 4.0, 8.0)] + [
    record(5.0, 'window'),
    record(0.1, sync_every=25),
    record(6.0, tail=0.5),
  ]
  rows = R.ask_thresholds(records, ref)
  assert [r['step'] for r in rows] == [99, 199]
  for r in rows:
    assert r['n'] == 6 and r['up'] == 3 and r['misplaced'] == 0
    assert r['low'] == pytest.approx(1.5) and r['high'] == pytest.approx(3.0)


def test_bad_override_is_one_error_line(tmp_path):
  r = subprocess.run(
    [sys.executable, '-m', 'research.autolr', '--quick', '--workdir', str(tmp_path), '--config.hdet.spred=0.2'],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 2
  assert r.stderr.strip().startswith('error:') and 'spred' in r.stderr and len(r.stderr.strip().splitlines()) == 1
  assert not any(tmp_path.iterdir())  # nothing written


def test_grid_subset_names_the_grid_or_is_refused(capsys):
  args, _ = A.parse_args(['--optim', 'adamw', '--grid-lrs', '0.015,0.03'])
  assert args.grid_lrs == [0.015, 0.03]
  with pytest.raises(SystemExit) as e:  # 0.02 is not a point of the AdamW grid (0.00375 * 2**k)
    A.parse_args(['--optim', 'adamw', '--grid-lrs', '0.015,0.02'])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert '--grid-lrs' in err and '[0.02]' in err and '0.015' in err


def _replay_fit(rec):
  """Each sync's taken step of a recorded 'fit' run, recomputed in float64 from the record alone (the
  compared losses and each replica's LR) with the oracles: the fit, the Rprop gain gated on |b| > 2 se,
  the trust region and, after the stop, 'rise' (or 'hold'); with hdet.settle, the climb settles at the second
  ask down beyond 2 se in a row once the LR has risen, and steps nothing after; with hdet.backoff, no window's
  mean training loss rose beyond the larger of ``k sqrt(2) se`` and ``f |L|`` over the window before (the record's
  train_loss and its se), and the record says none backed off. Returns the steps and, per sync, whether the LR had
  settled after it."""
  from oracles import numpy_accelerate, numpy_fit, numpy_slope_stderr

  h, steps = rec['config']['hdet'], rec['config']['num_train_steps']
  assert h.get('overshoot', 1.0) == 1.0  # (a record made before 1.0 holds the field, at the only value left)
  stop = int(h['stop_fraction'] * steps) if h['stop_fraction'] < 1 else None
  xtx, xty, fitted, sure, out, settled = np.zeros((2, 2)), np.zeros(2), [], [], [], []
  was_down, before = False, None
  for c in rec['controller']:
    if h.get('backoff'):  # the guard: a rise beyond both margins over the window before (this replay: none fired)
      loss = c['train_loss']
      fires = before is not None and not (
        loss - before[0] <= max(h['backoff_stderrs'] * np.sqrt(2.0) * before[1], h['backoff_fraction'] * abs(before[0]))
      )
      assert not fires and not c.get('backed_off', False), (c['step'], loss, before)
      before = (loss, c['train_loss_se'])
    lr = np.asarray(c['values'][0], np.float64)
    u = (lr / lr.mean() - 1.0)[:, None]  # the multipliers average to 1
    done = bool(settled and settled[-1])
    if done:
      u = np.zeros_like(u)  # a settled LR's replicas trained at the base
    if stop is not None and c['step'] + 1 > stop and h.get('after_stop', 'hold') == 'hold':
      out.append(out[-1] if out else 0.0)  # held: the record repeats the last step
      settled.append(False)
      continue
    b, _, step, xtx, xty = numpy_fit(xtx, xty, c['window_losses'], u, [True], h['memory'], [h['trust']])
    se = numpy_slope_stderr(c['window_losses'], u)[0] if not done else np.inf
    fitted.append(step[0])
    sure.append(abs(b[0]) > 2 * se)
    taken = numpy_accelerate(fitted, h.get('step_growth', 1.0), h.get('max_gain', 4.0), h['trust'], sure)[-1]
    rise_only = stop is not None and c['step'] + 1 > stop
    down = b[0] > 2 * se
    ends = bool(h.get('settle')) and rise_only and sum(out) > 0 and down and was_down
    out.append(0.0 if done else max(taken, 0.0) if rise_only else taken)
    settled.append(done or ends)
    was_down = down
  return np.asarray(out), settled


def test_recorded_default_controller_runs_replay_with_the_oracles():
  """Every committed record of the default variant is the run of today's controller: its per-sync steps and the
  sync where its climb settled, recomputed from the record's own losses and LRs by the float64 oracles, are the
  steps it took and the sync it settled at."""
  runs = pathlib.Path(REPO) / 'results' / 'autolr' / 'runs' / 'default'
  paths = [
    p
    for o in ('adamw', 'sgd')
    for st in A.STARTS
    for seed in A.SEEDS
    if (p := runs / (A.hdet_name(o, A.DEFAULT_VARIANT, st, seed) + '.json')).exists()
  ]
  assert len(paths) == 18, (
    f'{len(paths)} records of the default variant {A.DEFAULT_VARIANT!r}: run '
    f'python -m research.autolr --stage hdet --variants {A.DEFAULT_VARIANT}'
  )
  settle_syncs = []
  for p in paths:
    rec = json.load(open(p))
    if rec.get('diverged_at') is not None:
      continue
    want, settled = _replay_fit(rec)
    got = np.asarray([c['delta'] for c in rec['controller']])
    np.testing.assert_allclose(got, want, atol=1e-3, err_msg=p.name)
    # hdet.settle: the LR settles at the sync the oracle says (or, where the oracle says never, never).
    assert [bool(c.get('settled', [False])[0]) for c in rec['controller']] == settled, p.name
    settle_syncs.append(settled.index(True) if any(settled) else None)
  # 17 of the 18 settle, at the 3rd-10th sync; SGD from 10x high, seed 1, never asks down twice in a row beyond 2 se.
  assert sum(s is not None for s in settle_syncs) == 17 and all(2 <= s <= 9 for s in settle_syncs if s is not None)


def test_the_guard_never_fired_on_the_lm_so_its_runs_are_the_unguarded_defaults():
  """The default's guard (back-off beyond 2 se and 5%, with rollback) is on in all 18 of its LM records and fired
  in none: each is the run of the default before it (UNGUARDED_DEFAULT), the same validation metric and per-step
  training trajectory, bit for bit (the guard reads the window's loss; it changes nothing until it fires)."""
  runs = pathlib.Path(REPO) / 'results' / 'autolr' / 'runs' / 'default'
  pairs = [
    (
      runs / (A.hdet_name(o, A.DEFAULT_VARIANT, st, seed) + '.json'),
      runs / (A.hdet_name(o, A.UNGUARDED_DEFAULT, st, seed) + '.json'),
    )
    for o in ('adamw', 'sgd')
    for st in A.STARTS
    for seed in A.SEEDS
  ]
  assert all(a.exists() and b.exists() for a, b in pairs)
  for a, b in pairs:
    guarded, unguarded = json.load(open(a)), json.load(open(b))
    h = guarded['config']['hdet']
    assert (h['backoff'], h['rollback'], h['backoff_stderrs'], h['backoff_fraction']) == (True, True, 2.0, 0.05)
    assert not unguarded['config']['hdet'].get('backoff', False)
    assert not any(c.get('backed_off', False) for c in guarded['controller']), a.name
    assert guarded['val_bpb'] == unguarded['val_bpb'] and guarded['trajectory'] == unguarded['trajectory'], a.name


def test_the_report_averages_over_the_sweeps_seeds_whatever_trained():
  """--seeds picks what trains; the report stays over autolr.SEEDS (fresh seeds would otherwise rewrite
  results/autolr.md over themselves) unless --report-seeds says otherwise; a quick run reports its own seed."""
  args, _ = A.parse_args(['--seeds', '3,4', '--report-only'])
  assert args.seeds == [3, 4] and args.report_seeds == list(A.SEEDS)
  args, _ = A.parse_args(['--seeds', '3,4', '--report-seeds', '3,4,5'])
  assert args.report_seeds == [3, 4, 5]
  args, _ = A.parse_args(['--quick', '--seeds', '2'])
  assert args.report_seeds == [2]


def test_retired_variants_are_refused_and_their_records_still_reported(capsys):
  """The variants whose knob was removed in 1.0 train no more (--variants refuses them), but the report reads their
  committed records, in the order they were measured; every live variant sets only fields today's config has."""
  from hdet_jax.trainer import compat, config_lib

  with pytest.raises(SystemExit) as e:
    A.parse_args(['--variants', 'fit_lr,fit_common'])
  assert e.value.code == 2 and 'retired in 1.0' in capsys.readouterr().err
  assert set(A.RETIRED_VARIANTS).isdisjoint(A.VARIANT_SETTINGS) and len(A.RETIRED_VARIANTS) == 14
  assert A.REPORTED_VARIANTS[:4] == ('paper', 'paper_common', 'fit_window', 'fit_common')
  assert set(A.REPORTED_VARIANTS) == set(A.VARIANT_SETTINGS) | set(A.RETIRED_VARIANTS)
  base = config_lib.flatten(A.base_config({}, False))
  for v in A.VARIANT_SETTINGS:
    o = A.run_overrides('hdet', 'adamw', 0.03, 0, 1500, variant=v)
    assert set(o) <= set(base) and not set(o) & set(compat.REMOVED), v
