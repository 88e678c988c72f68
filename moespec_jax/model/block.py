"""A transformer block: pre-norm attention (GQA or MLA), then a dense SwiGLU or MoE FFN."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from moespec_jax.config import ModelConfig
from moespec_jax.model.attention import Attention
from moespec_jax.model.budget import ExpertBudget
from moespec_jax.model.cache import LayerCache, TreeMask
from moespec_jax.model.kernels import PLAIN, Kernels
from moespec_jax.model.layers import RMSNorm, RopeTables, SwiGLU, at_index
from moespec_jax.model.mla import MLAttention
from moespec_jax.model.moe import LayerRouting, MoE


class Block(nnx.Module):
  """Pre-norm block: x + attn(norm(x)), then x + ffn(norm(x)); ffn is dense or MoE."""

  def __init__(
    self,
    config: ModelConfig,
    layer: int,
    *,
    rngs: nnx.Rngs,
    dtype: DTypeLike = jnp.float32,
    dense_hidden: int | None = None,
  ) -> None:
    """Block `layer` of `config` (MoE where `config.is_moe_layer(layer)`); with `dense_hidden`, a
    dense SwiGLU of that width whatever the layer."""
    out_scale = 1.0 / math.sqrt(2 * config.n_layers)
    self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
    attention = MLAttention if config.attention_type == "mla" else Attention
    self.attn = attention(config, out_scale=out_scale, rngs=rngs, dtype=dtype)
    self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
    self.is_moe = config.is_moe_layer(layer) and not dense_hidden
    if self.is_moe:
      self.ffn = MoE(config, out_scale=out_scale, rngs=rngs, dtype=dtype)
    else:
      width = dense_hidden or config.dense_hidden
      self.ffn = SwiGLU(config.d_model, width, out_scale=out_scale, rngs=rngs, dtype=dtype)

  def __call__(
    self,
    x_BTD: jax.Array,
    positions_BT: jax.Array,
    rope: RopeTables,
    layer_cache: LayerCache | None,
    *,
    kernels: Kernels = PLAIN,
    expert_budget: ExpertBudget | None = None,
    valid_BT: jax.Array | None = None,
    fresh_cache: bool = False,
    output_at_B: jax.Array | None = None,
    tree: TreeMask | None = None,
  ) -> tuple[jax.Array, LayerCache | None, LayerRouting | None]:
    """Returns (output, new layer cache, routing). `output_at_B`: the block's output at that one
    index per row only, [B, 1, D] (a caller that reads it there only; [B, W]: at those W indices,
    [B, W, D]): attention's queries and the FFN run there only, while every index writes its cache
    entries. `kernels`: the policy and a `PackedBlock` or None. `tree`: a tree pass (`cache.TreeMask`)."""
    attn_out, new_cache = self.attn(
      self.attn_norm(x_BTD, kernels),
      positions_BT,
      rope,
      layer_cache,
      kernels=kernels.child("attn"),
      fresh_cache=fresh_cache,
      query_at_B=output_at_B,
      tree=tree,
    )
    if output_at_B is not None:
      x_BTD = at_index(x_BTD, output_at_B)
      valid_BT = None if valid_BT is None else at_index(valid_BT, output_at_B)
    x_BTD = x_BTD + attn_out
    h = self.ffn_norm(x_BTD, kernels)
    if self.is_moe:
      ffn_out, routing = self.ffn(h, kernels=kernels.child("ffn"), expert_budget=expert_budget, valid_BT=valid_BT)
    else:
      ffn_out, routing = self.ffn(h, kernels.child("ffn")), None
    return x_BTD + ffn_out, new_cache, routing
