"""Small building blocks: RMSNorm, rotary embeddings, SwiGLU, initialisers, and the packed dense
products of decoding programs on CPU."""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import cpu

# Decoding programs on CPU read the dense projections (attention, dense and shared SwiGLUs,
# routers) as column blocks packed once per model (`pallas_kernels.cpu.pack_columns`), with a
# C++ product that streams each block once for all the rows of a pass. XLA's dot re-packs a weight
# on every call of a multi-row product: 2-9 rows against [256, 768] weights ran 1.5-2.5x slower
# than the packed product here, 1 row about as fast. Passes of more rows than this (prefills) keep
# XLA's dot.
PACKED_MAX_ROWS = 128


def use_packed(packed_NDC, x_BTD) -> bool:
  """Whether a product of `x_BTD` reads the packed weight `packed_NDC` (None: not packed)."""
  return packed_NDC is not None and x_BTD.shape[0] * x_BTD.shape[1] <= PACKED_MAX_ROWS


def packed_product(x_BTD, packed_NDC, n_cols: int):
  """x [B, T, D] @ W for W packed by `cpu.pack_columns`: float32 [B, T, n_cols]."""
  b, t, d = x_BTD.shape
  return cpu.packed_matmul(x_BTD.reshape(b * t, d), packed_NDC, n_cols).reshape(b, t, n_cols)


def at_index(x_BT, at_B):
  """Row b's entry at index at_B[b], keeping a length-1 axis: [B, T, ...] -> [B, 1, ...] (a pass's
  outputs or inputs where one index per row alone is read); with at_B [B, W], the W entries of
  row b at indices at_B[b]: [B, W, ...]."""
  rows_B = jnp.arange(x_BT.shape[0])
  if at_B.ndim == 2:
    return x_BT[rows_B[:, None], at_B]
  return x_BT[rows_B, at_B][:, None]


def fan_in_init(fan_in: int, scale: float = 1.0):
  """Normal init with std = scale / sqrt(fan_in)."""
  return jax.nn.initializers.normal(stddev=scale / math.sqrt(fan_in))


def halving_sum(x):
  """Sum over the last axis, keepdims, by halving: the two halves added elementwise until one
  column is left (zero-padded to a power of two). Every row's bits depend on its own entries
  alone; XLA:CPU's reduction of a [40, 256] array gave 8 of its rows other last bits than the
  same rows reduced alone."""
  n = x.shape[-1]
  width = 1 << max(0, (n - 1).bit_length())
  if width != n:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    x = x[..., :half] + x[..., half:]
  return x


class RMSNorm(nnx.Module):
  """y = x / rms(x) * weight, computed in float32. With `row_invariant` (decoding programs on
  CPU: `Transformer.use_row_invariant_norms`) the mean square is a `halving_sum`, so a row's
  result does not depend on the other rows of the pass (slower to differentiate: training keeps
  XLA's reduction)."""

  def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
    self.weight = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps
    self.row_invariant = False

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    squares = x32 * x32
    if self.row_invariant:
      mean_square = halving_sum(squares) / x32.shape[-1]
    else:
      mean_square = jnp.mean(squares, axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(mean_square + self.eps)
    return (y * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def rope_tables(positions_BT, head_dim: int, theta: float, *, inv_freq_F=None, scale: float = 1.0):
  """cos/sin tables [B, T, head_dim / 2] for integer positions (`inv_freq_F`: the rotary
  frequencies, default theta^(-2i / head_dim); `scale` multiplies both, as YaRN's attention
  factor). Computed once per pass for every layer (`_materialized`)."""
  if inv_freq_F is None:
    inv_freq_F = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles_BTF = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_F, jnp.float32)
  f = angles_BTF.shape[-1]
  cos_sin_BTG = _materialized(jnp.concatenate([jnp.cos(angles_BTF), jnp.sin(angles_BTF)], axis=-1) * scale)
  return cos_sin_BTG[..., :f], cos_sin_BTG[..., f:]


def _materialized(x_BTG):
  """x, computed once where XLA:CPU would recompute it inside every consumer.

  XLA:CPU fused the rotary tables' cos and sin into each layer's rotation of queries and keys and
  evaluated them once per head there (their optimization barrier is dropped before fusion); a
  product with the identity (exact: x * 1 plus zeros) is not fused into its consumers. A
  Qwen3-MoE-layout checkpoint's batch-8 prefill of 192 tokens ran 1.087x faster, a whole 64-token
  call 1.071x (interleaved rounds, same tokens). Other backends compute x as it is."""
  if jax.default_backend() != "cpu":
    return x_BTG
  eye_GG = jnp.eye(x_BTG.shape[-1], dtype=x_BTG.dtype)
  return jnp.einsum("btg,gh->bth", x_BTG, eye_GG, precision=jax.lax.Precision.HIGHEST)


def apply_rope(x_BTHD, cos_BTF, sin_BTF):
  """Rotary embedding in the half-split layout (Llama / Mixtral / Qwen / DeepSeek convention)."""
  half = x_BTHD.shape[-1] // 2
  x32 = x_BTHD.astype(jnp.float32)
  x1, x2 = x32[..., :half], x32[..., half:]
  cos, sin = cos_BTF[:, :, None, :], sin_BTF[:, :, None, :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTHD.dtype)


class SwiGLU(nnx.Module):
  """Dense SwiGLU FFN: (silu(x Wg) * (x Wu)) Wd. Used for dense layers and shared experts."""

  def __init__(self, d_model: int, hidden: int, *, out_scale: float, rngs: nnx.Rngs, dtype=jnp.float32):
    self.w_gate_DF = nnx.Param(fan_in_init(d_model)(rngs.params(), (d_model, hidden), dtype))
    self.w_up_DF = nnx.Param(fan_in_init(d_model)(rngs.params(), (d_model, hidden), dtype))
    self.w_down_FD = nnx.Param(fan_in_init(hidden, out_scale)(rngs.params(), (hidden, d_model), dtype))
    # [Wg | Wu] and Wd packed for decoding programs on CPU (`set_packed`; not parameters).
    self.packed_gate_up_NDC = self.packed_down_NDC = None

  def pack(self) -> dict:
    """This FFN's weights as `cpu.pack_columns` blocks, for `set_packed`."""
    gate_up_DG = jnp.concatenate([self.w_gate_DF[...], self.w_up_DF[...]], axis=1)
    return {"gate_up": cpu.pack_columns(gate_up_DG),
            "down": cpu.pack_columns(self.w_down_FD[...])}

  def set_packed(self, packed: dict) -> None:
    self.packed_gate_up_NDC = nnx.data(packed["gate_up"])
    self.packed_down_NDC = nnx.data(packed["down"])

  def __call__(self, x_BTD):
    if use_packed(self.packed_gate_up_NDC, x_BTD):
      hidden, d = self.w_gate_DF.shape[1], x_BTD.shape[-1]
      gate_up_BTG = packed_product(x_BTD, self.packed_gate_up_NDC, 2 * hidden)
      h_BTF = jax.nn.silu(gate_up_BTG[..., :hidden]) * gate_up_BTG[..., hidden:]
      return packed_product(h_BTF, self.packed_down_NDC, d).astype(x_BTD.dtype)
    gate = jnp.einsum("btd,df->btf", x_BTD, self.w_gate_DF[...])
    up = jnp.einsum("btd,df->btf", x_BTD, self.w_up_DF[...])
    return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, self.w_down_FD[...])
