"""research/finer_grid.py: the LR bracket on a grid a factor 2^0.5 apart, its narrower first rungs composed from
one bracket's record (checked against a real bracket), and its committed rows recomputed from the records."""

import json
import math
import os

import numpy as np
import pytest

from research.archive import finer_grid as exp
from research import wider_rung


def _record(first: dict, last: dict, kept_lr: float) -> dict:
  lrs = sorted(first)
  return {
    'lrs': lrs,
    'kept_lr': kept_lr,
    'rungs': [
      {'losses': {f'{lr:.6g}': v for lr, v in first.items()}},
      {'losses': {f'{lr:.6g}': v for lr, v in last.items()}},
    ],
  }


def _oracle_kept(first: dict, last: dict, keep: int) -> float:
  """Plain Python: the ``keep`` lowest first-rung losses (NaN last, ties to the lower LR), then the lowest last-rung
  loss among them."""
  rank = lambda d: sorted(d, key=lambda lr: (d[lr] if d[lr] == d[lr] else float('inf'), lr))
  pool = rank(first)[:keep]
  return rank({lr: last[lr] for lr in pool})[0]


def test_kept_at_matches_a_plain_oracle():
  first = {0.1: 3.0, 0.2: 2.5, 0.4: 2.0, 0.8: 2.0, 1.6: 1.5, 3.2: float('nan')}
  last = {1.6: 1.4, 0.4: 1.2, 0.8: 1.3, 0.2: 1.1}  # (the 4 kept: what the record's last rung saw)
  rec = _record(first, last, kept_lr=0.2)
  got = {k: exp.kept_at(rec, k) for k in (1, 2, 3, 4)}
  assert got == {k: _oracle_kept(first, last, k) for k in (1, 2, 3, 4)}
  assert got == {1: 1.6, 2: 0.4, 3: 0.4, 4: 0.2}  # (0.4 and 0.8 tie at the first rung: the lower LR ranks first)


def test_the_fine_grid_is_the_default_grid_and_the_points_between():
  from hdet_jax.trainer import bracket

  fine = bracket.point_lrs(0.03, exp.FINE['bracket.points'], exp.FINE['bracket.factor'])
  default = bracket.point_lrs(0.03, 8, 2.0)
  np.testing.assert_allclose(fine[::2], default, rtol=1e-12)
  np.testing.assert_allclose(fine[1::2], [0.03 * 2.0**j for j in range(-3, 4)], rtol=1e-12)
  assert [exp.compute_runs(k, False) for k in exp.KEEPS] == pytest.approx([3.2, 3.6, 4.0])


def test_a_replaced_point_enters_on_the_records_footing(monkeypatch):
  ends = {0.2: 1.9}
  monkeypatch.setattr(wider_rung, 'end', lambda cell, start, seed, lr, *a: {'final_metric': ends[lr]})
  default = {'kept_lr': 0.2, 'final_metric': 2.0, 'here': False}
  # another point: the record's final plus the difference of the two ends trained here
  assert exp.on_footing(1.85, 0.3, default, 'lm:750:adamw', 'best', 0, '', False) == pytest.approx(1.95, rel=1e-12)
  assert exp.on_footing(1.85, 0.2 * (1 + 1e-15), default, 'lm:750:adamw', 'best', 0, '', False) == 2.0  # the same point
  assert exp.on_footing(1.85, 0.3, {**default, 'here': True}, 'lm:750:adamw', 'best', 0, '', False) == 1.85


