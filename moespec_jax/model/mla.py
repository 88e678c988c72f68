"""Multi-head latent attention (MLA, DeepSeek-V2/V3) with a compressed KV cache.

Per token the cache holds only the normalised KV latent c [kv_lora_rank] and the shared
rotary key k_r [qk_rope_head_dim] (stored as the cache's keys [B, S, 1, C] and values
[B, S, 1, R]). Attention runs in the latent space with the up-projections absorbed:

    score(t, s) = (q_nope_t W_uk) . c_s + q_rope_t . k_r_s
    out_t       = (sum_s p(t, s) c_s) W_uv W_o

which equals expanding per-head keys/values from c (up to float rounding) without
materialising them: what a decode or verification pass against the cache reads. A prefill (or
a pass without a cache), many queries against few keys, expands them instead (k_nope = c W_uk,
v = c W_uv per head): smaller products there. RoPE uses the half-split layout; checkpoints
with interleaved rotary pairs are permuted at import (`moespec_jax.hf`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from moespec_jax.config import ModelConfig
from moespec_jax.model import cache as cache_lib
from moespec_jax.model import layers
from moespec_jax.model.cache import LayerCache
from moespec_jax.model.kernels import PLAIN, Kernels, PackedMLA, packed_product, use_packed
from moespec_jax.model.layers import RMSNorm, RopeTables, apply_rope, at_index, fan_in_init
from pallas_kernels import cpu

# DeepSeek's q/kv latent norms use their own epsilon, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(config: ModelConfig) -> tuple[np.ndarray, float]:
  """Inverse frequencies [R / 2] of the rotary dims and the cos/sin scale (YaRN)."""
  dim, base = config.qk_rope_head_dim, config.rope_theta
  pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
  if config.rope_scaling == "none":
    return (1.0 / pos_freqs).astype(np.float32), 1.0
  factor, orig = config.rope_factor, config.rope_original_max_len

  def correction_dim(rotations: float):
    return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

  low = max(math.floor(correction_dim(config.rope_beta_fast)), 0)
  high = min(math.ceil(correction_dim(config.rope_beta_slow)), dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolation = 1.0 - ramp
  inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
  if config.rope_mscale and config.rope_mscale_all_dim:
    attn_factor = _yarn_mscale(factor, config.rope_mscale) / _yarn_mscale(factor, config.rope_mscale_all_dim)
  else:
    attn_factor = _yarn_mscale(factor)
  return inv_freq.astype(np.float32), float(attn_factor)


def rope_tables(positions_BT: jax.Array, config: ModelConfig, *, on_cpu: bool | None = None) -> RopeTables:
  """cos/sin tables [B, T, qk_rope_head_dim / 2] of MLA's rotary key dims (YaRN included);
  `on_cpu`: see `layers.rope_tables`."""
  inv_freq_F, attn_factor = rope_inv_freq(config)
  return layers.rope_tables(
    positions_BT, config.qk_rope_head_dim, config.rope_theta, inv_freq_F=inv_freq_F, scale=attn_factor, on_cpu=on_cpu
  )


def softmax_scale(config: ModelConfig) -> float:
  """1/sqrt(qk head dim), times mscale^2 under YaRN with mscale_all_dim (DeepSeek)."""
  scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
  if config.rope_scaling == "yarn" and config.rope_mscale_all_dim:
    m = _yarn_mscale(config.rope_factor, config.rope_mscale_all_dim)
    scale = scale * m * m
  return scale


def _per_head_product(x_BTHI: jax.Array, packed_HNIC: jax.Array, n_cols: int) -> jax.Array:
  """x [B, T, H, I] times head h's packed [I, n_cols] weight, for every h: [B, T, H, n_cols]
  (float32; the C++ product of `pallas_kernels.cpu.packed_matmul`, G = H)."""
  b, t, h, i = x_BTHI.shape
  x_HMI = jnp.transpose(x_BTHI.reshape(b * t, h, i), (1, 0, 2))
  y_HMC = cpu.packed_matmul(x_HMI, packed_HNIC, n_cols)
  return jnp.transpose(y_HMC, (1, 0, 2)).reshape(b, t, h, n_cols).astype(x_BTHI.dtype)


class MLAttention(nnx.Module):
  """Causal MLA; same call contract as `Attention` (the cache holds latents)."""

  def __init__(self, config: ModelConfig, *, out_scale: float, rngs: nnx.Rngs, dtype: DTypeLike = jnp.float32) -> None:
    d, h = config.d_model, config.n_heads
    n, r, v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    c, ql = config.kv_lora_rank, config.q_lora_rank
    self.config = config
    init = fan_in_init(d)
    if ql:
      self.w_qa_DQ = nnx.Param(init(rngs.params(), (d, ql), dtype))
      self.q_norm = RMSNorm(ql, LATENT_NORM_EPS, dtype=dtype)
      self.w_qb_QHK = nnx.Param(fan_in_init(ql)(rngs.params(), (ql, h, n + r), dtype))
      self.w_q_DHK = None
    else:
      self.w_qa_DQ = self.q_norm = self.w_qb_QHK = None
      self.w_q_DHK = nnx.Param(init(rngs.params(), (d, h, n + r), dtype))
    self.w_kv_DC = nnx.Param(init(rngs.params(), (d, c), dtype))
    self.w_kr_DR = nnx.Param(init(rngs.params(), (d, r), dtype))
    self.kv_norm = RMSNorm(c, LATENT_NORM_EPS, dtype=dtype)
    self.w_uk_CHN = nnx.Param(fan_in_init(c)(rngs.params(), (c, h, n), dtype))
    self.w_uv_CHV = nnx.Param(fan_in_init(c)(rngs.params(), (c, h, v), dtype))
    self.w_o_HVD = nnx.Param(fan_in_init(h * v, out_scale)(rngs.params(), (h, v, d), dtype))

  def _absorb_queries(self, q_nope_BTHN: jax.Array, packed: PackedMLA | None) -> jax.Array:
    """The queries' no-rope part through W_uk: scores against the latent itself. With packed
    weights, W_uk head-major (in its [C, H, N] layout XLA:CPU transposed it on every pass), or per
    head for the C++ product of passes of few rows (whose rows, unlike those of XLA's batched dot,
    do not depend on the other rows)."""
    if packed is not None and use_packed(packed.uk_HNDC, q_nope_BTHN):
      return _per_head_product(q_nope_BTHN, packed.uk_HNDC, self.config.kv_lora_rank)
    if packed is not None:
      return jnp.einsum("bthn,hnc->bthc", q_nope_BTHN, packed.uk_HNC)
    return jnp.einsum("bthn,chn->bthc", q_nope_BTHN, self.w_uk_CHN[...])

  def _up_values(self, out_lat_BTHC: jax.Array, packed: PackedMLA | None) -> jax.Array:
    """Attention outputs in the latent through W_uv: [B, T, H, V] (packed as W_uk is)."""
    if packed is not None and use_packed(packed.uv_HNDC, out_lat_BTHC):
      return _per_head_product(out_lat_BTHC, packed.uv_HNDC, self.config.v_head_dim)
    if packed is not None:
      return jnp.einsum("bthc,hcv->bthv", out_lat_BTHC, packed.uv_HCV)
    return jnp.einsum("bthc,chv->bthv", out_lat_BTHC, self.w_uv_CHV[...])

  def _project(self, x_BTD: jax.Array, kernels: Kernels) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries [B, T, H, N + R], the latent before its norm [B, T, C] and the rotary key before
    RoPE [B, T, R]."""
    cfg = self.config
    h, qk = cfg.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    b, t = x_BTD.shape[:2]
    packed = kernels.dense
    if packed is not None and use_packed(packed.x_NDC, x_BTD):
      q_cols = h * qk if self.w_q_DHK is not None else cfg.q_lora_rank
      n_cols = q_cols + cfg.kv_lora_rank + cfg.qk_rope_head_dim
      xs_BTN = packed_product(x_BTD, packed.x_NDC, n_cols).astype(x_BTD.dtype)
      q_BTQ, latent_BTC, k_rope_BTR = jnp.split(xs_BTN, [q_cols, q_cols + cfg.kv_lora_rank], axis=-1)
      if self.w_q_DHK is not None:
        return q_BTQ.reshape(b, t, h, qk), latent_BTC, k_rope_BTR
      q_BTQ = self.q_norm(q_BTQ, kernels)
      q_BTHK = packed_product(q_BTQ, packed.qb_NDC, h * qk).astype(x_BTD.dtype).reshape(b, t, h, qk)
      return q_BTHK, latent_BTC, k_rope_BTR
    if self.w_q_DHK is not None:
      q_BTHK = jnp.einsum("btd,dhk->bthk", x_BTD, self.w_q_DHK[...])
    else:
      q_BTQ = self.q_norm(jnp.einsum("btd,dq->btq", x_BTD, self.w_qa_DQ[...]), kernels)
      q_BTHK = jnp.einsum("btq,qhk->bthk", q_BTQ, self.w_qb_QHK[...])
    return (
      q_BTHK,
      jnp.einsum("btd,dc->btc", x_BTD, self.w_kv_DC[...]),
      jnp.einsum("btd,dr->btr", x_BTD, self.w_kr_DR[...]),
    )

  def _output(self, out_BTHV: jax.Array, packed: PackedMLA | None) -> jax.Array:
    """The heads' outputs [B, T, H, V] projected back to the model: [B, T, D]."""
    if packed is not None and use_packed(packed.o_NDC, out_BTHV):
      b, t = out_BTHV.shape[:2]
      out_BTD = packed_product(out_BTHV.reshape(b, t, -1), packed.o_NDC, self.w_o_HVD.shape[2])
      return out_BTD.astype(out_BTHV.dtype)
    return jnp.einsum("bthv,hvd->btd", out_BTHV, self.w_o_HVD[...])

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
    """Returns (out_BTD, (latent_BSC, rope_key_BSR) or None); `rope`: `mla.rope_tables`.

    With a cache, queries attend to the cache's earlier positions and to the pass's own entries
    (positions <= their own), which are written into the cache; with `fresh_cache` (a prefill)
    only to the pass's own entries. `query_at_B` [B]: queries (and the output, [B, 1, D]) at that
    one index per row only ([B, W]: at those W); every index still writes its cache entries.
    `kernels`: the policy (passes against the compressed cache on the C++ kernel; prefills into a
    fresh cache keep XLA's products) and a `PackedMLA` or None. `tree`: a tree pass
    (`cache.TreeMask`), on XLA's path, reading the updated cache at every batch size.
    """
    if tree is not None and (layer_cache is None or fresh_cache or query_at_B is not None):
      raise ValueError("a tree pass needs a filled cache and every query (no fresh_cache, no query_at_B)")
    cfg = self.config
    n = cfg.qk_nope_head_dim
    cos, sin = rope
    packed = kernels.dense

    q_BTHK, latent_BTC, k_rope_BTR = self._project(x_BTD, kernels)
    q_nope_BTHN, q_rope_BTHR = q_BTHK[..., :n], apply_rope(q_BTHK[..., n:], cos, sin)
    latent_BTGC = self.kv_norm(latent_BTC, kernels)[:, :, None]
    k_rope_BTGR = apply_rope(k_rope_BTR[:, :, None], cos, sin)

    new_cache = (
      None
      if layer_cache is None
      else tuple(
        cache_lib.write_positions(c, new, positions_BT[:, 0] if tree is None else tree.write_B)
        for c, new in zip(layer_cache, (latent_BTGC, k_rope_BTGR))
      )
    )
    scale = jnp.float32(softmax_scale(cfg))
    latent_BTC, k_rope_BTR = latent_BTGC[:, :, 0], k_rope_BTGR[:, :, 0]
    query_positions_BT = positions_BT
    if query_at_B is not None:  # queries at that index; keys and values at every index
      q_nope_BTHN, q_rope_BTHR, query_positions_BT = (
        at_index(a, query_at_B) for a in (q_nope_BTHN, q_rope_BTHR, positions_BT)
      )
    own_visible_BTT = positions_BT[:, None, :] <= query_positions_BT[:, :, None]
    if new_cache is None or fresh_cache:
      out_BTHV = self._own_attention(q_nope_BTHN, q_rope_BTHR, latent_BTC, k_rope_BTR, own_visible_BTT, scale)
      return self._output(out_BTHV, packed), new_cache
    q_lat_BTHC = self._absorb_queries(q_nope_BTHN, packed)
    if kernels.policy.attention == "cpu" and tree is None:
      # Query rows t-major (token, then head); each sees the updated cache up to its own position.
      b, t, h = q_lat_BTHC.shape[:3]
      latent_BSC, k_rope_BSR = new_cache
      limit_BQ = jnp.repeat(query_positions_BT, h, axis=1)
      out_lat_BQC = cpu.mla_attention(
        (q_lat_BTHC * scale).reshape(b, t * h, -1),
        (q_rope_BTHR * scale).reshape(b, t * h, -1),
        latent_BSC,
        k_rope_BSR,
        limit_BQ,
      )
      out_BTHV = self._up_values(out_lat_BQC.reshape(b, t, h, -1).astype(q_lat_BTHC.dtype), packed)
      return self._output(out_BTHV, packed), new_cache

    def scores(latent_BSC: jax.Array, k_rope_BSR: jax.Array, visible_BTS: jax.Array):
      s_BHTS = (
        jnp.einsum("bthc,bsc->bhts", q_lat_BTHC, latent_BSC) + jnp.einsum("bthr,bsr->bhts", q_rope_BTHR, k_rope_BSR)
      ).astype(jnp.float32) * scale
      return jnp.where(visible_BTS[:, None], s_BHTS, -1e30)

    # XLA:CPU's speed for p.c depends on the operand order (the same contraction): the latent
    # first was much faster for one query and no slower for several
    # (docs/findings/2026-12-01-mla-latent-vs-expanded.md).
    if x_BTD.shape[0] > 1 or tree is not None:  # the updated cache (positions <= each query's own)
      latent_BSC, k_rope_BSR = new_cache
      visible_BTS = cache_lib.visible_slots(latent_BSC.shape[1], query_positions_BT, tree)
      probs_BHTS = jax.nn.softmax(scores(latent_BSC, k_rope_BSR, visible_BTS), axis=-1)
      out_lat_BTHC = jnp.einsum("bsc,bhts->bthc", latent_BSC, probs_BHTS.astype(latent_BSC.dtype))
    else:
      # Batch 1: the cache as it was before this pass (positions before the pass's first) and
      # the pass's own entries (cast as a read of the cache would give them), one softmax over
      # both. Reading the updated [1, S, C] cache made XLA:CPU duplicate the in-place update and
      # copy each cache four times per pass (two copies are left this way); at larger batches
      # the updated cache is read without copies.
      old_latent_BSC, old_k_rope_BSR = layer_cache
      latent_BTC, k_rope_BTR = latent_BTC.astype(old_latent_BSC.dtype), k_rope_BTR.astype(old_k_rope_BSR.dtype)
      key_pos_S = jnp.arange(old_latent_BSC.shape[1])
      old_BHTS = scores(old_latent_BSC, old_k_rope_BSR, key_pos_S[None, None] < positions_BT[:, :1, None])
      own_BHTT = scores(latent_BTC, k_rope_BTR, own_visible_BTT)
      probs_BHTX = jax.nn.softmax(jnp.concatenate([old_BHTS, own_BHTT], axis=-1), axis=-1)
      probs_old_BHTS = probs_BHTX[..., : key_pos_S.size].astype(old_latent_BSC.dtype)
      probs_own_BHTT = probs_BHTX[..., key_pos_S.size :].astype(latent_BTC.dtype)
      out_lat_BTHC = jnp.einsum("bsc,bhts->bthc", old_latent_BSC, probs_old_BHTS) + jnp.einsum(
        "bsc,bhts->bthc", latent_BTC, probs_own_BHTT
      )
    return self._output(self._up_values(out_lat_BTHC, packed), packed), new_cache

  def _own_attention(
    self,
    q_nope_BTHN: jax.Array,
    q_rope_BTHR: jax.Array,
    latent_BTC: jax.Array,
    k_rope_BTR: jax.Array,
    visible_BTT: jax.Array,
    scale: float | jax.Array,
  ) -> jax.Array:
    """Attention among the pass's own positions (a prefill, or no cache) with per-head keys and
    values expanded from the latent: [B, T, H, V]. Many queries against few keys each: the
    expanded products are several times narrower than the latent ones (qk_nope_head_dim +
    qk_rope_head_dim and v_head_dim against kv_lora_rank + qk_rope_head_dim and kv_lora_rank per
    head)."""
    k_nope_BTHN = jnp.einsum("btc,chn->bthn", latent_BTC, self.w_uk_CHN[...])
    values_BTHV = jnp.einsum("btc,chv->bthv", latent_BTC, self.w_uv_CHV[...])
    s_BHTS = (
      jnp.einsum("bthn,bshn->bhts", q_nope_BTHN, k_nope_BTHN) + jnp.einsum("bthr,bsr->bhts", q_rope_BTHR, k_rope_BTR)
    ).astype(jnp.float32) * scale
    probs_BHTS = jax.nn.softmax(jnp.where(visible_BTT[:, None], s_BHTS, -1e30), axis=-1)
    return jnp.einsum("bshv,bhts->bthv", values_BTHV, probs_BHTS.astype(values_BTHV.dtype))
