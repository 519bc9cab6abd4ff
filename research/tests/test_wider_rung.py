"""research/wider_rung.py: the LR bracket with a wider first rung, composed from a committed bracket's runs (the
archived research/archive/last_rung.py's quick run builds on its quick bracket: research/archive/tests/)."""

import json
import math
import os

import numpy as np
import pytest

from research import bracket_mode
from research import wider_rung as exp

CELL = exp.QUICK_CELL


@pytest.fixture(scope='module')
def quick(tmp_path_factory):
  work = str(tmp_path_factory.mktemp('wider_rung'))
  exp.main(['--quick', '--workdir', work])
  return work


def test_the_added_points_are_the_next_in_the_first_rungs_order():
  rec = {
    'lrs': [0.1, 0.2, 0.4, 0.8, 1.6],
    'kept_lr': 0.4,
    'rungs': [{'losses': {'0.1': 3.0, '0.2': 2.0, '0.4': 1.0, '0.8': 2.0, '1.6': float('nan')}, 'kept': [0.2, 0.4]}],
  }
  # 0.4 and then 0.2 / 0.8 tied (the lower LR first, as bracket.survivors); NaN ranks last
  assert exp.first_rung_order(rec) == [0.4, 0.2, 0.8, 0.1, 1.6]
  assert exp.extra_points(rec) == [0.8, 0.1]


def test_quick_composes_the_wider_bracket_as_a_real_one_trains_it(quick):
  work = quick
  with open(bracket_mode.record_path(CELL, 'best', 0, True, work), encoding='utf-8') as f:
    rec = json.load(f)
  # The bracket's own first rung: the 2 of 5 with the lowest loss; the added points are the other two, in loss order.
  first = rec['rungs'][0]['losses']
  order = [rec['lrs'][i] for i in np.argsort([first[f'{lr:.6g}'] for lr in rec['lrs']], kind='stable')]
  assert sorted(order[:2]) == rec['rungs'][0]['kept'] and exp.extra_points(rec) == order[2:4]
  got = exp.compose(CELL, 'best', 0, True, work, train=False)
  assert got['reproduced']  # each probe's first-rung loss is the bracket's own, bit for bit (one CPU)
  probes = {}
  for lr in order[2:4]:
    with open(exp.probe_path(CELL, 'best', 0, lr, True, work), encoding='utf-8') as f:
      probes[lr] = json.load(f)
    assert probes[lr]['losses'][0] == first[f'{lr:.6g}'] and probes[lr]['rung_steps'] == [4, 8]
  # The widest rung keeps four: its last rung is the argmin of the kept point's and the probes' losses there.
  last = {
    rec['kept_lr']: rec['rungs'][-1]['losses'][f'{rec["kept_lr"]:.6g}'],
    **{lr: p['losses'][-1] for lr, p in probes.items()},
  }
  winner = min(last, key=lambda lr: (last[lr], lr))
  assert got['wider']['2']['kept_lr'] == winner
  # ... and a real bracket with that rung trains to the same point and the same final metric, bit for bit.
  checked = exp.check(f'{CELL}:best:0', True, work)
  assert checked['rungs'] == '0.25:4,0.5:1' and checked['equal'], checked
  check_rec = json.load(open(exp.check_path(CELL, 'best', 0, True, work), encoding='utf-8'))
  from hdet_jax.trainer import process

  assert check_rec.pop('machine')['cpu'] == process.cpu_model() and check_rec == checked  # the record names its machine
  assert math.isfinite(checked['bracket']['final_metric'])
  saved = json.load(open(os.path.join(work, 'wider_rung.json'), encoding='utf-8'))
  assert saved['compute_runs'] == {
    '5-2-1': (5 * 4 + 2 * 4 + 8) / 16,
    '5-3-1': (5 * 4 + 3 * 4 + 8) / 16,
    '5-4-1': (5 * 4 + 4 * 4 + 8) / 16,
  }
  seed = saved['rows'][CELL]['best']['seeds'][0]
  assert seed['wider']['2']['final_metric'] == checked['bracket']['final_metric']


def test_committed_records_compose_from_their_probes():
  """Every committed wider bracket: its added points are the record's next two by first-rung loss, its kept point
  the last rung's argmin over the kept point and the probes, and its final the committed end of that point."""
  with open(os.path.join(exp.REPO, 'results', 'wider_rung.json'), encoding='utf-8') as f:
    rows = json.load(f)['rows']
  n = 0
  for cell, starts in rows.items():
    for start, row in starts.items():
      for s in row['seeds']:
        with open(bracket_mode.record_path(cell, start, s['seed'], False, ''), encoding='utf-8') as f:
          rec = json.load(f)
        assert s['extras'] == exp.first_rung_order(rec)[4:6]
        last = {float(k): v for k, v in s['last_rung'].items()}
        for k in exp.EXTRA:
          pool = [rec['kept_lr']] + s['extras'][:k]
          want = min(pool, key=lambda lr: (last[float(f'{lr:.6g}')], lr))
          got = s['wider'][str(k)]
          assert got['kept_lr'] == want
          if want == rec['kept_lr']:
            assert got['final_metric'] == rec['final_metric']
          else:
            with open(exp.end_path(cell, start, s['seed'], want, False, ''), encoding='utf-8') as f:
              assert got['final_metric'] == json.load(f)['final_metric']
        n += 1
  assert n >= 36


def test_a_replaced_point_enters_on_the_records_footing():
  seed = {
    'kept_lr': 0.4,
    'final_metric': 2.0,
    'reproduced': False,
    'kept_end_here': 1.9,
    'wider': {'1': {'kept_lr': 0.4, 'final_metric': 2.0}, '2': {'kept_lr': 0.2, 'final_metric': 1.85}},
  }
  assert exp.paired_final(seed, 1) == 2.0  # unchanged: the record's own
  assert abs(exp.paired_final(seed, 2) - (2.0 - 0.05)) < 1e-12  # the record's + (new end - kept end), both here
  seed['reproduced'] = True  # one footing already: the new point's own end
  assert exp.paired_final(seed, 2) == 1.85


def test_the_default_bracket_is_ahead_of_every_lr_free_peer_from_every_start():
  """Where the LR-free peers were run (AdamW at each workload's default length, 3 seeds: results/workloads.json),
  the default bracket (8-5-1, results/wider_rung.json) ends below every peer's 3-seed mean from every start."""
  with open(os.path.join(exp.REPO, 'results', 'workloads.json'), encoding='utf-8') as f:
    sweeps = json.load(f)
  with open(os.path.join(exp.REPO, 'results', 'wider_rung.json'), encoding='utf-8') as f:
    rows = json.load(f)['rows']
  cells = [(w, s) for w in sweeps for s in sweeps[w] if sweeps[w][s]['adamw']['peers']]
  assert sorted(cells) == [('finetune', '300'), ('lm', '1500'), ('mnist1d', '1000')]
  for w, s in cells:
    peers = sweeps[w][s]['adamw']['peers']
    best_peer = min(p['value'] for p in peers.values())
    for start in ('low', 'best', 'high'):
      row = rows[f'{w}:{s}:adamw'][start]
      # the 3-seed mean of the kept runs' finals, from the seeds (on the record's footing: exp.paired_final)
      mean = float(np.mean([exp.paired_final(seed, 1) for seed in row['seeds']]))
      assert mean == pytest.approx(row['wider1'], rel=1e-12)
      assert mean < best_peer, (w, s, start, mean, best_peer)
