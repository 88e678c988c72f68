"""Small building blocks: RMSNorm, rotary embeddings, SwiGLU, initialisers."""

import math

import jax
import jax.numpy as jnp
from flax import nnx


def fan_in_init(fan_in: int, scale: float = 1.0):
  """Normal init with std = scale / sqrt(fan_in)."""
  return jax.nn.initializers.normal(stddev=scale / math.sqrt(fan_in))


class RMSNorm(nnx.Module):
  """y = x / rms(x) * weight, computed in float32."""

  def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
    self.weight = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def rope_tables(positions_BT, head_dim: int, theta: float):
  """cos/sin tables [B, T, head_dim / 2] for integer positions."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles_BTF = positions_BT.astype(jnp.float32)[..., None] * inv_freq
  return jnp.cos(angles_BTF), jnp.sin(angles_BTF)


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

  def __call__(self, x_BTD):
    gate = jnp.einsum("btd,df->btf", x_BTD, self.w_gate_DF[...])
    up = jnp.einsum("btd,df->btf", x_BTD, self.w_up_DF[...])
    return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, self.w_down_FD[...])
