"""`moespec_jax.parallel.mesh` on this process's one device (the 8-device checks: tests/mesh/): the
mesh, parameter shardings and bytes, the combine's bytes, the errors."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import moespec_jax as msj
from moespec_jax.parallel import mesh as mesh_lib


def test_a_one_device_mesh_runs_generation_as_one_device(tiny_model):
  mesh = mesh_lib.make_mesh()
  assert dict(mesh.shape) == {"data": 1, "expert": len(jax.devices())}
  placed = tiny_model.on_mesh(mesh)
  assert placed.expert_sharding().n_ranks == 1
  want = msj.generate(tiny_model, [[5, 6, 7], [8, 9]], 6)
  out = msj.generate(placed, [[5, 6, 7], [8, 9]], 6)
  np.testing.assert_array_equal(out.tokens, want.tokens)
  assert out.stats["expert_ranks"] == 1 and out.stats["max_over_mean_rank_load"] == 1.0
  assert "expert_ranks" not in want.stats
  # One rank: the combine sends nothing.
  assert out.stats["combine_bytes_per_pass"] == 0.0


def test_state_shardings_put_the_routed_experts_on_the_expert_axis(tiny_model):
  shardings = mesh_lib.state_shardings(tiny_model.state, mesh_lib.make_mesh())
  for path, sharding in jax.tree_util.tree_flatten_with_path(shardings)[0]:
    name = jax.tree_util.keystr(path)
    routed = any(p in name for p in ("w_gate_EDF", "w_up_EDF", "w_down_EFD"))
    assert sharding.spec == (P("expert") if routed else P()), name


def test_bytes_per_device_and_combine_bytes(tiny_config, tiny_model):
  mesh = mesh_lib.make_mesh()
  total = sum(leaf.nbytes for leaf in jax.tree.leaves(tiny_model.state))
  assert mesh_lib.expected_bytes_per_device(tiny_model.state, mesh) == total
  assert mesh_lib.bytes_per_device(tiny_model.on_mesh(mesh).state) == {jax.devices()[0].id: total}
  assert mesh_lib.combine_bytes(tiny_config, mesh, 8) == 0.0  # one rank


def test_mesh_errors():
  n = len(jax.devices())
  with pytest.raises(ValueError, match=f"needs {n + 1} devices, {n} are here"):
    mesh_lib.make_mesh(n + 1, 1)
  with pytest.raises(ValueError, match="data must be an int >= 1"):
    mesh_lib.make_mesh(1.5)
  other = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("rows", "experts"))
  with pytest.raises(ValueError, match="a model mesh has the axes"):
    mesh_lib.expert_sharding(other)
