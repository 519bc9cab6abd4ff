"""research/heldout_task.py: the sweep, the default HDET and the default bracket on a CNN size and data draw
no default was chosen on; the narrower bracket read from the same runs."""

import json
import os

import numpy as np
import pytest

from research.archive import heldout_task as exp
from research import records


def test_the_pinned_bracket_is_the_default_one():

  default = records.load_config(os.path.join(exp.REPO, 'configs', 'default.py'))
  assert {f'bracket.{k}': v for k, v in default.bracket.to_dict().items() if k != 'points'} == {
    k: v for k, v in exp.BRACKET.items() if k != 'bracket.points'
  }
  assert exp.BRACKET['bracket.points'] == 8


def test_the_narrower_bracket_ranks_the_first_rungs_best_again_at_the_last():
  lrs = [0.03 * 2.0 ** (k - 2.5) for k in range(5)]  # 0.0053033..., 0.0106066..., ...: not 6-digit numbers
  key = lambda k: f'{lrs[k]:.6g}'
  rec = {
    'lrs': lrs,
    'kept_lr': lrs[2],
    'rungs': [
      {'losses': {key(0): 3.0, key(1): 1.0, key(2): 2.0, key(3): 1.5, key(4): 9.0}, 'kept': [lrs[1], lrs[2], lrs[3]]},
      {'losses': {key(1): 0.9, key(2): 0.5, key(3): 0.7}, 'kept': [lrs[2]]},
    ],
  }
  # lrs[2] (third at the first rung) is out; of lrs[1] and lrs[3], lrs[3] leads at the last: the record's LR, exactly
  assert exp.narrower_kept(rec) == lrs[3]
  rec['rungs'][1]['losses'][key(1)] = 0.6
  assert exp.narrower_kept(rec) == lrs[1]


def test_quick_trains_the_sweep_hdet_and_the_bracket_and_reads_the_narrower_one(tmp_path):
  work = str(tmp_path)
  exp.main(['--quick', '--workdir', work])
  site = exp.Site('wide', True, work)
  grid = {lr: exp.load(exp.grid_name(lr, 0), site)['final_metric'] for lr in exp.plan(site)['grid']}
  best_lr = min(grid, key=grid.get)
  assert exp.anchor_lr(site) == best_lr
  b = exp.load('bracket_best_s0', site)
  np.testing.assert_allclose(b['lrs'], [best_lr * 2.0 ** (k - 2) for k in range(5)], rtol=1e-12)
  # The narrower bracket: numpy's ranking of the first rung's losses, its best one fewer than kept, argmin at the last.
  first, last = b['rungs'][0], b['rungs'][1]
  order = sorted(b['lrs'], key=lambda lr: (first['losses'][f'{lr:.6g}'], lr))
  assert sorted(order[:2]) == first['kept']
  want = min(order[:1], key=lambda lr: (last['losses'][f'{lr:.6g}'], lr))
  assert exp.narrower_kept(b) == want
  with open(tmp_path / 'heldout_task.json', encoding='utf-8') as f:
    r = json.load(f)
  assert list(r) == ['wide']  # (quick: the first check only)
  row = r['wide']['starts']['best']
  assert r['wide']['best'] == min(grid.values()) and row['bracket'] == b['final_metric']
  assert row['bracket_gap'] == pytest.approx(b['final_metric'] / r['wide']['best'] - 1, rel=1e-12)
  hdet = exp.load('hdet_best_s0', site)
  assert row['hdet_gap'] == pytest.approx(hdet['final_metric'] / r['wide']['best'] - 1, rel=1e-12)
  records = os.path.join(work, 'records', 'wide')
  if want == b['kept_lr']:
    assert row['narrower'] == b['final_metric']
  else:  # its kept run, trained to the end as the bracket's own point would be
    ends = [n for n in os.listdir(records) if n.startswith('end_')]
    assert len(ends) == 1 and row['narrower'] == exp.load(ends[0][:-5], site)['final_metric']
  # Cached: a rerun trains nothing and reports the same.
  before = sorted(os.listdir(records))
  exp.main(['--quick', '--workdir', work])
  assert sorted(os.listdir(records)) == before
  with open(tmp_path / 'heldout_task.json', encoding='utf-8') as f:
    assert json.load(f) == r


