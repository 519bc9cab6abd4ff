"""Communication across the replica axis, counted from a compiled program's HLO text.

HDET's cost over plain data parallel is communication between replicas (groups of devices on a
2-D mesh): the gradient all-reduce on every step (unless the low-communication mode skips it) and
the average at each sync. This module reads it off what XLA will run, instead of estimating it:
every collective in the compiled program, its per-device operand bytes, and whether its device
groups span more than one replica. A pure text parser over numpy; no device work.

Collectives inside a ``lax.cond`` branch are counted as if the branch ran: compile the sync and
the non-sync program separately (``sync=True/False``) to tell them apart, or split one program's
collectives by place with :func:`collectives_by_place`.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

_OPS = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute')
_LINE = re.compile(r'=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>' + '|'.join(_OPS) + r')(?P<start>-start)?\(')
_ARRAY = re.compile(r'\b(pred|[subfc]\d+|bf16)\[([\d,]*)\]')
_IOTA = re.compile(r'replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?')
_LIST = re.compile(r'replica_groups=\{((?:\{[\d,]*\},?)*)\}')
_MESH = re.compile(r'replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}')  # mesh['axis_0'=4,'axis_1'=2] {'axis_1'}
_PAIRS = re.compile(r'source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}')
_BYTES = {'pred': 1, 'bf16': 2}


class Collective(NamedTuple):
  """One collective of a compiled program."""

  op: str  # 'all-reduce', 'all-gather', ...
  operand_bytes: int  # bytes each participating device sends into it (its operand).
  groups: tuple[tuple[int, ...], ...]  # device groups, by position in the mesh's flattened devices.
  crosses_replicas: bool  # whether some group holds devices of more than one replica.


def _element_bytes(dtype: str) -> int:
  return _BYTES.get(dtype) or max(1, int(re.sub(r'\D', '', dtype)) // 8)  # c64: 64 bits in all


def _shape_bytes(shape: str) -> int:
  """Bytes of an HLO result shape, e.g. ``f32[4,2]{1,0}`` or a tuple ``(f32[4]{0}, pred[])``."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    total += _element_bytes(dtype) * int(np.prod([int(d) for d in dims.split(',') if d], dtype=np.int64))
  return total


def _groups(line: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
  """The device groups of a collective (iota ``[4,2]<=[8]``, explicit ``{{0,2},{1,3}}``, or by mesh axes
  ``mesh['axis_0'=4,'axis_1'=2] {'axis_1'}``: the devices that differ only along the named axes)."""
  by_axes = _MESH.search(line)
  if by_axes:
    axes = re.findall(r"'([^']+)'=(\d+)", by_axes.group(1))
    inside = set(re.findall(r"'([^']+)'", by_axes.group(2)))
    ids = np.arange(int(np.prod([int(n) for _, n in axes]))).reshape([int(n) for _, n in axes])
    order = [i for i, (a, _) in enumerate(axes) if a not in inside] + [
      i for i, (a, _) in enumerate(axes) if a in inside
    ]
    size = int(np.prod([int(n) for a, n in axes if a in inside]))
    return tuple(tuple(int(i) for i in row) for row in ids.transpose(order).reshape(-1, size))
  iota = _IOTA.search(line)
  if iota:
    out, dims, perm = ([int(v) for v in g.split(',')] if g else None for g in iota.groups())
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    ids = ids.transpose(perm) if perm else ids
    return tuple(tuple(int(i) for i in row) for row in ids.reshape(out))
  listed = _LIST.search(line)
  if listed and listed.group(1):
    return tuple(tuple(int(i) for i in g.split(',') if i) for g in re.findall(r'\{([\d,]*)\}', listed.group(1)))
  pairs = _PAIRS.search(line)
  if pairs:  # collective-permute: each source-target pair is a group of two
    return tuple(tuple(int(i) for i in p) for p in re.findall(r'\{(\d+),(\d+)\}', pairs.group(1)))
  return (tuple(range(num_devices)),)  # no groups listed: every device in one group


def collectives(hlo_text: str, mesh_shape: tuple[int, ...], replica_dim: int = 0) -> list[Collective]:
  """Every collective in ``hlo_text`` (``jitted.lower(...).compile().as_text()``).

  Args:
    hlo_text: the compiled program's HLO.
    mesh_shape: the mesh's shape (``tuple(mesh.devices.shape)``); device ids in the HLO are
      positions in the mesh's flattened device array.
    replica_dim: which mesh dimension is the replica axis.
  """
  num = int(np.prod(mesh_shape))
  out = []
  for line in hlo_text.splitlines():
    m = _LINE.search(line)
    if not m or m.group('start') and m.group('op') != 'all-reduce':
      continue  # async pairs other than all-reduce-start carry (operand, result) tuples: not on CPU
    groups = _groups(line, num)
    size = len(groups[0]) if groups else 1
    nbytes = _shape_bytes(m.group('shape'))
    nbytes = {'all-gather': nbytes // size, 'reduce-scatter': nbytes * size}.get(m.group('op'), nbytes)
    replica_of = lambda i: np.unravel_index(i, mesh_shape)[replica_dim]
    crosses = any(len({replica_of(i) for i in g}) > 1 for g in groups)
    out.append(Collective(m.group('op'), int(nbytes), groups, crosses))
  return out


def replica_axis_bytes(hlo_text: str, mesh_shape: tuple[int, ...], replica_dim: int = 0) -> int:
  """Per-device operand bytes of the collectives whose groups span more than one replica."""
  return sum(c.operand_bytes for c in collectives(hlo_text, mesh_shape, replica_dim) if c.crosses_replicas)


def _branch_computations(hlo_text: str) -> tuple[dict[str, list[str]], set[str]]:
  """({computation name: its lines}, the computations that run only inside a conditional's branch, and what
  those call)."""
  bodies, name = {}, None
  for line in hlo_text.splitlines():
    m = re.match(r'^(?:ENTRY\s+)?(%?[\w.\-]+)\s.*\{\s*$', line)
    if m and not line.startswith(' '):
      name = m.group(1).lstrip('%')
      bodies[name] = []
    elif name is not None:
      bodies[name].append(line)
  branches = set()
  for line in (line for body in bodies.values() for line in body if ' conditional(' in line):
    for group, single in re.findall(
      r'(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?([\w.\-]+))', line
    ):
      branches |= {n.strip().lstrip('%') for n in group.split(',') if n.strip()} | ({single} if single else set())
  frontier = list(branches)
  while frontier:
    for line in bodies.get(frontier.pop(), ()):
      for callee in re.findall(r'(?:calls|to_apply|body|condition)=%?([\w.\-]+)', line):
        if callee not in branches:
          branches.add(callee)
          frontier.append(callee)
  return bodies, branches


def collectives_by_place(
  hlo_text: str, mesh_shape: tuple[int, ...], replica_dim: int = 0
) -> tuple[list[Collective], list[Collective]]:
  """The collectives of a compiled program that run on every call, and those inside a conditional's branch
  (``hdet``'s sync under the ``lax.cond`` dispatch), each as :func:`collectives` gives them."""
  bodies, branches = _branch_computations(hlo_text)
  always = '\n'.join(line for n, body in bodies.items() if n not in branches for line in body)
  inside = '\n'.join(line for n, body in bodies.items() if n in branches for line in body)
  return collectives(always, mesh_shape, replica_dim), collectives(inside, mesh_shape, replica_dim)