def test_quick_composes_the_narrowest_bracket_as_a_real_one_trains_it(tmp_path):
  """The quick run with --check: a real bracket keeping 2 at the first rung ends where the composition from the
  bracket keeping 3 says, bit for bit (kept LR and final metric)."""
  work = str(tmp_path)
  exp.main(['--quick', '--check', f'{exp.QUICK_CELL}:best:0', '--workdir', work])
  with open(exp.record_path(exp.QUICK_CELL, 'best', 0, True, work), encoding='utf-8') as f:
    rec = json.load(f)
  assert len(rec['lrs']) == 5 and len(rec['rungs'][0]['kept']) == 3 and rec['rungs'][1]['step'] == 8
  first = {lr: rec['rungs'][0]['losses'][f'{lr:.6g}'] for lr in rec['lrs']}
  last = {lr: rec['rungs'][1]['losses'][f'{lr:.6g}'] for lr in rec['rungs'][0]['kept']}
  with open(os.path.join(work, 'finer_grid.json'), encoding='utf-8') as f:
    saved = json.load(f)
  row = saved['rows'][exp.QUICK_CELL]['best']
  for k in exp.QUICK_KEEPS:
    assert row['kept_x'][str(k)] == [_oracle_kept(first, last, k) / 0.01]
  with open(exp.check_path(exp.QUICK_CELL, True, work), encoding='utf-8') as f:
    checked = json.load(f)
  assert checked['rungs'] == '0.25:2,0.5:1' and checked['equal'], checked
  assert checked['bracket']['kept_lr'] == _oracle_kept(first, last, 2)
  assert math.isfinite(checked['bracket']['final_metric'])


def _load(path):
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def test_committed_rows_recompute_from_the_records():
  """Every committed row: each seed's kept point per first-rung count is the plain oracle's on the bracket's record,
  its final the record's or its end's (on the LM and fine-tuning: the default's recorded final plus the difference
  of the two ends trained here), and the gaps the ratio of the 3-seed means, the verdicts the 1% / 2 se rule."""
  saved = _load(os.path.join(exp.REPO, 'results', 'finer_grid.json'))
  counts, n = {}, 0
  for cell, starts in saved['rows'].items():
    anchor = exp.anchor(cell, False)
    for start, row in starts.items():
      for i, seed in enumerate((0, 1, 2)):
        rec = _load(exp.record_path(cell, start, seed, False, ''))
        first = {lr: rec['rungs'][0]['losses'][f'{lr:.6g}'] for lr in rec['lrs']}
        last = {lr: rec['rungs'][1]['losses'][f'{lr:.6g}'] for lr in rec['rungs'][0]['kept']}
        default = exp.default_bracket(cell, start, seed)
        for k in exp.KEEPS:
          kept = _oracle_kept(first, last, k)
          assert row['kept_x'][str(k)][i] == kept / anchor
          final = (
            rec['final_metric']
            if kept == rec['kept_lr']
            else _load(exp.end_path(cell, start, seed, kept, False, ''))['final_metric']
          )
          if not default['here'] and abs(kept / default['kept_lr'] - 1) < 1e-9:
            final = default['final_metric']
          elif not default['here']:
            here = _load(wider_rung.end_path(cell, start, seed, default['kept_lr'], False, ''))['final_metric']
            final = default['final_metric'] + final - here
          assert row['finals'][str(k)][i] == pytest.approx(final, rel=1e-12)
      for name, g in row['gaps'].items():
        finals = row['default']['finals'] if name == 'default' else row['finals'][name]
        assert g['gap'] == pytest.approx(sum(finals) / sum(row['sweep']) - 1, rel=1e-9)
        per_seed = [v / r - 1 for v, r in zip(finals, row['sweep'])]
        assert g['se'] == pytest.approx(np.std(per_seed, ddof=1) / np.sqrt(3), rel=1e-9, abs=1e-15)
        want = 'within' if g['gap'] <= 0.01 else 'miss' if g['gap'] - 2 * g['se'] > 0.01 else 'not resolved'
        assert g['verdict'] == want
        counts.setdefault(name, {}).setdefault(want, 0)
        counts[name][want] += 1
      f9, d = row['finals'][str(max(exp.KEEPS))], row['default']['finals']
      vs = row['vs_default']
      assert vs['gap'] == pytest.approx(sum(f9) / sum(d) - 1, rel=1e-9, abs=1e-15)
      per_seed = [a / b - 1 for a, b in zip(f9, d)]
      assert vs['se'] == pytest.approx(np.std(per_seed, ddof=1) / np.sqrt(3), rel=1e-9, abs=1e-15)
      assert vs['resolved'] == (None if abs(vs['gap']) <= 2 * vs['se'] else 'behind' if vs['gap'] > 0 else 'ahead')
      n += 1
  assert n >= 30
  assert {k: {v: c for v, c in t.items() if c} for k, t in saved['tally']['all'].items()} == counts


