"""HDET against plain data-parallel training: step time, memory, compilation, vmap, trainer overhead.

    python -m benchmarks.bench                      # everything, writes results/benchmarks.md
    python -m benchmarks.bench --sections steptime  # one part (stdout only unless --write)
    python -m benchmarks.bench --sections fixed --sizes default  # the non-sync program's counted inputs only

Run from the repository root. Each part interleaves its variants in random order, block by
block, in one process (memory: one subprocess per variant), and prints one line per figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

os.environ.setdefault('JAX_NUM_CPU_DEVICES', '8')

from benchmarks import common as C  # noqa: E402  (sets up the devices before jax starts)
from benchmarks.common import Runner, Variant  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

TS = (1, 10, 100, 1000)
LINES: list[str] = []  # one line per figure, for stdout and the markdown.
TABLES: dict[str, list[str]] = {}


def say(line: str):
  print(line, flush=True)
  LINES.append(line)


def log(line: str):
  print('#' + line, file=sys.stderr, flush=True)


def sizes():
  m, seq, batch, src = C.default_model_config()
  big = C.scaled_model_config(m, seq)
  return {
    'default': (m, seq, batch, src),
    '10x': (big, seq, batch, f'{src}, d_model scaled to ~10x parameters'),
    # Not in a default run: on CPU it is slow, on a GPU the small models time kernel launches.
    '100x': (C.scaled_model_config(m, seq, 100.0), seq, batch, f'{src}, d_model scaled to ~100x parameters'),
  }


# ------------------------------------------------------------------------------------------------
# 1. Step time.
# ------------------------------------------------------------------------------------------------
STEP_VARIANTS = [
  # name, variant, phase
  ('plain_donate', Variant('plain_donate', 'plain', donate=True), 'loop'),
  # The same program again, with its own state: plain / plain is the method's noise floor (A/A).
  ('plain_donate_control', Variant('plain_donate', 'plain', donate=True), 'loop'),
  ('plain_nodonate', Variant('plain_nodonate', 'plain', donate=False), 'loop'),
  # "before": one program, lax.cond holds the all-reduce, no donation (README example style).
  ('cond_nodonate_nosync', Variant('cond', 'hdet', 'cond', donate=False, sync_every=50_000), 'loop'),
  ('cond_nodonate_sync', Variant('cond1', 'hdet', 'cond', donate=False, sync_every=1), 'loop'),
  # Two whole-step programs picked by the loop, donation, exact_sync (the trainer's earlier design).
  ('static_donate_nosync', Variant('static', 'hdet', 'static', donate=True, exact_sync=True), 'nosync'),
  ('static_donate_sync', Variant('static', 'hdet', 'static', donate=True, exact_sync=True), 'sync'),
  # "after": the same non-sync step, and on sync steps that step plus a small window-end program
  # (the trainer's design). Its non-sync step is static_donate_nosync's program.
  ('split_donate_sync', Variant('split', 'hdet', 'split', donate=True, exact_sync=True), 'sync'),
  # ablations: which of the two changes matters.
  ('cond_donate_nosync', Variant('cond_d', 'hdet', 'cond', donate=True, sync_every=50_000), 'loop'),
  ('static_nodonate_nosync', Variant('static_n', 'hdet', 'static', donate=False, exact_sync=True), 'nosync'),
]
ABLATIONS = ('cond_donate_nosync', 'static_nodonate_nosync')


def amortized(nosync, sync, plain, t):
  """Per-round ratio of a T-step window: (T - 1) non-sync steps and one sync step, over T plain steps."""
  return C.median_ci([((t - 1) * n + s) / (t * p) for n, s, p in zip(nosync, sync, plain)])


def fmt_ci(q):
  lo, med, hi = q
  return f'{med:.4f} [95% CI {lo:.4f}-{hi:.4f}]'


def bench_steptime(size_name, rounds, k, ablations=True):
  m, seq, batch, src = sizes()[size_name]
  mesh = C.make_mesh()
  graphdef, _ = C.model_lib.abstract_model(m, seq)
  nparams = C.num_params(m, seq)
  chosen = [x for x in STEP_VARIANTS if ablations or x[0] not in ABLATIONS]
  runners = {}
  for name, v, phase in chosen:
    runners[name] = Runner(v, graphdef, m, seq, batch, mesh, phase=phase)
    runners[name].run(2)  # compile and warm up.
  log(f' steptime {size_name}: {nparams} params/replica, {rounds} rounds x {k} steps')
  times = C.interleave(runners, rounds, k, seed=1, log=log)
  med = {n: float(np.median(ts)) for n, ts in times.items()}
  say(
    f'steptime[{size_name}] model: d_model={m.d_model} layers={m.num_layers} seq={seq} '
    f'batch/replica={batch} params/replica={nparams} ({src}); {rounds} interleaved rounds x {k} steps'
  )
  for n in med:
    say(f'steptime[{size_name}] {n}: median {med[n] * 1e3:.2f} ms/step')
  TABLES.setdefault('steptime', []).extend(_steptime_rows(size_name, nparams, times))
  bench_fixed_work(size_name, runners, graphdef, (m, seq, batch), mesh)
  _steptime_costs(size_name, runners)
  return times


def bench_fixed(size_name):
  """The fixed-work counts alone (no timing): ``--sections fixed``, seconds on a CPU."""
  m, seq, batch, _ = sizes()[size_name]
  mesh = C.make_mesh()
  graphdef, _ = C.model_lib.abstract_model(m, seq)
  runners = {
    name: Runner(v, graphdef, m, seq, batch, mesh, phase=phase)
    for name, v, phase in STEP_VARIANTS
    if name in ('plain_donate', 'static_donate_nosync')
  }
  return bench_fixed_work(size_name, runners, graphdef, (m, seq, batch), mesh)


def _steptime_rows(size_name, nparams, times):
  """The step-time table's rows (and their log lines): each dispatch's ratios to plain data parallel."""
  size = f'{size_name} ({nparams / 1e6:.2f}M)'
  aa = C.ratio_ci(times['plain_donate_control'], times['plain_donate'])
  say(f'steptime[{size_name}] control (A/A): plain / plain = {fmt_ci(aa)}')
  rows = [f'| {size} | control: plain / plain (A/A, the noise floor) | {fmt_ci(aa)} | | | | |']
  pairs = [
    ('before: lax.cond, no donation', 'cond_nodonate_nosync', 'cond_nodonate_sync', 'plain_nodonate'),
    ('two whole-step programs + donation', 'static_donate_nosync', 'static_donate_sync', 'plain_donate'),
    (
      'after: step + window-end program + donation (trainer)',
      'static_donate_nosync',
      'split_donate_sync',
      'plain_donate',
    ),
  ]
  for label, ns, s, p in pairs:
    nos = C.ratio_ci(times[ns], times[p])
    syn = C.ratio_ci(times[s], times[p])
    say(f'steptime[{size_name}] {label}: non-sync step / plain = {fmt_ci(nos)}')
    say(f'steptime[{size_name}] {label}: sync step / plain = {fmt_ci(syn)}')
    cells = []
    for t in TS:
      q = amortized(times[ns], times[s], times[p], t)
      say(f'steptime[{size_name}] {label}: HDET/plain at T={t} = {fmt_ci(q)}')
      cells.append(f'{q[1]:.4f} ({q[0]:.4f}-{q[2]:.4f})')
    rows.append(f'| {size} | {label} | {fmt_ci(nos)} | ' + ' | '.join(cells) + ' |')
  for label, ns, p in [
    ('ablation: lax.cond + donation', 'cond_donate_nosync', 'plain_donate'),
    ('ablation: two programs, no donation', 'static_nodonate_nosync', 'plain_nodonate'),
  ]:
    if ns in times:
      q = C.ratio_ci(times[ns], times[p])
      say(f'steptime[{size_name}] {label}: non-sync step / plain = {fmt_ci(q)}')
      rows.append(f'| {size} | {label} | {fmt_ci(q)} | | | | |')
  return rows


def _steptime_costs(size_name, runners):
  """Noise-free proxy: XLA's cost analysis of the (unoptimised) step programs, per window and per program."""
  costs = {}
  for n in ('plain_donate', 'static_donate_nosync', 'static_donate_sync'):
    if n in runners:
      rn = runners[n]
      lowered = rn.program(0).lower(rn.params, rn.opt_state, rn.batches[0])
      ca = lowered.cost_analysis()
      if ca is None:  # some backends (XLA:GPU in jax 0.11) analyse only the compiled program.
        ca = lowered.compile().cost_analysis()
      ca = ca[0] if isinstance(ca, (list, tuple)) else ca
      costs[n] = (float(ca.get('flops', 0.0)), float(ca.get('bytes accessed', 0.0)))
  if {'plain_donate', 'static_donate_nosync', 'static_donate_sync'} <= set(costs):
    (f0, b0), (fn_, bn), (fs, bs) = (costs[n] for n in ('plain_donate', 'static_donate_nosync', 'static_donate_sync'))
    for t in TS:
      fr, br = ((t - 1) * fn_ + fs) / (t * f0), ((t - 1) * bn + bs) / (t * b0)
      say(f'steptime[{size_name}] XLA cost analysis, HDET/plain at T={t}: flops {fr:.5f}, bytes accessed {br:.5f}')
      TABLES.setdefault('cost', []).append(f'| {size_name} | sync window, T={t} | {fr:.5f} | {br:.5f} |')
  for n in ('static_donate_nosync', 'static_donate_sync'):
    if n in costs and 'plain_donate' in costs:
      f, b = costs[n]
      f0, b0 = costs['plain_donate']
      say(f'steptime[{size_name}] XLA cost analysis {n} / plain: flops {f / f0:.5f}, bytes accessed {b / b0:.5f}')
      TABLES.setdefault('cost', []).append(
        f'| {size_name} | {n.replace("static_donate_", "")} | {f / f0:.5f} | {b / b0:.5f} |'
      )


