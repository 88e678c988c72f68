"""Pallas GPU kernels (Triton lowering) for the routed SwiGLU expert FFN: deduplicated and per-slot.

Why Triton and not Mosaic GPU: these are decode-time kernels with 1-16 tokens per pass, i.e.
a few rows per expert. Mosaic GPU targets Hopper/Blackwell warpgroup MMA with 64-row tiles and
TMA pipelines; it would pad a 1-row GEMV to 64 rows and does not run on pre-Hopper GPUs. The
Triton lowering runs on any CUDA GPU JAX supports, allows 16-row `dot` tiles for the grouped
(dedup) kernel and plain broadcast-multiply-reduce GEMVs for the per-slot kernel, and lets a
program index the whole weight array with a data-dependent expert id (no scalar prefetch needed).

Each method is two kernels (no cross-program reduction is needed, so no atomics):
  1. h = silu(x @ Wg[e]) * (x @ Wu[e]), grid (row blocks, F tiles), looping over D;
  2. y = h @ Wd[e],                     grid (row blocks, D tiles), looping over F.
Every weight tile is loaded by exactly one program per row block, so dedup (rows grouped by
expert, block rows >= the largest group by default) reads each selected expert once per pass and
per_slot (one row per program) reads it once per (token, slot) pair.
Triton blocks must have power-of-two sizes: D and the F tile must be powers of two (F itself
need not be: it is a multiple of the tile, e.g. 1408 = 11 * 128).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import metadata

_WHOLE = pl.no_block_spec  # the kernel indexes the whole array itself (data-dependent expert)


def _pow2_tile(n: int, cap: int) -> int:
  t = 1
  while t * 2 <= cap and n % (t * 2) == 0:
    t *= 2
  return t


def _check_shapes(D: int, F: int, tf: int, td: int) -> None:
  if D & (D - 1):
    raise ValueError(f"the Pallas GPU kernels need a power-of-two d_model, got {D}")
  if F % tf or tf & (tf - 1):
    raise ValueError(f"hidden tile {tf} must be a power of two dividing expert_hidden {F}")
  del td


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
  prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return jnp.dot(a, b, precision=prec, preferred_element_type=jnp.float32)


# ---- deduplicated (grouped rows, tl.dot tiles) ----


def _dedup_up_kernel(
  be_ref: jax.Ref, used_ref: jax.Ref, x_ref: jax.Ref, wg_ref: jax.Ref, wu_ref: jax.Ref, h_ref: jax.Ref, *, bd: int
) -> None:
  b = pl.program_id(0)
  f0 = pl.program_id(1) * h_ref.shape[1]
  bm, tf = h_ref.shape
  D = x_ref.shape[1]

  @pl.when(b < used_ref[0])
  def _():
    e = be_ref[b]

    def body(i: jax.Array, carry: tuple[jax.Array, jax.Array]):
      g, u = carry
      xs = x_ref[:, pl.ds(i * bd, bd)]
      g = g + _dot(xs, wg_ref[e, pl.ds(i * bd, bd), pl.ds(f0, tf)])
      u = u + _dot(xs, wu_ref[e, pl.ds(i * bd, bd), pl.ds(f0, tf)])
      return g, u

    z = jnp.zeros((bm, tf), jnp.float32)
    g, u = lax.fori_loop(0, D // bd, body, (z, z))
    h_ref[...] = (jax.nn.silu(g) * u).astype(h_ref.dtype)


def _dedup_down_kernel(
  be_ref: jax.Ref, used_ref: jax.Ref, h_ref: jax.Ref, wd_ref: jax.Ref, o_ref: jax.Ref, *, tf: int
) -> None:
  b = pl.program_id(0)
  d0 = pl.program_id(1) * o_ref.shape[1]
  bm, td = o_ref.shape
  F = h_ref.shape[1]

  @pl.when(b < used_ref[0])
  def _():
    e = be_ref[b]

    def body(i: jax.Array, acc: jax.Array):
      return acc + _dot(h_ref[:, pl.ds(i * tf, tf)], wd_ref[e, pl.ds(i * tf, tf), pl.ds(d0, td)])

    o_ref[...] = lax.fori_loop(0, F // tf, body, jnp.zeros((bm, td), jnp.float32)).astype(o_ref.dtype)


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
  num_warps: int = 4,
) -> jax.Array:
  """Per-(token, slot) expert outputs y_RD, rows grouped by expert (each expert read once)."""
  T, D = x_TD.shape
  K = expert_ids_TK.shape[1]
  E, _, F = w_gate_EDF.shape
  bm = block_rows or max(16, 1 << (T - 1).bit_length())  # >= largest group, >= 16 for tl.dot
  tf = hidden_tile or _pow2_tile(F, 64)
  td = min(D, 64)
  bd = min(D, 64)
  _check_shapes(D, F, tf, td)
  meta = metadata.block_groups(expert_ids_TK, E, bm)
  n_blocks = meta.block_expert_N.shape[0]
  x_ext = jnp.concatenate([x_TD, jnp.zeros((1, D), x_TD.dtype)], axis=0)
  tok_M = jnp.where(meta.row_of_slot_M < T * K, meta.row_of_slot_M // K, T)
  xs_MD = x_ext[tok_M].astype(w_gate_EDF.dtype)
  used = meta.num_used_blocks.reshape(1)
  params = plgpu.CompilerParams(num_warps=num_warps, num_stages=2)
  h_MF = pl.pallas_call(
    functools.partial(_dedup_up_kernel, bd=bd),
    grid=(n_blocks, F // tf),
    in_specs=[_WHOLE, _WHOLE, pl.BlockSpec((bm, D), lambda b, j: (b, 0)), _WHOLE, _WHOLE],
    out_specs=pl.BlockSpec((bm, tf), lambda b, j: (b, j)),
    out_shape=jax.ShapeDtypeStruct((n_blocks * bm, F), w_gate_EDF.dtype),
    compiler_params=params,
    interpret=interpret,
  )(meta.block_expert_N, used, xs_MD, w_gate_EDF, w_up_EDF)
  out_MD = pl.pallas_call(
    functools.partial(_dedup_down_kernel, tf=tf),
    grid=(n_blocks, D // td),
    in_specs=[_WHOLE, _WHOLE, pl.BlockSpec((bm, F), lambda b, j: (b, 0)), _WHOLE],
    out_specs=pl.BlockSpec((bm, td), lambda b, j: (b, j)),
    out_shape=jax.ShapeDtypeStruct((n_blocks * bm, D), jnp.float32),
    compiler_params=params,
    interpret=interpret,
  )(meta.block_expert_N, used, h_MF, w_down_EFD)
  return out_MD[meta.slot_of_row_R]


# ---- per-slot (one row per program, broadcast-multiply-reduce GEMV) ----


def _per_slot_up_kernel(
  ids_ref: jax.Ref, x_ref: jax.Ref, wg_ref: jax.Ref, wu_ref: jax.Ref, h_ref: jax.Ref, *, bd: int
) -> None:
  r = pl.program_id(0)
  tf = h_ref.shape[0]
  f0 = pl.program_id(1) * tf
  D = x_ref.shape[0]
  e = ids_ref[r]

  def body(i: jax.Array, carry: tuple[jax.Array, jax.Array]):
    g, u = carry
    xs = x_ref[pl.ds(i * bd, bd)].astype(jnp.float32)[:, None]
    g = g + jnp.sum(xs * wg_ref[e, pl.ds(i * bd, bd), pl.ds(f0, tf)].astype(jnp.float32), axis=0)
    u = u + jnp.sum(xs * wu_ref[e, pl.ds(i * bd, bd), pl.ds(f0, tf)].astype(jnp.float32), axis=0)
    return g, u

  z = jnp.zeros((tf,), jnp.float32)
  g, u = lax.fori_loop(0, D // bd, body, (z, z))
  h_ref[...] = (jax.nn.silu(g) * u).astype(h_ref.dtype)


def _per_slot_down_kernel(ids_ref: jax.Ref, h_ref: jax.Ref, wd_ref: jax.Ref, o_ref: jax.Ref, *, tf: int) -> None:
  r = pl.program_id(0)
  td = o_ref.shape[0]
  d0 = pl.program_id(1) * td
  F = h_ref.shape[0]
  e = ids_ref[r]

  def body(i: jax.Array, acc: jax.Array):
    hs = h_ref[pl.ds(i * tf, tf)].astype(jnp.float32)[:, None]
    return acc + jnp.sum(hs * wd_ref[e, pl.ds(i * tf, tf), pl.ds(d0, td)].astype(jnp.float32), axis=0)

  o_ref[...] = lax.fori_loop(0, F // tf, body, jnp.zeros((td,), jnp.float32)).astype(o_ref.dtype)


def per_slot_rows(
  x_TD: jax.Array,
  expert_ids_TK: jax.Array,
  w_gate_EDF: jax.Array,
  w_up_EDF: jax.Array,
  w_down_EFD: jax.Array,
  *,
  hidden_tile: int | None = None,
  interpret: bool = False,
  num_warps: int = 4,
) -> jax.Array:
  """Per-(token, slot) expert outputs y_RD, one weight read per pair."""
  T, D = x_TD.shape
  K = expert_ids_TK.shape[1]
  F = w_gate_EDF.shape[2]
  tf = hidden_tile or _pow2_tile(F, 128)
  td = min(D, 128)
  bd = min(D, 32)
  _check_shapes(D, F, tf, td)
  ids_R = expert_ids_TK.reshape(-1).astype(jnp.int32)
  x_RD = jnp.repeat(x_TD, K, axis=0).astype(w_gate_EDF.dtype)  # row r = t*K + k holds x_t
  params = plgpu.CompilerParams(num_warps=num_warps, num_stages=2)
  h_RF = pl.pallas_call(
    functools.partial(_per_slot_up_kernel, bd=bd),
    grid=(T * K, F // tf),
    in_specs=[_WHOLE, pl.BlockSpec((None, D), lambda r, j: (r, 0)), _WHOLE, _WHOLE],
    out_specs=pl.BlockSpec((None, tf), lambda r, j: (r, j)),
    out_shape=jax.ShapeDtypeStruct((T * K, F), w_gate_EDF.dtype),
    compiler_params=params,
    interpret=interpret,
  )(ids_R, x_RD, w_gate_EDF, w_up_EDF)
  return pl.pallas_call(
    functools.partial(_per_slot_down_kernel, tf=tf),
    grid=(T * K, D // td),
    in_specs=[_WHOLE, pl.BlockSpec((None, F), lambda r, j: (r, 0)), _WHOLE],
    out_specs=pl.BlockSpec((None, td), lambda r, j: (r, j)),
    out_shape=jax.ShapeDtypeStruct((T * K, D), jnp.float32),
    compiler_params=params,
    interpret=interpret,
  )(ids_R, h_RF, w_down_EFD)


@functools.partial(jax.jit, static_argnames=("method", "interpret", "block_rows", "hidden_tile"))
def expert_ffn_gpu(
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
  """Routed SwiGLU expert FFN with the Pallas GPU kernel of `method` ('dedup' or 'per_slot')."""
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
