"""Expert parallelism: the routed expert FFN with its experts spread over a mesh axis.

The experts' weights [E, ...] are sharded on the `expert` axis of a `jax.sharding.Mesh`, rank r
holding experts [r E / R, (r + 1) E / R). Two dispatches, chosen by the rows of a call:

- **replicated** (decode and verification passes, few rows; tpu-inference's GMM-EP path): every
  rank sees all the pass's tokens, runs its local experts on the (token, slot) pairs routed to them
  with the single-device kernels on its slice (other slots: gate 0), and the partial outputs are
  summed with `psum` over the expert axis. A rank that no pair routes to skips its kernel but joins
  the same `psum`.
- **exchanged** (prefills and training, many rows; MaxText's dropless dispatch): each rank holds a
  shard of the tokens, sorts its pairs by destination rank, sends each rank its pairs and gets the
  results back. With `jax.lax.ragged_all_to_all` where the platform compiles it (TPU, GPU); on CPU,
  where XLA cannot, `all_to_all` of groups padded to the most a rank can send (all its pairs),
  selected automatically. Every rank runs the same two exchanges whatever its routing.

Rows are sharded on the mesh's `data` axis where it has one (the pass's rows must divide it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# Calls of at most this many rows (tokens) run the replicated dispatch, larger ones the exchanged.
REPLICATED_MAX_ROWS = 128


@dataclasses.dataclass(frozen=True)
class ExpertSharding:
  """Where the routed experts live: `mesh`, its expert axis, and its data axis (None: none)."""

  mesh: Mesh
  expert_axis: str = "expert"
  data_axis: str | None = "data"

  def __post_init__(self) -> None:
    if self.expert_axis not in self.mesh.axis_names:
      raise ValueError(f"expert_axis {self.expert_axis!r} is not an axis of the mesh {self.mesh.axis_names}")
    if self.data_axis is not None and self.data_axis not in self.mesh.axis_names:
      raise ValueError(f"data_axis {self.data_axis!r} is not an axis of the mesh {self.mesh.axis_names}")

  @property
  def n_ranks(self) -> int:
    """Ranks of the expert axis."""
    return int(self.mesh.shape[self.expert_axis])

  @property
  def n_data(self) -> int:
    """Shards of the data axis (1 without one)."""
    return 1 if self.data_axis is None else int(self.mesh.shape[self.data_axis])

  @property
  def rows_spec(self) -> P:
    """A [rows, ...] array's partition: rows on the data axis."""
    return P(self.data_axis)

  def experts(self) -> NamedSharding:
    """The sharding of an expert-stacked weight [E, ...]: experts on the expert axis."""
    return NamedSharding(self.mesh, P(self.expert_axis))

  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())


def exchanges(n_rows: int, sharding: ExpertSharding) -> bool:
  """Whether a call of `n_rows` rows runs the exchanged dispatch: more than REPLICATED_MAX_ROWS
  rows that divide over the data and expert axes together (else the replicated one)."""
  return n_rows > REPLICATED_MAX_ROWS and n_rows % (sharding.n_data * sharding.n_ranks) == 0


LocalFFN = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def check_experts(n_experts: int, sharding: ExpertSharding) -> None:
  """ValueError where `n_experts` does not divide over the expert axis."""
  if n_experts % sharding.n_ranks:
    raise ValueError(
      f"{n_experts} routed experts do not divide over the {sharding.n_ranks} ranks of the mesh's "
      f"{sharding.expert_axis!r} axis"
    )


def _local_slots(ids_TK: jax.Array, gates_TK: jax.Array, e_local: int, rank: jax.Array):
  """This rank's view of the routing: local expert ids, and gate 0 for the slots of other ranks'
  experts (their ids point at a local expert some slot reads anyway, so that the dedup kernel reads
  no extra expert; at expert 0 where none does). Returns (ids, gates, whether any slot is local)."""
  lo = rank * e_local
  mine_TK = (ids_TK >= lo) & (ids_TK < lo + e_local)
  local_TK = ids_TK - lo
  first = jnp.min(jnp.where(mine_TK, local_TK, e_local))
  first = jnp.where(first == e_local, 0, first)
  return (
    jnp.where(mine_TK, local_TK, first).astype(jnp.int32),
    jnp.where(mine_TK, gates_TK, jnp.zeros_like(gates_TK)),
    jnp.any(mine_TK),
  )


