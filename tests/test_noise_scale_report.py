"""experiments/noise_scale.py: the noise scale read from a run's stored blocks, its quick run, and the report's carry."""

import json
import math
import os

import numpy as np
import pytest

from experiments import noise_scale as exp
from hdet_jax import noise_scale as ns


def _record(blocks, steps=100, b=8, big=64):
  return {'config': {'num_train_steps': steps, 'optim': {'b2': 0.95}},
          'noise': {'local_batch': b, 'global_batch': big, 'blocks': blocks}}


def test_measure_noise_weights_the_blocks_within_the_window_by_their_steps():
  blocks = [{'end': 25, 'steps': 25, 'grad_sq': 3.0, 'mean_grad_sq': 1.0},
            {'end': 30, 'steps': 5, 'grad_sq': 9.0, 'mean_grad_sq': 2.0},
            {'end': 55, 'steps': 25, 'grad_sq': 100.0, 'mean_grad_sq': 50.0}]
  rec = _record(blocks)
  # The first 0.3 of 100 steps: the first two blocks, 25 and 5 steps.
  local, mean = (25 * 3.0 + 5 * 9.0) / 30, (25 * 1.0 + 5 * 2.0) / 30
  trace = (local - mean) / (1 / 8 - 1 / 64)
  assert exp.measure_noise(rec, 0.3) == pytest.approx(trace / (mean - trace / 64))
  assert exp.measure_noise(rec, 0.2) is None  # no whole block ends by step 20
  assert exp.measure_noise(rec, 0.3, 'pre') is None  # (no preconditioned sums in these blocks)
  for blk in blocks:
    blk['pre_grad_sq'], blk['pre_mean_grad_sq'] = 1.5 * blk['grad_sq'], blk['mean_grad_sq']
  # Preconditioned: from the first block starting after 1 / (1 - b2) = 20 steps (the second one, steps 25-29).
  pre_trace = (1.5 * 9.0 - 2.0) / (1 / 8 - 1 / 64)
  assert exp.measure_noise(rec, 0.3, 'pre') == pytest.approx(pre_trace / (2.0 - pre_trace / 64))
  rec['config']['optim']['b2'] = 0.9  # a horizon of 10 steps: still the second block on
  assert exp.measure_noise(rec, 0.3, 'pre') == pytest.approx(pre_trace / (2.0 - pre_trace / 64))
  rec['noise']['blocks'][1]['grad_sq'] = None
  assert exp.measure_noise(rec, 0.3) is None


def test_the_record_keeps_block_means_of_every_steps_sums(tmp_path):
  """make_record's blocks: the means of each 25 steps' logged sums (the last block shorter), from a metrics file."""
  from hdet_jax.trainer import config_lib
  config = config_lib.with_overrides(config_lib.load_config_file(exp.os.path.join(exp.REPO, 'configs', 'tiny.py')),
                                     {'num_train_steps': 60, 'log_noise_scale': True})
  rng = np.random.default_rng(0)
  local, mean = rng.uniform(2, 3, 60), rng.uniform(0.5, 1, 60)
  with open(tmp_path / 'metrics.jsonl', 'w', encoding='utf-8') as f:
    for s in range(60):
      f.write(json.dumps({'kind': 'train', 'step': s, 'loss': [1.0] * 8, 'bases': [[0.01]], 'values': [[0.01] * 8],
                          'grad_sq': local[s], 'mean_grad_sq': mean[s]}) + '\n')
  summary = {'final_val_bits_per_byte': 1.0, 'final_train_loss': 1.0, 'diverged_at': None}
  rec = exp.make_record('adamw/noise_best_s0', config, summary, str(tmp_path), 1.0)
  blocks = rec['noise']['blocks']
  assert [(b['end'], b['steps']) for b in blocks] == [(25, 25), (50, 25), (60, 10)]
  np.testing.assert_allclose([b['grad_sq'] for b in blocks], [local[:25].mean(), local[25:50].mean(), local[50:].mean()])
  np.testing.assert_allclose([b['mean_grad_sq'] for b in blocks], [mean[:25].mean(), mean[25:50].mean(), mean[50:].mean()])
  assert (rec['noise']['local_batch'], rec['noise']['global_batch']) == (4, 32)  # tiny: 4 windows x 8 replicas
  want = ns.noise_scale(local.mean(), mean.mean(), 4, 32)
  assert exp.measure_noise(rec, 1.0) == pytest.approx(want, rel=1e-9)


def test_quick_run_records_the_sums(tmp_path):
  exp.main(['--quick', '--workload', 'lm', '--seeds', '0', '--workdir', str(tmp_path)])
  rec = json.loads((tmp_path / 'lm' / 'noise_records' / 'adamw' / 'noise_best_s0.json').read_text())
  blocks = rec['noise']['blocks']
  assert rec['config']['log_noise_scale'] is True and rec['noise']['global_batch'] == 8 * rec['noise']['local_batch']
  assert sum(b['steps'] for b in blocks) == rec['config']['num_train_steps']
  assert all(b['grad_sq'] > b['mean_grad_sq'] > 0 for b in blocks)  # mean |g_r|^2 >= |mean g_r|^2, always
  assert all(b['pre_grad_sq'] > b['pre_mean_grad_sq'] > 0 for b in blocks)  # (AdamW: preconditioned too)
  # 16 steps, one block from step 0: none starts after Adam's 1 / (1 - b2) = 20-step horizon, so no reading.
  assert exp.measure_noise(rec, 1.0, 'pre') is None
  assert math.isfinite(exp.measure_noise(rec, 1.0))
  assert os.path.exists(tmp_path / 'noise_scale.md')
  # The small-batch sweep: the quick grid on seed 0, one window per replica; its best is the grid's top (0.03), so
  # one more point past it (0.06).
  small = sorted(os.listdir(tmp_path / 'lm' / 'noise_records' / 'adamw'))
  assert small == ['noise_best_s0.json', 'small_lr0.003_s0.json', 'small_lr0.03_s0.json', 'small_lr0.06_s0.json']
  vals = {lr: json.loads((tmp_path / 'lm' / 'noise_records' / 'adamw' / f'small_lr{lr}_s0.json').read_text())['val_bpb']
          for lr in ('0.003', '0.03')}
  assert vals['0.03'] < vals['0.003']
  rec = json.loads((tmp_path / 'lm' / 'noise_records' / 'adamw' / 'small_lr0.03_s0.json').read_text())
  assert rec['config']['data']['batch_size'] == 1 and 'noise' not in rec


