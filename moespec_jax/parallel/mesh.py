"""A model's device mesh: a `data` axis (rows of a batch) and an `expert` axis (routed experts).

The routed experts' weights (`model.moe.ROUTED_EXPERT_PARAMS`, of the target's MoE layers and its
MTP modules') are sharded on `expert`, each rank holding E / R whole experts; every other parameter
is replicated. Decoding's rows must divide the `data` axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moespec_jax.config import ModelConfig
from moespec_jax.model.moe import ROUTED_EXPERT_PARAMS
from pallas_kernels.expert_parallel import ExpertSharding

AXES = ("data", "expert")


def make_mesh(data: int = 1, expert: int | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, expert) mesh over `devices` (default: all of this process's and the others',
  `jax.devices()`); `expert` defaults to the devices left after `data`. ValueError where the axes
  ask for more devices than there are, or for none."""
  devices = list(jax.devices() if devices is None else devices)
  if isinstance(data, bool) or not isinstance(data, int) or data < 1:
    raise ValueError(f"data must be an int >= 1, got {data!r}")
  if expert is None:
    expert = len(devices) // data
  if isinstance(expert, bool) or not isinstance(expert, int) or expert < 1:
    raise ValueError(
      f"expert must be an int >= 1 (at most the {len(devices)} devices over data={data}), got {expert!r}"
    )
  if data * expert > len(devices):
    raise ValueError(f"a mesh of data={data} x expert={expert} needs {data * expert} devices, {len(devices)} are here")
  return Mesh(np.array(devices[: data * expert]).reshape(data, expert), AXES)


def initialize(coordinator_address: str, num_processes: int, process_id: int, timeout_s: int = 300) -> None:
  """Joins this process to a multi-host run (`jax.distributed.initialize`), before any other JAX
  call; `make_mesh` then spans every process's devices. CPU processes exchange through gloo (XLA's
  CPU collectives). Every process runs the same calls with the same inputs (JAX's multi-controller
  model) and reads the same outputs."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices' only; harmless elsewhere
  jax.distributed.initialize(
    coordinator_address=coordinator_address,
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=timeout_s,
  )


def expert_sharding(mesh: Mesh) -> ExpertSharding:
  """The dispatch's view of a model mesh (`make_mesh`)."""
  if tuple(mesh.axis_names) != AXES:
    raise ValueError(f"a model mesh has the axes {AXES} (make_mesh), got {tuple(mesh.axis_names)}")
  return ExpertSharding(mesh, expert_axis="expert", data_axis="data")


def check_model(config: ModelConfig, mesh: Mesh) -> None:
  """ValueError where the config's routed experts do not divide over the mesh's expert axis."""
  ranks = int(mesh.shape["expert"])
  if config.n_moe_layers and config.n_routed_experts % ranks:
    raise ValueError(
      f"the model's {config.n_routed_experts} routed experts do not divide over the mesh's {ranks} expert ranks"
    )


def check_rows(n_rows: int, mesh: Mesh) -> None:
  """ValueError where a batch of `n_rows` does not divide over the mesh's data axis."""
  if n_rows % int(mesh.shape["data"]):
    raise ValueError(f"a batch of {n_rows} rows does not divide over the mesh's data axis of {mesh.shape['data']}")


def combine_bytes(config: ModelConfig, mesh: Mesh, tokens: float) -> float:
  """Bytes each expert rank sends to sum the MoE layers' outputs of a pass of `tokens` tokens over
  the expert axis (a ring all-reduce: 2 (R - 1) / R of each layer's [tokens, d_model] output)."""
  ranks = int(mesh.shape["expert"])
  layer = tokens * config.d_model * np.dtype(config.dtype).itemsize
  return float(config.n_moe_layers * 2.0 * (ranks - 1) / ranks * layer)


def _is_routed_expert(path: tuple) -> bool:
  """Whether a parameter's path (pytree keys, or a pure dict's plain keys) names a routed expert."""
  names = [getattr(k, "key", getattr(k, "name", k)) for k in path]
  return any(name in ROUTED_EXPERT_PARAMS for name in names)


def param_sharding(path: tuple, mesh: Mesh) -> NamedSharding:
  """Where the parameter at `path` (its keys in the model's pure dict) lives on the mesh."""
  return NamedSharding(mesh, P("expert") if _is_routed_expert(path) else P())


def state_shardings(state: Any, mesh: Mesh) -> Any:
  """A NamedSharding for every array of a model state (or an abstract one): routed experts on the
  expert axis, the rest replicated."""
  experts, replicated = NamedSharding(mesh, P("expert")), NamedSharding(mesh, P())
  return jax.tree_util.tree_map_with_path(lambda path, _: experts if _is_routed_expert(path) else replicated, state)


def abstract_on_mesh(state: Any, mesh: Mesh) -> Any:
  """An abstract state's arrays as ShapeDtypeStructs placed on the mesh (a restore target)."""
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, state_shardings(state, mesh)
  )


def place(state: Any, mesh: Mesh) -> Any:
  """A model state's arrays placed on the mesh."""
  return jax.device_put(state, state_shardings(state, mesh))


def bytes_per_device(state: Any) -> dict[int, int]:
  """The bytes of a state's arrays each device holds, by device id."""
  held: dict[int, int] = {}
  for leaf in jax.tree.leaves(state):
    for shard in leaf.addressable_shards:
      held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
  return held


def expected_bytes_per_device(state: Any, mesh: Mesh) -> int:
  """What `bytes_per_device` should find on each device: the routed experts' bytes over the
  expert axis plus every other array whole."""
  ranks = int(mesh.shape["expert"])
  total = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    nbytes = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
    total += nbytes // ranks if _is_routed_expert(path) else nbytes
  return total