def replicated_dispatch(
  x_TD: jax.Array,
  ids_TK: jax.Array,
  gates_TK: jax.Array,
  w_gate_EDF: jax.Array,
  w_up_EDF: jax.Array,
  w_down_EFD: jax.Array,
  *,
  sharding: ExpertSharding,
  local_ffn: LocalFFN,
) -> jax.Array:
  """The routed FFN with tokens replicated over the expert axis and partial outputs `psum`-ed."""
  check_experts(w_gate_EDF.shape[0], sharding)
  rows, experts = sharding.rows_spec, P(sharding.expert_axis)

  def shard(x: jax.Array, ids: jax.Array, gates: jax.Array, wg: jax.Array, wu: jax.Array, wd: jax.Array):
    ids_l, gates_l, any_local = _local_slots(ids, gates, wg.shape[0], lax.axis_index(sharding.expert_axis))
    y = lax.cond(
      any_local,
      lambda: local_ffn(x, ids_l, gates_l, wg, wu, wd).astype(x.dtype),
      lambda: jnp.zeros_like(x),
    )
    return lax.psum(y, sharding.expert_axis)

  return jax.shard_map(
    shard,
    mesh=sharding.mesh,
    in_specs=(rows, rows, rows, experts, experts, experts),
    out_specs=rows,
    check_vma=False,
  )(x_TD, ids_TK, gates_TK, w_gate_EDF, w_up_EDF, w_down_EFD)


def ragged_all_to_all_compiles(platform: str) -> bool:
  """Whether XLA compiles `jax.lax.ragged_all_to_all` for `platform` (not XLA:CPU)."""
  return platform in ("tpu", "gpu", "cuda", "rocm")


def _send_order(dest_R: jax.Array, n_ranks: int):
  """Pairs sorted by destination rank: (the order, pairs per destination [n_ranks])."""
  order_R = jnp.argsort(dest_R, stable=True)
  counts_N = jnp.sum(jax.nn.one_hot(dest_R, n_ranks, dtype=jnp.int32), axis=0)
  return order_R, counts_N


