"""Weights laid out for the C++ products (`ffi.packed_matmul`): column blocks, each one
contiguous [D, block] matrix that a pass streams once for all of its rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Columns per block: 4 vectors of 16 floats, so that register panels of up to 4 rows cover a block
# (csrc/gemv.h) and a pass of several rows reads each block once from memory.
PACK_COLUMNS = 64


def pack_columns(w_DV: jax.Array, block: int = PACK_COLUMNS) -> jax.Array:
  """`w_DV` [D, V] as column blocks [ceil(V / block), D, block] (zero-padded), the layout
  `packed_matmul` streams: each block one contiguous [D, block] matrix."""
  if w_DV.ndim != 2 or block < 1:
    raise ValueError(f"pack_columns needs a [D, V] weight and block >= 1, got {w_DV.shape}, {block}")
  d, v = w_DV.shape
  n = -(-v // block)
  w = jnp.pad(w_DV.astype(jnp.float32), ((0, 0), (0, n * block - v)))
  return w.reshape(d, n, block).transpose(1, 0, 2)
