"""benchmarks/same_layout.py --quick: HDET's step against plain under the same map (plain (b): hdet with spread 0,
no controller, no sync) on the same ('replica', 'data') mesh, on examples/add_to_trainer's linen trainer with
gradient accumulation (hdet_jax.multi_steps), compiled and counted, never run. The full run (both trainers, with
and without accumulation, 1 and 2 replicas per device, plain as users run it) is in results/benchmarks.md."""

from benchmarks import same_layout


def test_hdet_costs_what_plain_costs_under_the_same_map(capsys):
  """The goal: flops within 1.005x of plain (b), and nothing across replica groups between syncs but what plain (b)
  sends, the gradient's all-reduce. Measured (the suite's flags): flops 1.0001x, bytes accessed 1.0004x, 74,692 B
  of all-reduce across groups per device on every step in both, the window's average (74,704 B, about the
  parameters' 75,648 B per device) in a branch."""
  steps = same_layout.main(['--quick'])['steps']
  key = ('linen', 'example', True, 1)
  hdet, base = steps[key + ('HDET',)], steps[key + ('plain (b)',)]
  assert hdet['flops'] <= 1.005 * base['flops'], (hdet['flops'], base['flops'])
  assert {c.op for c in hdet['always']} == {c.op for c in base['always']} == {'all-reduce'}
  assert hdet['always B'] == base['always B'] > 0
  assert any(c.op == 'all-reduce' and c.operand_bytes >= 0.9 * hdet['always B'] for c in hdet['inside'])
  assert hdet['remat'] == base['remat'] == 0
  printed = capsys.readouterr().out
  assert '| linen | k=2, multi_steps | 1 (N=4) | HDET |' in printed and 'the 1.005x goal is met' in printed, printed
