"""benchmarks/comm.py: collectives read from HLO text, their operand bytes and whether they cross replicas.

Lines in the forms XLA:CPU prints (jax 0.10), checked against hand-counted groups and bytes.
"""

from benchmarks import comm

MESH = (4, 2)  # 4 replica groups of 2 devices: device d is in group d // 2

HLO = '\n'.join(
  [
    # the gradient all-reduce across groups: devices {0,2,4,6} and {1,3,5,7} (one per group each)
    '%ar = f32[64,16]{1,0} all-reduce(%g), channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}, '
    'use_global_device_ids=true, to_apply=%add',
    # inside the groups, iota form [4,2]<=[8]: {0,1},{2,3},...; a tuple of two scalars
    '%ar2 = (f32[], pred[]) all-reduce(%a, %b), channel_id=2, replica_groups=[4,2]<=[8], '
    'use_global_device_ids=true, to_apply=%add',
    # across groups in transposed iota form [2,4]<=[4,2]T(1,0): {0,2,4,6},{1,3,5,7}; result 4x the operand
    '%ag = bf16[8,32]{1,0} all-gather(%x), channel_id=3, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}',
    # inside the groups, a reduce-scatter: its operand is 2x the result
    'ROOT %rs = f32[10]{0} reduce-scatter(%y), channel_id=4, replica_groups={{0,1},{2,3},{4,5},{6,7}}, '
    'dimensions={0}, to_apply=%add',
    '%not_a_collective = f32[4]{0} add(%p, %q)',
  ]
)


def test_collectives_groups_bytes_and_crossing():
  got = comm.collectives(HLO, MESH)
  assert [c.op for c in got] == ['all-reduce', 'all-reduce', 'all-gather', 'reduce-scatter']
  assert [c.operand_bytes for c in got] == [64 * 16 * 4, 4 + 1, 8 * 32 * 2 // 4, 10 * 4 * 2]
  assert got[1].groups == ((0, 1), (2, 3), (4, 5), (6, 7))
  assert got[2].groups == ((0, 2, 4, 6), (1, 3, 5, 7))
  assert [c.crosses_replicas for c in got] == [True, False, True, False]
  assert comm.replica_axis_bytes(HLO, MESH) == 64 * 16 * 4 + 8 * 32 * 2 // 4


def test_replica_dim_picks_the_axis():
  # With the replica axis second (mesh 2 x 4, replicas along dim 1), {0,1} crosses and {0,4} does not.
  line = '%ar = f32[2]{0} all-reduce(%g), replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add'
  assert comm.replica_axis_bytes(line, (2, 4), replica_dim=1) == 8
  line = '%ar = f32[2]{0} all-reduce(%g), replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add'
  assert comm.replica_axis_bytes(line, (2, 4), replica_dim=1) == 0


def test_pairs_and_unlisted_groups():
  """collective-permute's source-target pairs are groups of two; no groups listed (or an empty list) is one group of
  every device, which crosses the replicas whenever there are several."""
  lines = [
    '%cp = f32[4]{0} collective-permute(%x), channel_id=5, source_target_pairs={{0,2},{2,4},{4,6},{6,0}}',
    '%cp2 = s32[3]{0} collective-permute(%y), channel_id=6, source_target_pairs={{0,1},{1,0}}',
    '%ar = f32[3]{0} all-reduce(%g), channel_id=7, to_apply=%add',
    '%ar2 = f32[5]{0} all-reduce(%g), channel_id=8, replica_groups={}, to_apply=%add',
  ]
  got = comm.collectives('\n'.join(lines), MESH)
  assert [c.op for c in got] == ['collective-permute', 'collective-permute', 'all-reduce', 'all-reduce']
  assert got[0].groups == ((0, 2), (2, 4), (4, 6), (6, 0)) and got[1].groups == ((0, 1), (1, 0))
  assert got[2].groups == got[3].groups == (tuple(range(8)),)
  assert [c.operand_bytes for c in got] == [16, 12, 12, 20]
  assert [c.crosses_replicas for c in got] == [True, False, True, True]  # {0,1} is inside group 0
  assert comm.replica_axis_bytes('\n'.join(lines), MESH) == 16 + 12 + 20
  # On a mesh of one replica group nothing crosses.
  assert comm.replica_axis_bytes('\n'.join(lines), (1, 8)) == 0


def test_collectives_by_place_splits_what_runs_every_call_from_what_a_branch_runs():
  """A hand-written HLO: ENTRY all-reduces 16 bytes and calls a conditional whose true branch calls a computation
  that all-reduces 64; the false branch has none. The branch's callee counts as inside a branch."""
  hlo = '\n'.join(
    [
      '%inner (p: f32[16]) -> f32[16] {',
      '  %ar.2 = f32[16]{0} all-reduce(%p), replica_groups={{0,2},{1,3}}, to_apply=%add',
      '}',
      '%true_branch (t: f32[16]) -> f32[16] {',
      '  ROOT %c = f32[16]{0} call(%t), to_apply=%inner',
      '}',
      '%false_branch (f: f32[16]) -> f32[16] {',
      '  ROOT %f = f32[16]{0} copy(%f)',
      '}',
      'ENTRY %main (a: f32[4], p: pred[]) -> f32[16] {',
      '  %ar.1 = f32[4]{0} all-reduce(%a), replica_groups={{0,1},{2,3}}, to_apply=%add',
      '  ROOT %r = f32[16]{0} conditional(%p, %x, %x), true_computation=%true_branch, false_computation=%false_branch',
      '}',
    ]
  )
  always, inside = comm.collectives_by_place(hlo, (2, 2))
  assert [(c.op, c.operand_bytes, c.crosses_replicas) for c in always] == [('all-reduce', 16, False)]
  assert [(c.op, c.operand_bytes, c.crosses_replicas) for c in inside] == [('all-reduce', 64, True)]
