"""one_cycle against torch's OneCycleLR, as recorded by the reference and as a numpy formula."""

import math
import pathlib

import numpy as np
import pytest

import hdet_jax as H

DATA = pathlib.Path(__file__).parent / 'data' / 'onecycleautolr_traces.npz'


def torch_one_cycle(step, max_lr, total, pct=0.3, div=25.0, final_div=1e4, strategy='cos', three_phase=False):
  """numpy transcription of torch.optim.lr_scheduler.OneCycleLR.get_lr."""
  initial = max_lr / div
  minimum = initial / final_div
  if three_phase:
    phases = [
      (float(pct * total) - 1, initial, max_lr),
      (float(2 * pct * total) - 2, max_lr, initial),
      (total - 1, initial, minimum),
    ]
  else:
    phases = [(float(pct * total) - 1, initial, max_lr), (total - 1, max_lr, minimum)]
  start = 0.0
  for i, (end, a, b) in enumerate(phases):
    if step <= end or i == len(phases) - 1:
      p = (step - start) / (end - start)
      if strategy == 'cos':
        return b + (a - b) / 2.0 * (math.cos(math.pi * p) + 1)
      return (b - a) * p + a
    start = end


@pytest.mark.parametrize(
  'kw',
  [
    dict(max_lr=1e-3, total_steps=2000),
    dict(max_lr=0.3, total_steps=97, pct_start=0.25, div_factor=10.0, final_div_factor=100.0),
    dict(max_lr=1e-2, total_steps=500, anneal_strategy='linear'),
    dict(max_lr=1e-2, total_steps=500, three_phase=True),
  ],
)
def test_matches_torch_formula(kw):
  sched = H.one_cycle(**kw)
  total = kw['total_steps']
  ours = np.array([float(sched(t)) for t in range(total)])
  ref = np.array(
    [
      torch_one_cycle(
        t,
        kw['max_lr'],
        total,
        kw.get('pct_start', 0.3),
        kw.get('div_factor', 25.0),
        kw.get('final_div_factor', 1e4),
        kw.get('anneal_strategy', 'cos'),
        kw.get('three_phase', False),
      )
      for t in range(total)
    ]
  )
  np.testing.assert_allclose(ours, ref, rtol=2e-5, atol=1e-12)
  # Past the end it holds the final value instead of raising.
  assert float(sched(total + 10)) == pytest.approx(ref[-1], rel=1e-5)


def test_matches_reference_trace_before_auto_lr():
  # The reference's first 200 steps are plain OneCycleLR (its missing spread in warmup is defect 1).
  d = np.load(DATA)
  lr = d['E_noauto/lr_after'][0, :, 0]
  sched = H.one_cycle(max_lr=1e-3, total_steps=2000)
  ours = np.array([float(sched(t)) for t in range(2000)])
  np.testing.assert_allclose(ours, lr[:2000], rtol=1e-5)


@pytest.mark.parametrize(
  'kw, name',
  [
    (dict(max_lr=0.0, total_steps=10), 'max_lr'),
    (dict(max_lr=1.0, total_steps=1), 'total_steps'),
    (dict(max_lr=1.0, total_steps=10, pct_start=1.0), 'pct_start'),
    (dict(max_lr=1.0, total_steps=10, anneal_strategy='exp'), 'anneal_strategy'),
    (dict(max_lr=1.0, total_steps=10, div_factor=0.0), 'div_factor'),
  ],
)
def test_bad_arguments(kw, name):
  with pytest.raises(ValueError, match=name):
    H.one_cycle(**kw)


@pytest.mark.parametrize(
  'kw, valid, peak_step',
  [
    # The warm-up phase would end at step pct_start * S - 1 = -0.5, before it starts; 0.2 ends it at step 1.
    (dict(total_steps=10, pct_start=0.05), dict(total_steps=10, pct_start=0.2), 1),
    # Three phases: up until 2 * 5.5 - 2 = 9 = S - 1 leaves the last phase empty; 0.5 ends them at 4, 8 and 9.
    (dict(total_steps=10, pct_start=0.55, three_phase=True), dict(total_steps=10, pct_start=0.5, three_phase=True), 4),
  ],
)
def test_an_empty_phase_names_pct_start(kw, valid, peak_step):
  with pytest.raises(ValueError, match=rf'pct_start={kw["pct_start"]!r} with total_steps=10 leaves an empty phase'):
    H.one_cycle(max_lr=1.0, **kw)
  sched = H.one_cycle(max_lr=1.0, **valid)
  ref = [
    torch_one_cycle(t, 1.0, 10, valid['pct_start'], three_phase=valid.get('three_phase', False)) for t in range(10)
  ]
  np.testing.assert_allclose([float(sched(t)) for t in range(10)], ref, rtol=2e-5)
  assert int(np.argmax(ref)) == peak_step and float(sched(peak_step)) == pytest.approx(1.0, rel=1e-6)