def test_optimum_is_the_parabolas_vertex_in_log_lr():
  lrs = [0.01 * 2.0 ** k for k in range(6)]
  value = lambda lr: 1.0 + (math.log(lr) - math.log(0.05)) ** 2  # a parabola in log LR with its vertex at 0.05
  run = lambda lr, seed, shift=0.0: {'val_bpb': value(lr) + shift, 'diverged_at': None, 'config': {'seed': seed}}
  grid = {lr: [run(lr, 0)] for lr in lrs}
  got = exp.optimum(grid)
  assert got['grid_lr'] == 0.04 and got['lr'] == pytest.approx(0.05, rel=1e-9)
  # A second seed, 0.5 worse, on two of the three points only: the parabola stays on the common seed.
  grid[0.04].append(run(0.04, 1, 0.5))
  grid[0.08].append(run(0.08, 1, 0.5))
  got = exp.optimum(grid)
  assert got['lr'] == pytest.approx(0.05, rel=1e-9) and got['parabola_seeds'] == 1
  grid[0.08] = [{'val_bpb': None, 'diverged_at': 10, 'config': {'seed': 0}}]  # a neighbour diverged: the grid point
  assert exp.optimum(grid)['lr'] == 0.04
  assert exp.optimum({0.01: grid[0.01]})['lr'] == 0.01


def test_surge_fit_recovers_the_law_from_three_batches():
  c, b_noise = 0.3, 40.0
  batches = [8.0, 16.0, 32.0]
  lrs = [exp.surge_lr(c, b_noise, b) for b in batches]
  got_c, got_bn = exp.surge_fit(batches, lrs)
  assert got_bn == pytest.approx(b_noise, rel=0.01) and got_c == pytest.approx(c, rel=0.01)
  # The law by hand: c / (sqrt(B_noise / B) + sqrt(B / B_noise)), peaking at B = B_noise with c / 2.
  assert exp.surge_lr(c, b_noise, b_noise) == pytest.approx(c / 2)
  assert exp.surge_lr(c, b_noise, 10.0) == pytest.approx(c / (2.0 + 0.5))
  assert exp.surge_fit([8.0], [0.1]) is None


def _parabola_grid(folder, prefix, vertex, seeds=(0,)):
  """Records of a sweep whose seed-mean final is a parabola in log LR with its vertex at ``vertex``."""
  os.makedirs(os.path.join(folder, 'adamw'), exist_ok=True)
  grid = {}
  for k in range(8):
    lr = 0.00375 * 2.0 ** k
    for seed in seeds:
      rec = {'name': f'adamw/{prefix}_lr{lr:g}_s{seed}', 'val_bpb': 2.0 + (math.log(lr) - math.log(vertex)) ** 2,
             'diverged_at': None, 'config': {'seed': seed, 'optim': {'max_lr': lr}}}
      with open(os.path.join(folder, rec['name'] + '.json'), 'w', encoding='utf-8') as f:
        json.dump(rec, f)
      grid.setdefault(lr, []).append(rec)
  return grid


def test_ladder_report_predicts_the_factor_from_the_small_batches(tmp_path):
  folder = str(tmp_path / 'sweep')
  _parabola_grid(folder, 'grid', 0.04)  # the sweep at B: its best at 0.04
  small = _parabola_grid(str(tmp_path / 'b8'), 'small', 0.01)
  rungs = {4: _parabola_grid(str(tmp_path / 'b4'), 'small4', 0.015), 2: _parabola_grid(str(tmp_path / 'b2'), 's2', 0.0225)}
  lad = exp.ladder_report(small, rungs, folder, 'adamw')
  assert lad['lr'] == pytest.approx({'8': 0.01, '4': 0.015, '2': 0.0225, '1': 0.04})
  assert lad['doubling'] == pytest.approx([1.5, 1.5, 0.04 / 0.0225])
  assert lad['factor'] == pytest.approx(4.0)
  pred = {k: v['factor'] for k, v in lad['predicted'].items()}
  # One power law through the small batches (exponent log2 1.5): 1.5 per doubling, three doublings to B.
  for name in ('power law through B/8, B/4', 'power law through B/8, B/2'):
    assert pred[name] == pytest.approx(1.5 ** 3)
  # 1.5 per doubling is steeper than the surge law can rise (sqrt(2) per doubling, far below its noise scale): fitted
  # to these points it predicts at most sqrt(8).
  assert pred['Adam surge law through B/8, B/4, B/2'] <= math.sqrt(8) + 1e-6
  assert all(v['sweep_pct'] is None for v in lad['predicted'].values())  # (no own-gradient winners here)
  lines = exp._ladder_table({'lm': {'1500': {'adamw': {'ladder': lad}}}})  # pylint: disable=protected-access
  assert '| lm | 1500 | adamw | 0.01, 0.015, 0.0225, 0.04 | 1.50 / 1.50 / 1.78 | 4.00 |' in lines[-1]