@pytest.mark.parametrize('check', list(exp.CHECKS))
def test_the_committed_checks_read_as_their_records(check):
  """results/heldout_task.json's gaps are its records' 3-seed means against the sweep's best 3-seed mean."""
  site = exp.Site(check, False, '')
  with open(os.path.join(exp.REPO, 'results', 'heldout_task.json'), encoding='utf-8') as f:
    r = json.load(f)[check]
  means = {
    lr: np.mean([exp.load(exp.grid_name(lr, s), site)['final_metric'] for s in exp.SEEDS])
    for lr in exp.plan(site)['grid']
  }
  assert r['best'] == pytest.approx(min(means.values()), rel=1e-12)
  assert r['best_lr'] == f'{min(means, key=means.get):g}'
  for start in exp.STARTS:
    for kind in ('bracket', 'hdet'):
      finals = [exp.load(f'{kind}_{start}_s{s}', site)['final_metric'] for s in exp.SEEDS]
      assert r['starts'][start][f'{kind}_gap'] == pytest.approx(np.mean(finals) / r['best'] - 1, rel=1e-9)


def test_the_digits_check_trains_on_the_committed_digits():
  """The digits check's runs read research/data/digits.npz (a path relative to the repository, so that records
  hold no machine's path): 1,437 training and 360 test signals of 64 samples, the default CNN's 25 channels."""
  import contextlib

  config = exp.config_for('grid_lr0.03_s0', exp.Site('digits', False, ''))
  assert config.data.path == 'research/data/digits.npz' and config.data.batch_size == 8
  assert config.model.channels == 25 and config.num_train_steps == 600
  with contextlib.chdir(exp.REPO):
    run = records.resolve(config)
    data = run.task.load(run.task_settings, 8, run.seed)
  assert data.description == '1,437 train / 360 test examples (signals 64 x 1)'
  assert exp.load('grid_lr0.03_s0', exp.Site('digits', False, ''))['num_params'] == 5960


def test_fresh_seeds_name_the_sweep_and_the_bracket_and_exclude_the_reports_seeds(monkeypatch, capsys):
  trained = []
  monkeypatch.setattr(exp, 'train', lambda name, site: trained.append((name, site.check)) or {'final_metric': 1.0})
  exp.train_fresh(exp.Site('narrow', False, ''), [3, 4])
  grid = exp.plan(exp.Site('narrow', False, ''))['grid']
  assert trained == (
    [(exp.grid_name(lr, s), 'narrow') for s in (3, 4) for lr in grid]
    + [(f'bracket_{st}_s{s}', 'narrow') for s in (3, 4) for st in exp.STARTS]
  )
  for bad in (['--fresh-seeds', '2,3'], ['--fresh-seeds', '3', '--quick']):
    with pytest.raises(SystemExit):
      exp.main(bad + ['--report-only'])
    assert '--fresh-seeds must be seeds other than 0,1,2' in capsys.readouterr().err
  # Every seed-3-7 record the 8-seed table reads is committed: the command would train nothing.
  from research.archive import finer_grid

  for check in (cell.split(':')[1] for cell in finer_grid.TASKS):
    site = exp.Site(check, False, '')
    assert all(exp.load(exp.grid_name(lr, s), site) for s in range(3, 8) for lr in exp.plan(site)['grid'])
    assert all(exp.load(f'bracket_{st}_s{s}', site) for s in range(3, 8) for st in exp.STARTS)


