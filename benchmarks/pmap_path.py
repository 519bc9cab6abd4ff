"""The pmap path's cost, counted: HDET against plain under ``jax.pmap``, beside the mesh path (``shard_map``).

    python -m benchmarks.pmap_path [--smoke] [--write] [--rounds R] [--k K] [--compiles C] [--save FILE]
    python -m benchmarks.pmap_path --from FILE [--write]   # the report of a saved run, nothing measured

The benchmarks' step (``benchmarks/common.py``: the trainer's TransformerLM, ``optax.adam(one_cycle)``, the
gradient's ``lax.pmean``), N = 8 replicas on 8 simulated CPU devices, run two ways from the same per-replica
function: ``jax.pmap(step, axis_name='data')`` (the pmap path: what examples/pmap_vmap.py and a flax-imagenet
style trainer call every step) and ``jax.jit(shard_map_replicas(step, mesh, 'data'))`` (the mesh path). Plain is
``optax.adam`` alone; HDET is ``hdet(optax.adam, one_cycle, N=8, spread=0.25, auto_lr=AutoLR(total_steps=S))``
as a pmap trainer writes it: the HDETState as it is (not packed), ``optax.apply_updates``, no donation. Its
programs:

* ``sync=None``, one program (the examples' way): ``hdet``'s ``lax.cond`` decides on the device. Its two paths
  are counted apart: the compiled HLO with the conditional replaced by a call of one branch, counted by XLA's
  own cost analysis (``cond, not taken``: a non-sync step; ``cond, taken``: a sync step);
* ``sync=False`` and ``sync=True``, two programs the loop picks between (the trainer's dispatch);
* the same with HDET's small state packed in one buffer (``hdet_jax.packed``), and with the parameters and
  optimizer state donated (``jax.pmap(..., donate_argnums=(0, 1))``), beside plain donated.

Counted per device and step (deterministic): XLA's flops and bytes accessed; the kernels of the optimized HLO
(fusions, copies, every other instruction that runs work; parameters, constants, tuples, bitcasts and
get-tuple-elements are free), the collectives (all-reduce and all-gather: count and operand bytes,
``benchmarks/comm.py``). Timed, labelled CPU: compilation (``.lower().compile()`` of freshly built programs, the
median of ``--compiles`` builds per program, the paths side by side in a fresh order every round) and the step
(the median over interleaved rounds of K calls of each program through the path's own dispatch, ``pmap``'s or
``jit``'s, with a plain/plain A/A control per path). ``--write`` replaces this benchmark's section of
results/benchmarks.md (or appends it); ``--smoke`` runs a one-block model, one compile and two rounds of two calls,
and writes nothing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import re
import statistics
import sys
import time
import types

os.environ.setdefault('JAX_NUM_CPU_DEVICES', '8')

from benchmarks import comm  # noqa: E402
from benchmarks import common as C  # noqa: E402  (sets up the devices before jax starts)
from benchmarks import pages  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

RESULTS = C.REPO / 'results' / 'benchmarks.md'
HEADING = '## The pmap path, counted'
PATHS = {'mesh': 'shard_map', 'pmap': 'pmap'}  # path name: common.Variant backend
SMOKE_MODEL = (types.SimpleNamespace(d_model=16, num_layers=1, num_heads=2, mlp_ratio=2), 8, 2, 'one-block smoke model')
# The variants, one of each per path: (name, kind, mode, donate, packed). exact_sync off; "packed": HDET's small
# state in one buffer (``hdet_jax.packed``'s layout, common.py's ``packed=True``).
VARIANTS = (
  ('plain', 'plain', 'static', False, False),
  ('cond', 'hdet', 'cond', False, False),
  ('two programs', 'hdet', 'static', False, False),
  ('cond, packed', 'hdet', 'cond', False, True),
  ('two programs, packed', 'hdet', 'static', False, True),
  ('plain, donated', 'plain', 'static', True, False),
  ('two programs, donated', 'hdet', 'static', True, False),
  ('two programs, packed, donated', 'hdet', 'static', True, True),
)
# The counted programs: (row, variant, program flag, branch of the conditional or None, the plain row it is read
# against).
PROGRAMS = (
  ('plain', 'plain', None, None, 'plain'),
  ('non-sync step: cond, not taken (sync=None)', 'cond', None, 0, 'plain'),
  ('non-sync step: sync=False program', 'two programs', False, None, 'plain'),
  ('sync step: cond, taken (sync=None)', 'cond', None, 1, 'plain'),
  ('sync step: sync=True program', 'two programs', True, None, 'plain'),
  ('non-sync step: cond, not taken, packed', 'cond, packed', None, 0, 'plain'),
  ('non-sync step: sync=False program, packed', 'two programs, packed', False, None, 'plain'),
  ('plain, donated', 'plain, donated', None, None, 'plain, donated'),
  ('non-sync step: sync=False program, donated', 'two programs, donated', False, None, 'plain, donated'),
  (
    'non-sync step: sync=False program, packed, donated',
    'two programs, packed, donated',
    False,
    None,
    'plain, donated',
  ),
)
FREE = {'parameter', 'constant', 'get-tuple-element', 'tuple', 'bitcast', 'partition-id', 'replica-id'}
# The timed programs: (name, variant, Runner phase).
TIMED = (
  ('plain', 'plain', 'loop'),
  ('plain (A/A control)', 'plain', 'loop'),
  ('cond, not taken', 'cond', 'loop'),
  ('sync=False program', 'two programs', 'nosync'),
  ('sync=True program', 'two programs', 'sync'),
)
# The compiled builds: (name, variant): every program of the variant.
COMPILED = (
  ('plain', 'plain'),
  ('cond (one program)', 'cond'),
  ('two programs (sync=False and sync=True)', 'two programs'),
)


def variant(name: str, path: str) -> C.Variant:
  _, kind, mode, donate, packed = next(v for v in VARIANTS if v[0] == name)
  return C.Variant(f'{name} ({path})', kind, mode, donate=donate, packed=packed, backend=PATHS[path])


# ------------------------------------------------------------------------------------------------
# Counting a compiled program, branch by branch.
# ------------------------------------------------------------------------------------------------
def _computations(hlo: str) -> dict[str, list[str]]:
  """{computation name: its instruction lines}; the entry computation under the key 'ENTRY'."""
  bodies, name = {}, None
  for line in hlo.splitlines():
    m = re.match(r'^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$', line)
    if m and not line.startswith(' '):
      name = 'ENTRY' if m.group(1) else m.group(2)
      bodies[name] = []
    elif name is not None and line.startswith(' '):
      bodies[name].append(line)
  return bodies


def _conditionals(hlo: str) -> list[tuple[str, list[str], list[str]]]:
  """The entry computation's conditionals: (line, operands, branch computations), branch 0 first (lax.cond's
  false branch)."""
  out = []
  for line in _computations(hlo)['ENTRY']:
    m = re.search(r' conditional\(%?[\w.\-]+, (.*?)\), branch_computations=\{(.*?)\}', line)
    if m:
      ops = [o.strip().lstrip('%') for o in m.group(1).split(',')]
      out.append((line, ops, [b.strip().lstrip('%') for b in m.group(2).split(',')]))
  return out


def take_branch(hlo: str, branch: int) -> str:
  """The program with its one conditional replaced by a call of branch ``branch``: what runs when the predicate
  picks it (``lax.cond``: 0 = false, 1 = true)."""
  (line, ops, branches), *more = _conditionals(hlo)
  assert not more, 'one conditional expected in the entry computation'
  head = line[: line.index(' conditional(')]
  tail = line[line.index('branch_computations=') :]
  tail = tail[tail.index('}') + 1 :]
  return hlo.replace(line, f'{head} call(%{ops[branch]}), to_apply=%{branches[branch]}{tail}')


def xla_cost(hlo: str) -> dict[str, float]:
  """XLA's cost analysis (flops, bytes accessed) of an HLO module's text, on the CPU client.

  jaxlib's HLO parser and cost analysis (private modules): :func:`count` checks them against the compiled
  program's own ``cost_analysis()`` on every program without a conditional.
  """
  import jaxlib._hlo as hlo_lib
  from jax._src.lib import _jax

  cost = _jax.hlo_module_cost_analysis(jax.devices()[0].client, hlo_lib.hlo_module_from_text(hlo))
  return {'flops': float(cost['flops']), 'bytes accessed': float(cost['bytes accessed'])}


def _reached(bodies: dict[str, list[str]]) -> set[str]:
  """The computations a call of the entry runs as instructions of their own: the entry and what it reaches through
  calls, loops and conditionals (all branches: take one first with :func:`take_branch`); not fused computations
  (one fusion is one kernel) nor reducers."""
  seen, frontier = {'ENTRY'}, ['ENTRY']
  while frontier:
    for line in bodies.get(frontier.pop(), ()):
      if not re.search(r' (?:call|while|conditional)\(', line):
        continue
      callees = re.findall(r'(?:to_apply|body|condition)=%?([\w.\-]+)', line)
      for group in re.findall(r'branch_computations=\{(.*?)\}', line):
        callees += [b.strip().lstrip('%') for b in group.split(',')]
      for name in set(callees) - seen:
        seen.add(name)
        frontier.append(name)
  return seen


def kernels(hlo: str) -> dict[str, int]:
  """Instructions that run work, by kind (fusion, copy, all-reduce...), in the computations :func:`_reached` finds."""
  bodies, counts = _computations(hlo), {}
  for name in _reached(bodies):
    for line in bodies[name]:
      m = re.search(r'= (?:\(.*?\)|\S+) ([a-z][\w-]*)\(', line)
      if m and m.group(1) not in FREE and m.group(1) not in ('call', 'while', 'conditional'):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
  return counts


def count(compiled, branch=None) -> dict:
  """flops, bytes accessed, kernels and collectives of a compiled program (of one branch of its conditional)."""
  hlo = compiled.as_text()
  if branch is None:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    cost = {'flops': float(cost['flops']), 'bytes accessed': float(cost['bytes accessed'])}
    if not _conditionals(hlo):
      assert xla_cost(hlo) == cost, (xla_cost(hlo), cost)  # the branch counts' method, checked
  else:
    hlo = take_branch(hlo, branch)
    cost = xla_cost(hlo)
  k = kernels(hlo)
  bodies = _computations(hlo)
  lines = '\n'.join(line for name in _reached(bodies) for line in bodies[name])
  colls = comm.collectives(lines, (C.N,))
  out = dict(cost)
  out['kernels'] = sum(k.values())
  out['fusions'], out['copies'] = k.get('fusion', 0), k.get('copy', 0)
  for op in ('all-reduce', 'all-gather'):
    out[op] = (sum(1 for c in colls if c.op == op), sum(c.operand_bytes for c in colls if c.op == op))
  out['other collectives'] = sum(1 for c in colls if c.op not in ('all-reduce', 'all-gather'))
  return out


# ------------------------------------------------------------------------------------------------
# Timing.
# ------------------------------------------------------------------------------------------------
class Timed:
  """One program of a runner, called through its path's own dispatch (``pmap``'s wrapper or ``jit``'s): ``run(k)``
  times k calls to completion and keeps each call's dispatch time (until the call returns, the work queued)."""

  def __init__(self, runner: C.Runner, phase: str):
    self.runner, self.phase, self.dispatch = runner, phase, []

  def run(self, k: int) -> float:
    r = self.runner
    r.phase = self.phase
    jax.block_until_ready((r.params, r.opt_state))
    start = time.perf_counter()
    for _ in range(k):
      fn, call = r.program(r.t), time.perf_counter()
      r.params, r.opt_state, loss = fn(r.params, r.opt_state, r.batches[r.t % len(r.batches)])
      self.dispatch.append(time.perf_counter() - call)
      r.t += 1
    jax.block_until_ready((r.params, r.opt_state, loss))
    return time.perf_counter() - start


