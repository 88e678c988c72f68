"""Small building blocks: RMSNorm, rotary embeddings, SwiGLU, initialisers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike, DTypeLike

from moespec_jax.model.kernels import PLAIN, Kernels, packed_product, use_packed

# A pass's rotary (cos, sin) tables, each [B, T, F] (`rope_tables`).
RopeTables = tuple[jax.Array, jax.Array]


def at_index(x_BT: jax.Array, at_B: jax.Array) -> jax.Array:
  """Row b's entry at index at_B[b], keeping a length-1 axis: [B, T, ...] -> [B, 1, ...] (a pass's
  outputs or inputs where one index per row alone is read); with at_B [B, W], the W entries of
  row b at indices at_B[b]: [B, W, ...]."""
  rows_B = jnp.arange(x_BT.shape[0])
  if at_B.ndim == 2:
    return x_BT[rows_B[:, None], at_B]
  return x_BT[rows_B, at_B][:, None]


def fan_in_init(fan_in: int, scale: float = 1.0) -> jax.nn.initializers.Initializer:
  """Normal init with std = scale / sqrt(fan_in)."""
  return jax.nn.initializers.normal(stddev=scale / math.sqrt(fan_in))


def halving_sum(x: jax.Array) -> jax.Array:
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
  """y = x / rms(x) * weight, computed in float32. Where the policy asks for row-invariant norms
  (decoding programs on CPU) the mean square is a `halving_sum`, so a row's result does not depend
  on the other rows of the pass (slower to differentiate: training keeps XLA's reduction)."""

  def __init__(self, dim: int, eps: float, *, dtype: DTypeLike = jnp.float32) -> None:
    self.weight = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x: jax.Array, kernels: Kernels = PLAIN) -> jax.Array:
    x32 = x.astype(jnp.float32)
    squares = x32 * x32
    if kernels.policy.row_invariant_norms:
      mean_square = halving_sum(squares) / x32.shape[-1]
    else:
      mean_square = jnp.mean(squares, axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(mean_square + self.eps)
    return (y * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def rope_tables(
  positions_BT: jax.Array,
  head_dim: int,
  theta: float,
  *,
  inv_freq_F: ArrayLike | None = None,
  scale: float = 1.0,
  on_cpu: bool | None = None,
) -> RopeTables:
  """cos/sin tables [B, T, head_dim / 2] for integer positions (`inv_freq_F`: the rotary
  frequencies, default theta^(-2i / head_dim); `scale` multiplies both, as YaRN's attention
  factor). Computed once per pass for every layer on the CPU platform (`_materialized`; `on_cpu`
  None: the platform of jax.default_backend())."""
  if inv_freq_F is None:
    inv_freq_F = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles_BTF = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_F, jnp.float32)
  f = angles_BTF.shape[-1]
  cos_sin_BTG = jnp.concatenate([jnp.cos(angles_BTF), jnp.sin(angles_BTF)], axis=-1) * scale
  if on_cpu is None:
    on_cpu = jax.default_backend() == "cpu"
  if on_cpu:
    cos_sin_BTG = _materialized(cos_sin_BTG)
  return cos_sin_BTG[..., :f], cos_sin_BTG[..., f:]


def _materialized(x_BTG: jax.Array) -> jax.Array:
  """x, computed once where XLA:CPU would recompute it inside every consumer.

  XLA:CPU fused the rotary tables' cos and sin into each layer's rotation of queries and keys and
  evaluated them once per head there (their optimization barrier is dropped before fusion); a
  product with the identity (exact: x * 1 plus zeros) is not fused into its consumers."""
  eye_GG = jnp.eye(x_BTG.shape[-1], dtype=x_BTG.dtype)
  return jnp.einsum("btg,gh->bth", x_BTG, eye_GG, precision=jax.lax.Precision.HIGHEST)


def apply_rope(x_BTHD: jax.Array, cos_BTF: jax.Array, sin_BTF: jax.Array) -> jax.Array:
  """Rotary embedding in the half-split layout (Llama / Mixtral / Qwen / DeepSeek convention)."""
  half = x_BTHD.shape[-1] // 2
  x32 = x_BTHD.astype(jnp.float32)
  x1, x2 = x32[..., :half], x32[..., half:]
  cos, sin = cos_BTF[:, :, None, :], sin_BTF[:, :, None, :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTHD.dtype)


class SwiGLU(nnx.Module):
  """Dense SwiGLU FFN: (silu(x Wg) * (x Wu)) Wd. Used for dense layers and shared experts."""

  def __init__(
    self, d_model: int, hidden: int, *, out_scale: float, rngs: nnx.Rngs, dtype: DTypeLike = jnp.float32
  ) -> None:
    self.w_gate_DF = nnx.Param(fan_in_init(d_model)(rngs.params(), (d_model, hidden), dtype))
    self.w_up_DF = nnx.Param(fan_in_init(d_model)(rngs.params(), (d_model, hidden), dtype))
    self.w_down_FD = nnx.Param(fan_in_init(hidden, out_scale)(rngs.params(), (hidden, d_model), dtype))

  def __call__(self, x_BTD: jax.Array, kernels: Kernels = PLAIN) -> jax.Array:
    """`kernels.dense`: a `PackedSwiGLU` (passes of few rows read it with the C++ product) or None."""
    packed = kernels.dense
    if packed is not None and use_packed(packed.gate_up_NDC, x_BTD):
      hidden, d = self.w_gate_DF.shape[1], x_BTD.shape[-1]
      gate_up_BTG = packed_product(x_BTD, packed.gate_up_NDC, 2 * hidden)
      h_BTF = jax.nn.silu(gate_up_BTG[..., :hidden]) * gate_up_BTG[..., hidden:]
      return packed_product(h_BTF, packed.down_NDC, d).astype(x_BTD.dtype)
    gate = jnp.einsum("btd,df->btf", x_BTD, self.w_gate_DF[...])
    up = jnp.einsum("btd,df->btf", x_BTD, self.w_up_DF[...])
    return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, self.w_down_FD[...])
