"""Shared setup for the HDET benchmarks: devices, model, data, optimizers and step programs.

Import this module before anything imports jax: it asks for 8 simulated CPU devices.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import pathlib
import re
import statistics
import time
import types
from typing import Any

os.environ.setdefault('JAX_NUM_CPU_DEVICES', '8')

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import hdet_jax as H  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
AXIS = 'data'
N = 8

# ----------------------------------------------------------------------------------------------
# Model: the trainer's flax.nnx TransformerLM.
# ----------------------------------------------------------------------------------------------
from hdet_jax.trainer.tasks import lm_model as model_lib  # noqa: E402

MODEL_SOURCE = 'hdet_jax.trainer.tasks.lm_model.TransformerLM'


def default_model_config():
  """(model config, seq_len, per-replica batch, where it came from)."""
  path = REPO / 'configs' / 'default.py'
  if path.exists():
    try:
      spec = importlib.util.spec_from_file_location('hdet_default_config', path)
      mod = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(mod)
      cfg = mod.get_config()
      m = cfg.model
      model = types.SimpleNamespace(
        d_model=int(m.d_model), num_layers=int(m.num_layers), num_heads=int(m.num_heads), mlp_ratio=int(m.mlp_ratio)
      )
      return model, int(cfg.data.seq_len), int(cfg.data.batch_size), 'configs/default.py'
    except Exception as e:  # a config in flux: fall back, and say so.
      print(f'# configs/default.py not usable ({type(e).__name__}: {e}); using the built-in size')
  model = types.SimpleNamespace(d_model=64, num_layers=2, num_heads=4, mlp_ratio=4)
  return model, 64, 8, 'built-in (configs/default.py absent)'


def scaled_model_config(model, seq_len: int, factor: float = 10.0):
  """About ``factor`` times the parameters: the widest d_model (a multiple of the heads) not past it."""
  target = factor * num_params(model, seq_len)
  heads, best = model.num_heads, None
  d = heads
  while True:
    cand = types.SimpleNamespace(d_model=d, num_layers=model.num_layers, num_heads=heads, mlp_ratio=model.mlp_ratio)
    n = num_params(cand, seq_len)
    if best is None or abs(n - target) < abs(best[0] - target):
      best = (n, cand)
    if n > target:
      return best[1]
    d += heads


def make_mesh(n: int = N) -> Mesh:
  return Mesh(np.asarray(jax.devices()[:n]), (AXIS,))


def replica_backend() -> str:
  """'shard_map' (one replica per device) where there are N devices, else 'vmap' (all on one device).

  A single GPU runs the N replicas under ``vmap``: the same per-replica step, the axis name bound by
  ``vmap`` instead of a mesh, so the collectives are the same calls.
  """
  return 'shard_map' if jax.device_count() >= N else 'vmap'


# ----------------------------------------------------------------------------------------------
# Optimizers and step programs.
# ----------------------------------------------------------------------------------------------
TOTAL_STEPS = 100_000  # long enough that the schedule and the controller never run out.
MAX_LR = 3e-3


def plain_tx():
  return optax.adam(H.one_cycle(max_lr=MAX_LR, total_steps=TOTAL_STEPS))


# The controllers a benchmark can run HDET with (``python -m benchmarks.bench --auto-lr NAME``).
CONTROLLERS = {
  # The product default, the guarded climb: the controller users are told to run.
  'default': lambda: H.AutoLR(total_steps=TOTAL_STEPS),
  # The paper's (eqs. 4-9): what the overhead benchmark ran until 2026-12, kept to compare against.
  'paper': lambda: H.AutoLR.paper(total_steps=TOTAL_STEPS, warmup_steps=0, temperature=0.1),
}
CONTROLLER = 'default'  # the key of CONTROLLERS that hdet_tx builds; bench.py's --auto-lr sets it.
CONTROLLER_CALLS = {
  'default': 'AutoLR(total_steps=S)',
  'paper': 'AutoLR.paper(total_steps=S, warmup_steps=0, temperature=0.1)',
}


def hdet_tx(sync_every: int, exact_sync: bool):
  return H.hdet(
    optax.adam,
    H.one_cycle(max_lr=MAX_LR, total_steps=TOTAL_STEPS),
    num_replicas=N,
    spread=0.25,
    sync_every=sync_every,
    replica_axis=AXIS,
    auto_lr=CONTROLLERS[CONTROLLER](),
    exact_sync=exact_sync,
  )


@dataclasses.dataclass(frozen=True)
class Variant:
  """One way of running the step.

  kind: 'plain' (optax.adam on the pmean'd gradient) or 'hdet'.
  mode: 'cond' (one program, ``sync=None``: a lax.cond decides), 'static' (two programs,
    ``sync=False`` / ``sync=True``, picked by the Python loop) or 'split' (the ``sync=False`` step on
    every step, then on sync steps a small window-end program, ``update(None, ..., sync=True)``:
    the trainer's design).
  donate: donate params and optimizer state to the step.
  exact_sync: build hdet with exact_sync=True and apply with H.apply_updates (the trainer's way).
  sync_every: T.
  packed: keep HDET's state packed between calls (:class:`hdet_jax.packing.PackedState`: its small fields in one
    buffer, unpacked inside the program; the trainer's way), or pass the HDETState's leaves as they are.
  """

  name: str
  kind: str
  mode: str = 'static'
  donate: bool = True
  exact_sync: bool = False
  sync_every: int = 1000
  backend: str = 'auto'  # 'shard_map', 'pmap', 'vmap' (all replicas on one device), or 'auto': replica_backend()
  packed: bool = True

  def resolved(self) -> 'Variant':
    """This variant with 'auto' replaced by the backend this machine's devices allow."""
    return dataclasses.replace(self, backend=replica_backend()) if self.backend == 'auto' else self

  def tx(self):
    return plain_tx() if self.kind == 'plain' else hdet_tx(self.sync_every, self.exact_sync)


def _unpacking(tx, v: Variant, fn):
  """``fn(params, HDETState, *rest) -> (params, HDETState, ...)`` on packed states when ``v.packed``."""
  if v.kind == 'plain' or not v.packed:
    return fn

  def wrapped(params, packed, *rest):
    out = fn(params, H.packing.unpack_state(packed, jax.eval_shape(tx.init, params)), *rest)
    return (out[0], H.packing.pack_state(out[1]), *out[2:])

  return wrapped


def per_replica_step(graphdef, tx, v: Variant, sync):
  @functools.partial(_unpacking, tx, v)
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: model_lib.loss_fn(graphdef, p, batch))(params)
    grads = lax.pmean(grads, AXIS)
    if v.kind == 'plain':
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
    else:
      updates, opt_state = tx.update(grads, opt_state, params, value=loss, sync=sync)
      if v.exact_sync:
        params = H.apply_updates(params, updates, opt_state, replica_axis=AXIS, sync=sync)
      else:
        params = optax.apply_updates(params, updates)
    return params, opt_state, loss

  return step


def build_programs(graphdef, v: Variant, mesh) -> tuple[Any, dict]:
  """(tx, {sync flag: jitted step}); the flag is None for one-program variants."""
  tx = v.tx()
  donate = (0, 1) if v.donate else ()
  flags = [None] if (v.kind == 'plain' or v.mode == 'cond') else [False] if v.mode == 'split' else [False, True]
  programs = {}
  if v.kind == 'hdet' and v.mode == 'split':

    def window_end(params, opt_state):
      updates, opt_state = tx.update(None, opt_state, params, sync=True)
      return H.apply_updates(params, updates, opt_state, replica_axis=AXIS, sync=True), opt_state

    programs['end'] = _compiled(_unpacking(tx, v, window_end), v, mesh, donate)
  for flag in flags:
    programs[flag] = _compiled(per_replica_step(graphdef, tx, v, flag), v, mesh, donate)
  return tx, programs


def _compiled(fn, v: Variant, mesh, donate):
  """``fn`` (one replica's program) as a program over the replicas: ``jax.pmap`` itself for the pmap backend
  (what a pmap trainer calls, not a jit around it), else a jit of :func:`_over_replicas`."""
  if v.backend == 'pmap':
    return jax.pmap(fn, axis_name=AXIS, devices=list(mesh.devices.flat), donate_argnums=donate)
  return jax.jit(_over_replicas(fn, v, mesh), donate_argnums=donate)


def _over_replicas(fn, v: Variant, mesh):
  """``fn`` (one replica's program) mapped over the replica axis: one per device, or vmapped on one."""
  if v.backend == 'shard_map':
    return H.shard_map_replicas(fn, mesh, AXIS)
  return jax.vmap(fn, axis_name=AXIS)


def init_state(model_cfg, seq_len, tx, v: Variant, mesh, key=0):
  """Stacked params and optimizer state, on the mesh (shard_map, pmap: one replica per device) or on device 0
  (vmap)."""

  def init(k):
    _, params = model_lib.split_model(model_cfg, seq_len, k)
    stacked = H.stack_replicas(params, N)
    init = tx.init if v.kind == 'plain' or not v.packed else lambda p: H.packing.pack_state(tx.init(p))
    return stacked, jax.vmap(init)(stacked)

  if v.backend in ('shard_map', 'pmap'):
    sharding = NamedSharding(mesh, P(AXIS))
  else:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.jit(init, out_shardings=sharding)(jax.random.key(key))


def make_batches(seq_len, batch, v: Variant, mesh, count=4, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(count):
    x = rng.integers(0, 256, size=(N, batch, seq_len + 1), dtype=np.uint8)
    if v.backend in ('shard_map', 'pmap'):
      out.append(jax.device_put(x, NamedSharding(mesh, P(AXIS))))
    else:
      out.append(jax.device_put(x, jax.devices()[0]))
  return out


class Runner:
  """Holds one variant's state and runs timed blocks of steps.

  ``phase``: for two-program variants, 'nosync' runs only the non-sync program and 'sync' only
  the sync program; 'loop' dispatches by step number as a training loop does ((t+1) % T == 0).
  One-program variants ignore it (the count inside the state decides).
  ``state``: (params, opt_state) as :func:`init_state` makes them for this variant, to start from (another runner's,
  made once); None: made here.
  """

  def __init__(self, v: Variant, graphdef, model_cfg, seq_len, batch, mesh, phase='loop', state=None):
    v = v.resolved()
    self.v, self.phase = v, phase
    self.tx, self.programs = build_programs(graphdef, v, mesh)
    self.params, self.opt_state = state or init_state(model_cfg, seq_len, self.tx, v, mesh)
    self.batches = make_batches(seq_len, batch, v, mesh)
    self.t = 0

  def example_args(self, flag) -> tuple:
    """Arguments to lower program ``flag`` with (the window end takes no batch)."""
    if flag == 'end':
      return self.params, self.opt_state
    return self.params, self.opt_state, self.batches[0]

  def compile_ahead(self) -> None:
    """Replaces every jitted program with its ahead-of-time compiled executable."""
    self.programs = {flag: fn.lower(*self.example_args(flag)).compile() for flag, fn in self.programs.items()}

  def ends_window(self, t) -> bool:
    """Whether a split variant runs its window-end program after step t."""
    if 'end' not in self.programs or self.phase == 'nosync':
      return False
    return self.phase == 'sync' or (t + 1) % self.v.sync_every == 0

  def program(self, t):
    if None in self.programs:
      return self.programs[None]
    if 'end' in self.programs:
      return self.programs[False]
    if self.phase == 'nosync':
      return self.programs[False]
    if self.phase == 'sync':
      return self.programs[True]
    return self.programs[(t + 1) % self.v.sync_every == 0]

  def run(self, k: int) -> float:
    jax.block_until_ready((self.params, self.opt_state))
    start = time.perf_counter()
    for _ in range(k):
      fn = self.program(self.t)
      self.params, self.opt_state, loss = fn(self.params, self.opt_state, self.batches[self.t % len(self.batches)])
      if self.ends_window(self.t):
        self.params, self.opt_state = self.programs['end'](self.params, self.opt_state)
      self.t += 1
    jax.block_until_ready((self.params, self.opt_state, loss))
    return time.perf_counter() - start


def interleave(runners: dict[str, Runner], rounds: int, k: int, seed: int = 0, log=None):
  """Times ``rounds`` blocks of ``k`` steps per runner, in a fresh random order every round."""
  rng = np.random.default_rng(seed)
  names = list(runners)
  times = {n: [] for n in names}
  for r in range(rounds):
    for i in rng.permutation(len(names)):
      n = names[i]
      times[n].append(runners[n].run(k) / k)
    if log:
      log(f'  round {r + 1}/{rounds}: ' + ' '.join(f'{n}={times[n][-1] * 1e3:.1f}ms' for n in names))
  return times


def quartiles(xs) -> tuple[float, float, float]:
  xs = sorted(xs)
  if len(xs) < 4:
    m = statistics.median(xs)
    return xs[0], m, xs[-1]
  q = statistics.quantiles(xs, n=4, method='inclusive')
  return q[0], q[1], q[2]


def ratio_stats(num, den) -> tuple[float, float, float]:
  """(q1, median, q3) of the per-round ratios num[r] / den[r]."""
  return quartiles([a / b for a, b in zip(num, den)])


def median_ci(xs, level: float = 0.95, n_boot: int = 4000, seed: int = 0) -> tuple[float, float, float]:
  """(low, median, high): the median with a bootstrap percentile confidence interval."""
  xs = np.asarray(xs, np.float64)
  rng = np.random.default_rng(seed)
  meds = np.median(xs[rng.integers(0, len(xs), size=(n_boot, len(xs)))], axis=1)
  lo, hi = np.quantile(meds, [(1 - level) / 2, (1 + level) / 2])
  return float(lo), float(np.median(xs)), float(hi)


def ratio_ci(num, den) -> tuple[float, float, float]:
  """(low, median, high) of the per-round ratios num[r] / den[r], with a 95% bootstrap CI."""
  return median_ci([a / b for a, b in zip(num, den)])


def hlo_counts(compiled) -> dict[str, int]:
  """Instructions of a compiled program's entry computation, by kind (fusion, copy, parameter...).

  On XLA:CPU every fusion and copy in the entry computation is one kernel launch per device, so
  these counts are the per-step fixed work a program adds, free of timing noise.
  """
  text = compiled.as_text()
  entry = text[text.index('ENTRY') :]
  entry = entry[: entry.index('\n}')]
  counts: dict[str, int] = {}
  for line in entry.split('\n')[1:]:
    m = re.search(r'= \S+ ([a-z][\w-]*)\(', line)
    if m:
      counts[m.group(1)] = counts.get(m.group(1), 0) + 1
  return counts


def num_params(model_cfg, seq_len) -> int:
  _, shapes = model_lib.abstract_model(model_cfg, seq_len)
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


class CompileCounter:
  """Counts XLA backend compilations (and their seconds) through jax.monitoring."""

  EVENT = '/jax/core/compile/backend_compile_duration'
  TRACE = '/jax/core/compile/jaxpr_trace_duration'
  LOWER = '/jax/core/compile/jaxpr_to_mlir_module_duration'

  def __init__(self):
    self.events: list[tuple[str, float]] = []
    jax.monitoring.register_event_duration_secs_listener(self._listen)

  def _listen(self, event, duration, **kwargs):
    if event in (self.EVENT, self.TRACE, self.LOWER):
      self.events.append((event, duration))

  def mark(self) -> int:
    return len(self.events)

  def since(self, mark: int, event=None) -> tuple[int, float]:
    ev = [d for e, d in self.events[mark:] if e == (event or self.EVENT)]
    return len(ev), sum(ev)