@pytest.mark.parametrize('check', ['wide', 'narrow'])
def test_the_eight_seed_pairing_is_finer_grids(check):
  """The bracket's 8-seed paired gaps here (records.paired_gap on this check's records) equal research.finer_grid's
  8-seed table for the default bracket, which pairs the same records by its own code."""
  with open(os.path.join(exp.REPO, 'results', 'finer_grid.json'), encoding='utf-8') as f:
    theirs = json.load(f)['eight_seeds'][f'task:{check}']
  ours = exp.paired(exp.Site(check, False, ''), exp.SEEDS + exp.FRESH_SEEDS, ('bracket',))
  assert ours['best_lr'] == theirs['sweep_lr']
  for start in exp.STARTS:
    got, want = ours['starts'][start]['bracket'], theirs['starts'][start]['default']
    assert got['gap'] == pytest.approx(want['gap'], rel=1e-12) and got['se'] == pytest.approx(want['se'], rel=1e-12)
    assert records.verdict(got) == want['verdict']


def test_paired_against_a_numpy_oracle(monkeypatch):
  """Synthetic records: the best LR by the mean over the seeds, then each start's per-seed gaps, their mean ratio and
  standard error; a missing record leaves its row empty; the verdicts' thresholds (a miss: gap - 2 se > 1%)."""
  grid = exp.plan(exp.Site('wide', False, ''))['grid']
  finals = {exp.grid_name(lr, s): 1.0 + abs(k - 3) * 0.1 + 0.01 * s for k, lr in enumerate(grid) for s in (0, 1, 2)}
  finals.update({f'bracket_{st}_s{s}': [1.02, 0.98, 1.05][s] * (1 + 0.01 * s) for st in exp.STARTS for s in (0, 1, 2)})
  monkeypatch.setattr(exp, 'load', lambda name, site: {'final_metric': finals[name]} if name in finals else None)
  r = exp.paired(exp.Site('wide', False, ''), (0, 1, 2))
  assert r['best_lr'] == grid[3]
  ref = np.array([1.0, 1.01, 1.02])
  b = np.array([1.02, 0.98 * 1.01, 1.05 * 1.02])
  per = b / ref - 1
  got = r['starts']['low']['bracket']
  assert got['gap'] == pytest.approx(b.mean() / ref.mean() - 1, rel=1e-12)
  assert got['se'] == pytest.approx(per.std(ddof=1) / np.sqrt(3), rel=1e-12)
  assert r['starts']['best']['hdet'] == {'gap': None, 'se': None}
  verdicts = [
    records.verdict({'gap': g, 'se': se})
    for g, se in ((0.01, 0.5), (0.05, 0.0199), (0.05, 0.0201), (0.05, None), (None, None), (-0.3, None))
  ]
  assert verdicts == ['within', 'miss', 'not resolved', 'not resolved', '-', 'within']


def test_the_rung_traces_end_as_the_sweep_and_their_table_ranks_as_numpy():
  """The committed digits traces (the sweep's seed-0 runs again, evaluated at the rungs) end at the grid records'
  finals bit for bit (evaluating changes no training step); the report's ranks are numpy's."""
  for check in exp.CHECKS:  # (every check's traces: evaluating at the rungs changes no training step)
    site = exp.Site(check, False, '')
    for seed in exp.SEEDS:
      traces = [exp.load(f'trace_lr{records.lr_tag(lr, 4)}_s{seed}', site) for lr in exp.plan(site)['grid']]
      assert [t['final_metric'] for t in traces] == [
        exp.load(exp.grid_name(lr, seed), site)['final_metric'] for lr in exp.plan(site)['grid']
      ], (check, seed)
  site = exp.Site('digits', False, '')
  grid = exp.plan(site)['grid']
  traces = [exp.load(f'trace_lr{records.lr_tag(lr, 4)}_s0', site) for lr in grid]
  assert sorted(traces[0]['rungs']) == ['180', '60']  # 0.1 and 0.3 of 600 steps
  lines = exp.rank_flip_lines(site, 0)
  rows = [line for line in lines if line.startswith('| 0.')]
  columns = [[t['rungs'][s]['train_loss'] for t in traces] for s in ('60', '180')]
  columns += [[t['rungs'][s]['test_metric'] for t in traces] for s in ('60', '180')] + [
    [t['final_metric'] for t in traces]
  ]
  for j, column in enumerate(columns):
    want = np.argsort(np.argsort(column)) + 1
    got = [int(row.split(' | ')[j + 1].split('(')[1].rstrip(') |')) for row in rows]
    assert got == want.tolist(), j


