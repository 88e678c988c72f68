"""`pallas_kernels.expert_parallel` on a one-device mesh (the 8-device checks: tests/mesh/): both
dispatches equal the one-device FFN, the choice between them, and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import pallas_kernels
from pallas_kernels import expert_parallel

E, D, F, K = 8, 16, 8, 2


@pytest.fixture(scope="module")
def sharding():
  return expert_parallel.ExpertSharding(Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "expert")))


@pytest.mark.parametrize("rows", [4, 160])
def test_both_dispatches_equal_one_device(sharding, rows):
  rng = np.random.default_rng(rows)
  weights = [jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in ((E, D, F), (E, D, F), (E, F, D))]
  x = jnp.asarray(rng.normal(size=(rows, D)).astype(np.float32))
  ids = jnp.asarray(rng.integers(0, E, size=(rows, K)).astype(np.int32))
  gates = jnp.asarray(rng.random(size=(rows, K)).astype(np.float32))
  assert expert_parallel.exchanges(rows, sharding) == (rows > expert_parallel.REPLICATED_MAX_ROWS)
  want = pallas_kernels.expert_ffn(x, ids, gates, *weights, method="dedup")
  got = jax.jit(lambda *a: pallas_kernels.expert_ffn(*a, method="dedup", sharding=sharding))(x, ids, gates, *weights)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_the_exchange_needs_rows_that_divide_the_axes():
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "expert"))
  sharding = expert_parallel.ExpertSharding(mesh)
  assert not expert_parallel.exchanges(expert_parallel.REPLICATED_MAX_ROWS, sharding)
  assert expert_parallel.exchanges(expert_parallel.REPLICATED_MAX_ROWS + 1, sharding)
  assert expert_parallel.ragged_all_to_all_compiles("tpu") and not expert_parallel.ragged_all_to_all_compiles("cpu")


def test_errors(sharding):
  with pytest.raises(ValueError, match="data_axis 'rows' is not an axis"):
    expert_parallel.ExpertSharding(sharding.mesh, data_axis="rows")
  assert sharding.n_ranks == 1 and sharding.n_data == 1
