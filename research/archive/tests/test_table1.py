"""research/table1: its records from the trainer's metrics, the whole flow and its cache, the report.

The whole --quick run trains 12 runs (about 4-5 minutes on 2 loaded cores, most of it compiling); by
default the flow runs on a stand-in trainer that writes metrics.jsonl as the trainer does, and one real
run checks the records against the trainer's own metrics. HDET_SLOW_TESTS=1 adds the real --quick run.
"""

import json
import os
import shutil

import numpy as np
import pytest

from hdet_jax.trainer import run_settings
from research import records
from research.archive import table1 as T

QUICK_RUNS = 12  # 2 sweep points, Baseline-Low, the pre-training run, 4 rows and 4 mechanism runs (1 seed)


def _fake_train_and_evaluate(calls):
  """A stand-in for the trainer: the metrics.jsonl records a run would write (no training) and its summary.

  Peak LRs above 0.1 'crash' (their loss grows), so the sweep's choice is known: high 0.3, low 0.3 / 9.
  """
  from hdet_jax.trainer import metrics

  def run(config, workdir, tuning=None):
    calls.append((os.path.basename(workdir), config.init_from, config.optim.max_lr))
    os.makedirs(workdir, exist_ok=True)
    resolved = run_settings.resolve(config, tuning=tuning)
    names, n, steps = list(resolved.programs.hyperparam_names), 8, config.num_train_steps
    lr, rng = config.optim.max_lr, np.random.default_rng(config.seed)
    w = metrics.MetricsWriter(os.path.join(workdir, 'metrics.jsonl'))
    w.write('hyperparams', step=0, names=names)
    for s in range(steps):
      loss = 5.5 + (s / steps) * (3.0 if lr > 0.1 else -2.0) + 0.01 * rng.random(n)
      w.write(
        'train',
        step=s,
        loss=loss.astype(np.float32),
        lr=np.full(n, lr),
        base_lr=lr,
        sync=False,
        values=np.full((len(names), n), lr),
        bases=np.full(len(names), lr),
      )
      if (s + 1) % min(resolved.optimizer.windows[-1], config.log_every) == 0:
        w.write('distance', step=s, distance=rng.random(n), mean_norm=10.0)
    w.close()
    return {'step': steps, 'final_val_loss': 3.0 + (lr > 0.1), 'setup_s': 0.0, 'preempted': False}

  return run


