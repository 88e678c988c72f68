"""Grouped-query attention with rotary embeddings and an optional KV cache.

Variants of the imported families: q/k/v biases (Qwen2-MoE) and RMSNorm on queries and keys
before RoPE, per head (Qwen3-MoE) or over the whole projection (OLMoE).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from moespec_jax.config import ModelConfig
from moespec_jax.model import cache as cache_lib
from moespec_jax.model.cache import LayerCache
from moespec_jax.model.kernels import PLAIN, Kernels, PackedAttention, packed_product, use_packed
from moespec_jax.model.layers import RMSNorm, RopeTables, apply_rope, at_index, fan_in_init
from pallas_kernels import cpu


class Attention(nnx.Module):
  """Causal GQA. Queries attend to keys at positions <= their own position."""

  def __init__(self, config: ModelConfig, *, out_scale: float, rngs: nnx.Rngs, dtype: DTypeLike = jnp.float32) -> None:
    d, h, hkv, dh = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
    self.n_heads, self.n_kv_heads, self.head_dim = h, hkv, dh
    init = fan_in_init(d)
    self.w_q_DHK = nnx.Param(init(rngs.params(), (d, h, dh), dtype))
    self.w_k_DHK = nnx.Param(init(rngs.params(), (d, hkv, dh), dtype))
    self.w_v_DHK = nnx.Param(init(rngs.params(), (d, hkv, dh), dtype))
    self.w_o_HKD = nnx.Param(fan_in_init(h * dh, out_scale)(rngs.params(), (h, dh, d), dtype))
    if config.qkv_bias:
      self.b_q_HK = nnx.Param(jnp.zeros((h, dh), dtype))
      self.b_k_GK = nnx.Param(jnp.zeros((hkv, dh), dtype))
      self.b_v_GK = nnx.Param(jnp.zeros((hkv, dh), dtype))
    else:
      self.b_q_HK = self.b_k_GK = self.b_v_GK = None
    self.qk_norm = config.qk_norm
    if config.qk_norm == "none":
      self.q_norm = self.k_norm = None
    else:
      q_dim, k_dim = (dh, dh) if config.qk_norm == "head" else (h * dh, hkv * dh)
      self.q_norm = RMSNorm(q_dim, config.norm_eps, dtype=dtype)
      self.k_norm = RMSNorm(k_dim, config.norm_eps, dtype=dtype)

  def _qkv(self, x_BTD: jax.Array, packed: PackedAttention | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The three projections, without biases: [B, T, H, K], [B, T, G, K], [B, T, G, K]."""
    if packed is not None and use_packed(packed.qkv_NDC, x_BTD):
      h, g, k = self.n_heads, self.n_kv_heads, self.head_dim
      qkv_BTN = packed_product(x_BTD, packed.qkv_NDC, (h + 2 * g) * k).astype(x_BTD.dtype)
      q_BTN, k_BTN, v_BTN = jnp.split(qkv_BTN, [h * k, (h + g) * k], axis=-1)
      return (
        q_BTN.reshape(*x_BTD.shape[:2], h, k),
        k_BTN.reshape(*x_BTD.shape[:2], g, k),
        v_BTN.reshape(*x_BTD.shape[:2], g, k),
      )
    return (
      jnp.einsum("btd,dhk->bthk", x_BTD, self.w_q_DHK[...]),
      jnp.einsum("btd,dgk->btgk", x_BTD, self.w_k_DHK[...]),
      jnp.einsum("btd,dgk->btgk", x_BTD, self.w_v_DHK[...]),
    )

  def _project(self, x_BTD: jax.Array, kernels: Kernels) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries, keys and values before RoPE: [B, T, H, K], [B, T, G, K], [B, T, G, K]."""
    q_BTHK, k_BTGK, v_BTGK = self._qkv(x_BTD, kernels.dense)
    if self.b_q_HK is not None:
      q_BTHK = q_BTHK + self.b_q_HK[...]
      k_BTGK = k_BTGK + self.b_k_GK[...]
      v_BTGK = v_BTGK + self.b_v_GK[...]
    if self.qk_norm == "head":
      q_BTHK, k_BTGK = self.q_norm(q_BTHK, kernels), self.k_norm(k_BTGK, kernels)
    elif self.qk_norm == "full":
      q_BTHK = self.q_norm(q_BTHK.reshape(*q_BTHK.shape[:2], -1), kernels).reshape(q_BTHK.shape)
      k_BTGK = self.k_norm(k_BTGK.reshape(*k_BTGK.shape[:2], -1), kernels).reshape(k_BTGK.shape)
    return q_BTHK, k_BTGK, v_BTGK

  def __call__(
    self,
    x_BTD: jax.Array,
    positions_BT: jax.Array,
    rope: RopeTables,
    layer_cache: LayerCache | None = None,
    *,
    kernels: Kernels = PLAIN,
    fresh_cache: bool = False,
    query_at_B: jax.Array | None = None,
    tree: cache_lib.TreeMask | None = None,
  ) -> tuple[jax.Array, LayerCache | None]:
    """Returns (out_BTD, (keys_NKS, values_NSK) or None), N = B * n_kv_heads (keys key-major:
    `cache.KVCache`).

    With `layer_cache=(keys, values)`, the pass's keys/values are written at their positions
    (each row's positions must be contiguous) and queries attend to the cache (positions <=
    their own). `fresh_cache`: the cache holds nothing yet (a prefill), so queries attend to
    the pass's own keys only (not to the empty entries). `query_at_B` [B]: queries (and the
    output, [B, 1, D]) at that one index per row only ([B, W]: at those W, [B, W, D]); every index
    still writes its keys/values. `kernels`: the policy (attention against the cache on the C++
    kernel, the prefill included) and a `PackedAttention` or None. `tree`: a tree pass
    (`cache.TreeMask`; on the C++ kernel with its window as mask bits, up to `cpu.TREE_WINDOW`
    positions; XLA's path beyond).
    """
    if tree is not None and (layer_cache is None or fresh_cache or query_at_B is not None):
      raise ValueError("a tree pass needs a filled cache and every query (no fresh_cache, no query_at_B)")
    cos, sin = rope
    q_BTHK, k_BTGK, v_BTGK = self._project(x_BTD, kernels)
    q_BTHK, k_BTGK = apply_rope(q_BTHK, cos, sin), apply_rope(k_BTGK, cos, sin)
    query_positions_BT = positions_BT
    if query_at_B is not None:
      q_BTHK, query_positions_BT = at_index(q_BTHK, query_at_B), at_index(positions_BT, query_at_B)

    # Queries of one KV head stacked as Q = T * R rows (t-major), one batch entry per (row, KV
    # head) pair N = B * G, as the cache lies: the products are plain batched matmuls over N.
    b, t, s = x_BTD.shape[0], q_BTHK.shape[1], x_BTD.shape[1]
    g, r, k = self.n_kv_heads, self.n_heads // self.n_kv_heads, self.head_dim
    scale = 1.0 / jnp.sqrt(jnp.float32(k))
    q_NQK = q_BTHK.reshape(b, t, g, r, k).transpose(0, 2, 1, 3, 4).reshape(b * g, t * r, k)
    write_B = positions_BT[:, 0] if tree is None else tree.write_B
    new_cache = (
      None
      if layer_cache is None
      else (
        cache_lib.write_positions(layer_cache[0], k_BTGK, write_B, key_major=True),
        cache_lib.write_positions(layer_cache[1], v_BTGK, write_B),
      )
    )
    if new_cache is not None and kernels.policy.attention == "cpu" and tree is not None:
      m = tree.mask_BTM.shape[2]
      if m <= cpu.TREE_WINDOW:  # the tree's window as each query's mask bits
        keys_NKS, values_NSK = new_cache

        def per_query(x_B: jax.Array) -> jax.Array:  # a row's value for each of its (KV head, query) rows
          return jnp.broadcast_to(jnp.repeat(x_B, g)[:, None], (b * g, t * r))

        limit_NQ, base_NQ = per_query(tree.base_B + m - 1), per_query(tree.base_B)
        window_NQM = jnp.broadcast_to(tree.mask_BTM[:, None, :, None], (b, g, t, r, m)).reshape(b * g, t * r, m)
        out_NQK = cpu.tree_attention(q_NQK * scale, keys_NKS, values_NSK, limit_NQ, base_NQ, window_NQM)
        return self._output(out_NQK.astype(q_NQK.dtype), b, t, kernels.dense), new_cache
    if new_cache is not None and kernels.policy.attention == "cpu" and tree is None:
      # Prefills too: the kernel scores each block of about 32 positions' queries against the
      # keys up to the block's last position only, so it skips most masked pairs and never reads
      # empty entries.
      keys_NKS, values_NSK = new_cache
      limit_NQ = jnp.broadcast_to(query_positions_BT[:, None, :, None], (b, g, t, r)).reshape(b * g, t * r)
      out_NQK = cpu.cached_attention(q_NQK * scale, keys_NKS, values_NSK, limit_NQ).astype(q_NQK.dtype)
      return self._output(out_NQK, b, t, kernels.dense), new_cache
    if new_cache is None or fresh_cache:  # S: the pass's own positions
      keys_NSK, values_NSK = (x.swapaxes(1, 2).reshape(b * g, s, k) for x in (k_BTGK, v_BTGK))
      key_pos_BS = positions_BT
      scores_NQS = jnp.einsum("nqk,nsk->nqs", q_NQK, keys_NSK)
      visible_BTS = key_pos_BS[:, None, :] <= query_positions_BT[:, :, None]
    else:
      keys_NKS, values_NSK = new_cache
      visible_BTS = cache_lib.visible_slots(keys_NKS.shape[2], query_positions_BT, tree)
      scores_NQS = jnp.einsum("nqk,nks->nqs", q_NQK, keys_NKS)
    visible_BQS = jnp.repeat(visible_BTS, r, axis=1)
    scores_BGQS = scores_NQS.astype(jnp.float32).reshape(b, g, t * r, -1)
    probs_BGQS = jax.nn.softmax(jnp.where(visible_BQS[:, None], scores_BGQS * scale, -1e30), axis=-1)
    probs_NQS = probs_BGQS.reshape(b * g, t * r, -1).astype(values_NSK.dtype)
    out_NQK = jnp.einsum("nqs,nsk->nqk", probs_NQS, values_NSK)
    return self._output(out_NQK, b, t, kernels.dense), new_cache

  def _output(self, out_NQK: jax.Array, b: int, t: int, packed: PackedAttention | None) -> jax.Array:
    """The heads' outputs [B * G, T * R, K] projected back to the model: [B, T, D]."""
    g, r, k = self.n_kv_heads, self.n_heads // self.n_kv_heads, self.head_dim
    out_BTHK = out_NQK.reshape(b, g, t, r, k).transpose(0, 2, 1, 3, 4).reshape(b, t, self.n_heads, k)
    if packed is not None and use_packed(packed.o_NDC, out_BTHK):
      d = self.w_o_HKD.shape[2]
      return packed_product(out_BTHK.reshape(b, t, -1), packed.o_NDC, d).astype(out_BTHK.dtype)
    return jnp.einsum("bthk,hkd->btd", out_BTHK, self.w_o_HKD[...])
