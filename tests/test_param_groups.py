"""Parameter groups by regex on parameter paths (hdet_jax.param_groups)."""

import jax
import jax.numpy as jnp
import optax
import pytest

import hdet_jax as H
from hdet_jax.param_groups import path_string

N, AX = 8, 'data'


@pytest.mark.parametrize(
  'groups, match',
  [
    ({'embedding': r'^embed/', 'rest': r'kernel', 'ghost': r'does_not_exist'}, 'match no parameter'),
    ({'a': r'kernel', 'b': r'attn'}, 'several groups'),
    ({'a': r'kernel'}, 'matches no group'),
  ],
)
def test_bad_groups(groups, match):
  params = {'embed': {'table': jnp.zeros(2)}, 'attn': {'kernel': jnp.zeros(2)}}
  tx = H.hdet(optax.sgd, 1e-2, num_replicas=N, spread=0.25, sync_every=4, replica_axis=AX, param_groups=groups)
  with pytest.raises(ValueError, match='param_groups.*' + match):
    tx.init(params)


def test_bad_group_regex():
  with pytest.raises(ValueError, match=r"param_groups\['a'\]"):
    H.hdet(optax.sgd, 1e-2, num_replicas=N, param_groups={'a': '(unclosed'})


def test_path_strings_and_labels():
  """Dict keys, sequence indices and dataclass-like attributes join with '/'; each leaf gets its one group."""
  params = {'emb': {'w': jnp.zeros(2)}, 'blocks': [{'attn': {'kernel': jnp.zeros(1)}}, {'mlp': jnp.zeros(1)}]}
  paths = [path_string(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  assert paths == ['blocks/0/attn/kernel', 'blocks/1/mlp', 'emb/w']
  labels = H.param_groups.group_labels(params, {'embed': '^emb', 'attention': '/attn/', 'mlp': 'mlp$'})
  assert labels == {'emb': {'w': 'embed'}, 'blocks': [{'attn': {'kernel': 'attention'}}, {'mlp': 'mlp'}]}


def test_path_string_of_plain_entries():
  """Entries that are not jax key types (plain strings, ints) join by their str."""
  assert path_string(['blocks', 3, jax.tree_util.DictKey('kernel')]) == 'blocks/3/kernel'
  assert path_string((jax.tree_util.GetAttrKey('w'), 'x', jax.tree_util.SequenceKey(0))) == 'w/x/0'
  assert path_string(()) == ''
