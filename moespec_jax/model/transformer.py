"""The decoder-only MoE transformer (Flax NNX)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from moespec_jax.config import ModelConfig
from moespec_jax.model import mla
from moespec_jax.model.block import Block
from moespec_jax.model.budget import ExpertBudget
from moespec_jax.model.cache import KVCache, TreeMask
from moespec_jax.model.kernels import PLAIN, Kernels
from moespec_jax.model.layers import RMSNorm, RopeTables, fan_in_init, rope_tables
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


class Transformer(nnx.Module):
  """Embeddings, `n_layers` blocks, final norm, output head."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs) -> None:
    dtype = jnp.dtype(config.dtype)
    self.config = config
    self.embed_VD = nnx.Param(jax.random.normal(rngs.params(), (config.vocab_size, config.d_model), dtype))
    self.layers = nnx.List([Block(config, i, rngs=rngs, dtype=dtype) for i in range(config.n_layers)])
    self.final_norm = RMSNorm(config.d_model, config.norm_eps)
    if config.tie_embeddings:
      self.lm_head_DV = None
    else:
      init = fan_in_init(config.d_model)
      self.lm_head_DV = nnx.Param(init(rngs.params(), (config.d_model, config.vocab_size), dtype))
    # MTP drafter heads (model/mtp.py): an optional sub-tree, created after the target so that
    # the target's parameters do not depend on num_mtp_modules.
    if config.num_mtp_modules:
      self.mtp = nnx.List([MTPModule(config, rngs=rngs, dtype=dtype) for _ in range(config.num_mtp_modules)])
    else:
      self.mtp = None

  def rope(self, positions_BT: jax.Array, kernels: Kernels = PLAIN) -> RopeTables:
    """The rotary cos/sin tables of a pass, shared by its layers (MLA: its rotary key dims)."""
    c = self.config
    if c.attention_type == "mla":
      return mla.rope_tables(positions_BT, c, on_cpu=kernels.policy.on_cpu)
    return rope_tables(positions_BT, c.head_dim, c.rope_theta, on_cpu=kernels.policy.on_cpu)

  def new_cache(self, batch: int, max_len: int) -> KVCache:
    return KVCache.for_config(self.config, batch, max_len)

  def head(self, hidden_BTD: jax.Array, kernels: Kernels = PLAIN) -> jax.Array:
    """Output logits (f32) from final hidden states. With the head packed (`kernels.packed`, a
    `PackedWeights` whose `head_NDC` is set: decoding programs on CPU) the C++ product streams its
    column blocks (`pallas_kernels.cpu.packed_matmul`)."""
    packed = kernels.packed
    if kernels.policy.head == "cpu" and packed is not None and packed.head_NDC is not None:
      b, t, d = hidden_BTD.shape
      logits_MV = cpu.packed_matmul(hidden_BTD.reshape(b * t, d), packed.head_NDC, self.config.vocab_size)
      return logits_MV.reshape(b, t, -1)
    if self.lm_head_DV is None:  # tied: the embedding read as it lies (a .T was copied every pass)
      return jnp.einsum("btd,vd->btv", hidden_BTD, self.embed_VD[...]).astype(jnp.float32)
    return jnp.einsum("btd,dv->btv", hidden_BTD, self.lm_head_DV[...]).astype(jnp.float32)

  def __call__(
    self,
    tokens_BT: jax.Array,
    positions_BT: jax.Array | None = None,
    cache: KVCache | None = None,
    *,
    kernels: Kernels = PLAIN,
    expert_budget: ExpertBudget | None = None,
    valid_BT: jax.Array | None = None,
    compute_logits: bool = True,
    fresh_cache: bool = False,
    hidden_at_B: jax.Array | None = None,
    tree: TreeMask | None = None,
  ) -> ForwardOutput:
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
    `kernels`: the program's kernel policy and packed weights (a `PackedWeights` or None; each block
    gets its part); the default runs XLA's ops with the config's expert method.
    `tree` (with a filled cache): a tree pass (`cache.TreeMask`). Its T tokens are written at
    consecutive slots while `positions_BT` give each token its depth's position (RoPE); a token
    attends to every slot before the tree's and to those of the tree the mask allows (itself and
    its ancestors: `rejection.ancestor_mask`). After verification `KVCache.move_path` moves the
    accepted path's entries to consecutive slots.
    """
    if hidden_at_B is not None and expert_budget is not None:
      raise ValueError(
        "hidden_at_B with expert_budget: the last layer's expert budget would be ranked over the "
        "selected positions only; run the whole pass (hidden_at_B=None) and index its output"
      )
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1], dtype=jnp.int32), tokens_BT.shape)
    x_BTD = jnp.take(self.embed_VD[...], tokens_BT, axis=0)
    rope = self.rope(positions_BT, kernels)
    new_keys, new_values, routings = [], [], []
    last = len(self.layers) - 1
    for i, block in enumerate(self.layers):
      layer_cache = None if cache is None else (cache.keys[i], cache.values[i])
      x_BTD, layer_new, routing = block(
        x_BTD,
        positions_BT,
        rope,
        layer_cache,
        kernels=kernels.child("layers", i),
        expert_budget=expert_budget,
        valid_BT=valid_BT,
        fresh_cache=fresh_cache,
        output_at_B=hidden_at_B if i == last else None,
        tree=tree,
      )
      if layer_new is not None:
        new_keys.append(layer_new[0])
        new_values.append(layer_new[1])
      if routing is not None:
        routings.append(routing)
    hidden_BTD = self.final_norm(x_BTD, kernels)
    routing = None
    if routings and hidden_at_B is None:
      routing = Routing(*(jnp.stack(parts) for parts in zip(*routings)))
    new_cache = None if cache is None else KVCache(tuple(new_keys), tuple(new_values))
    logits_BTV = self.head(hidden_BTD, kernels) if compute_logits else None
    return ForwardOutput(logits_BTV, hidden_BTD, routing, new_cache)
