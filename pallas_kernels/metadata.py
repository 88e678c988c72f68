"""Routing metadata: (token, slot) rows sorted and grouped by expert, with static shapes.

Shared by the XLA grouped path, the Pallas kernels and the byte accounting. Row r = t*K + k is
the (token t, slot k) pair; rows are stably sorted by expert.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike


class SortedRows(NamedTuple):
  """Rows sorted by expert. order_R[i] = row at sorted position i; counts_E = rows per expert."""

  order_R: jax.Array  # int32 [R]
  sorted_expert_R: jax.Array  # int32 [R]
  counts_E: jax.Array  # int32 [E]
  starts_E: jax.Array  # int32 [E], exclusive cumsum of counts_E


def sort_rows(expert_ids_TK: jax.Array, n_experts: int) -> SortedRows:
  """Stable sort of the flattened (token, slot) rows by expert id."""
  ids_R = expert_ids_TK.reshape(-1).astype(jnp.int32)
  order_R = jnp.argsort(ids_R, stable=True).astype(jnp.int32)
  counts_E = jnp.zeros((n_experts,), jnp.int32).at[ids_R].add(1)
  starts_E = jnp.cumsum(counts_E) - counts_E
  return SortedRows(order_R, ids_R[order_R], counts_E, starts_E)


def num_padded_blocks(n_rows: int, n_experts: int, block_rows: int) -> int:
  """Static bound on row blocks when each expert group is padded to a multiple of block_rows."""
  max_rows = n_rows + min(n_experts, n_rows) * (block_rows - 1)
  return -(-max_rows // block_rows)


class BlockGroups(NamedTuple):
  """Expert groups padded to whole blocks of `block_rows` rows.

  slot_of_row_R[r]: padded slot of row r. row_of_slot_M[m]: row at padded slot m, or R if the
  slot is padding. block_expert_N[b]: expert of block b (unused blocks repeat the last used
  block's expert, so a kernel sweeping blocks in order fetches no new weights for them).
  num_used_blocks: blocks that hold at least one real row.
  """

  slot_of_row_R: jax.Array
  row_of_slot_M: jax.Array
  block_expert_N: jax.Array
  num_used_blocks: jax.Array


def block_groups(expert_ids_TK: jax.Array, n_experts: int, block_rows: int) -> BlockGroups:
  """Pads each expert's sorted group of rows to a multiple of block_rows (static shapes)."""
  n_rows = expert_ids_TK.size
  s = sort_rows(expert_ids_TK, n_experts)
  n_blocks = num_padded_blocks(n_rows, n_experts, block_rows)
  blocks_E = (s.counts_E + block_rows - 1) // block_rows
  block_end_E = jnp.cumsum(blocks_E)
  block_start_E = block_end_E - blocks_E
  # Padded slot of sorted position i: its expert's first padded slot + rank within the group.
  pos_R = jnp.arange(n_rows, dtype=jnp.int32)
  e = s.sorted_expert_R
  slot_sorted_R = block_start_E[e] * block_rows + (pos_R - s.starts_E[e])
  slot_of_row_R = jnp.zeros((n_rows,), jnp.int32).at[s.order_R].set(slot_sorted_R)
  row_of_slot_M = jnp.full((n_blocks * block_rows,), n_rows, jnp.int32).at[slot_sorted_R].set(s.order_R)
  used = block_end_E[-1]
  b_N = jnp.minimum(jnp.arange(n_blocks, dtype=jnp.int32), jnp.maximum(used - 1, 0))
  block_expert_N = jnp.searchsorted(block_end_E, b_N, side="right").astype(jnp.int32)
  block_expert_N = jnp.minimum(block_expert_N, n_experts - 1)
  return BlockGroups(slot_of_row_R, row_of_slot_M, block_expert_N, used.astype(jnp.int32))


def combine(y_RD: jax.Array, gates_TK: jax.Array, out_dtype: DTypeLike) -> jax.Array:
  """y_t = sum_k g_tk * y_(t*K+k): the gated sum of per-(token, slot) expert outputs."""
  T, K = gates_TK.shape
  y_TKD = y_RD.reshape(T, K, -1)
  return jnp.einsum("tk,tkd->td", gates_TK.astype(jnp.float32), y_TKD.astype(jnp.float32)).astype(out_dtype)


def routed_ffn(
  dedup_rows: Callable[..., jax.Array],
  per_slot_rows: Callable[..., jax.Array],
  x_TD: jax.Array,
  expert_ids_TK: jax.Array,
  gates_TK: jax.Array,
  w_gate_EDF: jax.Array,
  w_up_EDF: jax.Array,
  w_down_EFD: jax.Array,
  *,
  method: str,
  interpret: bool,
  block_rows: int | None,
  hidden_tile: int | None,
) -> jax.Array:
  """A backend's routed SwiGLU expert FFN from its two row kernels: each (token, slot) row's
  expert output by `method` ('dedup': `dedup_rows`, 'per_slot': `per_slot_rows`), then `combine`."""
  if method == "dedup":
    y_RD = dedup_rows(
      x_TD,
      expert_ids_TK,
      w_gate_EDF,
      w_up_EDF,
      w_down_EFD,
      block_rows=block_rows,
      hidden_tile=hidden_tile,
      interpret=interpret,
    )
  elif method == "per_slot":
    y_RD = per_slot_rows(
      x_TD, expert_ids_TK, w_gate_EDF, w_up_EDF, w_down_EFD, hidden_tile=hidden_tile, interpret=interpret
    )
  else:
    raise ValueError(f"method must be 'dedup' or 'per_slot', got {method!r}")
  return combine(y_RD, gates_TK, x_TD.dtype)