def _flags(vname: str) -> list:
  """The program flags of a variant's build (``common.build_programs``)."""
  _, kind, mode, *_ = next(v for v in VARIANTS if v[0] == vname)
  return [False, True] if kind == 'hdet' and mode == 'static' else [None]


def compile_more(graphdef, shape, mesh, rounds: int, seconds: dict, log=None) -> None:
  """Appends to ``seconds`` {(build, path): {'wall': [...], 'backend': [...]}} ``rounds`` more fresh builds of each
  (programs built anew, so nothing is cached in the process), builds and paths in a fresh order every round."""
  counter = C.CompileCounter()
  rng = np.random.default_rng(3)
  cases = [(b, p) for b, _ in COMPILED for p in PATHS]
  for r in range(rounds):
    for i in rng.permutation(len(cases)):
      build, path = cases[i]
      vname = dict(COMPILED)[build]
      v = variant(vname, path).resolved()
      tx, programs = C.build_programs(graphdef, v, mesh)
      params, opt_state = C.init_state(*shape[:2], tx, v, mesh)
      batch = C.make_batches(shape[1], shape[2], v, mesh, count=1)[0]
      jax.block_until_ready((params, opt_state))
      mark, start = counter.mark(), time.perf_counter()
      for flag in _flags(vname):
        programs[flag].lower(params, opt_state, batch).compile()
      seconds[build, path]['wall'].append(time.perf_counter() - start)
      seconds[build, path]['backend'].append(counter.since(mark)[1])
    if log:
      log(f'compile round {r + 2}: done')