def exchanged_dispatch(
  x_TD: jax.Array,
  ids_TK: jax.Array,
  gates_TK: jax.Array,
  w_gate_EDF: jax.Array,
  w_up_EDF: jax.Array,
  w_down_EFD: jax.Array,
  *,
  sharding: ExpertSharding,
  local_ffn: LocalFFN,
  ragged: bool,
) -> jax.Array:
  """The routed FFN with tokens sharded over the expert axis (and the data axis): each rank sends
  its (token, slot) pairs to their experts' ranks, which run them and send the outputs back.
  `ragged`: `ragged_all_to_all` (TPU, GPU), else `all_to_all` of groups padded to all of a rank's
  pairs (CPU). Row counts must divide the data and expert axes together."""
  check_experts(w_gate_EDF.shape[0], sharding)
  axes = (sharding.data_axis, sharding.expert_axis) if sharding.data_axis else (sharding.expert_axis,)
  rows, experts = P(axes), P(sharding.expert_axis)
  n_ranks = sharding.n_ranks

  def shard(x: jax.Array, ids: jax.Array, gates: jax.Array, wg: jax.Array, wu: jax.Array, wd: jax.Array):
    t, k = ids.shape
    e_local = wg.shape[0]
    n_pairs = t * k
    ids_R, token_R = ids.reshape(-1), jnp.arange(n_pairs) // k
    dest_R = ids_R // e_local
    order_R, send_N = _send_order(dest_R, n_ranks)
    x_send_RD = x[token_R[order_R]]
    id_send_R = (ids_R[order_R] % e_local).astype(jnp.int32)
    if ragged:
      recv_N = lax.all_to_all(send_N, sharding.expert_axis, 0, 0, tiled=True)
      send_off_N = jnp.cumsum(send_N) - send_N
      # Where this rank's pairs land in each receiver's buffer: after those of lower ranks.
      recv_off_all = lax.all_to_all(
        jnp.cumsum(recv_N) - recv_N, sharding.expert_axis, 0, 0, tiled=True
      )  # offsets at the receivers, by receiver
      cap = n_ranks * n_pairs
      x_in = jnp.zeros((cap, x.shape[1]), x.dtype)
      x_in = lax.ragged_all_to_all(
        x_send_RD, x_in, send_off_N, send_N, recv_off_all, recv_N, axis_name=sharding.expert_axis
      )
      id_in = lax.ragged_all_to_all(
        id_send_R,
        jnp.zeros((cap,), jnp.int32),
        send_off_N,
        send_N,
        recv_off_all,
        recv_N,
        axis_name=sharding.expert_axis,
      )
      valid = jnp.arange(cap) < jnp.sum(recv_N)
      y_in = local_ffn(x_in, id_in[:, None], valid[:, None].astype(x.dtype), wg, wu, wd).astype(x.dtype)
      recv_off_N = jnp.cumsum(recv_N) - recv_N
      back_off = lax.all_to_all(send_off_N, sharding.expert_axis, 0, 0, tiled=True)
      y_back = lax.ragged_all_to_all(
        y_in,
        jnp.zeros((n_pairs, x.shape[1]), x.dtype),
        recv_off_N,
        recv_N,
        back_off,
        send_N,
        axis_name=sharding.expert_axis,
      )
    else:
      # Padded groups: slot j of group r holds this rank's j-th pair for rank r (each group sized
      # for all n_pairs, the most a rank can send to one rank).
      start_N = jnp.cumsum(send_N) - send_N
      dest_sorted_R = dest_R[order_R]
      slot_R = jnp.arange(n_pairs) - start_N[dest_sorted_R]
      x_groups = jnp.zeros((n_ranks, n_pairs, x.shape[1]), x.dtype).at[dest_sorted_R, slot_R].set(x_send_RD)
      id_groups = jnp.zeros((n_ranks, n_pairs), jnp.int32).at[dest_sorted_R, slot_R].set(id_send_R)
      valid_groups = jnp.zeros((n_ranks, n_pairs), x.dtype).at[dest_sorted_R, slot_R].set(1)
      x_in = lax.all_to_all(x_groups, sharding.expert_axis, 0, 0, tiled=True).reshape(-1, x.shape[1])
      id_in = lax.all_to_all(id_groups, sharding.expert_axis, 0, 0, tiled=True).reshape(-1)
      valid_in = lax.all_to_all(valid_groups, sharding.expert_axis, 0, 0, tiled=True).reshape(-1)
      y_in = local_ffn(x_in, id_in[:, None], valid_in[:, None], wg, wu, wd).astype(x.dtype)
      y_groups = lax.all_to_all(y_in.reshape(n_ranks, n_pairs, -1), sharding.expert_axis, 0, 0, tiled=True)
      y_back = y_groups[dest_sorted_R, slot_R]
    # y_back[i]: the output of sorted pair i; weight by its gate and sum into its token.
    gate_sorted_R = gates.reshape(-1)[order_R]
    y = jnp.zeros(x.shape, jnp.float32).at[token_R[order_R]].add(gate_sorted_R[:, None] * y_back.astype(jnp.float32))
    return y.astype(x.dtype)

  return jax.shard_map(
    shard,
    mesh=sharding.mesh,
    in_specs=(rows, rows, rows, experts, experts, experts),
    out_specs=rows,
    check_vma=False,
  )(x_TD, ids_TK, gates_TK, w_gate_EDF, w_up_EDF, w_down_EFD)
