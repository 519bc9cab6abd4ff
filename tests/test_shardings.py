"""hdet_jax.shardings: one family for the shardings of stacked replicas. By HDET's rules (``mesh=``) it gives 1.0's
group_shardings and state_shardings layouts leaf for leaf (recorded from 1.0's code); from a trainer's own shardings
it puts the replica axis first; the 1.0 names warn and give the same."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import hdet_jax as H

# Written by 1.0's code (e0ff62a^: group_shardings for the parameters, state_shardings for the optimizer state), each
# leaf's path and spec, for the cases CASES builds.
RECORDED = json.load(open(os.path.join(os.path.dirname(__file__), 'data', 'group_shardings_1_0.json')))
PARAMS = {
  'fc1': {'kernel': jnp.ones((4, 6)), 'bias': jnp.ones(6)},
  'fc2': {'kernel': jnp.ones((6, 4))},
  'emb': jnp.ones((10, 4)),
}
TENSOR_RULES = ((r'fc1/(kernel|bias)$', -1), (r'fc2/kernel$', 0))
MESHES = {
  'fsdp': ((4, 2), ('replica', 'fsdp'), {}),
  'tensor': ((4, 2), ('replica', 'tensor'), dict(inner_axis=None, tensor_rules=TENSOR_RULES)),
  'both': ((2, 2, 2), ('replica', 'fsdp', 'tensor'), dict(tensor_rules=TENSOR_RULES, fsdp_rules=((r'emb$', 1),))),
}


def _stacked(rollback):
  tx = H.hdet(optax.adamw, 1e-3, num_replicas=4, replica_axis='replica', auto_lr=H.AutoLR(total_steps=100),
              rollback=rollback)  # fmt: skip
  return (
    jax.eval_shape(lambda p: H.stack_replicas(p, 4), PARAMS),
    jax.eval_shape(lambda p: H.stack_replicas(tx.init(p), 4), PARAMS),
  )


def _specs(tree):
  leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda s: isinstance(s, NamedSharding))
  return [[jax.tree_util.keystr(p), str(s.spec)] for p, s in leaves]


@pytest.mark.parametrize('rollback', [False, True])
@pytest.mark.parametrize('layout', list(MESHES))
def test_by_the_rules_each_leaf_is_laid_out_as_1_0_laid_it_out(layout, rollback):
  shape, axes, kw = MESHES[layout]
  mesh = Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), axes)
  params, state = _stacked(rollback)
  for tag, tree in (('params', params), ('state', state)):
    got = _specs(H.stacked_shardings(tree, 'replica', mesh=mesh, **kw))
    assert got == RECORDED[f'{rollback}-{layout}-{tag}'], tag


def test_a_train_state_holding_an_hdet_state_is_laid_out_in_one_call():
  """Parameters by the rules, the HDETState in it as alone: its own fields whole, its moments as the parameters."""
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('replica', 'fsdp'))
  params, state = _stacked(False)
  both = H.stacked_shardings({'params': params, 'opt_state': state}, 'replica', mesh=mesh)
  assert _specs(both['params']) == RECORDED['False-fsdp-params']
  assert _specs(both['opt_state']) == RECORDED['False-fsdp-state']
  assert both['opt_state'].count.spec == P('replica')  # an HDET field: whole in each group


def test_from_a_trainers_own_shardings_the_replica_axis_goes_first():
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('replica', 'data'))
  own = {'w': NamedSharding(mesh, P(None, 'data')), 'count': NamedSharding(mesh, P()), 'b': P('data')}
  got = H.stacked_shardings(own, 'replica')
  assert (got['w'].spec, got['count'].spec, got['b']) == (
    P('replica', None, 'data'),
    P('replica'),
    P('replica', 'data'),
  )
  assert got['w'].mesh is mesh
  assert H.batch_shardings(NamedSharding(mesh, P('data')), 'replica').spec == P(('replica', 'data'))
  with pytest.raises(ValueError, match='expected NamedSharding or PartitionSpec leaves.*or pass mesh= to lay out'):
    H.stacked_shardings({'w': jnp.ones((4, 2))}, 'replica')


def test_the_1_0_names_warn_and_give_the_same_shardings():
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('replica', 'fsdp'))
  params, state = _stacked(True)
  with pytest.warns(DeprecationWarning, match=r'group_shardings\(stacked, mesh, \.\.\.\) is deprecated: use '):
    old = H.group_shardings(params, mesh, 'replica')
  assert old == H.stacked_shardings(params, 'replica', mesh=mesh)
  with pytest.warns(DeprecationWarning, match=r'state_shardings\(state, mesh, \.\.\.\) is deprecated: use '):
    old = H.state_shardings(state, mesh, 'replica', 'fsdp')
  assert old == H.stacked_shardings(state, 'replica', mesh=mesh, inner_axis='fsdp')
