"""`pallas_kernels.expert_parallel` on 8 simulated CPU devices: the routed FFN with its experts
spread over a mesh's expert axis equals the one-device FFN, whichever dispatch, method and mesh,
with ranks that no token routes to and with every token routed to one rank."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import pallas_kernels
from pallas_kernels import expert_parallel
from tests.conftest import MESH_DEVICES

E, D, F, K = 16, 32, 24, 4
MESHES = [(1, 8), (2, 4), (8, 1)]


def test_the_run_has_its_devices():
  assert len(jax.devices()) == MESH_DEVICES


@pytest.fixture(scope="module")
def weights():
  rng = np.random.default_rng(0)
  return tuple(
    jnp.asarray(rng.normal(size=shape).astype(np.float32) * 0.2) for shape in ((E, D, F), (E, D, F), (E, F, D))
  )


def _routing(rows: int, kind: str, seed: int):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, D)).astype(np.float32)
  if kind == "random":
    ids = rng.integers(0, E, size=(rows, K))
  else:  # "one rank": every pair on the experts of the first rank of an 8-way axis (others empty)
    ids = rng.integers(0, E // 8, size=(rows, K))
  gates = rng.random(size=(rows, K)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(ids.astype(np.int32)), jnp.asarray(gates)


def _sharding(shape):
  mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data", "expert"))
  return expert_parallel.ExpertSharding(mesh)


# 8 rows: the replicated dispatch (psum); 256: the exchanged one (all_to_all of padded groups on CPU).
@pytest.mark.parametrize("rows", [8, 256])
@pytest.mark.parametrize("kind", ["random", "one rank"])
@pytest.mark.parametrize("shape", MESHES)
def test_sharded_ffn_equals_one_device(weights, shape, kind, rows):
  sharding = _sharding(shape)
  x, ids, gates = _routing(rows, kind, seed=rows + len(kind))
  placed = [jax.device_put(w, sharding.experts()) for w in weights]
  for method in ("xla", "dedup", "per_slot"):
    expected = pallas_kernels.expert_ffn(x, ids, gates, *weights, method=method)
    fn = jax.jit(lambda *a, m=method: pallas_kernels.expert_ffn(*a, method=m, sharding=sharding))
    got = fn(x, ids, gates, *placed)
    # Sums in another order: a rank's slots, then the ranks (XLA's grouped products: other blocks).
    tol = 1e-6 if rows <= expert_parallel.REPLICATED_MAX_ROWS else 1e-5
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=tol, atol=tol, err_msg=method)


def test_each_rank_holds_its_own_experts(weights):
  sharding = _sharding((2, 4))
  placed = jax.device_put(weights[0], sharding.experts())
  for shard in placed.addressable_shards:
    rank = sharding.mesh.devices.flatten().tolist().index(shard.device) % 4
    np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(weights[0][rank * 4 : (rank + 1) * 4]))


def test_a_rank_without_pairs_reads_no_expert():
  # This rank's view of a routing none of whose pairs are its own: every gate 0, nothing to run.
  ids = jnp.array([[0, 1], [2, 3]], jnp.int32)
  local_ids, gates, any_local = expert_parallel._local_slots(ids, jnp.ones((2, 2)), 2, jnp.int32(3))
  assert not bool(any_local) and float(jnp.sum(gates)) == 0.0
  local_ids, gates, any_local = expert_parallel._local_slots(ids, jnp.ones((2, 2)), 2, jnp.int32(1))
  assert bool(any_local)
  np.testing.assert_array_equal(np.asarray(gates), [[0, 0], [1, 1]])
  np.testing.assert_array_equal(np.asarray(local_ids), [[0, 0], [0, 1]])  # off-rank slots point at a read expert


def test_experts_that_do_not_divide_the_axis_are_refused(weights):
  sharding = _sharding((1, 8))
  x, ids, gates = _routing(4, "random", 0)
  six = [w[:6] for w in weights]
  with pytest.raises(ValueError, match="6 routed experts do not divide over the 8 ranks"):
    pallas_kernels.expert_ffn(x, ids % 6, gates, *six, method="xla", sharding=sharding)


def test_a_mesh_without_the_named_axes_is_refused():
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("rows", "experts"))
  with pytest.raises(ValueError, match="expert_axis 'expert' is not an axis"):
    expert_parallel.ExpertSharding(mesh)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_the_ragged_exchange_lowers_for_accelerators(weights, platform):
  # XLA:CPU cannot compile ragged_all_to_all; the accelerators' dispatch is lowered from here.
  sharding = _sharding((2, 4))
  x, ids, gates = _routing(256, "random", 1)
  local = lambda *a: pallas_kernels.expert_ffn(*a, method="xla")
  fn = jax.jit(lambda *a: expert_parallel.exchanged_dispatch(*a, sharding=sharding, local_ffn=local, ragged=True))
  text = fn.trace(x, ids, gates, *weights).lower(lowering_platforms=(platform,)).as_text()
  assert "ragged_all_to_all" in text


@pytest.mark.parametrize("rows", [8, 256])
def test_gradients_through_the_sharded_ffn_equal_one_device(weights, rows):
  # Training's path: both dispatches differentiate (the collectives' transposes, the kernels' VJP).
  sharding = _sharding((2, 4))
  x, ids, gates = _routing(rows, "random", seed=7)

  def loss(x, gates, wg, wu, wd, sharded):
    y = pallas_kernels.expert_ffn(x, ids, gates, wg, wu, wd, method="dedup", sharding=sharding if sharded else None)
    return jnp.sum(jnp.sin(y))

  want = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x, gates, *weights, False)
  placed = [jax.device_put(w, sharding.experts()) for w in weights]
  got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), static_argnums=5)(x, gates, *placed, True)
  for name, g, w in zip(("x", "gates", "w_gate", "w_up", "w_down"), got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4, err_msg=name)