def test_the_committed_check_equals_its_composition():
  """The real 15-5-1 bracket trained in full (mnist1d, AdamW, 500 steps, from the best, seed 0): the kept point and
  final metric of the committed row's composition, bit for bit."""
  checked = _load(exp.check_path('mnist1d:500:adamw', False, ''))
  assert checked['spec'] == 'mnist1d:500:adamw:best:0' and checked['rungs'] == '0.1:5,0.3:1' and checked['equal']
  row = _load(os.path.join(exp.REPO, 'results', 'finer_grid.json'))['rows']['mnist1d:500:adamw']['best']
  assert checked['bracket']['final_metric'] == row['finals']['5'][0]
  assert checked['bracket']['kept_lr'] == row['kept_x']['5'][0] * exp.anchor('mnist1d:500:adamw', False)


def test_the_committed_report_is_what_the_records_give_now():
  """``--report-only``'s rows rebuilt from the records equal the committed JSON (so a change to how a row is built,
  ranked or judged shows here, not only when someone reruns the report)."""
  saved = _load(os.path.join(exp.REPO, 'results', 'finer_grid.json'))
  for cell, starts in saved['rows'].items():
    assert json.loads(json.dumps(exp.cell_rows(cell, False, ''))) == starts, cell


def test_check_with_report_only_is_one_clear_error():
  with pytest.raises(SystemExit, match='--check trains a bracket and --report-only trains nothing'):
    exp.main(['--report-only', '--check', 'mnist1d:500:adamw:best:0'])


