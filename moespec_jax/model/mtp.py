"""Multi-token-prediction (MTP) drafter modules in the style of DeepSeek-V3.

Module k (k = 1..M, M = `num_mtp_modules`) combines the previous depth's hidden state with
the embedding of the next token and runs one transformer block:

  h'_i^k = W_p [RMSNorm(h_i^{k-1}); RMSNorm(Emb(t_{i+k}))]
  h_i^k = Block_k(h'^k)_i      (causal over the module's own stream, with its own KV cache)
  logits_i^k = head(final_norm(h_i^k))      predicts t_{i+k+1}

h^0 is the target's final hidden state (`ForwardOutput.hidden`); the embedding, the final
norm and the output head are the target's (shared, frozen while the heads train). The block
is MoE when the target has MoE layers, dense otherwise, or dense of width `mtp_dense_hidden` where
the config sets it (a draft step then reads no routed expert).

Depths beyond M (K > M drafts) reuse the last module recursively, EAGLE-style: depth k > M
continues module M's stream one index further, taking the previous depth's output as the
stand-in for the next target hidden state (h_i^M predicts t_{i+M+1}, as h_{i+1}^{M-1} does).

KV caches during generation (one cache layer per module, rolled back by position only,
as the target's): after each verify pass of K+1 tokens at positions [p, p+K+1) of which a
drafts were accepted and token y was committed, `fill` runs modules 1..M over those K+1
indices with the target's hidden states and the committed next tokens [d_1..d_a, y]
(placeholders where the next token is not known yet). The output of module 1 at index p+a
is the depth-1 draft for the next pass; deeper drafts are single-token steps that write
at index p+a (modules 2..M) or beyond (recursive depths). Module 1's entries below the next
pass's first index p+a+1 are then exactly what teacher forcing computes in training, and
everything at or beyond it is rewritten by the next fill before it can be read: causal
attention by position makes this rollback copy-free. For modules k >= 2, the entries at the
k-1 indices before p+a+1 keep the token they were given (a draft or a placeholder) when it
was not the committed one; this only affects draft quality (DeepSeek-V3 and the default model
use M = 1), never exactness, since verification does not depend on what the drafter computes.
A generation's prompt fill may cover only each row's last prompt positions (`SpecParams.
mtp_prompt_window`): the row's stream then starts there at index 0, and every later index is the
position less that offset (RoPE is relative: the shift leaves attention unchanged).
Training (`forward_train`) runs
the same modules over whole sequences with teacher forcing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from moespec_jax.config import ModelConfig
from moespec_jax.model.block import Block
from moespec_jax.model.cache import KVCache, LayerCache, TreeMask
from moespec_jax.model.kernels import PLAIN, Kernels, packed_product, use_packed
from moespec_jax.model.layers import RMSNorm, RopeTables, at_index, fan_in_init
from moespec_jax.model.moe import LayerRouting


class MTPTarget(Protocol):
  """What the MTP modules read of their target: the `Transformer` (which imports this module), its
  embedding, final norm, output head, rotary tables and its MTP modules."""

  config: ModelConfig
  embed_VD: nnx.Param
  final_norm: RMSNorm
  mtp: Sequence[MTPModule] | None

  def rope(self, positions_BT: jax.Array, kernels: Kernels = PLAIN) -> RopeTables: ...

  def head(self, hidden_BTD: jax.Array, kernels: Kernels = PLAIN) -> jax.Array: ...


class MTPModule(nnx.Module):
  """One MTP depth: norms, the [hidden; embedding] projection W_p, one transformer block."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: DTypeLike = jnp.float32) -> None:
    d = config.d_model
    self.hidden_norm = RMSNorm(d, config.norm_eps)
    self.embed_norm = RMSNorm(d, config.norm_eps)
    self.w_proj_CD = nnx.Param(fan_in_init(2 * d)(rngs.params(), (2 * d, d), dtype))
    # MoE block when the target has MoE layers (layer index n_layers is MoE iff any layer is),
    # unless the config asks for a dense FFN (`mtp_dense_hidden`).
    layer = config.n_layers if config.n_moe_layers else 0
    self.block = Block(config, layer, rngs=rngs, dtype=dtype, dense_hidden=config.mtp_dense_hidden or None)
    # Imported DeepSeek-V3 layers: their own norm (and maybe head) before the logits.
    self.head_norm = RMSNorm(d, config.norm_eps) if config.mtp_head_norm else None
    self.head_DV = (
      nnx.Param(fan_in_init(d)(rngs.params(), (d, config.vocab_size), dtype)) if config.mtp_own_head else None
    )

  def logits(
    self, model: MTPTarget, h_BTD: jax.Array, *, kernels: Kernels = PLAIN, model_kernels: Kernels = PLAIN
  ) -> jax.Array:
    """Output logits of the module's hidden state (the target's head unless it has its own).
    `kernels`: this module's (a `PackedMTP` or None); `model_kernels`: the target's (its final norm
    and head)."""
    if self.head_norm is not None:
      normed_BTD = self.head_norm(h_BTD, kernels)
    else:
      normed_BTD = model.final_norm(h_BTD, model_kernels)
    if self.head_DV is None:
      return model.head(normed_BTD, model_kernels)
    packed = kernels.dense
    if packed is not None and use_packed(packed.head_NDC, normed_BTD):
      return packed_product(normed_BTD, packed.head_NDC, self.head_DV.shape[1])
    return jnp.einsum("btd,dv->btv", normed_BTD, self.head_DV[...])

  def __call__(
    self,
    hidden_BTD: jax.Array,
    next_emb_BTD: jax.Array,
    positions_BT: jax.Array,
    rope: RopeTables,
    layer_cache: LayerCache | None,
    *,
    kernels: Kernels = PLAIN,
    valid_BT: jax.Array | None = None,
    fresh_cache: bool = False,
    output_at_B: jax.Array | None = None,
    tree: TreeMask | None = None,
  ) -> tuple[jax.Array, LayerCache | None, LayerRouting | None]:
    """Returns (h_BTD, new layer cache, routing). Tokens outside `valid_BT` read no routed expert
    (see `Transformer.__call__`); `output_at_B`: see `Block.__call__`. `kernels`: the policy and a
    `PackedMTP` or None. `tree`: a draft tree's level over the module's own cache (`TreeMask`)."""
    x_BTC = jnp.concatenate([self.hidden_norm(hidden_BTD, kernels), self.embed_norm(next_emb_BTD, kernels)], axis=-1)
    packed = kernels.dense
    if packed is not None and use_packed(packed.proj_NDC, x_BTC):
      x_BTD = packed_product(x_BTC, packed.proj_NDC, self.w_proj_CD.shape[1]).astype(x_BTC.dtype)
    else:
      x_BTD = jnp.einsum("btc,cd->btd", x_BTC, self.w_proj_CD[...])
    return self.block(
      x_BTD,
      positions_BT,
      rope,
      layer_cache,
      kernels=kernels.child("block"),
      valid_BT=valid_BT,
      fresh_cache=fresh_cache,
      output_at_B=output_at_B,
      tree=tree,
    )


