"""Grouped-query attention with rotary embeddings and an optional KV cache."""

import jax
import jax.numpy as jnp
from flax import nnx

from moespec_jax.config import ModelConfig
from moespec_jax.model import cache as cache_lib
from moespec_jax.model.layers import apply_rope, fan_in_init


class Attention(nnx.Module):
  """Causal GQA. Queries attend to keys at positions <= their own position."""

  def __init__(self, config: ModelConfig, *, out_scale: float, rngs: nnx.Rngs, dtype=jnp.float32):
    d, h, hkv, dh = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
    self.n_heads, self.n_kv_heads, self.head_dim = h, hkv, dh
    init = fan_in_init(d)
    self.w_q_DHK = nnx.Param(init(rngs.params(), (d, h, dh), dtype))
    self.w_k_DHK = nnx.Param(init(rngs.params(), (d, hkv, dh), dtype))
    self.w_v_DHK = nnx.Param(init(rngs.params(), (d, hkv, dh), dtype))
    self.w_o_HKD = nnx.Param(fan_in_init(h * dh, out_scale)(rngs.params(), (h, dh, d), dtype))

  def __call__(self, x_BTD, positions_BT, rope, layer_cache=None):
    """Returns (out_BTD, (keys_BSHK, values_BSHK) or None).

    With `layer_cache=(keys, values)`, the pass's keys/values are written at their
    positions (each row's positions must be contiguous) and attention reads the cache.
    """
    cos, sin = rope
    q_BTHK = apply_rope(jnp.einsum("btd,dhk->bthk", x_BTD, self.w_q_DHK[...]), cos, sin)
    k_BTGK = apply_rope(jnp.einsum("btd,dgk->btgk", x_BTD, self.w_k_DHK[...]), cos, sin)
    v_BTGK = jnp.einsum("btd,dgk->btgk", x_BTD, self.w_v_DHK[...])

    if layer_cache is None:
      keys, values, key_pos_BS = k_BTGK, v_BTGK, positions_BT
      new_cache = None
    else:
      start_B = positions_BT[:, 0]
      keys = cache_lib.write_rows(layer_cache[0], k_BTGK, start_B)
      values = cache_lib.write_rows(layer_cache[1], v_BTGK, start_B)
      key_pos_BS = jnp.broadcast_to(jnp.arange(keys.shape[1]), keys.shape[:2])
      new_cache = (keys, values)

    b, t = x_BTD.shape[:2]
    groups = self.n_heads // self.n_kv_heads
    q_BTGRK = q_BTHK.reshape(b, t, self.n_kv_heads, groups, self.head_dim)
    scores_BGRTS = jnp.einsum("btgrk,bsgk->bgrts", q_BTGRK, keys).astype(jnp.float32)
    scores_BGRTS = scores_BGRTS / jnp.sqrt(jnp.float32(self.head_dim))
    visible_BTS = key_pos_BS[:, None, :] <= positions_BT[:, :, None]
    scores_BGRTS = jnp.where(visible_BTS[:, None, None], scores_BGRTS, -1e30)
    probs_BGRTS = jax.nn.softmax(scores_BGRTS, axis=-1).astype(values.dtype)
    out_BTGRK = jnp.einsum("bgrts,bsgk->btgrk", probs_BGRTS, values)
    out_BTHK = out_BTGRK.reshape(b, t, self.n_heads, self.head_dim)
    return jnp.einsum("bthk,hkd->btd", out_BTHK, self.w_o_HKD[...]), new_cache
