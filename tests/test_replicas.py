"""Replica-axis helpers (hdet_jax.replicas): stacking and averaging, the finite mean."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hdet_jax as H

from jax.sharding import PartitionSpec as P
from replica_testing import AX, N, make_mesh


@pytest.fixture(scope='module')
def mesh():
  return make_mesh()


def test_average_replicas_is_the_mean_and_exact_on_agreeing_replicas():
  x = jax.random.normal(jax.random.key(0), (N, 1000)) * 3 + 1
  np.testing.assert_allclose(np.asarray(H.average_replicas({'a': x})['a']),
                             np.asarray(x, np.float64).mean(0), rtol=1e-6, atol=1e-6)
  same = jnp.broadcast_to(x[3], x.shape)
  np.testing.assert_array_equal(np.asarray(H.average_replicas(same)), np.asarray(x[3]))


def test_finite_mean_equals_pmean_when_all_finite(mesh):
  x = jax.random.normal(jax.random.key(0), (N, 33))
  f = lambda fn: jax.jit(jax.shard_map(lambda a: fn(a), mesh=mesh, in_specs=P(AX), out_specs=P(AX)))
  a = f(lambda a: H.pmean_finite(a, AX))(x)
  b = f(lambda a: lax.pmean(a, AX))(x)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