def measure(smoke: bool = False, rounds: int = 30, k: int = 5, compiles: int = 3, log=None) -> dict:
  """Every program's counts, compile seconds and step times; see the module docstring."""
  if jax.device_count() < C.N:
    raise RuntimeError(f'pmap_path: needs {C.N} devices (one replica each), found {jax.device_count()}')
  m, seq, batch, src = SMOKE_MODEL if smoke else C.default_model_config()
  mesh = C.make_mesh()
  graphdef, _ = C.model_lib.abstract_model(m, seq)
  runners = {}
  # One initial state per layout (plain's; HDET's packed or not), shared by the runners that start from it: the
  # variants differ in their programs, not in their state (one tx each kind, which init_state places alike on both
  # paths), and sharing is safe since the runners that run (TIMED's) donate nothing; the donated ones are only
  # lowered. 3 initializations instead of 18, each a jit (trace, lowering, compilation) of its own.
  states = {}
  for path in PATHS:
    for name, kind, _, _, packed in VARIANTS:
      layout = (kind, packed and kind == 'hdet')
      r = runners[name, path] = C.Runner(variant(name, path), graphdef, m, seq, batch, mesh, state=states.get(layout))
      states.setdefault(layout, (r.params, r.opt_state))
  # Every program compiled once, in a random order of paths and programs: the counts, and the first round of
  # compile times. The path's own function is called later on the same arguments: no second compilation.
  counter, rng = C.CompileCounter(), np.random.default_rng(2)
  jobs = sorted(
    {(vname, flag, path) for _, vname, flag, _, _ in PROGRAMS for path in PATHS}
    | {(vname, flag, path) for _, vname in COMPILED for flag in _flags(vname) for path in PATHS},
    key=str,
  )
  executables, secs = {}, {}
  for i in rng.permutation(len(jobs)):
    vname, flag, path = jobs[i]
    r = runners[vname, path]
    mark, start = counter.mark(), time.perf_counter()
    executables[jobs[i]] = r.programs[flag].lower(*r.example_args(flag)).compile()
    secs[jobs[i]] = (time.perf_counter() - start, counter.since(mark)[1])
  counted = {
    (row, path): count(executables[vname, flag, path], branch)
    for row, vname, flag, branch, _ in PROGRAMS
    for path in PATHS
  }
  seconds = {
    (build, path): {
      'wall': [sum(secs[vname, f, path][0] for f in _flags(vname))],
      'backend': [sum(secs[vname, f, path][1] for f in _flags(vname))],
    }
    for build, vname in COMPILED
    for path in PATHS
  }
  if log:
    log('counted; compile round 1: done')
  leaves = {}
  timed = {}
  for path in PATHS:
    for name, vname, phase in TIMED:
      if name == 'plain (A/A control)':  # the same program as plain, with a state of its own (from the same start)
        r = C.Runner(variant(vname, path), graphdef, m, seq, batch, mesh, state=states[vname, False])
        r.programs = runners[vname, path].programs
      else:
        r = runners[vname, path]
      timed[name, path] = Timed(r, phase)
      timed[name, path].run(2)  # warms up (the first call's allocations)
      timed[name, path].dispatch.clear()
      leaves[name] = len(jax.tree.leaves((r.params, r.opt_state)))
  load = [os.getloadavg()[0]]  # other jobs on the machine: the timed figures' context
  times = C.interleave(timed, rounds, k, seed=1, log=log)
  load.append(os.getloadavg()[0])
  compile_more(graphdef, (m, seq, batch), mesh, compiles - 1, seconds, log=log)
  return {
    'counted': counted,
    'times': times,
    'dispatch': {key: t.dispatch for key, t in timed.items()},
    'leaves': leaves,
    'compiled': seconds,
    'model': f'd_model={m.d_model} layers={m.num_layers} seq={seq} batch/replica={batch} '
    f'params/replica={C.num_params(m, seq):,} ({src})',
    'load': load,
    'param B': 4 * C.num_params(m, seq),  # float32 parameters of one replica, on its device
    'rounds': rounds,
    'k': k,
    'compiles': compiles,
  }