def test_the_whole_flow_on_a_stand_in_trainer_then_from_the_records(tmp_path, monkeypatch, capsys):
  from hdet_jax.trainer import checkpoints, trainer

  calls = []
  monkeypatch.setattr(trainer, 'train_and_evaluate', _fake_train_and_evaluate(calls))
  monkeypatch.setattr(
    checkpoints, 'latest_step', lambda workdir: 1 if os.path.exists(os.path.join(workdir, 'metrics.jsonl')) else None
  )
  T.main(['--quick', '--workdir', str(tmp_path)])
  assert len(calls) == QUICK_RUNS
  pretrain = str(tmp_path / 'pretrain')
  warm = {name for name, init_from, _ in calls if init_from == pretrain}
  assert warm == {'warm_init_s0', 'hdet_no_auto_lr_s0', 'hdet_full_s0', 'baseline_low_warm_s0'}
  assert all(init_from in (None, pretrain) for _, init_from, _ in calls)
  assert dict((name, lr) for name, _, lr in calls)['hdet_full_s0'] == 0.3  # the sweep's edge
  assert sorted(os.listdir(tmp_path)) == [
    'figures',
    'pretrain',
    'records',
    'table1.json',
    'table1.md',
  ]  # (the rest gone)
  rec = json.load(open(tmp_path / 'records' / 'hdet_cold_s0.json'))
  warm_rec = json.load(open(tmp_path / 'records' / 'hdet_full_s0.json'))
  assert rec['config']['init_from'] is None and warm_rec['config']['init_from'] == 'pretrain'  # no machine's path
  assert len(rec['loss_mean']) == T.QUICK['steps'] and len(rec['dists']) == T.QUICK['steps'] // T.QUICK['sync_every']
  assert rec['hyperparam_names'] == ['learning_rate/embedding', 'learning_rate/no_decay', 'learning_rate/weights']
  crashed = lambda name: json.load(open(tmp_path / 'records' / f'{name}.json'))['crashed']
  assert crashed('sweep_lr0.3_s0') and not crashed('sweep_lr0.003_s0') and not crashed('pretrain')
  md = (tmp_path / 'table1.md').read_text()
  for title in (
    '## 1. Choosing the LRs',
    "## 2. The paper's six rows",
    '## 4. Where any stability comes from',
    '**baseline_high = 0.3**',
    'python -m research.table1 --quick',
  ):
    assert title in md, title
  for name in ('sweep', 'loss', 'lr', 'distance'):
    assert (tmp_path / 'figures' / f'table1_{name}.png').stat().st_size > 10_000
  # The JSON: the stand-in's numbers (val loss 3 nats, 4 above 0.1) and the choice they imply.
  js = json.load(open(tmp_path / 'table1.json'))
  bpb = lambda nats: nats / np.log(2)  # the LM's bits per byte from its validation loss in nats per byte
  assert js['choice']['baseline_high'] == 0.3 and js['choice']['baseline_low'] == pytest.approx(0.3 / 9)
  assert js['sweep']['0.003']['val_bpb'] == [pytest.approx(bpb(3.0))] and js['sweep']['0.3']['crashed'] == [True]
  assert js['rows']['hdet_full']['peak_lr'] == 0.3 and js['rows']['hdet_full']['val_bpb'] == [pytest.approx(bpb(4.0))]
  assert js['runs'] == QUICK_RUNS and set(js['rows']) == set(T.table1_report.ROWS) | set(T.MECHANISM)
  # Every run is recorded: a rerun trains nothing (the warm checkpoint is not retrained either, though its workdir
  # is gone), and --report-only redraws the same report from the records alone, into --out.
  before = md
  shutil.rmtree(tmp_path / 'pretrain')
  T.main(['--quick', '--workdir', str(tmp_path)])
  T.main(['--quick', '--workdir', str(tmp_path), '--report-only', '--out', str(tmp_path / 'again')])
  assert len(calls) == QUICK_RUNS
  assert (tmp_path / 'again' / 'table1.md').read_text().split('Total: ')[0] == before.split('Total: ')[0]
  assert (tmp_path / 'again' / 'table1.json').read_bytes() == (tmp_path / 'table1.json').read_bytes()
  # A warm run to train again finds the checkpoint gone, and retrains the pre-training run first.
  os.remove(tmp_path / 'records' / 'hdet_full_s0.json')
  T.main(['--quick', '--workdir', str(tmp_path)])
  assert [c[0] for c in calls[QUICK_RUNS:]] == ['pretrain', 'hdet_full_s0']


def test_a_real_run_is_recorded_from_the_trainers_metrics_and_reused(tmp_path):
  """One --quick HDET row through the trainer: the record holds its per-step losses, its distances and
  its final numbers as the trainer's metrics.jsonl and summary give them; asking again trains nothing."""
  from hdet_jax.trainer import metrics

  made = []

  def make_record(name, config, summary, workdir, wall_s):
    made.append((summary, metrics.read_metrics(os.path.join(workdir, 'metrics.jsonl'))))
    return T.make_record(name, config, summary, workdir, wall_s)

  cache = records.RunCache(str(tmp_path / 'records'), str(tmp_path / 'work'), make_record, T.describe)
  ex = T.Experiment(cache, dict(T.QUICK, grid=(), seeds=(0,)), report_only=False)
  config = ex.config('hdet_cold', 0.03, 0)
  rec = ex.run('hdet_cold_s0', config)
  ((summary, m),) = made
  loss = np.array([r['loss'] for r in m['train']], np.float32)  # [40, 8]
  assert rec['loss_mean'] == [float(np.mean(x)) for x in loss]
  assert rec['final_train_loss'] == pytest.approx(float(np.mean(loss[-T.LOG :].mean(1), dtype=np.float64)))
  assert rec['val_loss'] == summary['final_val_loss'] and rec['diverged_at'] is None and not rec['crashed']
  assert [d[0] for d in rec['dists']] == [9, 19, 29, 39]  # just before each sync (every 10 steps)
  assert [d[1] for d in rec['dists']] == [list(d['distance']) for d in m['distance']]
  assert not os.path.exists(cache.workdir('hdet_cold_s0'))  # the record holds what the report needs
  assert ex.run('hdet_cold_s0', config) == rec and len(made) == 1  # cached
  changed = ex.config('hdet_cold', 0.03, 0, **{'hdet.spread': 0.2})
  assert cache.get('hdet_cold_s0', T.run_key(changed)) is None  # another config is another run


