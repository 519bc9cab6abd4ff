"""HDET's step against plain data parallelism on the same ``('replica', 'data')`` mesh, and the evaluation.

    python -m benchmarks.same_layout [--quick] [--write]

On 8 simulated CPU devices, 4 groups x 2 FSDP devices (mesh ``('replica', 'data')``), one micro-batch step (32 rows)
of each of examples/add_to_trainer's trainers (flax linen, flax nnx), compiled, never run. Each trainer is the
example file itself (its model, optimizer chain, step, jit with shardings and donation); a program changes only
what its row names, through the names the file looks up (``hdet_jax``, ``optax``, ``P``):

* **plain (a)**, as users run it: plain_{linen,nnx}.py's step under GSPMD over both axes, the batch on
  ``P(('replica', 'data'))`` (in the step's constraint and its in-sharding) where the 1-D trainer wrote ``P('data')``;
  the parameters and moments ``P(None, 'data')`` as the file annotates them, the same on every group;
* **plain (b)**, under the same map: hdet_{linen,nnx}.py with ``hdet(spread=0, auto_lr=None,
  sync_every=10**9)``, which equals the base optimizer (``hdet``'s docstring): the map, the stacked state and the
  gradient's all-reduce without HDET's spread, controller or sync;
* **HDET**: hdet_{linen,nnx}.py as it is;
* **plain, batch P('data')**, a control: plain's step on the 2-D mesh with its own ``P('data')``: the batch is
  then the same on every group.

Each with and without gradient accumulation (k = 2: ``optax.MultiSteps`` in plain (a), ``hdet_jax.multi_steps``
around hdet, as the examples have it; without: the chain alone), and at 1 and 2 replicas per device (N = 4 on the 4
groups, and N = 8 with ``over_replicas(per_device=2)``; plain (a) has no replicas). Counted per device: XLA's cost
analysis (flops, bytes accessed; a conditional counts as its costliest branch) and the collectives of the compiled
HLO whose device groups span more than one group (``benchmarks/comm.py``), split into those on every step and
those inside a conditional's branch (HDET's sync; under ``multi_steps`` the optimizer's whole update is such a
branch, and so is what it holds), and whether XLA warned of an involuntary full rematerialization while compiling.

The evaluation: examples/add_to_trainer's eval step on the replicas' average, the way the examples evaluated before
(``jax.jit(eval_step)(hdet_jax.average_replicas(params), batch)``) and with ``hdet_jax.evaluate_over_replicas``,
with the eval batch (64 rows) on the split batch's sharding or on the trainer's ``P('data')``, and the eval step as
the file has it or with the train step's ``with_sharding_constraint(batch, P('data'))``. ``--write`` replaces the
section between this benchmark's markers in results/benchmarks.md (or appends it); ``--quick`` compiles the goal's
two programs only (plain (b) and HDET, the linen trainer with accumulation, one replica per device; the evaluation
is tests/test_eval_pattern.py's) and writes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import functools
import importlib.util
import os
import pathlib
import re
import sys
import tempfile
import time
import types

import jax

try:  # before JAX's backend starts; under pytest, conftest.py has already set 8 devices
  jax.config.update('jax_num_cpu_devices', 8)
except RuntimeError:
  pass

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import hdet_jax  # noqa: E402
from benchmarks import comm  # noqa: E402
from benchmarks.gspmd_path import machine  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / 'examples' / 'add_to_trainer'
RESULTS = ROOT / 'results' / 'benchmarks.md'
HEADING = '## The cost against plain on the same layout'
BEGIN, END = '<!-- same_layout: begin -->', '<!-- same_layout: end -->'
GROUPS, FSDP = 4, 2
TRAINERS = ('linen', 'nnx')
ROWS = ('plain (a)', 'plain (b)', 'HDET')
CONTROL = "plain, batch P('data')"
NEVER = 10**9  # plain (b)'s sync_every: no window ends
# The example files' sizes, and a wider model (3.1M parameters per replica, 4,096 tokens per micro-batch) to see
# whether what the tiny one shows holds at a size nearer real use: the files' module constants, set on the copy.
SIZES = {'example': {}, 'wider': {'VOCAB': 1024, 'WIDTH': 512, 'SEQ': 128}}
REMAT = 'involuntary full rematerialization'


def _load(name):
  """A fresh copy of an example file (each program patches its own copy's names)."""
  spec = importlib.util.spec_from_file_location(f'same_layout_{name}', EXAMPLES / f'{name}.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _namespace(module, **names):
  """``module``'s names with some replaced: what an example file looks up as ``hdet_jax`` or ``optax``."""
  return types.SimpleNamespace(**{**vars(module), **names})


def _split_P(*spec):
  """``P`` for plain (a): the batch's ``'data'`` becomes ``('replica', 'data')`` (the files use P for batches only)."""
  return PartitionSpec(*[('replica', 'data') if s == 'data' else s for s in spec])


def mesh() -> Mesh:
  if len(jax.devices()) < GROUPS * FSDP:
    raise RuntimeError(f'same_layout: needs {GROUPS * FSDP} devices, found {len(jax.devices())}')
  return Mesh(np.array(jax.devices()[: GROUPS * FSDP]).reshape(GROUPS, FSDP), ('replica', 'data'))


@contextlib.contextmanager
def _stderr_to(path):
  """XLA's C++ warnings (file descriptor 2) into ``path`` while the block runs."""
  sys.stderr.flush()
  saved = os.dup(2)
  with open(path, 'w') as f:
    os.dup2(f.fileno(), 2)
  try:
    yield
  finally:
    ctypes.CDLL(None).fflush(None)  # the C library's buffered stderr first
    os.dup2(saved, 2)
    os.close(saved)


def compile_counting(lowered):
  """(compiled, the XLA warnings printed while it compiled: a list of lines)."""
  with tempfile.TemporaryDirectory() as tmp:
    log = os.path.join(tmp, 'stderr')
    with _stderr_to(log):
      compiled = lowered.compile()
    text = pathlib.Path(log).read_text()
  remat = [line for line in text.splitlines() if REMAT in line.lower()]
  sys.stderr.write(''.join(line + '\n' for line in text.splitlines() if line not in remat))  # others as they were
  return compiled, remat


# ------------------------------------------------------------------------------------------------
# The programs.
# ------------------------------------------------------------------------------------------------
def trainer_module(trainer: str, row: str, accum: bool, per_device: int = 1, size: str = 'example'):
  """The example file of ``row`` with its names patched as the module docstring says."""
  m = _load(f'{"plain" if row in ("plain (a)", CONTROL) else "hdet"}_{trainer}')
  vars(m).update(SIZES[size])
  if row in ('plain (a)', CONTROL):
    if not accum:
      m.optax = _namespace(optax, MultiSteps=lambda opt, k: opt)
    if row == 'plain (a)':
      m.P = _split_P
    return m
  m.N = GROUPS * per_device
  names = {'over_replicas': functools.partial(hdet_jax.over_replicas, per_device=per_device)}
  if not accum:
    names['multi_steps'] = lambda opt, k: opt
  if row == 'plain (b)':
    base = dict(spread=0.0, auto_lr=None, sync_every=NEVER)
    names['hdet'] = lambda opt, **kw: hdet_jax.hdet(opt, **{**kw, **base})
  m.hdet_jax = _namespace(hdet_jax, **names)
  return m


def _under_mesh(trainer, the_mesh):
  """nnx builds its state under the mesh (the example's train() does), linen without."""
  return jax.set_mesh(the_mesh) if trainer == 'nnx' else contextlib.nullcontext()


def step_program(trainer: str, row: str, accum: bool, per_device: int = 1, the_mesh=None, size: str = 'example'):
  """(compiled step, remat warnings, the state): the trainer's ``make_trainer(mesh)`` step on its first
  micro-batch (32 rows)."""
  the_mesh = mesh() if the_mesh is None else the_mesh
  m = trainer_module(trainer, row, accum, per_device, size)
  micro = np.split(next(m.batches(0)), 2)[0]
  with _under_mesh(trainer, the_mesh):
    init, step, _, batch_sharding = m.make_trainer(the_mesh)
    state = init.eval_shape(jax.random.key(0))  # shapes and shardings: lowered, never run
    batch = jax.device_put(micro, batch_sharding)
    compiled, warnings = compile_counting(step.lower(state, batch))
  return compiled, warnings, state


def counts(compiled, warnings) -> dict:
  """Per device: XLA's flops and bytes accessed; the cross-group collectives on every step and in branches."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  hlo = compiled.as_text()
  always, inside = comm.collectives_by_place(hlo, (GROUPS, FSDP))
  across = lambda cs: [c for c in cs if c.crosses_replicas]
  return {
    'flops': float(cost['flops']),
    'bytes accessed': float(cost['bytes accessed']),
    'always': across(always),
    'inside': across(inside),
    'always B': sum(c.operand_bytes for c in across(always)),
    'inside B': sum(c.operand_bytes for c in across(inside)),
    'conditionals': len(re.findall(r' conditional\(', hlo)),
    'remat': len(warnings),
  }


def configurations(quick: bool):
  """(trainer, size, accumulation, replicas per device, rows) of every block of the table."""
  if quick:  # the goal's two rows
    return [('linen', 'example', True, 1, ('plain (b)', 'HDET'))]
  blocks = [(t, 'example', a, k, ROWS) for t in TRAINERS for a in (False, True) for k in (1, 2)]
  blocks[2] = blocks[2][:4] + (ROWS + (CONTROL,),)  # linen with accumulation, 1 per device: the control too
  return blocks + [('linen', 'wider', True, 1, ROWS)]


def measure_steps(quick: bool = False, log=None) -> dict:
  """{(trainer, size, accum, per_device, row): counts}; plain (a) is the same program at any per_device."""
  the_mesh, out = mesh(), {}
  for trainer, size, accum, k, rows in configurations(quick):
    for row in rows:
      if row in ('plain (a)', CONTROL) and (trainer, size, accum, 1, row) in out:
        out[(trainer, size, accum, k, row)] = out[(trainer, size, accum, 1, row)]
        continue
      start = time.perf_counter()
      compiled, warnings, _ = step_program(trainer, row, accum, k, the_mesh, size)
      out[(trainer, size, accum, k, row)] = counts(compiled, warnings)
      if log:
        log(f'{trainer} {size} accum={accum} per_device={k} {row}: compiled in {time.perf_counter() - start:.1f} s')
  return out


# ------------------------------------------------------------------------------------------------
# The evaluation.
# ------------------------------------------------------------------------------------------------
EVAL_WAYS = ('before', 'evaluate_over_replicas')
EVAL_LAYOUTS = ('as the example has it', "eval batch on P('data')", "P('data') constraint in the eval step")


def example(trainer: str, the_mesh=None) -> types.SimpleNamespace:
  """hdet_{trainer}.py built on the mesh: its module, its own ``evaluate``, the split batch's sharding, the initial
  state's stacked params and the eval step (make_trainer's, rebuilt from the file's names)."""
  the_mesh = mesh() if the_mesh is None else the_mesh
  m = _load(f'hdet_{trainer}')
  with _under_mesh(trainer, the_mesh):
    init, _, evaluate, split_batch = m.make_trainer(the_mesh)
    state = init(jax.random.key(0))
    eval_step = _eval_step(m, trainer)  # nnx builds its graphdef under the mesh, as make_trainer does
  params = state.params if trainer == 'linen' else state[0]
  return types.SimpleNamespace(
    trainer=trainer,
    mesh=the_mesh,
    module=m,
    evaluate=evaluate,
    split_batch=split_batch,
    params=params,
    eval_step=eval_step,
  )


def eval_programs(ex: types.SimpleNamespace, layouts=EVAL_LAYOUTS):
  """({(way, layout): (jitted evaluate, args)}, the eval batch): ``example()``'s evaluation, before and new, on
  its initial state and a 64-row eval batch."""
  the_mesh, eval_step, params, split_batch = ex.mesh, ex.eval_step, ex.params, ex.split_batch
  raw = next(ex.module.batches(1000))
  data = NamedSharding(the_mesh, PartitionSpec('data'))

  def constrained(params, batch):
    return eval_step(params, jax.lax.with_sharding_constraint(batch, data))

  out = {}
  for layout in layouts:
    step = constrained if layout.startswith("P('data') constraint") else eval_step
    batch = jax.device_put(raw, data if layout.startswith('eval batch') else split_batch)
    out[('before', layout)] = (jax.jit(step), (hdet_jax.average_replicas(params), batch))
    out[('evaluate_over_replicas', layout)] = (
      jax.jit(hdet_jax.evaluate_over_replicas(step, the_mesh, 'replica')),
      (params, batch),
    )
  return out, raw


def _eval_step(m, trainer):
  """The example's own eval step (make_trainer's ``eval_step``), rebuilt from the file's names."""
  if trainer == 'linen':
    return lambda params, batch: m.loss_fn(params, m.Model().apply, batch)
  model_def = m.nnx.graphdef(m.nnx.eval_shape(lambda: m.Model(m.nnx.Rngs(0))))
  return lambda params, batch: m.loss_fn(m.nnx.merge(model_def, params), batch)


def measure_eval(trainer: str = 'linen', log=None) -> dict:
  """{(way, layout): {'flops', 'bytes accessed', 'across B', 'loss'}} and the single-device reference loss."""
  ex = example(trainer)
  programs, raw = eval_programs(ex)
  out = {}
  with _under_mesh(trainer, ex.mesh):
    for key, (fn, args) in programs.items():
      compiled, _ = compile_counting(fn.lower(*args))
      cost = compiled.cost_analysis()
      cost = cost[0] if isinstance(cost, (list, tuple)) else cost
      always, inside = comm.collectives_by_place(compiled.as_text(), (GROUPS, FSDP))
      out[key] = {
        'flops': float(cost['flops']),
        'bytes accessed': float(cost['bytes accessed']),
        'across B': sum(c.operand_bytes for c in always + inside if c.crosses_replicas),
        'loss': float(fn(*args)),
      }
      if log:
        log(f'eval {trainer} {key}: {out[key]["flops"]:,.0f} flops')
  one = jax.devices()[0]
  average = jax.device_put(jax.device_get(hdet_jax.average_replicas(ex.params)), one)
  reference = float(jax.jit(ex.eval_step)(average, jax.device_put(raw, one)))
  return {'programs': out, 'single device': reference}


# ------------------------------------------------------------------------------------------------
# Report.
# ------------------------------------------------------------------------------------------------
def _ops(cs) -> str:
  kinds = {}
  for c in cs:
    kinds[c.op] = kinds.get(c.op, 0) + 1
  return ', '.join(f'{op} {n}' for op, n in sorted(kinds.items())) or 'none'


def _base(key):
  """The plain (b) row of ``key``'s block."""
  return key[:4] + ('plain (b)',)


def step_table(steps: dict) -> list[str]:
  lines = [
    '| trainer | accumulation | replicas per device | program | XLA flops | / plain (b) | XLA bytes accessed | '
    '/ plain (b) | across groups, every step: ops; B/device | across groups, in branches (sync steps): ops; '
    'B/device | remat warnings |',
    '|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for key, r in steps.items():
    trainer, size, accum, k, row = key
    plain = row in ('plain (a)', CONTROL)
    if plain and k > 1:
      continue  # the same program as at 1 per device
    b = steps.get(_base(key))
    ratio = lambda name: f'{r[name] / b[name]:.4f}' if b else ''
    acc = ('k=2, ' + ('MultiSteps' if plain else 'multi_steps')) if accum else 'none'
    name = trainer if size == 'example' else f'{trainer}, {size}'
    lines.append(
      f'| {name} | {acc} | {"-" if plain else f"{k} (N={GROUPS * k})"} | {row} | {r["flops"]:,.0f} | '
      f'{ratio("flops")} | {r["bytes accessed"]:,.0f} | {ratio("bytes accessed")} | {_ops(r["always"])}; '
      f'{r["always B"]:,} | {_ops(r["inside"])}; {r["inside B"]:,} | {r["remat"]} |'
    )
  return lines


def eval_table(evals: dict) -> list[str]:
  lines = [
    '| trainer | eval step and batch | before: XLA flops | new: XLA flops | new / before | before: bytes accessed | '
    'new: bytes accessed | across groups, B/device: before; new | loss: before; new; one device |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  for trainer, ev in evals.items():
    p = ev['programs']
    for layout in EVAL_LAYOUTS:
      if ('before', layout) not in p:
        continue
      old, new = p[('before', layout)], p[('evaluate_over_replicas', layout)]
      lines.append(
        f'| {trainer} | {layout} | {old["flops"]:,.0f} | {new["flops"]:,.0f} | {new["flops"] / old["flops"]:.3f} | '
        f'{old["bytes accessed"]:,.0f} | {new["bytes accessed"]:,.0f} | {old["across B"]:,}; {new["across B"]:,} | '
        f'{old["loss"]:.7f}; {new["loss"]:.7f}; {ev["single device"]:.7f} |'
      )
  return lines


def goal(steps: dict) -> dict:
  """Per HDET program: its flops / plain (b)'s, and the cross-group collectives on every step beyond plain (b)'s
  (op kinds and bytes): the goal is <= 1.005 and none."""
  out = {}
  for key, r in steps.items():
    if key[4] != 'HDET':
      continue
    b = steps[_base(key)]
    out[key] = {
      'flops': r['flops'] / b['flops'],
      'bytes accessed': r['bytes accessed'] / b['bytes accessed'],
      'extra ops': sorted({c.op for c in r['always']} - {c.op for c in b['always']}),
      'extra B': r['always B'] - b['always B'],
      'sync B': r['inside B'],
    }
  return out


def reading(steps: dict, evals: dict) -> list[str]:
  """Sentences read off the figures: the goal (flops within 1.005x of plain (b); nothing across groups between
  syncs but the gradient's all-reduce), where it is missed, plain (a) against plain (b), the evaluation."""
  g = goal(steps)
  out = []
  flops = {key: x['flops'] for key, x in g.items()}
  missed = [key for key, x in flops.items() if x > 1.005]
  out.append(
    f'HDET / plain (b): flops {min(flops.values()):.4f}-{max(flops.values()):.4f}, bytes accessed '
    f'{min(x["bytes accessed"] for x in g.values()):.4f}-{max(x["bytes accessed"] for x in g.values()):.4f} over '
    f'the {len(g)} HDET programs: the 1.005x goal is '
    + ('met in every one.' if not missed else f'missed in {len(missed)}: ' + ', '.join(map(str, missed)) + '.')
  )
  extra = {key: x for key, x in g.items() if x['extra ops'] or x['extra B']}
  out.append(
    'Between syncs each HDET program sends across groups '
    + (
      "what plain (b) sends, the gradient's all-reduce alone (same ops, same bytes)"
      if not extra
      else 'more than plain (b) in '
      + ', '.join(f'{key} (+{x["extra B"]:,} B, {x["extra ops"]})' for key, x in extra.items())
    )
    + "; the window's average and the controller's gather sit in a branch taken on sync steps "
    f'({min(x["sync B"] for x in g.values()):,}-{max(x["sync B"] for x in g.values()):,} B per device).'
  )
  for key, r in steps.items():
    if key[4] != 'plain (a)' or key[3] != 1:
      continue
    b = steps[_base(key)]
    out.append(
      f'plain (a), {key[0]} ({key[1]} size), accumulation {"on" if key[2] else "off"}: {r["flops"] / b["flops"]:.3f}x '
      f'the flops of plain (b), {r["bytes accessed"] / b["bytes accessed"]:.3f}x its bytes accessed, '
      f'{r["always B"] / max(b["always B"], 1):.2f}x its bytes across groups per step, {r["remat"]} remat warnings.'
    )
  pairs = [
    (r, steps[key[:3] + (1, 'plain (b)')])
    for key, r in steps.items()
    if key[4] == 'plain (b)' and key[3] > 1 and key[:3] + (1, 'plain (b)') in steps
  ]
  if pairs:
    f = [a['flops'] / b['flops'] for a, b in pairs]
    m = [a['bytes accessed'] / b['bytes accessed'] for a, b in pairs]
    out.append(
      f'Two replicas per device (N=8 on the 4 groups) cost the map itself, plain (b), {min(f):.3f}-{max(f):.3f}x the '
      f'flops and {min(m):.2f}-{max(m):.2f}x the bytes accessed of one per device (N=4): each device updates two '
      "replicas' parameters and moments; HDET adds nothing to that (the rows above)."
    )
  never = [r['inside B'] for key, r in steps.items() if key[4] == 'plain (b)']
  out.append(
    f"plain (b)'s program still holds hdet's sync branch ({min(never):,}-{max(never):,} B across groups), never "
    "taken at sync_every=10**9; it counts in its flops as in HDET's."
  )
  for trainer, ev in evals.items():
    p = ev['programs']
    worst = max(abs(x['loss'] - ev['single device']) / ev['single device'] for x in p.values())
    out.append(
      f'Evaluation ({trainer}): every program gives the one-device loss of the average to {worst:.1e} relative.'
    )
    pairs = [
      (layout, p[('evaluate_over_replicas', layout)]['flops'] / p[('before', layout)]['flops'])
      for layout in EVAL_LAYOUTS
      if ('before', layout) in p
    ]
    out.append(
      f'Evaluation ({trainer}), new / before in flops: ' + '; '.join(f'{layout} {x:.3f}' for layout, x in pairs) + '.'
    )
  return out


# Read off the compiled programs' HLO and XLA's warnings (the shapes at the example's size).
WHY = (
  "Why plain (a) costs more: XLA's SPMD partitioner warns that, in the backward pass, it cannot go from the "
  "activations' sharding (rows split over all 8 devices) to the one the kernels' gradients ask for (features "
  "split over 'data', the same on every group), and replicates them: its cross-group all-gathers bring the whole "
  "micro-batch's activations (`f32[32,16,256]` at the example's size) to every device, and the work on them runs "
  "there. Under the map the replica axis is manual and the partitioner sees one group's step only. The control "
  "(the plain trainer's own `P('data')` batch on this mesh) trains on the whole micro-batch in every group. "
  "Evaluation: the former program's average (`average_replicas`, run before it, eagerly) is not in its counts; "
  "the new one's include the average's all-reduce. With the `P('data')` constraint or batch, the former runs its "
  "matmuls on all 1,024 tokens of the eval batch on every device (the features split over 'data'), the new on "
  "its group's 256 only."
)


def section(steps: dict, evals: dict, command: str) -> list[str]:
  return [
    HEADING,
    '',
    BEGIN,
    f"`{command}` ({datetime.date.today().isoformat()}; {machine()}). Mesh `('replica', 'data')` = 4 groups x "
    "2 FSDP devices; one micro-batch step (32 rows) of examples/add_to_trainer's trainers, compiled. plain (a): the "
    "plain trainer under GSPMD over both axes, the batch on `P(('replica', 'data'))`; plain (b): the HDET trainer "
    'with `hdet(spread=0, auto_lr=None, sync_every=10**9)` (the base optimizer under the same map); HDET: the HDET '
    "trainer as it is; the control: the plain trainer with its own `P('data')` batch on this mesh. Per device: "
    "XLA's cost analysis (a conditional counts as its costliest branch) and the collectives whose groups span "
    "more than one group (`benchmarks/comm.py`), on every step and inside a conditional's branch. "
    'Accumulation k=2: `optax.MultiSteps` in plain (a), `hdet_jax.multi_steps` around hdet; 2 replicas per device: '
    '`over_replicas(per_device=2)`, N=8 on the 4 groups (plain (a) has no replicas: its row at 1 per device '
    f'stands for both). "wider": VOCAB, WIDTH, SEQ = {", ".join(str(v) for v in SIZES["wider"].values())} '
    '(3.1M parameters per replica). Remat warnings: XLA\'s "involuntary full rematerialization" warnings while '
    'compiling.',
    '',
    *step_table(steps),
    '',
    '### Evaluation',
    '',
    "The examples' eval step on the replicas' average (HDET's initial state, a 64-row eval batch): before, "
    '`jax.jit(eval_step)(hdet_jax.average_replicas(params), batch)`; new, '
    "`jax.jit(hdet_jax.evaluate_over_replicas(eval_step, mesh, 'replica'))(params, batch)`; one device: the eval "
    "step on one device. The eval batch on the split batch's sharding `P(('replica', 'data'))` as the "
    "examples put it, or on the trainer's `P('data')`; the eval step as the examples have it, or with the train "
    "step's `with_sharding_constraint(batch, P('data'))`.",
    '',
    *eval_table(evals),
    '',
    ' '.join(reading(steps, evals)),
    '',
    WHY,
    END,
  ]


def write(lines: list[str], path=RESULTS) -> None:
  """Replaces the text between the markers in ``path`` (the heading stays above them, so another benchmark that
  rewrites its own section up to the next heading leaves this one whole), or appends the section at the end."""
  text = pathlib.Path(path).read_text()
  new = '\n'.join(lines)
  if BEGIN in text and END in text:
    before, rest = text.split(BEGIN, 1)
    text = before + new[new.index(BEGIN) :] + rest.split(END, 1)[1]
  else:
    text = text.rstrip('\n') + '\n\n' + new + '\n'
  pathlib.Path(path).write_text(text)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--quick', action='store_true', help='the linen trainer with accumulation only; writes nothing')
  p.add_argument('--write', action='store_true', help=f'write the section into {RESULTS.relative_to(ROOT)}')
  args = p.parse_args(argv)
  start = time.perf_counter()
  log = lambda line: print('# ' + line, file=sys.stderr, flush=True)
  steps = measure_steps(args.quick, log=log)
  print('\n'.join(step_table(steps)))
  print(flush=True)
  evals = {} if args.quick else {t: measure_eval(t, log=log) for t in TRAINERS}
  if evals:
    print('\n'.join(eval_table(evals)))
    print()
  print(' '.join(reading(steps, evals)))
  print(f'# {time.perf_counter() - start:.0f} s', file=sys.stderr)
  if args.write and not args.quick:
    argv = sys.argv[1:] if argv is None else list(argv)
    write(section(steps, evals, 'python -m benchmarks.same_layout' + (' ' + ' '.join(argv) if argv else '')))
    print(f'# wrote {RESULTS.relative_to(ROOT)}', file=sys.stderr)
  return {'steps': steps, 'evals': evals}


if __name__ == '__main__':
  main()