def test_the_annealed_copy_runs_the_sweeps_schedule_to_the_last_rung_then_anneals_to_its_end():
  """research.heldout_task.annealed_config: the sweep's LRs bit for bit for the 180 steps to the last rung (0.3 of
  600; the batches depend on the step only), then down to the sweep's end LR in 60 steps."""

  site = exp.Site('digits', False, '')
  full = exp.config_for('grid_lr0.12_s1', site)
  copy = exp.annealed_config(0.12, 1, site)
  assert copy.num_train_steps == 180 + 60 and copy.seed == full.seed == 1 and copy.optim.max_lr == 0.12
  a, b = records.resolve(full).optimizer.schedule, records.resolve(copy).optimizer.schedule
  steps = np.arange(180)  # the 180 steps to the last rung (step 180 compares the losses of steps 170-179)
  np.testing.assert_array_equal(np.asarray(jax_values(a, steps)), np.asarray(jax_values(b, steps)))
  assert float(b(179)) == pytest.approx(0.12, rel=1e-6)  # the peak, at the last rung
  assert float(b(239)) == float(a(599))  # the same end LR, 60 steps later instead of 420
  assert float(b(200)) < float(a(200))


def test_the_annealed_copy_refuses_another_schedule(monkeypatch):
  from hdet_jax.trainer import config_lib

  site = exp.Site('digits', False, '')
  cosine = config_lib.with_overrides(exp.config_for('grid_lr0.12_s1', site), {'optim.schedule': 'warmup_cosine'})
  monkeypatch.setattr(exp, 'config_for', lambda name, site, lr=None: cosine)
  with pytest.raises(ValueError, match="annealed_rung needs the one-cycle schedule.*'warmup_cosine'"):
    exp.annealed_config(0.12, 1, site)


def jax_values(schedule, steps):
  import jax.numpy as jnp

  return [schedule(jnp.asarray(t)) for t in steps]


def test_the_selection_table_picks_each_criterions_argmin_and_pairs_its_end():
  """results/heldout_task.md's selection table for the digits: per criterion and seed the grid LR with the lowest
  value (numpy's argmin over the committed traces and annealed copies), and the picked runs' ends paired with the
  best LR's (a numpy oracle of records.paired_gap)."""
  site = exp.Site('digits', False, '')
  grid = exp.plan(site)['grid']
  tag = lambda lr: records.lr_tag(lr, 4)
  final = lambda lr, s: exp.load(exp.grid_name(lr, s), site)['final_metric']
  values = {
    'training loss before step 180': lambda lr, s: exp.load(f'trace_lr{tag(lr)}_s{s}', site)['rungs']['180'][
      'train_loss'
    ],
    'test metric after the anneal': lambda lr, s: exp.load(f'anneal_lr{tag(lr)}_s{s}', site)['final_metric'],
    'training loss after the anneal': lambda lr, s: exp.load(f'anneal_lr{tag(lr)}_s{s}', site)['train_loss'],
  }
  means = {lr: np.mean([final(lr, s) for s in exp.SEEDS]) for lr in grid}
  best = min(means, key=means.get)
  rows = {line.split(' | ')[0][2:]: line for line in exp.selection_lines(site, exp.SEEDS) if line.startswith('| ')}
  for label, get in values.items():
    picks = [grid[int(np.argmin([get(lr, s) for lr in grid]))] for s in exp.SEEDS]
    ends, ref = (
      np.array([final(lr, s) for lr, s in zip(picks, exp.SEEDS)]),
      np.array([final(best, s) for s in exp.SEEDS]),
    )
    per = ends / ref - 1
    want = f'{100 * (ends.mean() / ref.mean() - 1):+.1f} ± {100 * per.std(ddof=1) / np.sqrt(3):.1f}%'
    assert rows[label] == f'| {label} | {" / ".join(f"{lr:g}" for lr in picks)} | {want} |'