def fixed_counts(runner) -> dict[str, int]:
  """The entry computation's instructions by kind, and the array leaves passed per call, of a runner's program."""
  compiled = runner.program(runner.t).lower(runner.params, runner.opt_state, runner.batches[0]).compile()
  counts = C.hlo_counts(compiled)
  counts['leaves'] = len(jax.tree.leaves((runner.params, runner.opt_state)))
  return counts


def bench_fixed_work(size_name, runners, graphdef=None, shape=None, mesh=None):
  """What the non-sync program adds per step, counted rather than timed: kernels, buffers, leaves.

  HDET's state is packed between calls (its small fields in one buffer); with ``graphdef``, ``shape``
  (model config, seq_len, batch) and ``mesh`` the unpacked state's count is printed too, for reference.
  """
  counts = {name: fixed_counts(runners[name]) for name in ('plain_donate', 'static_donate_nosync')}
  p, h = counts['plain_donate'], counts['static_donate_nosync']
  extra = {k: h.get(k, 0) - p.get(k, 0) for k in ('fusion', 'copy', 'parameter', 'leaves')}
  say(
    f'fixed[{size_name}] non-sync HDET program vs plain, per device and step: '
    f'{h.get("fusion", 0)} vs {p.get("fusion", 0)} fusion kernels ({extra["fusion"]:+d}), '
    f'{h.get("copy", 0)} vs {p.get("copy", 0)} copies ({extra["copy"]:+d}), '
    f'{h.get("parameter", 0)} vs {p.get("parameter", 0)} input buffers ({extra["parameter"]:+d}); '
    f'{h["leaves"]} vs {p["leaves"]} leaves passed per call ({extra["leaves"]:+d})'
  )
  if graphdef is not None:
    unpacked = Runner(
      Variant('static_unpacked', 'hdet', 'static', donate=True, exact_sync=True, packed=False),
      graphdef,
      *shape,
      mesh,
      phase='nosync',
    )
    u = fixed_counts(unpacked)
    say(
      f'fixed[{size_name}] the same with the HDETState unpacked (before issue 27): '
      f'{u.get("parameter", 0)} vs {p.get("parameter", 0)} input buffers '
      f'({u.get("parameter", 0) - p.get("parameter", 0):+d}), '
      f'{u.get("copy", 0)} vs {p.get("copy", 0)} copies; {u["leaves"]} vs {p["leaves"]} leaves'
    )
  TABLES.setdefault('fixed', []).append(
    f'| {size_name} | {p.get("fusion", 0)} / {extra["fusion"]:+d} | {p.get("copy", 0)} / {extra["copy"]:+d} | '
    f'{p.get("parameter", 0)} / {extra["parameter"]:+d} | {p["leaves"]} / {extra["leaves"]:+d} |'
  )
  return p, h