# ------------------------------------------------------------------------------------------------
# Report.
# ------------------------------------------------------------------------------------------------
def _ratio(a: float, b: float) -> str:
  return f'{a / b:.5f}' if b else 'n/a'


def _coll(x: tuple[int, int]) -> str:
  return f'{x[0]}; {x[1]:,}'


def counted_table(measured: dict) -> list[str]:
  c = measured['counted']
  lines = [
    '| path | program | XLA flops | / plain | XLA bytes accessed | / plain | kernels (/ plain) | fusions | copies | '
    'all-reduce: count; B | all-gather: count; B |',
    '|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for path in PATHS:
    for row, _, _, _, base in PROGRAMS:
      x, p = c[row, path], c[base, path]
      lines.append(
        f'| {path} | {row} | {x["flops"]:,.0f} | {_ratio(x["flops"], p["flops"])} | {x["bytes accessed"]:,.0f} | '
        f'{_ratio(x["bytes accessed"], p["bytes accessed"])} | {x["kernels"]} ({x["kernels"] / p["kernels"]:.3f}) | '
        f'{x["fusions"]} ({x["fusions"] - p["fusions"]:+d}) | {x["copies"]} ({x["copies"] - p["copies"]:+d}) | '
        f'{_coll(x["all-reduce"])} | {_coll(x["all-gather"])} |'
      )
  return lines


def window_lines(measured: dict, ts=(1, 10, 100, 1000)) -> list[str]:
  """A sync window's counted cost, ((T - 1) non-sync steps + 1 sync step) / (T plain steps), per design."""
  c = measured['counted']
  out = []
  for path in PATHS:
    p = c['plain', path]
    for label, ns, s in (
      ('sync=None (cond)', 'non-sync step: cond, not taken (sync=None)', 'sync step: cond, taken (sync=None)'),
      ('two programs', 'non-sync step: sync=False program', 'sync step: sync=True program'),
    ):
      cells = []
      for t in ts:
        f = ((t - 1) * c[ns, path]['flops'] + c[s, path]['flops']) / (t * p['flops'])
        b = ((t - 1) * c[ns, path]['bytes accessed'] + c[s, path]['bytes accessed']) / (t * p['bytes accessed'])
        cells.append(f'{f:.5f} / {b:.5f}')
      out.append(f'| {path} | {label} | ' + ' | '.join(cells) + ' |')
  return [
    '| path | HDET design | ' + ' | '.join(f'T={t}: flops / bytes' for t in ts) + ' |',
    '|---|---|' + '---|' * len(ts),
  ] + out


def compile_table(measured: dict) -> list[str]:
  sec = measured['compiled']
  med = lambda build, path, key: statistics.median(sec[build, path][key])
  lines = [
    '| programs built | mesh: lower + compile (s) | mesh: XLA backend (s) | pmap: lower + compile (s) | '
    'pmap: XLA backend (s) | pmap / mesh | / plain, mesh | / plain, pmap |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for build, _ in COMPILED:
    wm, wp = med(build, 'mesh', 'wall'), med(build, 'pmap', 'wall')
    bm, bp = med(build, 'mesh', 'backend'), med(build, 'pmap', 'backend')
    pm, pp = med('plain', 'mesh', 'wall'), med('plain', 'pmap', 'wall')
    lines.append(
      f'| {build} | {wm:.2f} | {bm:.2f} | {wp:.2f} | {bp:.2f} | {wp / wm:.2f} | {wm / pm:.2f} | {wp / pp:.2f} |'
    )
  return lines


def _ci(q) -> str:
  lo, mid, hi = q
  return f'{mid:.4f} [{lo:.4f}-{hi:.4f}]'


def step_table(measured: dict) -> list[str]:
  t, d = measured['times'], measured['dispatch']
  lines = [
    '| program | leaves per call | mesh: median (ms) | mesh: / plain [95% CI] | mesh: dispatch (ms) | '
    'pmap: median (ms) | pmap: / plain [95% CI] | pmap: dispatch (ms) | pmap / mesh [95% CI] |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  for name, _, _ in TIMED:
    cells = [str(measured['leaves'][name])]
    for path in PATHS:
      ms = statistics.median(t[name, path]) * 1e3
      ratio = '' if name == 'plain' else _ci(C.ratio_ci(t[name, path], t['plain', path]))
      cells += [f'{ms:.2f}', ratio, f'{statistics.median(d[name, path]) * 1e3:.3f}']
    lines.append(f'| {name} | ' + ' | '.join(cells) + f' | {_ci(C.ratio_ci(t[name, "pmap"], t[name, "mesh"]))} |')
  return lines


def _over(x: dict, b: dict) -> str:
  """The counted figures of ``x`` over 1.005x ``b``'s, as text."""
  keys = [k for k in ('flops', 'bytes accessed', 'kernels') if x[k] > 1.005 * b[k]]
  return ', '.join(f'{k} {x[k] / b[k]:.4f}x' for k in keys) or 'nothing'


def reading(measured: dict) -> list[str]:
  """The page's reading, one bullet a finding, every number read off the figures."""
  c, pb = measured['counted'], measured['param B']
  at = lambda row: c[row, 'pmap']
  p, pd = at('plain'), at('plain, donated')
  ns, nsp = at('non-sync step: sync=False program'), at('non-sync step: sync=False program, packed')
  nsd, nspd = at('non-sync step: sync=False program, donated'), at('non-sync step: sync=False program, packed, donated')
  cn, cnp = at('non-sync step: cond, not taken (sync=None)'), at('non-sync step: cond, not taken, packed')
  cs, ss = at('sync step: cond, taken (sync=None)'), at('sync step: sync=True program')
  out = []
  differ = [row for row, *_ in PROGRAMS if c[row, 'pmap'] != c[row, 'mesh']]
  out.append(
    '- **The pmap path compiles to what the mesh path compiles**: every counted figure of every program is the '
    "same on both paths (in this jax, `jax.pmap` is `jit` of a `shard_map` over the devices, pmap's squeeze and "
    'expand of the mapped axis costing nothing), so the pmap path has no cost of its own in the compiled program; '
    'what it costs over plain is the HDET design a pmap trainer runs.'
    if not differ
    else '- The pmap path and the mesh path count differently: ' + ', '.join(differ) + '.'
  )
  out.append(
    f'- **The sync=False program** (a non-sync step, two-program dispatch) counts {ns["flops"] / p["flops"]:.5f}x '
    f"plain's flops and {ns['bytes accessed'] / p['bytes accessed']:.5f}x its bytes, and sends plain's one "
    f'all-reduce ({ns["all-reduce"][1]:,} B, the gradient). Over 1.005x: {_over(ns, p)}. Its kernels are '
    f"plain's {p['kernels']} with {ns['fusions'] - p['fusions']:+d} fusions (scalar work on HDET's own state: the "
    "count, the window's loss sum, this replica's values for the coming step; their HLO names an exp, a mul, "
    f'adds, an axis_index and a reduce_sum) and {ns["copies"] - p["copies"]:+d} copies: without donation, every '
    'small state field a non-sync step leaves as it was is copied to an output buffer of its own (an output may '
    "not share a caller's buffer). Packed (`hdet_jax.packed`: the small fields in one buffer), "
    f'{nsp["copies"] - p["copies"]:+d} copies and kernels {nsp["kernels"] / p["kernels"]:.4f}x; donated too, '
    f'{nspd["copies"] - pd["copies"]:+d} copies and kernels {nspd["kernels"] / pd["kernels"]:.4f}x against plain '
    f'donated (unpacked and donated, {nsd["copies"] - pd["copies"]:+d}: donated buffers pair with outputs by '
    'shape, issue 27). What stays over 1.005x is the kernel count: '
    f'{nspd["fusions"] - pd["fusions"]:+d} scalar fusions packed and donated (packing adds '
    f'{nsp["fusions"] - ns["fusions"]:+d}, its slice and concatenate), a fixed few kernels a step whatever the '
    "model's size. Not changed: they are the state's own updates (the coming step's values are carried in the "
    'state by design, read and not recomputed).',
  )
  extra = cn['bytes accessed'] - ns['bytes accessed']
  out.append(
    f"- **The one-program design** (`sync=None`, the examples' way): its non-sync step (the cond not taken) "
    f"counts {cn['bytes accessed'] / p['bytes accessed']:.5f}x plain's bytes, {extra:,.0f} B per device more "
    f"than the sync=False program, of which {2 * pb:,} B are twice the parameters ({pb:,} B): `hdet`'s `lax.cond` "
    "takes the wrapped optimizer's updates as an operand (the sync branch replaces them), so XLA writes them out "
    "and `optax.apply_updates` reads them back, where plain and the sync=False program fuse Adam's update into "
    f"the parameters' ({cn['fusions'] - ns['fusions']:+d} fusions against the sync=False program, "
    f'{cn["copies"] - p["copies"]:+d} copies against plain; packed, {cnp["copies"] - p["copies"]:+d} copies, '
    f'{cnp["fusions"] - p["fusions"]:+d} fusions and still {cnp["bytes accessed"] - nsp["bytes accessed"]:,.0f} B '
    f'more than the packed sync=False program). Over 1.005x: {_over(cn, p)}. Not fixed in the library: a branch '
    'taken at run time needs its parameter-sized result in one buffer whichever branch runs, and the rewrites '
    'that keep the numbers (a correction added after the cond, a select between the two) write and read one as '
    'well. The fix is the dispatch the trainer uses: the sync=False program on every step and a sync program at a '
    "window's end.",
  )
  t100 = lambda n, s_, k: (99 * n[k] + s_[k]) / (100 * p[k])
  out.append(
    f"- **The sync step** (the window's average and the controller): the sync=True program counts "
    f"{ss['flops'] / p['flops']:.5f}x plain's flops and {ss['bytes accessed'] / p['bytes accessed']:.5f}x its "
    f"bytes, and sends {ss['all-reduce'][1] - p['all-reduce'][1]:,} B more all-reduce (the parameters' average, "
    f'{pb:,} B, and a few scalars) and {ss["all-gather"][0]} all-gather of {ss["all-gather"][1]:,} B (the '
    f"replicas' losses, for the controller); the cond taken {cs['flops'] / p['flops']:.5f}x and "
    f'{cs["bytes accessed"] / p["bytes accessed"]:.5f}x. That is the work a sync exists for, once a window: over '
    f'T = 100 steps, {t100(ns, ss, "flops"):.5f}x flops and {t100(ns, ss, "bytes accessed"):.5f}x bytes (two '
    f'programs), {t100(cn, cs, "flops"):.5f}x and {t100(cn, cs, "bytes accessed"):.5f}x (sync=None).',
  )
  sec = measured['compiled']
  med = lambda build, path: statistics.median(sec[build, path]['wall'])
  builds = [b for b, _ in COMPILED]
  out.append(
    '- **Compilation** (CPU, the median of the builds): '
    + '; '.join(f'{b} {med(b, "pmap"):.1f} s on the pmap path, {med(b, "mesh"):.1f} s on the mesh path' for b in builds)
    + '. The one-program design compiles the step and the sync branch together: '
    + f"{med(builds[1], 'pmap') / med(builds[0], 'pmap'):.2f}x plain's time on the pmap path, as the issue's "
    'trainer read (9 s against 4 s, on its own model; not rerun here). The two programs compile the step twice '
    '(the window-end program of section 3, `update(None, ..., sync=True)`, compiles less; pmap compiles what the '
    'mesh path compiles, so its figures there hold).',
  )
  t = measured['times']
  ratio = lambda name, path: C.ratio_ci(t[name, path], t['plain', path])[1]
  aa = [ratio('plain (A/A control)', path) for path in PATHS]
  load = measured.get('load') or []
  out.append(
    '- **Step time** (CPU, 2 cores shared with other jobs'
    + (f'; the 1-minute load average during the run: {", ".join(f"{x:.1f}" for x in load)}' if load else '')
    + '; the A/A control reads '
    + ' and '.join(f'{x:.3f}' for x in aa)
    + ' on the mesh and pmap paths, the noise floor): the cond not taken / plain '
    + ' and '.join(f'{ratio("cond, not taken", path):.3f}' for path in PATHS)
    + ', the sync=False program / plain '
    + ' and '.join(f'{ratio("sync=False program", path):.3f}' for path in PATHS)
    + '. The counted figures above are the evidence; on this machine the times cannot resolve a 1% difference.',
  )
  return out


def section(measured: dict, command: str) -> list[str]:
  from benchmarks import gspmd_path

  return (
    [
      HEADING,
      '',
      f'`{command}` ({datetime.date.today().isoformat()}; {gspmd_path.machine()}). **CPU**: XLA:CPU, every figure. '
      f'Model: {measured["model"]}; N=8 replicas, one per device. The mesh path: the per-replica step under '
      "`jax.jit(shard_map_replicas(step, mesh, 'data'))`; the pmap path: the same function under "
      "`jax.pmap(step, axis_name='data')`. Plain: `optax.adam(one_cycle)` on the `lax.pmean`'d gradient; HDET: "
      '`hdet(optax.adam, one_cycle, N=8, spread=0.25, auto_lr=AutoLR(total_steps=S))` as a pmap trainer writes it '
      '(the state not packed, `optax.apply_updates`, no donation unless the row says so). Counted per device and '
      "step (deterministic): XLA's cost analysis; the optimized HLO's kernels (instructions that run work, a fusion "
      "counting one; with the conditional, those of the branch that runs); the collectives' operand bytes "
      "(`benchmarks/comm.py`). A conditional's branch is counted by replacing the conditional with a call of that "
      "branch and running XLA's cost analysis on the result (checked equal to `cost_analysis()` on every program "
      'without one).',
      '',
    ]
    + counted_table(measured)
    + [
      '',
      'A sync window, counted: ((T - 1) non-sync steps + 1 sync step) / (T plain steps):',
      '',
    ]
    + window_lines(measured)
    + [
      '',
      f'Compilation, CPU: `.lower().compile()` of freshly built programs, median of {measured["compiles"]} builds '
      'each, the builds and paths in a fresh order every round:',
      '',
    ]
    + compile_table(measured)
    + [
      '',
      f'Step time, CPU (2 shared cores): median over {measured["rounds"]} interleaved rounds of {measured["k"]} calls '
      "of each program through its path's dispatch; ratios are the median of per-round ratios with a bootstrap "
      '95% CI; dispatch = the median time until a call returns (the work queued, not done); the cond runs its '
      'untaken branch (T = 1000):',
      '',
    ]
    + step_table(measured)
    + ['']
    + reading(measured)
    + ['']
  )


def write(measured: dict, command: str, path=RESULTS) -> None:
  """Replaces this benchmark's section of ``path`` (up to the next ``## `` heading), or appends it at the end."""
  pages.replace_section(path, HEADING, section(measured, command))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--smoke', action='store_true', help='a one-block model, 1 compile, 2 rounds of 2; writes nothing')
  p.add_argument('--rounds', type=int, default=None, help='interleaved step-time rounds (default 30; --smoke 2)')
  p.add_argument('--k', type=int, default=None, help='calls per program per round (default 5; --smoke 2)')
  p.add_argument('--compiles', type=int, default=None, help='builds per program for compile time (default 3)')
  p.add_argument('--save', metavar='FILE', help='also pickle the measurements to FILE')
  p.add_argument('--from', dest='load', metavar='FILE', help='report the measurements --save wrote (no measuring)')
  p.add_argument('--write', action='store_true', help=f'replace or append the section in {RESULTS.relative_to(C.REPO)}')
  args = p.parse_args(argv)
  for name in ('rounds', 'k', 'compiles'):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      p.error(f'--{name} must be at least 1, got {getattr(args, name)}')
  if not args.smoke:  # compile times of a cache hit would be the cache's
    jax.config.update('jax_enable_compilation_cache', False)
  rounds = args.rounds or (2 if args.smoke else 30)
  k = args.k or (2 if args.smoke else 5)
  compiles = args.compiles or (1 if args.smoke else 3)
  start = time.perf_counter()
  log = lambda line: print('# ' + line, file=sys.stderr, flush=True)
  if args.load:
    with open(args.load, 'rb') as f:
      measured, argv = pickle.load(f)
  else:
    measured = measure(args.smoke, rounds, k, compiles, log=log)
    argv = sys.argv[1:] if argv is None else list(argv)
    argv = [a for i, a in enumerate(argv) if a != '--save' and (i == 0 or argv[i - 1] != '--save')]
  if args.save:
    with open(args.save, 'wb') as f:
      pickle.dump((measured, argv), f)
  text = section(measured, 'python -m benchmarks.pmap_path' + (' ' + ' '.join(argv) if argv else ''))
  print('\n'.join(text[2:]))
  print(f'# {time.perf_counter() - start:.0f} s', file=sys.stderr)
  if args.write and not args.smoke:
    write(measured, 'python -m benchmarks.pmap_path' + (' ' + ' '.join(argv) if argv else ''))
    print(f'# wrote {RESULTS.relative_to(C.REPO)}', file=sys.stderr)
  return measured


if __name__ == '__main__':
  main()
