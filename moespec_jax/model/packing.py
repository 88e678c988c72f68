"""The weights the C++ CPU products read, packed from a model's parameters (`pack_weights`): the
output head and the dense projections as column blocks (`pallas_kernels.cpu.pack_columns`), laid out
as the module tree (`model.kernels.PackedWeights`). Packed once per parameter set (the caller keeps
them: `api.Model.packed_weights`) and passed into compiled programs beside the parameters."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from moespec_jax.model.kernels import (
  PackedAttention,
  PackedBlock,
  PackedMLA,
  PackedMoE,
  PackedMTP,
  PackedSwiGLU,
  PackedWeights,
)
from moespec_jax.model.mla import MLAttention
from pallas_kernels.cpu import pack_columns

if TYPE_CHECKING:
  from moespec_jax.model.attention import Attention
  from moespec_jax.model.block import Block
  from moespec_jax.model.layers import SwiGLU
  from moespec_jax.model.moe import MoE
  from moespec_jax.model.mtp import MTPModule
  from moespec_jax.model.transformer import Transformer


def pack_weights(model: Transformer, *, head: bool = True, dense: bool = True) -> PackedWeights:
  """The packed weights of `model` (a `Transformer`): its output head (`head`) and the dense
  projections of its blocks and MTP modules (`dense`; attention, dense and shared SwiGLUs, routers,
  MTP projections and own heads). A part not asked for is None (XLA's products)."""
  head_NDC = None
  if head:
    tied = model.lm_head_DV is None
    head_NDC = pack_columns(model.embed_VD[...].T if tied else model.lm_head_DV[...])
  if not dense:
    return PackedWeights(head_NDC=head_NDC)
  layers = tuple(_pack_block(block) for block in model.layers)
  mtp = None if model.mtp is None else tuple(_pack_mtp(module) for module in model.mtp)
  return PackedWeights(head_NDC=head_NDC, layers=layers, mtp=mtp)


def _pack_block(block: Block) -> PackedBlock:
  attn = _pack_mla(block.attn) if isinstance(block.attn, MLAttention) else _pack_attention(block.attn)
  ffn = _pack_moe(block.ffn) if block.is_moe else _pack_swiglu(block.ffn)
  return PackedBlock(attn=attn, ffn=ffn)


def _pack_swiglu(ffn: SwiGLU) -> PackedSwiGLU:
  gate_up_DG = jnp.concatenate([ffn.w_gate_DF[...], ffn.w_up_DF[...]], axis=1)
  return PackedSwiGLU(gate_up_NDC=pack_columns(gate_up_DG), down_NDC=pack_columns(ffn.w_down_FD[...]))


def _pack_attention(attn: Attention) -> PackedAttention:
  """Queries, keys and values side by side (one product per pass), and the output projection."""
  d = attn.w_q_DHK.shape[0]
  qkv_DN = jnp.concatenate([w[...].reshape(d, -1) for w in (attn.w_q_DHK, attn.w_k_DHK, attn.w_v_DHK)], axis=1)
  o_ND = attn.w_o_HKD[...].reshape(attn.n_heads * attn.head_dim, d)
  return PackedAttention(qkv_NDC=pack_columns(qkv_DN), o_NDC=pack_columns(o_ND))


def _pack_mla(attn: MLAttention) -> PackedMLA:
  """The products of x side by side, Wqb and Wo as blocks; the per-head up-projections W_uk and
  W_uv head-major and as blocks per head."""
  d = attn.w_kv_DC.shape[0]
  w_q = attn.w_q_DHK[...].reshape(d, -1) if attn.w_q_DHK is not None else attn.w_qa_DQ[...]
  x_DN = jnp.concatenate([w_q, attn.w_kv_DC[...], attn.w_kr_DR[...]], axis=1)
  qb_NDC = None
  if attn.w_qb_QHK is not None:
    qb_NDC = pack_columns(attn.w_qb_QHK[...].reshape(attn.w_qb_QHK.shape[0], -1))
  uk_HNC = jnp.transpose(attn.w_uk_CHN[...], (1, 2, 0))
  uv_HCV = jnp.transpose(attn.w_uv_CHV[...], (1, 0, 2))
  return PackedMLA(
    x_NDC=pack_columns(x_DN),
    o_NDC=pack_columns(attn.w_o_HVD[...].reshape(-1, d)),
    qb_NDC=qb_NDC,
    uk_HNC=uk_HNC,
    uv_HCV=uv_HCV,
    uk_HNDC=jax.vmap(pack_columns)(uk_HNC),
    uv_HNDC=jax.vmap(pack_columns)(uv_HCV),
  )


def _pack_moe(moe: MoE) -> PackedMoE:
  """The router's columns, then the shared-expert gate's (one product routes and gates)."""
  w_DC = moe.w_router_DE[...]
  if moe.w_shared_gate_D is not None:
    w_DC = jnp.concatenate([w_DC, moe.w_shared_gate_D[...].astype(w_DC.dtype)[:, None]], axis=1)
  shared = None if moe.shared is None else _pack_swiglu(moe.shared)
  return PackedMoE(router_NDC=pack_columns(w_DC), shared=shared)


def _pack_mtp(module: MTPModule) -> PackedMTP:
  head_NDC = None if module.head_DV is None else pack_columns(module.head_DV[...])
  return PackedMTP(proj_NDC=pack_columns(module.w_proj_CD[...]), head_NDC=head_NDC, block=_pack_block(module.block))