# ------------------------------------------------------------------------------------------------
# 2. Peak memory: one subprocess per variant.
# ------------------------------------------------------------------------------------------------
MEM_VARIANTS = {
  # The trainer's way: programs compiled ahead of time (HDET's sync program first), then the
  # compiler's freed heap returned to the OS (process.release_host_memory), then the steps.
  'plain_donate': Variant('plain_donate', 'plain', donate=True),
  'hdet_split_donate': Variant('split', 'hdet', 'split', donate=True, exact_sync=True, sync_every=2),
  # Compiled lazily by the first calls, nothing released: what a plain script does.
  'plain_nodonate': Variant('plain_nodonate', 'plain', donate=False),
  'hdet_cond_nodonate': Variant('cond', 'hdet', 'cond', donate=False, sync_every=2),
}
AOT_MEMORY = ('plain_donate', 'hdet_split_donate')


def _vm(field):
  """KiB from /proc/self/status (VmHWM: peak RSS of this process image; ru_maxrss after fork+exec
  can report the parent's peak)."""
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(field + ':'):
        return int(line.split()[1])
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def memory_child(size_name, vname, steps):
  base = _vm('VmHWM')
  m, seq, batch, _ = sizes()[size_name]
  v = MEM_VARIANTS[vname]
  mesh = C.make_mesh()
  graphdef, _ = C.model_lib.abstract_model(m, seq)
  r = Runner(v, graphdef, m, seq, batch, mesh, phase='loop')
  if vname in AOT_MEMORY:
    from hdet_jax.trainer import process

    r.compile_ahead()
    process.release_host_memory()
  r.run(steps)  # crosses steps // T syncs (compiling lazily where nothing was compiled ahead).
  peak, current = _vm('VmHWM'), _vm('VmRSS')
  state_bytes = sum(int(x.nbytes) for x in jax.tree.leaves((r.params, r.opt_state)))
  analysis = {}
  for flag, fn in r.programs.items():
    compiled = fn if vname in AOT_MEMORY else fn.lower(*r.example_args(flag)).compile()
    ma = compiled.memory_analysis()
    analysis[str(flag)] = {
      a: int(getattr(ma, a, 0) or 0)
      for a in ('argument_size_in_bytes', 'output_size_in_bytes', 'temp_size_in_bytes', 'alias_size_in_bytes')
    }
  stats = jax.devices()[0].memory_stats()
  print(
    json.dumps(
      {
        'baseline_kib': base,
        'peak_kib': peak,
        'current_kib': current,
        'state_bytes': state_bytes,
        'analysis': analysis,
        'device_stats': stats,
      }
    )
  )