def new_cache(config: ModelConfig, batch: int, max_len: int) -> KVCache:
  """One cache layer per MTP module, shaped like the target's (MLA: latent and rope key)."""
  return KVCache.for_config(config, batch, max_len, n_layers=config.num_mtp_modules)


def module_for_depth(depth: int, num_modules: int) -> tuple[int, int]:
  """(module index, position offset) of draft depth `depth` (1-based); see the module docstring."""
  m = min(depth, num_modules)
  return m - 1, depth - m


def run_module(
  model: MTPTarget,
  m: int,
  hidden_BTD: jax.Array,
  next_tokens_BT: jax.Array,
  positions_BT: jax.Array,
  cache: KVCache | None,
  *,
  kernels: Kernels = PLAIN,
  compute_logits: bool = True,
  valid_BT: jax.Array | None = None,
  fresh_cache: bool = False,
  output_at_B: jax.Array | None = None,
  tree: TreeMask | None = None,
) -> tuple[jax.Array, jax.Array | None, KVCache | None]:
  """Module `m` (0-based) over T tokens; returns (h_BTD, logits_BTV or None, new cache or None).
  Tokens outside `valid_BT` (default: none) read no routed expert: their outputs are not used.
  `output_at_B`: the output only at that index per row, [B, 1, ...] (`Block.__call__`). `kernels`:
  the model's (`Transformer.__call__`); the module gets its part. `tree`: the T tokens are a level
  of a draft tree (`cache.TreeMask`)."""
  emb_BTD = jnp.take(model.embed_VD[...], next_tokens_BT, axis=0)
  rope = model.rope(positions_BT, kernels)
  layer_cache = None if cache is None else (cache.keys[m], cache.values[m])
  module_kernels = kernels.child("mtp", m)
  h_BTD, layer_new, _ = model.mtp[m](
    hidden_BTD,
    emb_BTD,
    positions_BT,
    rope,
    layer_cache,
    kernels=module_kernels,
    valid_BT=valid_BT,
    fresh_cache=fresh_cache,
    output_at_B=output_at_B,
    tree=tree,
  )
  logits_BTV = None
  if compute_logits:
    logits_BTV = model.mtp[m].logits(model, h_BTD, kernels=module_kernels, model_kernels=kernels)
  if cache is not None:
    cache = KVCache(
      keys=cache.keys[:m] + (layer_new[0],) + cache.keys[m + 1 :],
      values=cache.values[:m] + (layer_new[1],) + cache.values[m + 1 :],
    )
  return h_BTD, logits_BTV, cache


