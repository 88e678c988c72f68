"""Expert placement: which expert rank holds each routed expert of each MoE layer, how the passes of
a routing trace load the ranks under a placement, and a model whose experts are renumbered so that
a mesh's contiguous shards realise a placement.

A placement is `rank_LE` int [L, E]: the rank of expert e of MoE layer l, each rank holding E / R
experts of every layer. A pass of n consecutive tokens loads rank r of layer l with the (token,
slot) pairs routed to its experts; the pass waits for its slowest rank, so a placement is judged by
the slowest rank's pairs over the mean rank's (`imbalance`), pass by pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from moespec_jax.model.moe import ROUTED_EXPERT_PARAMS
from moespec_jax.model.transformer import Transformer


def _check_ranks(n_experts: int, n_ranks: int) -> None:
  if n_ranks < 1 or n_experts % n_ranks:
    raise ValueError(f"{n_experts} experts do not divide over {n_ranks} ranks")


def contiguous(n_layers: int, n_experts: int, n_ranks: int) -> np.ndarray:
  """Rank r holds experts [r E / R, (r + 1) E / R) of every layer (a mesh's own sharding)."""
  _check_ranks(n_experts, n_ranks)
  return np.tile(np.arange(n_experts) // (n_experts // n_ranks), (n_layers, 1))


def by_popularity(popularity_LE: np.ndarray, n_ranks: int) -> np.ndarray:
  """Per layer, experts from the most to the least popular, each to the rank with the least
  popularity so far among those with room (E / R experts a rank): balances the expected load."""
  n_layers, n_experts = popularity_LE.shape
  _check_ranks(n_experts, n_ranks)
  room = n_experts // n_ranks
  rank_LE = np.zeros((n_layers, n_experts), np.int64)
  for layer in range(n_layers):
    load_R, count_R = np.zeros(n_ranks), np.zeros(n_ranks, np.int64)
    for e in np.argsort(-popularity_LE[layer], kind="stable"):
      open_R = np.flatnonzero(count_R < room)
      r = open_R[np.argmin(load_R[open_R])]
      rank_LE[layer, e] = r
      load_R[r] += popularity_LE[layer, e]
      count_R[r] += 1
  return rank_LE


def pass_pair_counts(segments: Sequence[np.ndarray], n_experts: int, n_tokens: int) -> list[np.ndarray]:
  """Per MoE layer, float [P, E]: the pairs each expert gets in each pass of `n_tokens` consecutive
  tokens (non-overlapping windows of each segment [L, N, K] of a routing trace)."""
  n_layers = segments[0].shape[0]
  out: list[list[np.ndarray]] = [[] for _ in range(n_layers)]
  for seg in segments:
    n_passes = seg.shape[1] // n_tokens
    if not n_passes:
      continue
    ids_LPX = seg[:, : n_passes * n_tokens].reshape(n_layers, n_passes, -1)
    for layer in range(n_layers):
      counts = np.zeros((n_passes, n_experts))
      np.add.at(counts, (np.arange(n_passes)[:, None], ids_LPX[layer]), 1.0)
      out[layer].append(counts)
  if not out[0]:
    raise ValueError(f"no segment of the trace holds a pass of {n_tokens} tokens")
  return [np.concatenate(parts) for parts in out]


def rank_loads(counts_PE: np.ndarray, rank_E: np.ndarray, n_ranks: int) -> np.ndarray:
  """[P, R]: each rank's pairs in each pass."""
  return counts_PE @ np.eye(n_ranks)[rank_E]


def imbalance(loads_PR: np.ndarray) -> np.ndarray:
  """[P]: the slowest rank's pairs over the mean rank's (1 for a pass without pairs)."""
  mean_P = loads_PR.mean(axis=1)
  return np.where(mean_P > 0, loads_PR.max(axis=1) / np.maximum(mean_P, 1e-12), 1.0)


def replicated_imbalance(counts_PE: np.ndarray, rank_E: np.ndarray, hot_E: np.ndarray, n_ranks: int) -> np.ndarray:
  """[P]: `imbalance` where the experts `hot_E` (bool [E]) are held by every rank and their pairs
  go, pass by pass, to the least loaded ranks (water-filling, whole pairs)."""
  base_PR = rank_loads(counts_PE * ~hot_E, rank_E, n_ranks)
  total_P = counts_PE.sum(axis=1)
  slowest_P = np.maximum(base_PR.max(axis=1), np.ceil(total_P / n_ranks))
  mean_P = total_P / n_ranks
  return np.where(mean_P > 0, slowest_P / np.maximum(mean_P, 1e-12), 1.0)


def by_pass_load(
  counts_LPE: Sequence[np.ndarray], n_ranks: int, *, start_LE: np.ndarray | None = None, sweeps: int = 10
) -> np.ndarray:
  """Per layer, a placement fitted to measured passes (`pass_pair_counts`): from `start_LE`
  (default: `contiguous`), swaps of two experts on different ranks that lower the passes' mean
  `imbalance`, until a sweep over all pairs finds none (or `sweeps` sweeps). Spreads experts that
  are chosen together in a pass, which popularity alone cannot see."""
  n_layers, n_experts = len(counts_LPE), counts_LPE[0].shape[1]
  rank_LE = contiguous(n_layers, n_experts, n_ranks) if start_LE is None else np.array(start_LE)
  for layer, counts_PE in enumerate(counts_LPE):
    rank_E = rank_LE[layer]
    best = imbalance(rank_loads(counts_PE, rank_E, n_ranks)).mean()
    for _ in range(sweeps):
      improved = False
      for a in range(n_experts):
        for b in range(a + 1, n_experts):
          if rank_E[a] == rank_E[b]:
            continue
          rank_E[[a, b]] = rank_E[[b, a]]
          value = imbalance(rank_loads(counts_PE, rank_E, n_ranks)).mean()
          if value < best - 1e-12:
            best, improved = value, True
          else:
            rank_E[[a, b]] = rank_E[[b, a]]
      if not improved:
        break
  return rank_LE


def cross_node_share(counts_PE: np.ndarray, rank_E: np.ndarray, home_P: np.ndarray, ranks_per_node: int) -> float:
  """The share of pairs whose expert's rank is on another node than their pass's home rank
  (`home_P`: where the pass's tokens live, as the exchanged dispatch sends them)."""
  node_E = np.asarray(rank_E) // ranks_per_node
  crossing_PE = node_E[None, :] != (np.asarray(home_P) // ranks_per_node)[:, None]
  total = counts_PE.sum()
  return float((counts_PE * crossing_PE).sum() / total) if total else 0.0


def expert_order(rank_LE: np.ndarray) -> np.ndarray:
  """[L, E]: the experts of each layer ordered by rank (stable): slot j of the renumbered model holds
  expert order[l, j], so that contiguous shards of the renumbered model realise `rank_LE`."""
  rank_LE = np.asarray(rank_LE)
  counts = np.stack([np.bincount(r, minlength=rank_LE.max() + 1) for r in rank_LE])
  if not np.all(counts == counts[:, :1]):
    raise ValueError("a placement must give every rank the same number of experts in every layer")
  return np.argsort(rank_LE, axis=1, kind="stable")


def renumber_experts(module: Transformer, order_LE: np.ndarray) -> None:
  """Renumbers the routed experts of the target's MoE layers in place: new expert j of layer l is
  old expert order[l, j] (router columns, score bias and expert weights together), an equivalent
  model whose routing names the experts by their new numbers. ValueError for group-limited routing
  (the groups are ranges of expert numbers) or an order that is not a permutation per layer."""
  config = module.config
  order_LE = np.asarray(order_LE)
  if order_LE.shape != (config.n_moe_layers, config.n_routed_experts):
    raise ValueError(
      f"order must be [MoE layers, experts] = {(config.n_moe_layers, config.n_routed_experts)}, got {order_LE.shape}"
    )
  if not np.all(np.sort(order_LE, axis=1) == np.arange(config.n_routed_experts)):
    raise ValueError("order must be a permutation of the experts in every layer")
  if config.n_groups > 1:
    raise ValueError("experts of group-limited routing (n_groups > 1) cannot be renumbered: groups are number ranges")
  for order_E, layer_index in zip(order_LE, config.moe_layers):
    ffn = module.layers[layer_index].ffn
    index = jnp.asarray(order_E)
    ffn.w_router_DE[...] = ffn.w_router_DE[...][:, index]
    if ffn.score_bias_E is not None:
      ffn.score_bias_E[...] = ffn.score_bias_E[...][index]
    for name in ROUTED_EXPERT_PARAMS:
      getattr(ffn, name)[...] = getattr(ffn, name)[...][index]
