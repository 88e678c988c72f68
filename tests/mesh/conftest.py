"""The models of the mesh tests: the suite's tiny config with one MTP module, on one device and on
each mesh (built once per run, so that the mesh programs compile once)."""

import pytest

import moespec_jax as msj
from moespec_jax.parallel import mesh as mesh_lib

# (data, expert) axes over the 8 devices: all experts spread, a two-by-four mesh, all rows spread.
MESHES = [(1, 8), (2, 4), (8, 1)]


@pytest.fixture(scope="session")
def mtp_config(tiny_config):
  return tiny_config.replace(num_mtp_modules=1)


@pytest.fixture(scope="session")
def one_device(mtp_config):
  return msj.Model.init(mtp_config, seed=3)


@pytest.fixture(scope="session")
def on_mesh(one_device):
  """{(data, expert): the one-device model placed on that mesh}."""
  return {shape: one_device.on_mesh(mesh_lib.make_mesh(*shape)) for shape in MESHES}
