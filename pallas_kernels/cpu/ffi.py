"""The C++ CPU kernels as JAX functions (jax.ffi calls into the library of `build.py`): the
routed expert FFN (csrc/moe_ffn_cpu.cc), the product with column-packed weights of the decoding
output head and dense projections (csrc/dense_cpu.cc), attention of decoding passes against the
KV cache (csrc/attention_cpu.cc; DeepSeek MLA's against its compressed cache:
csrc/mla_attention_cpu.cc; all on csrc/gemv.h) and a monotonic clock that compiled programs read
(csrc/clock_cpu.cc). Every call builds the library first if needed (`build.ensure_built`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu.build import ensure_built

MODES = {"dedup": 0, "per_slot": 1}


def expert_ffn_cpu(
  x_TD: jax.Array,
  expert_ids_TK: jax.Array,
  gates_TK: jax.Array,
  w_gate_EDF: jax.Array,
  w_up_EDF: jax.Array,
  w_down_EFD: jax.Array,
  *,
  method: str = "dedup",
) -> jax.Array:
  """The C++ kernel: method 'dedup' (each unique expert streamed once) or 'per_slot'.

  Computes in f32 (inputs are cast; keep weights f32 on CPU so the cast is free) and returns
  x's dtype. Not differentiable by itself (the entry point attaches the grouped XLA VJP).
  """
  if method not in MODES:
    raise ValueError(f"method must be one of {tuple(MODES)}, got {method!r}")
  ensure_built()
  f32 = jnp.float32
  out = jax.ffi.ffi_call("moespec_moe_ffn_f32", jax.ShapeDtypeStruct(x_TD.shape, f32), vmap_method="sequential")(
    x_TD.astype(f32),
    expert_ids_TK.astype(jnp.int32),
    gates_TK.astype(f32),
    w_gate_EDF.astype(f32),
    w_up_EDF.astype(f32),
    w_down_EFD.astype(f32),
    mode=np.int32(MODES[method]),
  )
  return out.astype(x_TD.dtype)


def packed_matmul(x_MD: jax.Array, w_NDC: jax.Array, n_cols: int | None = None) -> jax.Array:
  """x [M, D] @ W for W packed by `packing.pack_columns` (f32): [M, n_cols] (default all N * C columns;
  pass V to drop the padding). Or G products side by side: x [G, M, D] and W [G, N, D, C]
  (`packing.pack_columns` vmapped over G) give [G, M, n_cols]. The C++ kernel: each block streamed once
  for all M rows, and a row's result does not depend on the other rows."""
  ensure_built()
  grouped = x_MD.ndim == 3
  if (
    not ((x_MD.ndim == 2 and w_NDC.ndim == 3) or (grouped and w_NDC.ndim == 4 and w_NDC.shape[0] == x_MD.shape[0]))
    or x_MD.shape[-1] != w_NDC.shape[-2]
  ):
    raise ValueError(
      f"packed_matmul needs x [M, D] and W [N, D, C], or x [G, M, D] and W [G, N, D, C], "
      f"got {x_MD.shape} and {w_NDC.shape}"
    )
  n, _, c = w_NDC.shape[-3:]
  y = jax.ffi.ffi_call(
    "moespec_dense_f32", jax.ShapeDtypeStruct((*x_MD.shape[:-1], n * c), jnp.float32), vmap_method="sequential"
  )(x_MD.astype(jnp.float32), w_NDC.astype(jnp.float32))
  return y if n_cols is None or n_cols == n * c else y[..., :n_cols]


def cached_attention(q_NQD: jax.Array, keys_NDS: jax.Array, values_NSD: jax.Array, limit_NQ: jax.Array) -> jax.Array:
  """softmax(q . K) . V per (row, KV head) pair n against its cache: q [N, Q, D] (already
  scaled), keys key-major [N, D, S], values [N, S, D], limit [N, Q] (query i sees positions
  0..limit[n, i]). f32 [N, Q, D]. The C++ kernel reads each pair's cache once, up to its last
  visible position. Not differentiable (decoding only)."""
  ensure_built()
  n, q, d = q_NQD.shape
  if keys_NDS.shape[:2] != (n, d) or values_NSD.shape != (n, keys_NDS.shape[2], d) or limit_NQ.shape != (n, q):
    raise ValueError(
      f"cached_attention needs q [N, Q, D], keys [N, D, S], values [N, S, D], limit [N, Q]; "
      f"got {q_NQD.shape}, {keys_NDS.shape}, {values_NSD.shape}, {limit_NQ.shape}"
    )
  f32 = jnp.float32
  return jax.ffi.ffi_call("moespec_attention_f32", jax.ShapeDtypeStruct((n, q, d), f32), vmap_method="sequential")(
    q_NQD.astype(f32), keys_NDS.astype(f32), values_NSD.astype(f32), limit_NQ.astype(jnp.int32)
  )