@pytest.mark.skipif(
  not os.environ.get('HDET_SLOW_TESTS'),
  reason='12 trainer runs, about 4-5 minutes (mostly compiling); set HDET_SLOW_TESTS=1',
)
def test_quick_runs_every_stage(tmp_path):
  T.main(['--quick', '--workdir', str(tmp_path)])
  names = sorted(p[:-5] for p in os.listdir(tmp_path / 'records'))
  assert len(names) == QUICK_RUNS and 'pretrain' in names
  assert (tmp_path / 'table1.md').stat().st_size > 0


ROWS = ('hdet_full', 'hdet_no_auto_lr', 'hdet_cold', 'warm_init', 'baseline_high', 'baseline_low')


def test_the_rows_configs_are_research_s_valid_and_documented():
  """The Table 1 rows' configs live beside the study (research/configs/), each valid, building its optimizer, and
  starting its docstring with its command."""
  import ast

  from hdet_jax.trainer import optimizer as optimizer_lib

  folder = os.path.join(T.REPO, 'research', 'configs')
  assert sorted(p[:-3] for p in os.listdir(folder) if p.endswith('.py')) == sorted(ROWS)
  for name in ROWS:
    path = os.path.join(folder, f'{name}.py')
    doc = ast.get_docstring(ast.parse(open(path).read()))
    assert doc.startswith(f'research/configs/{name}.py: one row of the Table 1 ablation'), doc.splitlines()[0]
    run = records.resolve(T.load_row_config(name))
    assert callable(optimizer_lib.make_optimizer(run.optimizer, 8, seed=run.seed).update)


def test_the_rows_config_json_is_what_1_0_wrote_and_its_workdirs_resume(tmp_path):
  """config.json of the rows 1.0 recorded (tests/data/config_json_1.0.json, beside the product's configs): the same
  bytes but for the loop field added since, and a workdir holding 1.0's config.json passes the resume check."""
  from hdet_jax.trainer import config_lib
  from hdet_jax.trainer import checks

  recorded = json.load(open(os.path.join(T.REPO, 'tests', 'data', 'config_json_1.0.json')))['configs']
  rows = {name: old for name, old in recorded.items() if name in ROWS}
  assert sorted(rows) == ['baseline_low', 'hdet_cold', 'hdet_full', 'warm_init']
  for name, old in rows.items():
    run = records.resolve(T.load_row_config(name))
    given = {k: v for k, v in run.given.items() if k != 'chunk_steps'}
    new = {'training_fields': run.training_fields(8), 'config': config_lib.unflatten(given)}
    assert json.dumps(new, indent=1) == json.dumps(old, indent=1), name
    workdir = tmp_path / name
    workdir.mkdir()
    (workdir / 'config.json').write_text(json.dumps(old, indent=1))
    assert checks.check_workdir(str(workdir), run.training_fields(8)) is False  # accepted; no checkpoints yet


def test_ablation_rows_differ_as_the_paper_says():
  load = T.load_row_config
  full, cold, no_auto, warm, high, low = map(
    load, ['hdet_full', 'hdet_cold', 'hdet_no_auto_lr', 'warm_init', 'baseline_high', 'baseline_low']
  )
  lr = full.optim.max_lr
  assert cold.optim.max_lr == no_auto.optim.max_lr == warm.optim.max_lr == high.optim.max_lr == lr
  assert low.optim.max_lr == pytest.approx(lr / 9)
  assert full.hdet.auto_lr and cold.hdet.auto_lr and not no_auto.hdet.auto_lr
  # The paper's rows run the paper's controller with per-group LRs, whatever the main job runs.
  assert full.hdet.controller == cold.hdet.controller == 'paper' and full.hdet.score == 'window'
  assert full.hdet.param_groups and full.hdet.stop_fraction == 1.0
  # ... averaging every 25 steps from the schedule as given, whatever the main job's T and start.
  assert full.hdet.sync_every == 25 and full.hdet.initial_scale == 1.0 and full.hdet.after_stop == 'hold'
  assert full.hdet.step_growth == 1.0
  assert full.init_from and no_auto.init_from and warm.init_from and not cold.init_from and not high.init_from
  for plain in (warm, high, low):
    assert plain.hdet.spread == 0 and plain.hdet.sync_every == 0 and not plain.hdet.auto_lr
  for hdet in (full, cold, no_auto):
    assert hdet.hdet.spread > 0 and hdet.hdet.sync_every > 0
  assert len({c.num_train_steps for c in (full, cold, no_auto, warm, high, low)}) == 1
