"""Predicted routing of a draft token before the target routes it: a token-to-experts table.

A draft tree that widens the union of experts its verification pass reads costs more in an MoE
target; choosing nodes by that cost needs each candidate's experts before the pass. The table
holds, per MoE layer and token id, the K experts the target chose most often for that token over a
text (its own routing, counted); a token the text never held falls back to the layer's router
applied to the token's normed embedding. Predicting by the token alone ignores its context, which
the target's routing also reads: its recall against the target's choice, and that of the other
predictors the tree bench measures, are in docs/findings/2026-12-07-expert-aware-trees.md.

The table is [L, V, K] int32 (L MoE layers, V tokens): 16 KB a layer for the default model; a
large-vocabulary model's (V = 129k, L = 58, K = 8) about 240 MB, which would want int16 ids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from moespec_jax.model import moe as moe_lib

if TYPE_CHECKING:
  from moespec_jax.model.transformer import Transformer


@struct.dataclass
class ExpertTable:
  """Per MoE layer and token id, the K experts predicted for that token."""

  ids_LVK: jax.Array
  """int32 [L, V, K]: the predicted experts of token v at MoE layer l."""

  def predict(self, tokens: jax.Array) -> jax.Array:
    """int32 [..., L, K]: the predicted experts of each token of `tokens` [...]."""
    return jnp.moveaxis(self.ids_LVK[:, tokens], 0, -2)

  def expert_sets(self, tokens: jax.Array, n_experts: int) -> jax.Array:
    """bool [..., L, E]: the predicted experts of each token as a set per layer."""
    return jnp.any(jax.nn.one_hot(self.predict(tokens), n_experts, dtype=jnp.bool_), axis=-2)


def router_prediction(module: Transformer, x_ND: jax.Array) -> jax.Array:
  """int32 [L, N, K]: each MoE layer's routing of the residual-stream vectors `x_ND` (the layer's
  FFN norm, router and top-k, as the target routes its own residual stream there)."""
  out = []
  for i in module.config.moe_layers:
    block = module.layers[i]
    moe = block.ffn
    normed_ND = block.ffn_norm(x_ND.astype(jnp.float32))
    logits_NE = jnp.einsum("nd,de->ne", normed_ND, moe.w_router_DE[...].astype(jnp.float32))
    bias = None if moe.score_bias_E is None else moe.score_bias_E[...]
    ids_NK, _, _ = moe_lib.route(logits_NE, module.config, bias)
    out.append(ids_NK)
  return jnp.stack(out)


def count_experts(module: Transformer, tokens_NT: np.ndarray, *, batch: int = 16) -> np.ndarray:
  """float64 [L, V, E]: how often the target routed each token id to each expert, per MoE layer,
  over the rows of `tokens_NT` (each row one forward pass from position 0)."""
  config = module.config
  tokens_NT = np.asarray(tokens_NT, np.int32)
  if tokens_NT.ndim != 2 or tokens_NT.size == 0:
    raise ValueError(f"tokens must be a non-empty [rows, length] array, got shape {tokens_NT.shape}")
  if tokens_NT.min() < 0 or tokens_NT.max() >= config.vocab_size:
    raise ValueError(f"token ids must lie in [0, {config.vocab_size}), got [{tokens_NT.min()}, {tokens_NT.max()}]")
  if not config.n_moe_layers:
    raise ValueError("the model has no MoE layer: there is no routing to count")
  graphdef, state = nnx.split(module)
  routing_ids = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t, compute_logits=False).routing.expert_ids)
  counts_LVE = np.zeros((config.n_moe_layers, config.vocab_size, config.n_routed_experts))
  layer_L1 = np.arange(config.n_moe_layers)[:, None]
  for start in range(0, tokens_NT.shape[0], batch):
    chunk = tokens_NT[start : start + batch]
    ids_LBTK = np.asarray(routing_ids(state, jnp.asarray(chunk)))
    tok_R = np.repeat(chunk[..., None], config.top_k, axis=-1).reshape(-1)
    np.add.at(counts_LVE, (layer_L1, tok_R[None], ids_LBTK.reshape(config.n_moe_layers, -1)), 1)
  return counts_LVE


def build(module: Transformer, tokens_NT: np.ndarray, *, batch: int = 16) -> ExpertTable:
  """The table from the target's routing over `tokens_NT` (`count_experts`): each token's K most
  frequent experts per layer; tokens never seen there, the router on their normed embedding."""
  config = module.config
  counts_LVE = count_experts(module, tokens_NT, batch=batch)
  # Stable order: among equal counts, the lower expert id.
  counted_LVK = np.argsort(-counts_LVE, axis=-1, kind="stable")[..., : config.top_k]
  embed_VD = module.embed_VD[...]
  fallback_LVK = np.asarray(router_prediction(module, embed_VD))
  seen_V = counts_LVE[0].sum(axis=-1) > 0
  ids_LVK = np.where(seen_V[None, :, None], counted_LVK, fallback_LVK).astype(np.int32)
  return ExpertTable(ids_LVK=jnp.asarray(ids_LVK))


def recall(predicted_LNK: np.ndarray, actual_LNK: np.ndarray) -> np.ndarray:
  """float [L]: per layer, the mean share of each token's actual experts that were predicted."""
  predicted_LNK, actual_LNK = np.asarray(predicted_LNK), np.asarray(actual_LNK)
  if predicted_LNK.shape[:2] != actual_LNK.shape[:2]:
    raise ValueError(f"predicted {predicted_LNK.shape} and actual {actual_LNK.shape} differ in [L, N]")
  hit_LNK = (actual_LNK[..., :, None] == predicted_LNK[..., None, :]).any(axis=-1)
  return hit_LNK.mean(axis=(1, 2))