def bench_memory(size_name, steps=6):
  out = {}
  for vname in MEM_VARIANTS:
    cmd = [
      sys.executable,
      '-m',
      'benchmarks.bench',
      '--memory-child',
      vname,
      '--size',
      size_name,
      '--steps',
      str(steps),
      '--auto-lr',
      C.CONTROLLER,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    out[vname] = json.loads(res.stdout.strip().splitlines()[-1])
  rows = []
  for hv, pv in [('hdet_split_donate', 'plain_donate'), ('hdet_cond_nodonate', 'plain_nodonate')]:
    h, p = out[hv], out[pv]
    rss = h['peak_kib'] / p['peak_kib']
    grow_h = h['peak_kib'] - h['baseline_kib']
    grow_p = max(p['peak_kib'] - p['baseline_kib'], 1)
    st = h['state_bytes'] / p['state_bytes']
    cur = h['current_kib'] / max(p['current_kib'], 1)
    prog = {}
    for key, a in (('h', h), ('p', p)):
      prog[key] = max(
        x['argument_size_in_bytes'] + x['output_size_in_bytes'] + x['temp_size_in_bytes'] - x['alias_size_in_bytes']
        for x in a['analysis'].values()
      )
    say(
      f'memory[{size_name}] {hv}/{pv}: peak host RSS {h["peak_kib"] / 1024:.0f}/{p["peak_kib"] / 1024:.0f} MiB '
      f'= {rss:.4f}; RSS after the run {h["current_kib"] / 1024:.0f}/{p["current_kib"] / 1024:.0f} MiB = {cur:.4f}; '
      f'RSS growth after imports {grow_h / 1024:.0f}/{grow_p / 1024:.0f} MiB = {grow_h / grow_p:.4f}; '
      f'params+opt state {h["state_bytes"]}/{p["state_bytes"]} B = {st:.5f}; '
      f'compiled step footprint (args+out+temp-alias, largest program) {prog["h"]}/{prog["p"]} B = '
      f'{prog["h"] / prog["p"]:.4f}'
    )
    dev = _device_peak_ratio(h, p)
    if dev is not None:
      say(
        f'memory[{size_name}] {hv}/{pv}: peak device memory in use (memory_stats peak_bytes_in_use) '
        f'{h["device_stats"]["peak_bytes_in_use"]}/{p["device_stats"]["peak_bytes_in_use"]} B = {dev:.4f}'
      )
    rows.append(
      f'| {size_name} | {hv} / {pv} | {rss:.4f} | {cur:.4f} | {grow_h / grow_p:.4f} | {st:.5f} | '
      f'{prog["h"] / prog["p"]:.4f} | ' + ('n/a (CPU)' if dev is None else f'{dev:.4f}') + ' |'
    )
  TABLES.setdefault('memory', []).extend(rows)


def _device_peak_ratio(h, p):
  """HDET / plain peak device memory from the children's ``memory_stats()``; None where the device
  reports none (XLA:CPU)."""
  hs, ps = h.get('device_stats') or {}, p.get('device_stats') or {}
  if 'peak_bytes_in_use' not in hs or not ps.get('peak_bytes_in_use'):
    return None
  return hs['peak_bytes_in_use'] / ps['peak_bytes_in_use']


# ------------------------------------------------------------------------------------------------
# 3. Compilation: time, and the count over a run that crosses several syncs.
# ------------------------------------------------------------------------------------------------
def bench_compile(size_name='default', t_sync=5, syncs=4):
  m, seq, batch, _ = sizes()[size_name]
  mesh = C.make_mesh()
  graphdef, _ = C.model_lib.abstract_model(m, seq)
  counter = C.CompileCounter()
  steps = t_sync * syncs + 1
  rows = []
  cases = [
    ('plain', Variant('plain', 'plain', donate=True), False),
    ('hdet lax.cond', Variant('cond', 'hdet', 'cond', donate=False, sync_every=t_sync), False),
    (
      'hdet two programs, lazy',
      Variant('static', 'hdet', 'static', donate=True, exact_sync=True, sync_every=t_sync),
      False,
    ),
    (
      'hdet two programs, AOT',
      Variant('static', 'hdet', 'static', donate=True, exact_sync=True, sync_every=t_sync),
      True,
    ),
    (
      'hdet step + window end, AOT (trainer)',
      Variant('split', 'hdet', 'split', donate=True, exact_sync=True, sync_every=t_sync),
      True,
    ),
  ]
  for label, v, aot in cases:
    r = Runner(v, graphdef, m, seq, batch, mesh, phase='loop')
    jax.block_until_ready((r.params, r.opt_state))
    mark0 = counter.mark()
    t0 = time.perf_counter()
    if aot:
      r.compile_ahead()
    r.run(1)
    first = time.perf_counter() - t0
    n_first, backend_s = counter.since(mark0)
    _, trace_s = counter.since(mark0, C.CompileCounter.TRACE)
    _, lower_s = counter.since(mark0, C.CompileCounter.LOWER)
    per_step, later_s = [], 0.0
    for _ in range(steps - 1):
      mk = counter.mark()
      r.run(1)
      c, d = counter.since(mk)
      per_step.append(c)
      later_s += d
    later = sum(per_step)
    where = [i + 1 for i, c in enumerate(per_step) if c]
    say(
      f'compile[{size_name}] {label}: {n_first} compilation(s) before/at step 0 '
      f'(backend {backend_s:.2f} s, trace {trace_s:.2f} s, lower {lower_s:.2f} s; first call {first:.2f} s); '
      f'{later} more over steps 1..{steps - 1} (T={t_sync}, {syncs} syncs)'
      + (f' at steps {where} ({later_s:.2f} s)' if where else '')
    )
    rows.append(
      f'| {label} | {n_first} | {backend_s:.2f} | {trace_s + lower_s:.2f} | {first:.2f} | '
      f'{later}' + (f' (at step {", ".join(map(str, where))}, {later_s:.2f} s)' if where else '') + ' |'
    )
  TABLES['compile'] = rows


# ------------------------------------------------------------------------------------------------
# 4. One device (vmap) against N devices (shard_map).
# ------------------------------------------------------------------------------------------------
def _too_few_devices(what: str, then: str = '') -> bool:
  """Whether this machine has fewer than N devices; if so, says ``what`` is skipped and why."""
  if jax.device_count() >= C.N:
    return False
  say(f'{what}, and this machine has {jax.device_count()} {jax.devices()[0].platform.upper()} device(s){then}')
  return True


def bench_vmap(size_name, rounds, k):
  if _too_few_devices(
    f'vmap[{size_name}] skipped: it compares 1 device against {C.N}', '; section 1 runs under vmap here'
  ):
    return
  m, seq, batch, _ = sizes()[size_name]
  mesh = C.make_mesh()
  graphdef, _ = C.model_lib.abstract_model(m, seq)
  spec = [
    ('sm_plain', Variant('p', 'plain'), 'loop'),
    ('sm_hdet_nosync', Variant('s', 'hdet', 'static', exact_sync=True), 'nosync'),
    ('sm_hdet_sync', Variant('s', 'hdet', 'static', exact_sync=True), 'sync'),
    ('vmap_plain', Variant('p', 'plain', backend='vmap'), 'loop'),
    ('vmap_hdet_nosync', Variant('s', 'hdet', 'static', exact_sync=True, backend='vmap'), 'nosync'),
    ('vmap_hdet_sync', Variant('s', 'hdet', 'static', exact_sync=True, backend='vmap'), 'sync'),
    ('vmap_hdet_cond_nosync', Variant('c', 'hdet', 'cond', donate=False, sync_every=50_000, backend='vmap'), 'loop'),
  ]
  runners = {}
  for name, v, phase in spec:
    runners[name] = Runner(v, graphdef, m, seq, batch, mesh, phase=phase)
    runners[name].run(2)
  log(f' vmap {size_name}: {rounds} rounds x {k} steps')
  times = C.interleave(runners, rounds, k, seed=2, log=log)
  rows = []
  for n, ts in times.items():
    say(f'vmap[{size_name}] {n}: median {np.median(ts) * 1e3:.2f} ms/step')
  for label, a, b in [
    ('plain: 1 device (vmap) / 8 devices (shard_map)', 'vmap_plain', 'sm_plain'),
    ('HDET non-sync: 1 device / 8 devices', 'vmap_hdet_nosync', 'sm_hdet_nosync'),
    ('HDET sync: 1 device / 8 devices', 'vmap_hdet_sync', 'sm_hdet_sync'),
    ('1 device: HDET non-sync / plain', 'vmap_hdet_nosync', 'vmap_plain'),
    ('1 device: HDET sync / plain', 'vmap_hdet_sync', 'vmap_plain'),
    ('1 device: HDET lax.cond (not taken) / plain', 'vmap_hdet_cond_nosync', 'vmap_plain'),
    ('8 devices: HDET non-sync / plain', 'sm_hdet_nosync', 'sm_plain'),
  ]:
    q = C.ratio_ci(times[a], times[b])
    say(f'vmap[{size_name}] {label} = {fmt_ci(q)}')
    rows.append(f'| {label} | {fmt_ci(q)} |')
  for t in (100, 1000):
    q = amortized(times['vmap_hdet_nosync'], times['vmap_hdet_sync'], times['vmap_plain'], t)
    say(f'vmap[{size_name}] 1 device: HDET/plain at T={t} = {fmt_ci(q)}')
    rows.append(f'| 1 device: HDET/plain at T={t} | {fmt_ci(q)} |')
  TABLES['vmap'] = rows


# ------------------------------------------------------------------------------------------------
# 5. The trainer's overhead around the compiled step.
# ------------------------------------------------------------------------------------------------
def bench_trainer(steps):
  # Any device count: the trainer lays its N replicas on the devices it has (N / D per device, under vmap).
  from benchmarks import trainer_overhead

  res = trainer_overhead.measure(steps)
  for line in res['lines']:
    say(line)
  TABLES['trainer'] = res['rows']
  say(trainer_overhead.smoke()['line'])  # the smoke run's wall time (a timed test until 2026-12)


# ------------------------------------------------------------------------------------------------
def machine() -> str:
  try:
    cpu = [line.split(':', 1)[1].strip() for line in open('/proc/cpuinfo') if line.startswith('model name')][0]
  except Exception:
    cpu = platform.processor() or 'unknown CPU'
  mem = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30
  import flax
  import optax

  dev = jax.devices()[0]
  if dev.platform == 'cpu':
    devices = (
      f'{jax.device_count()} simulated CPU devices; N={C.N} replicas under '
      f'`{C.replica_backend()}`. No GPU: every figure is XLA:CPU'
    )
  else:
    devices = (
      f'{jax.device_count()} {dev.platform.upper()} device(s), {dev.device_kind}; N={C.N} replicas '
      f'under `{C.replica_backend()}`. Every figure is XLA:{dev.platform.upper()} except host RSS'
    )
  return (
    f'{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}; '
    f'{devices}. Python {platform.python_version()}, jax {jax.__version__}, flax {flax.__version__}, '
    f'optax {optax.__version__}.'
  )


def _table(heading: str, columns: list[str], rows: list[str], note: str | None) -> list[str]:
  """A markdown section: heading, a table of ``rows`` under ``columns``, and an optional note."""
  head = [heading, '', '| ' + ' | '.join(columns) + ' |', '|' + '---|' * len(columns)]
  return head + rows + (['', note, ''] if note else [''])


# How the benchmark measures (the report's Method paragraph).
METHOD = (
  'Method: every variant holds its own model and optimizer state; one process runs blocks of K steps of '
  'each variant in a fresh random order per round (each block ends with `block_until_ready`), after '
  'compilation. A ratio is the median over rounds of (variant block / plain block of the same round), with a '
  'bootstrap 95% confidence interval of that median. "control" times a second, identical plain runner: its '
  'ratio is what the method reads for two identical programs (the noise floor). HDET/plain at T is, per round, '
  '((T-1) x non-sync step + 1 x sync step) / (T x plain step), then the median over rounds: the cost of one '
  'sync window. Plain = the same step with `optax.adam(one_cycle)`; HDET = `hdet(optax.adam, one_cycle, N=8, '
  'spread=0.25, auto_lr={auto_lr})` (controller on, S = 100,000 steps, in sections 1-4). "before" = the '
  'one-program design (`sync=None`, a '
  '`lax.cond` holding the all-reduce, no donation; compared with plain without donation); "two whole-step '
  'programs" = `sync=False`/`sync=True` steps dispatched by the loop; "after" = the trainer\'s design: the '
  '`sync=False` step on every step and, on sync steps, a small window-end program after it '
  '(`update(None, state, params, sync=True)`); `exact_sync=True`, params and optimizer state donated, compared '
  'with plain with donation. Both two-program designs run the same non-sync program.'
)

# The report's tables: (key in TABLES, heading, columns, note after the table), in order.
SECTIONS = [
  (
    'steptime',
    '## 1. Step time (HDET / plain, median over interleaved rounds, bootstrap 95% CI of the median)',
    ['model (params/replica)', 'design', 'non-sync step / plain', 'T=1', 'T=10', 'T=100', 'T=1000'],
    'Targets: at most 1.01 at T=100 and 1.002 at T=1000.',
  ),
  (
    'fixed',
    "What the non-sync HDET program adds per step, counted (no timing noise): the entry computation's "
    'fusion kernels, copies and input buffers per device (each fusion or copy is one kernel launch per device '
    "on XLA:CPU) and the array leaves the host passes per call (params, optimizer state). Plain / HDET's "
    'extra:',
    ['model', 'fusions', 'copies', 'input buffers', 'leaves per call'],
    None,
  ),
  (
    'cost',
    'XLA cost analysis of the step programs (per device, deterministic, no timing noise), HDET / plain:',
    ['model', 'HDET program', 'flops', 'bytes accessed'],
    None,
  ),
  (
    'memory',
    '## 2. Peak memory (one subprocess per variant, init + 6 steps crossing 3 syncs)',
    [
      'model',
      'HDET / plain',
      'peak host RSS',
      'host RSS after the run',
      'peak RSS growth after imports',
      'params + optimizer state',
      'compiled step footprint',
      'peak device memory in use',
    ],
    'Target: at most 1.05. CPU: host RSS (`VmHWM` / `VmRSS` of the child process); the 8 simulated '
    'devices live in host RAM. GPU: also the device allocator\'s `memory_stats()["peak_bytes_in_use"]`. '
    "The donating variants run the trainer's way: every program compiled "
    "before the first step, then the compiler's freed heap returned to the OS "
    '(`process.release_host_memory`, glibc `malloc_trim`); the others compile lazily and release nothing. '
    'The compiled footprint is `memory_analysis()` of the larger of the step programs '
    '(arguments + outputs + temporaries - aliased, i.e. donated, bytes).',
  ),
  (
    'compile',
    '## 3. Compilation (default model)',
    [
      'design',
      'compilations at step 0',
      'XLA compile (s)',
      'trace + lower (s)',
      'first call (s)',
      'compilations after step 0',
    ],
    'Counted with `jax.monitoring` (`/jax/core/compile/backend_compile_duration` events). '
    '"lazy": the sync program compiles on the first sync step; "AOT": both programs are '
    '`.lower(...).compile()`d before step 0; "step + window end": the second program is the window end '
    'alone, not a second whole step.',
  ),
  (
    'vmap',
    '## 4. One device (`vmap`, N=8 replicas) against 8 devices (`shard_map`), default model',
    ['comparison', 'ratio (median, 95% CI)'],
    'Under `vmap` the step count in the state is batched, so a `lax.cond` on it becomes a '
    'select and both branches (with the all-reduce) run on every step.',
  ),
]


def write_markdown(path, args, elapsed):
  """The report: the machine, the command, ``METHOD``, every table of ``SECTIONS`` measured, and stdout's figures."""
  cmd = 'python -m benchmarks.bench' + (' ' + ' '.join(args.argv) if args.argv else '')
  md = [
    '# Benchmarks: HDET against plain data-parallel training',
    '',
    f'Machine: {machine()}',
    '',
    f'Regenerate (from the repository root, venv active): `{cmd}` (about {elapsed / 60:.0f} min; '
    "absolute times move with the machine's other load, ratios less so).",
    '',
    METHOD.format(auto_lr=C.CONTROLLER_CALLS[C.CONTROLLER]),
    '',
  ]
  for key, heading, columns, note in SECTIONS:
    if key in TABLES:
      md += _table(heading, columns, TABLES[key], note)
  if 'trainer' in TABLES:
    md += ["## 5. The trainer's overhead around the compiled step", ''] + TABLES['trainer'] + ['']
  md += ['## All figures (stdout of the run)', '', '```'] + LINES + ['```', '']
  with open(path, 'w') as f:
    f.write('\n'.join(md))


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--sections', default='steptime,memory,compile,vmap,trainer')
  p.add_argument('--sizes', default='default,10x')
  p.add_argument('--rounds', type=int, default=12)
  p.add_argument('--k', type=int, default=8, help='steps per block (default model; 10x uses k/2)')
  p.add_argument('--trainer-steps', type=int, default=500)
  p.add_argument(
    '--auto-lr',
    default='default',
    choices=sorted(C.CONTROLLERS),
    help="HDET's controller in sections 1-4: the product default AutoLR(total_steps=S), or AutoLR.paper",
  )
  p.add_argument('--write', default=None, help='markdown output (default results/benchmarks.md for a full run)')
  p.add_argument('--memory-child', default=None, help=argparse.SUPPRESS)
  p.add_argument('--size', default='default', help=argparse.SUPPRESS)
  p.add_argument('--steps', type=int, default=6, help=argparse.SUPPRESS)
  args = p.parse_args()
  args.argv = [a for a in sys.argv[1:]]
  C.CONTROLLER = args.auto_lr
  if args.memory_child:
    memory_child(args.size, args.memory_child, args.steps)
    return
  start = time.perf_counter()
  say(f'controller: HDET runs auto_lr={C.CONTROLLER_CALLS[C.CONTROLLER]} (S = {C.TOTAL_STEPS}) in sections 1-4')
  sections = args.sections.split(',')
  size_names = args.sizes.split(',')
  write = args.write or ('results/benchmarks.md' if args.sections == p.get_default('sections') else None)
  if write:
    os.makedirs(os.path.dirname(write) or '.', exist_ok=True)

  def guarded(fn, *a):
    try:
      fn(*a)
    except Exception as e:  # one broken part must not lose the others' figures.
      say(f'ERROR in {fn.__name__}{a}: {type(e).__name__}: {e}')
    if write:  # after every part, so a run stopped early keeps what it measured.
      write_markdown(write, args, time.perf_counter() - start)

  for s in size_names:
    if 'steptime' in sections:
      # The 10x model's steps are 4x longer: fewer steps per block, and no ablation variants.
      guarded(
        bench_steptime,
        s,
        args.rounds if s == 'default' else max(8, args.rounds * 2 // 3),
        args.k if s == 'default' else max(2, args.k // 2),
        s == 'default',
      )
  for s in size_names:
    if 'fixed' in sections and 'steptime' not in sections:
      guarded(bench_fixed, s)
  for s in size_names:
    if 'memory' in sections:
      guarded(bench_memory, s)
  if 'compile' in sections:
    guarded(bench_compile)
  if 'vmap' in sections:
    guarded(bench_vmap, 'default', max(6, args.rounds * 2 // 3), args.k)
  if 'trainer' in sections:
    guarded(bench_trainer, args.trainer_steps)
  if write:
    log(f' wrote {write}')


if __name__ == '__main__':
  main()
