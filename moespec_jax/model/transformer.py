"""The decoder-only MoE transformer (Flax NNX)."""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import nnx, struct

from moespec_jax.config import ModelConfig
from moespec_jax.model.attention import Attention
from moespec_jax.model.block import Block
from moespec_jax.model.cache import KVCache
from moespec_jax.model import mla
from moespec_jax.model.layers import RMSNorm, fan_in_init, rope_tables
from moespec_jax.model.mtp import MTPModule
from pallas_kernels import cpu


@struct.dataclass
class Routing:
  """Routing of the MoE layers, stacked over those layers (L = n_moe_layers)."""
  expert_ids: jax.Array  # [L, B, T, K] int32
  gates: jax.Array  # [L, B, T, K] f32
  probs: jax.Array  # [L, B, T, E] f32, per-token routing probabilities


@struct.dataclass
class ForwardOutput:
  logits: jax.Array | None  # [B, T, V] f32 (None with compute_logits=False)
  hidden: jax.Array  # [B, T, D] final hidden states (after the final norm), read by MTP heads
  routing: Routing | None
  cache: KVCache | None


def _path_key(path) -> str:
  return "/".join(str(part) for part in path)


class Transformer(nnx.Module):
  """Embeddings, `n_layers` blocks, final norm, output head."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(config.dtype)
    self.config = config
    self.embed_VD = nnx.Param(jax.random.normal(rngs.params(), (config.vocab_size, config.d_model), dtype))
    self.layers = nnx.List([Block(config, i, rngs=rngs, dtype=dtype) for i in range(config.n_layers)])
    self.final_norm = RMSNorm(config.d_model, config.norm_eps)
    if config.tie_embeddings:
      self.lm_head_DV = None
    else:
      self.lm_head_DV = nnx.Param(fan_in_init(config.d_model)(rngs.params(), (config.d_model, config.vocab_size), dtype))
    # The head as packed column blocks inside decoding programs (not a parameter; see `head`).
    self.packed_head_NDC = None
    # MTP drafter heads (model/mtp.py): an optional sub-tree, created after the target so that
    # the target's parameters do not depend on num_mtp_modules.
    if config.num_mtp_modules:
      self.mtp = nnx.List([MTPModule(config, rngs=rngs, dtype=dtype) for _ in range(config.num_mtp_modules)])
    else:
      self.mtp = None

  def use_cpu_cached_attention(self) -> None:
    """Passes against the cache run on the C++ kernels from here on (decoding programs on CPU):
    `Attention`'s prefills into a fresh cache included; `MLAttention`'s passes against the
    compressed cache (its prefills keep XLA's products)."""
    for _, module in nnx.iter_modules(self):
      if isinstance(module, (Attention, mla.MLAttention)):
        module.cpu_cached_attention = True

  def use_row_invariant_norms(self) -> None:
    """Every RMSNorm sums its squares by halving from here on (decoding programs on CPU): with
    the C++ kernels, whose rows do not depend on each other either, a token's logits are the same
    bits in a plain step and among a verification pass's tokens or a batch's rows."""
    for _, module in nnx.iter_modules(self):
      if isinstance(module, RMSNorm):
        module.row_invariant = True

  def pack_dense(self) -> dict[str, dict[str, jax.Array]]:
    """The dense projections packed for `use_packed_dense`, by module path: every module that
    packs its own (`pack` / `set_packed`: attention, GQA and MLA; SwiGLU, dense layers and shared
    experts; MoE routers; MTP modules' W_p and own heads, and their blocks')."""
    return {_path_key(path): module.pack() for path, module in nnx.iter_modules(self)
            if callable(getattr(module, "pack", None))}

  def use_packed_dense(self, packed: dict[str, dict[str, jax.Array]]) -> None:
    """Passes of few rows read the dense projections packed by `pack_dense` from here on, with
    the C++ product (decoding programs on CPU; `layers.PACKED_MAX_ROWS`)."""
    for path, module in nnx.iter_modules(self):
      if _path_key(path) in packed:
        module.set_packed(packed[_path_key(path)])

  def rope(self, positions_BT):
    """The rotary cos/sin tables of a pass, shared by its layers (MLA: its rotary key dims)."""
    c = self.config
    if c.attention_type == "mla":
      return mla.rope_tables(positions_BT, c)
    return rope_tables(positions_BT, c.head_dim, c.rope_theta)

  def new_cache(self, batch: int, max_len: int) -> KVCache:
    return KVCache.for_config(self.config, batch, max_len)

  def head(self, hidden_BTD):
    """Output logits (f32) from final hidden states. In decoding programs on CPU the head is
    read as packed column blocks (`packed_head_NDC`, set by decoding.loop: a C++ product that
    streams it, `pallas_kernels.cpu.packed_matmul`)."""
    if self.packed_head_NDC is not None:
      b, t, d = hidden_BTD.shape
      logits_MV = cpu.packed_matmul(hidden_BTD.reshape(b * t, d), self.packed_head_NDC, self.config.vocab_size)
      return logits_MV.reshape(b, t, -1)
    if self.lm_head_DV is None:  # tied: the embedding read as it lies (a .T was copied every pass)
      return jnp.einsum("btd,vd->btv", hidden_BTD, self.embed_VD[...]).astype(jnp.float32)
    return jnp.einsum("btd,dv->btv", hidden_BTD, self.lm_head_DV[...]).astype(jnp.float32)

  def __call__(self, tokens_BT, positions_BT=None, cache: KVCache | None = None, *,
               expert_method: str | None = None, expert_budget=None, valid_BT=None,
               compute_logits: bool = True, fresh_cache: bool = False, hidden_at_B=None) -> ForwardOutput:
    """One pass over `tokens_BT` at `positions_BT` (default 0..T-1 for every row).

    Without a cache this is the full causal forward; with one, the pass's keys/values are
    written at its positions (contiguous per row) and the updated cache is returned.
    `expert_budget` (a `model.budget.ExpertBudget`) makes the pass APPROXIMATE: each MoE layer
    uses at most that many routed experts, ranked over the `valid_BT` tokens. Tokens outside
    `valid_BT` (default: none) are ones whose output is not used (finished rows, empty draft
    slots): they read no expert of their own (`moe.masked_to_read_experts`: the dedup kernels
    then read the valid tokens' experts only), and their outputs and later keys/values differ
    from an unmasked pass.
    `compute_logits=False` skips the output head (logits None): a prefill needs the head at
    its last position only (`head(hidden)` there). `fresh_cache=True` (a prefill into an empty
    cache): attention reads only the pass's own keys, not the cache's empty entries.
    `hidden_at_B` [B]: hidden states and logits at that one index per row only, [B, 1, ...]; the
    last block's attention queries and FFN run there only (`Block.__call__`'s `output_at_B`),
    every index still writes its keys/values, and routing is None (a prefill whose last prompt
    position alone is read). [B, W]: at those W indices per row, [B, W, ...] (the MTP heads'
    prompt window). Not with `expert_budget`: the last block would rank its budget over those
    indices only, not over the pass's tokens (ValueError).
    """
    if hidden_at_B is not None and expert_budget is not None:
      raise ValueError("hidden_at_B with expert_budget: the last layer's expert budget would be ranked over the "
                       "selected positions only; run the whole pass (hidden_at_B=None) and index its output")
    c = self.config
    method = expert_method or c.expert_method
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1], dtype=jnp.int32), tokens_BT.shape)
    x_BTD = jnp.take(self.embed_VD[...], tokens_BT, axis=0)
    rope = self.rope(positions_BT)
    new_keys, new_values, routings = [], [], []
    last = len(self.layers) - 1
    for i, block in enumerate(self.layers):
      layer_cache = None if cache is None else (cache.keys[i], cache.values[i])
      x_BTD, layer_new, routing = block(x_BTD, positions_BT, rope, layer_cache, expert_method=method,
                                        expert_budget=expert_budget, valid_BT=valid_BT,
                                        fresh_cache=fresh_cache, output_at_B=hidden_at_B if i == last else None)
      if layer_new is not None:
        new_keys.append(layer_new[0])
        new_values.append(layer_new[1])
      if routing is not None:
        routings.append(routing)
    hidden_BTD = self.final_norm(x_BTD)
    routing = None
    if routings and hidden_at_B is None:
      routing = Routing(*(jnp.stack(parts) for parts in zip(*routings)))
    new_cache = None if cache is None else KVCache(tuple(new_keys), tuple(new_values))
    logits_BTV = self.head(hidden_BTD) if compute_logits else None
    return ForwardOutput(logits_BTV, hidden_BTD, routing, new_cache)
