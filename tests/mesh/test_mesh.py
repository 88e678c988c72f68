"""`moespec_jax.parallel.mesh` and `Model` on a mesh: where each parameter lives, what each device
holds, and the errors for meshes a model or a batch does not fit."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import moespec_jax as msj
from moespec_jax.parallel import mesh as mesh_lib
from pallas_kernels import expert_parallel
from tests.mesh.conftest import MESHES


def test_make_mesh_axes_and_errors():
  mesh = mesh_lib.make_mesh(2)
  assert mesh.axis_names == ("data", "expert") and dict(mesh.shape) == {"data": 2, "expert": 4}
  assert dict(mesh_lib.make_mesh(1, 4).shape) == {"data": 1, "expert": 4}
  assert dict(msj.make_mesh(data=4, expert=2).shape) == {"data": 4, "expert": 2}  # the package's name for it
  with pytest.raises(ValueError, match="needs 16 devices, 8 are here"):
    mesh_lib.make_mesh(2, 8)
  with pytest.raises(ValueError, match="data must be an int >= 1"):
    mesh_lib.make_mesh(0)
  with pytest.raises(ValueError, match="expert must be an int >= 1"):
    mesh_lib.make_mesh(1, 0)


@pytest.mark.parametrize("shape", MESHES)
def test_init_on_a_mesh_equals_one_device_and_shards_the_experts(mtp_config, one_device, shape):
  mesh = mesh_lib.make_mesh(*shape)
  model = msj.Model.init(mtp_config, seed=3, mesh=mesh)
  assert model.mesh is mesh
  for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(model.state)[0], jax.tree.leaves(one_device.state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    name = jax.tree_util.keystr(path)
    routed = any(p in name for p in ("w_gate_EDF", "w_up_EDF", "w_down_EFD"))
    assert got.sharding.spec == (P("expert") if routed else P()), name
  # Each device: the routed experts' share plus every other array whole (none of them padded).
  held = mesh_lib.bytes_per_device(model.state)
  expected = mesh_lib.expected_bytes_per_device(model.state, mesh)
  assert sorted(held) == [d.id for d in mesh.devices.flat]
  assert set(held.values()) == {expected}
  routed_bytes = sum(
    leaf.nbytes
    for path, leaf in jax.tree_util.tree_flatten_with_path(one_device.state)[0]
    if "_EDF" in jax.tree_util.keystr(path) or "_EFD" in jax.tree_util.keystr(path)
  )
  total = sum(leaf.nbytes for leaf in jax.tree.leaves(one_device.state))
  assert expected == total - routed_bytes + routed_bytes // shape[1]


def test_load_restores_each_shard_onto_the_mesh(one_device, tmp_path):
  path = one_device.save(tmp_path / "model")
  mesh = mesh_lib.make_mesh(2, 4)
  loaded = msj.Model.load(path, mesh=mesh)
  assert loaded.mesh is mesh
  for got, want in zip(jax.tree.leaves(loaded.state), jax.tree.leaves(one_device.state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert set(mesh_lib.bytes_per_device(loaded.state).values()) == {
    mesh_lib.expected_bytes_per_device(loaded.state, mesh)
  }


def test_experts_that_do_not_divide_the_expert_axis_are_refused(mtp_config, one_device):
  six = mtp_config.replace(n_routed_experts=6)
  with pytest.raises(ValueError, match="6 routed experts do not divide over the mesh's 4 expert ranks"):
    msj.Model.init(six, mesh=mesh_lib.make_mesh(2, 4))
  with pytest.raises(ValueError, match="6 routed experts do not divide"):
    msj.Model.init(six).on_mesh(mesh_lib.make_mesh(1, 4))


def test_a_batch_that_does_not_divide_the_data_axis_is_refused(on_mesh):
  with pytest.raises(ValueError, match="a batch of 3 rows does not divide over the mesh's data axis of 2"):
    msj.generate(on_mesh[(2, 4)], [[1, 2], [3, 4], [5, 6]], 4)


@pytest.mark.parametrize("rows", [(2, 24), (4, 48)])
def test_forward_on_each_mesh_matches_one_device(one_device, on_mesh, rows):
  # 48 tokens: the replicated dispatch; 192: the exchanged one (`expert_parallel.exchanges`).
  tokens = np.random.default_rng(0).integers(2, 264, size=rows)
  want = np.asarray(one_device.forward(tokens))
  for shape, model in on_mesh.items():
    assert expert_parallel.exchanges(tokens.size, model.expert_sharding()) == (tokens.size > 128)
    np.testing.assert_allclose(np.asarray(model.forward(tokens)), want, atol=1e-5, rtol=0, err_msg=str(shape))


def test_a_hugging_face_directory_loads_onto_the_mesh(tiny_config, tmp_path):
  # The suite's tiny model exported as Qwen2-MoE (per-expert tensors), against its one-device import.
  model = msj.Model.init(tiny_config, seed=3)
  path = model.save_hf(tmp_path / "qwen2_moe")
  mesh = mesh_lib.make_mesh(2, 4)
  loaded, one = msj.Model.load(path, mesh=mesh), msj.Model.load(path)
  assert loaded.mesh is mesh
  for (key, got), want in zip(jax.tree_util.tree_flatten_with_path(loaded.state)[0], jax.tree.leaves(one.state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    routed = any(p in jax.tree_util.keystr(key) for p in ("w_gate_EDF", "w_up_EDF", "w_down_EFD"))
    assert got.sharding.spec == (P("expert") if routed else P())
  assert set(mesh_lib.bytes_per_device(loaded.state).values()) == {
    mesh_lib.expected_bytes_per_device(loaded.state, mesh)
  }
  np.testing.assert_array_equal(
    msj.generate(loaded, [[5, 6, 7], [8, 9]], 8).tokens, msj.generate(model, [[5, 6, 7], [8, 9]], 8).tokens
  )