# Positions a draft tree's window may span in `tree_attention` (the kernel's kWindowWords x 32).
TREE_WINDOW = 128


def tree_attention(
  q_NQD: jax.Array,
  keys_NDS: jax.Array,
  values_NSD: jax.Array,
  limit_NQ: jax.Array,
  base_NQ: jax.Array,
  window_NQM: jax.Array,
) -> jax.Array:
  """`cached_attention` of a draft tree's pass: query i also skips the positions of its window
  [base, base + M) whose `window_NQM` entry is False (not itself, not an ancestor); positions before
  base are seen up to the limit. M <= TREE_WINDOW. Masked positions weigh exactly 0."""
  ensure_built()
  n, q, d = q_NQD.shape
  m = window_NQM.shape[-1]
  if m > TREE_WINDOW or window_NQM.shape != (n, q, m) or base_NQ.shape != (n, q) or limit_NQ.shape != (n, q):
    raise ValueError(
      f"tree_attention needs limit and base [N, Q] and a window [N, Q, M <= {TREE_WINDOW}] for q {q_NQD.shape}; "
      f"got {limit_NQ.shape}, {base_NQ.shape}, {window_NQM.shape}"
    )
  bits = jnp.pad(window_NQM, ((0, 0), (0, 0), (0, TREE_WINDOW - m))).reshape(n, q, TREE_WINDOW // 32, 32)
  words_NQW = jnp.sum(bits.astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
  f32 = jnp.float32
  return jax.ffi.ffi_call("moespec_tree_attention_f32", jax.ShapeDtypeStruct((n, q, d), f32), vmap_method="sequential")(
    q_NQD.astype(f32),
    keys_NDS.astype(f32),
    values_NSD.astype(f32),
    limit_NQ.astype(jnp.int32),
    base_NQ.astype(jnp.int32),
    jax.lax.bitcast_convert_type(words_NQW, jnp.int32),
  )


def mla_attention(
  q_lat_BQC: jax.Array, q_rope_BQR: jax.Array, latent_BSC: jax.Array, rope_BSR: jax.Array, limit_BQ: jax.Array
) -> jax.Array:
  """DeepSeek MLA against its compressed cache, the key up-projection absorbed into the queries:
  softmax(q_lat . latent + q_rope . rope) . latent per cache row b, every query row (tokens x
  heads) against the row's one shared cache. q_lat [B, Q, C] and q_rope [B, Q, R] (already
  scaled), latent [B, S, C], rope [B, S, R], limit [B, Q] (query i sees positions 0..limit[b, i]).
  f32 [B, Q, C]. Each row's cache is read up to its last visible position. Not differentiable."""
  ensure_built()
  b, q, c = q_lat_BQC.shape
  r = q_rope_BQR.shape[-1]
  s = latent_BSC.shape[1] if latent_BSC.ndim == 3 else -1
  if (
    q_rope_BQR.shape != (b, q, r)
    or latent_BSC.shape != (b, s, c)
    or rope_BSR.shape != (b, s, r)
    or limit_BQ.shape != (b, q)
  ):
    raise ValueError(
      f"mla_attention needs q_lat [B, Q, C], q_rope [B, Q, R], latent [B, S, C], rope [B, S, R], "
      f"limit [B, Q]; got {q_lat_BQC.shape}, {q_rope_BQR.shape}, {latent_BSC.shape}, "
      f"{rope_BSR.shape}, {limit_BQ.shape}"
    )
  f32 = jnp.float32
  return jax.ffi.ffi_call("moespec_mla_attention_f32", jax.ShapeDtypeStruct((b, q, c), f32), vmap_method="sequential")(
    q_lat_BQC.astype(f32),
    q_rope_BQR.astype(f32),
    latent_BSC.astype(f32),
    rope_BSR.astype(f32),
    limit_BQ.astype(jnp.int32),
  )


def clock_after(x: jax.typing.ArrayLike) -> tuple[jax.Array, jax.Array]:
  """(x, now): `x` (int32, any shape) passed through, and a CLOCK_MONOTONIC reading taken after
  x was computed and before anything that uses the returned x runs (int32 [2]: seconds,
  nanoseconds). Inside a compiled CPU program, no host round trip; see `elapsed_ms`."""
  ensure_built()
  x = jnp.asarray(x, jnp.int32)
  return jax.ffi.ffi_call(
    "moespec_clock_cpu",
    (jax.ShapeDtypeStruct(x.shape, jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32)),
    has_side_effect=True,
    vmap_method="sequential",
  )(x)


def elapsed_ms(start_2: jax.Array, end_2: jax.Array) -> jax.Array:
  """Milliseconds (f32) between two `clock_after` readings."""
  seconds = (end_2[0] - start_2[0]).astype(jnp.float32)
  return seconds * 1e3 + (end_2[1] - start_2[1]).astype(jnp.float32) * 1e-6
