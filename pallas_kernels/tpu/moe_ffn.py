"""Pallas TPU (Mosaic) kernels for the routed SwiGLU expert FFN: deduplicated and per-slot.

Both kernels fuse gate, up, SwiGLU and down for one row block and one hidden tile per grid step
and accumulate the down projection over hidden tiles in a VMEM scratch (the hidden axis is the
innermost, "arbitrary" grid axis). Expert choice enters through scalar-prefetched metadata read
by the BlockSpec index maps, so the pipeline DMAs exactly the weight tiles a step needs:

  dedup:    grid (row blocks, F tiles). Rows are sorted by expert and each expert's group padded to
            whole blocks (metadata.block_groups); block b uses expert block_expert[b]. With block
            rows >= the largest group (default: T rounded up to the sublane tile), every selected
            expert's weights are DMA'd once per pass. Blocks past the used ones repeat the last
            expert's indices (no new DMA) and skip compute.
  per_slot: grid (T*K pairs, F tiles); pair r = t*K + k reads expert ids[r]'s tiles and token t.

Tiling: activation blocks are (rows, D) with rows a multiple of 8 (f32) / 16 (bf16) and D whole;
weight blocks are (D, tf) and (tf, D) with tf a multiple of 128 dividing F, or F itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.typing import DTypeLike

from pallas_kernels import metadata


def _hidden_tile(F: int, requested: int | None = None) -> int:
  if requested is not None:
    if F % requested:
      raise ValueError(f"hidden tile {requested} must divide expert_hidden {F}")
    return requested
  for tf in (512, 256, 128):
    if F % tf == 0:
      return tf
  return F


def _sublanes(dtype: DTypeLike) -> int:
  return 8 if jnp.dtype(dtype).itemsize >= 4 else 16


def _swiglu_tile(x: jax.Array, wg: jax.Array, wu: jax.Array) -> jax.Array:
  g = jnp.dot(x, wg, preferred_element_type=jnp.float32)
  u = jnp.dot(x, wu, preferred_element_type=jnp.float32)
  return jax.nn.silu(g) * u


def _dedup_kernel(
  block_expert_ref: jax.Ref,
  used_ref: jax.Ref,
  x_ref: jax.Ref,
  wg_ref: jax.Ref,
  wu_ref: jax.Ref,
  wd_ref: jax.Ref,
  o_ref: jax.Ref,
  acc_ref: jax.Ref,
) -> None:
  del block_expert_ref
  b, j = pl.program_id(0), pl.program_id(1)

  @pl.when(j == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(b < used_ref[0])
  def _():
    h = _swiglu_tile(x_ref[...], wg_ref[...], wu_ref[...])
    acc_ref[...] += jnp.dot(h.astype(wd_ref.dtype), wd_ref[...], preferred_element_type=jnp.float32)

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def dedup_rows(
  x_TD: jax.Array,
  expert_ids_TK: jax.Array,
  w_gate_EDF: jax.Array,
  w_up_EDF: jax.Array,
  w_down_EFD: jax.Array,
  *,
  block_rows: int | None = None,
  hidden_tile: int | None = None,
  interpret: bool = False,
) -> jax.Array:
  """Per-(token, slot) expert outputs y_RD (R = T*K, row t*K + k), deduplicated kernel."""
  T, D = x_TD.shape
  K = expert_ids_TK.shape[1]
  E, _, F = w_gate_EDF.shape
  sub = _sublanes(w_gate_EDF.dtype)
  bm = block_rows or min(128, -(-T // sub) * sub)
  tf = _hidden_tile(F, hidden_tile)
  meta = metadata.block_groups(expert_ids_TK, E, bm)
  n_blocks = meta.block_expert_N.shape[0]
  x_ext = jnp.concatenate([x_TD, jnp.zeros((1, D), x_TD.dtype)], axis=0)
  tok_M = jnp.where(meta.row_of_slot_M < T * K, meta.row_of_slot_M // K, T)
  xs_MD = x_ext[tok_M].astype(w_gate_EDF.dtype)
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=2,
    grid=(n_blocks, F // tf),
    in_specs=[
      pl.BlockSpec((bm, D), lambda b, j, be, u: (b, 0)),
      pl.BlockSpec((None, D, tf), lambda b, j, be, u: (be[b], 0, j)),
      pl.BlockSpec((None, D, tf), lambda b, j, be, u: (be[b], 0, j)),
      pl.BlockSpec((None, tf, D), lambda b, j, be, u: (be[b], j, 0)),
    ],
    out_specs=pl.BlockSpec((bm, D), lambda b, j, be, u: (b, 0)),
    scratch_shapes=[pltpu.VMEM((bm, D), jnp.float32)],
  )
  out_MD = pl.pallas_call(
    _dedup_kernel,
    grid_spec=grid_spec,
    out_shape=jax.ShapeDtypeStruct((n_blocks * bm, D), jnp.float32),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    interpret=interpret,
  )(meta.block_expert_N, meta.num_used_blocks.reshape(1), xs_MD, w_gate_EDF, w_up_EDF, w_down_EFD)
  return out_MD[meta.slot_of_row_R]


def _per_slot_kernel(
  ids_ref: jax.Ref, x_ref: jax.Ref, wg_ref: jax.Ref, wu_ref: jax.Ref, wd_ref: jax.Ref, o_ref: jax.Ref, acc_ref: jax.Ref
) -> None:
  del ids_ref
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  h = _swiglu_tile(x_ref[...], wg_ref[...], wu_ref[...])
  acc_ref[...] += jnp.dot(h.astype(wd_ref.dtype), wd_ref[...], preferred_element_type=jnp.float32)

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def per_slot_rows(
  x_TD: jax.Array,
  expert_ids_TK: jax.Array,
  w_gate_EDF: jax.Array,
  w_up_EDF: jax.Array,
  w_down_EFD: jax.Array,
  *,
  hidden_tile: int | None = None,
  interpret: bool = False,
) -> jax.Array:
  """Per-(token, slot) expert outputs y_RD, one weight read per pair."""
  T, D = x_TD.shape
  K = expert_ids_TK.shape[1]
  F = w_gate_EDF.shape[2]
  tf = _hidden_tile(F, hidden_tile)
  ids_R = expert_ids_TK.reshape(-1).astype(jnp.int32)
  x_T1D = x_TD.astype(w_gate_EDF.dtype).reshape(T, 1, D)
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=1,
    grid=(T * K, F // tf),
    in_specs=[
      pl.BlockSpec((None, 1, D), lambda r, j, ids: (lax.div(r, K), 0, 0)),  # no floor-div: needs sign
      pl.BlockSpec((None, D, tf), lambda r, j, ids: (ids[r], 0, j)),
      pl.BlockSpec((None, D, tf), lambda r, j, ids: (ids[r], 0, j)),
      pl.BlockSpec((None, tf, D), lambda r, j, ids: (ids[r], j, 0)),
    ],
    out_specs=pl.BlockSpec((None, 1, D), lambda r, j, ids: (r, 0, 0)),
    scratch_shapes=[pltpu.VMEM((1, D), jnp.float32)],
  )
  out_R1D = pl.pallas_call(
    _per_slot_kernel,
    grid_spec=grid_spec,
    out_shape=jax.ShapeDtypeStruct((T * K, 1, D), jnp.float32),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    interpret=interpret,
  )(ids_R, x_T1D, w_gate_EDF, w_up_EDF, w_down_EFD)
  return out_R1D.reshape(T * K, D)


@functools.partial(jax.jit, static_argnames=("method", "interpret", "block_rows", "hidden_tile"))
def expert_ffn_tpu(
  x_TD: jax.Array,
  expert_ids_TK: jax.Array,
  gates_TK: jax.Array,
  w_gate_EDF: jax.Array,
  w_up_EDF: jax.Array,
  w_down_EFD: jax.Array,
  *,
  method: str = "dedup",
  interpret: bool = False,
  block_rows: int | None = None,
  hidden_tile: int | None = None,
) -> jax.Array:
  """Routed SwiGLU expert FFN with the Pallas TPU kernel of `method` ('dedup' or 'per_slot')."""
  return metadata.routed_ffn(
    dedup_rows,
    per_slot_rows,
    x_TD,
    expert_ids_TK,
    gates_TK,
    w_gate_EDF,
    w_up_EDF,
    w_down_EFD,
    method=method,
    interpret=interpret,
    block_rows=block_rows,
    hidden_tile=hidden_tile,
  )