def test_committed_eight_seed_rows_recompute_from_the_records():
  """The 8-seed rows: seeds 0-2 the committed 3-seed rows', seeds 3-7 the oracle's kept point on each fresh record
  with its final; the default's mnist1d's 8-seed table of results/last_rung.json, or a held-out classifier's
  bracket records; the reference the sweep's best LR by its 8-seed mean; gaps, se, verdicts and the paired
  comparison recomputed; and the rows rebuilt from the records equal the committed JSON."""
  from research.archive import heldout_task

  saved = _load(os.path.join(exp.REPO, 'results', 'finer_grid.json'))
  eight, three = saved['eight_seeds'], saved['rows']
  last = _load(os.path.join(exp.REPO, 'results', 'last_rung.json'))['eight_seeds']
  assert set(exp.MNIST1D) <= set(eight) <= set(exp.MNIST1D + exp.TASKS)
  n = 0
  for cell, e in eight.items():
    anchor = exp.anchor(cell, False)
    if cell.startswith('task:'):
      site = heldout_task.Site(cell.split(':')[1], False, '')
      sweeps = {
        lr: [heldout_task.load(heldout_task.grid_name(lr, s), site)['final_metric'] for s in range(8)]
        for lr in heldout_task.plan(site)['grid']
      }
      default = {
        start: [heldout_task.load(f'bracket_{start}_s{s}', site)['final_metric'] for s in range(8)]
        for start in e['starts']
      }
    else:
      default = {start: last[cell]['starts'][start]['finals'] for start in e['starts']}
      assert e['sweep'] == last[cell]['sweep']
      sweeps = {float(lr): [m] for lr, m in last[cell]['sweep_means'].items()}  # (the 8-seed means)
    assert min(sweeps, key=lambda lr: np.mean(sweeps[lr])) == e['sweep_lr']
    for start, row in e['starts'].items():
      assert row['default']['finals'] == default[start]
      for k in exp.KEEPS:
        r = row[str(k)]
        assert r['finals'][:3] == three[cell][start]['finals'][str(k)]
        assert r['kept_x'][:3] == three[cell][start]['kept_x'][str(k)]
        for i, seed in enumerate(range(3, 8), start=3):
          rec = _load(exp.record_path(cell, start, seed, False, ''))
          first = {lr: rec['rungs'][0]['losses'][f'{lr:.6g}'] for lr in rec['lrs']}
          lastr = {lr: rec['rungs'][1]['losses'][f'{lr:.6g}'] for lr in rec['rungs'][0]['kept']}
          kept = _oracle_kept(first, lastr, k)
          assert r['kept_x'][i] == kept / anchor
          final = (
            rec['final_metric']
            if kept == rec['kept_lr']
            else _load(exp.end_path(cell, start, seed, kept, False, ''))['final_metric']
          )
          assert r['finals'][i] == final
      for name in ['default'] + [str(k) for k in exp.KEEPS]:
        g = row[name]
        assert g['gap'] == pytest.approx(sum(g['finals']) / sum(e['sweep']) - 1, rel=1e-9)
        per_seed = [v / s - 1 for v, s in zip(g['finals'], e['sweep'])]
        assert g['se'] == pytest.approx(np.std(per_seed, ddof=1) / np.sqrt(8), rel=1e-9)
        assert g['verdict'] == (
          'within' if g['gap'] <= 0.01 else 'miss' if g['gap'] - 2 * g['se'] > 0.01 else 'not resolved'
        )
      f9, d, vs = row[str(max(exp.KEEPS))]['finals'], row['default']['finals'], row['vs_default']
      assert vs['gap'] == pytest.approx(sum(f9) / sum(d) - 1, rel=1e-9, abs=1e-15)
      per_seed = [a / b - 1 for a, b in zip(f9, d)]
      assert vs['se'] == pytest.approx(np.std(per_seed, ddof=1) / np.sqrt(8), rel=1e-9, abs=1e-15)
      assert vs['resolved'] == (None if abs(vs['gap']) <= 2 * vs['se'] else 'behind' if vs['gap'] > 0 else 'ahead')
      n += 1
    assert json.loads(json.dumps(exp.eight_seed_rows(cell, ''))) == e, cell
  assert n == 3 * len(eight)


def test_a_diverged_grid_seed_counts_as_inf_in_the_eight_seed_reference(monkeypatch):
  """A held-out classifier's 8-seed reference: the grid point with the lowest 8-seed mean, a diverged seed (None)
  counting as inf for its point only; the default bracket's finals and kept points per start."""
  from research.archive import heldout_task

  site = heldout_task.Site('narrow', False, '')
  grid = heldout_task.plan(site)['grid']
  finals = {lr: [1.0 + abs(i - 2) / 10] * 8 for i, lr in enumerate(grid)}  # the third point is the best
  finals[grid[2]][5] = None  # ... until one of its seeds diverges
  records_ = {heldout_task.grid_name(lr, s): {'final_metric': v[s]} for lr, v in finals.items() for s in range(8)}
  records_.update(
    {
      f'bracket_{st}_s{s}': {'final_metric': 2.0 + s, 'kept_lr': 0.5}
      for st in ('low', 'best', 'high')
      for s in range(8)
    }
  )
  monkeypatch.setattr(heldout_task, 'load', lambda name, site: records_.get(name))
  monkeypatch.setattr(exp, 'anchor', lambda cell, quick: 0.25)
  ref = exp.eight_seed_reference('task:narrow', '')
  assert ref['sweep_lr'] == grid[1] and ref['sweep'] == [1.1] * 8  # (grid[1] and grid[3] tie: the lower LR first)
  assert ref['default']['best'] == {'finals': [2.0 + s for s in range(8)], 'kept_x': [2.0] * 8}
