"""Sort-based grouped expert FFN in pure XLA: the differentiable path for large T (training).

The (token, slot) rows are sorted by expert and every expert's group is padded to a multiple
of `block_rows`, so each row block belongs to exactly one expert. One weight block is gathered
per row block and the products are batched einsums over blocks. Shapes are static: the padded
row count is bounded by T*K + E*(block_rows - 1) (rounded up to a whole block), so nothing is
dropped. Gradients come from JAX autodiff (gathers transpose to scatter-adds).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import metadata


@functools.partial(jax.jit, static_argnames=("block_rows",))
def expert_ffn_grouped(
  x_TD: jax.Array,
  expert_ids_TK: jax.Array,
  gates_TK: jax.Array,
  w_gate_EDF: jax.Array,
  w_up_EDF: jax.Array,
  w_down_EFD: jax.Array,
  *,
  block_rows: int = 128,
) -> jax.Array:
  """y_t = sum_k g_tk * FFN_{e_tk}(x_t) via expert-sorted, block-padded batched matmuls."""
  n_tokens, top_k = expert_ids_TK.shape
  n_experts = w_gate_EDF.shape[0]
  meta = metadata.block_groups(expert_ids_TK, n_experts, block_rows)
  n_blocks = meta.block_expert_N.shape[0]
  x = x_TD.astype(jnp.float32)
  # Padded slot -> source token (n_tokens = a zero row for padding).
  x_ext = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)], axis=0)
  tok_M = jnp.where(meta.row_of_slot_M < n_tokens * top_k, meta.row_of_slot_M // top_k, n_tokens)
  x_NBD = x_ext[tok_M].reshape(n_blocks, block_rows, -1)
  wg_NDF = w_gate_EDF[meta.block_expert_N].astype(jnp.float32)
  wu_NDF = w_up_EDF[meta.block_expert_N].astype(jnp.float32)
  wd_NFD = w_down_EFD[meta.block_expert_N].astype(jnp.float32)
  h_NBF = jax.nn.silu(jnp.einsum("nbd,ndf->nbf", x_NBD, wg_NDF)) * jnp.einsum("nbd,ndf->nbf", x_NBD, wu_NDF)
  y_NBD = jnp.einsum("nbf,nfd->nbd", h_NBF, wd_NFD)
  # Row (t, k) sits at padded slot slot_of_row_R[t*K + k].
  y_RD = y_NBD.reshape(n_blocks * block_rows, -1)[meta.slot_of_row_R]
  y_TKD = y_RD.reshape(n_tokens, top_k, -1)
  return jnp.einsum("tk,tkd->td", gates_TK.astype(jnp.float32), y_TKD).astype(x_TD.dtype)