def fill(
  model: MTPTarget,
  target_hidden_BTD: jax.Array,
  seq_BT: jax.Array,
  positions_BT: jax.Array,
  cache: KVCache,
  *,
  kernels: Kernels = PLAIN,
  at_B: jax.Array | None = None,
  valid_BT: jax.Array | None = None,
  fresh_cache: bool = False,
) -> tuple[jax.Array, jax.Array, KVCache]:
  """Runs modules 1..M over T indices; module k reads next tokens `seq_BT[:, k:]`.

  `seq_BT` holds T + M tokens per row: the tokens at positions [p+1, p+T+M) (unknown ones
  are placeholders). Returns (module-1 hidden, module-1 logits, new cache): at every index
  ([B, T, D], [B, T, V]), or with `at_B` at one index per row ([B, D], [B, V]; the head runs
  there only). `valid_BT` [B, T]: the indices whose outputs or cache entries are kept (the
  others read no routed expert). `fresh_cache`: the cache is empty (a prefill). `kernels`: the
  model's (`Transformer.__call__`).

  With `at_B`, the last module's attention queries and FFN run at that one index per row only
  (`Block.__call__`'s `output_at_B`): its cache entries come from its block's input, its output
  is read there (module 1) or not at all (a deeper last module). A prompt fill of T tokens then
  runs them (and reads its routed experts) for one token per row instead of T.
  """
  t = target_hidden_BTD.shape[1]
  n_modules = model.config.num_mtp_modules
  hidden, first = target_hidden_BTD, None
  for m in range(n_modules):
    hidden, _, cache = run_module(
      model,
      m,
      hidden,
      seq_BT[:, m : m + t],
      positions_BT,
      cache,
      kernels=kernels,
      compute_logits=False,
      valid_BT=valid_BT,
      fresh_cache=fresh_cache,
      output_at_B=at_B if m == n_modules - 1 else None,
    )
    if first is None:
      first = hidden
  first_kernels = kernels.child("mtp", 0)
  if at_B is None:
    return first, model.mtp[0].logits(model, first, kernels=first_kernels, model_kernels=kernels), cache
  h1_BD = (first if n_modules == 1 else at_index(first, at_B))[:, 0]
  logits1_BV = model.mtp[0].logits(model, h1_BD[:, None], kernels=first_kernels, model_kernels=kernels)[:, 0]
  return h1_BD, logits1_BV, cache


def forward_train(
  model: MTPTarget, target_hidden_BTD: jax.Array, tokens_BT: jax.Array, depths: int, *, kernels: Kernels = PLAIN
) -> list[jax.Array]:
  """Teacher-forced MTP logits for depths 1..`depths` (<= M) over a whole sequence.

  Depth k at index i predicts tokens_BT[:, i + k + 1]; returns a list of logits
  [B, T - k - 1, V] aligned so that entry i predicts tokens_BT[:, i + k + 1].
  """
  b, t = tokens_BT.shape
  out, hidden = [], target_hidden_BTD
  for k in range(1, depths + 1):
    n = t - k  # indices with a known next token t_{i+k}
    positions_BT = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    hidden, logits, _ = run_module(
      model, k - 1, hidden[:, :n], tokens_BT[:, k : k + n], positions_BT, None, kernels=kernels
    )
    out.append(logits[:, : n - 1])
  return out
