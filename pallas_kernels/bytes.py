"""Byte accounting: bytes each expert-FFN method requests for a routing (weights + activations).

Weights: one expert's SwiGLU weights are 3 * d_model * expert_hidden elements (gate, up, down).
  dedup:     each unique expert of the pass once;
  per_slot:  once per (token, slot) pair;
  xla:       as per_slot (the XLA paths read or gather one weight set per pair at small n).
Activations (same for every method): each (token, slot) pair reads its token's d_model inputs and
writes d_model outputs, plus its expert id (4 bytes) and gate (dtype_bytes).
These are the bytes a method asks the memory system for; caches may serve some of them, which is
why effective bandwidth (requested bytes / time) can exceed the streaming bandwidth for small layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

METHODS = ("dedup", "per_slot", "xla")


def unique_experts(expert_ids_TK: ArrayLike) -> int:
  """Number of distinct experts in a routing (numpy, host side)."""
  return int(np.unique(np.asarray(expert_ids_TK)).size)


def unique_experts_jnp(expert_ids_TK: jax.Array, n_experts: int) -> jax.Array:
  """Number of distinct experts, jit-compatible (int32 scalar)."""
  hit_E = jnp.zeros((n_experts,), jnp.int32).at[expert_ids_TK.reshape(-1)].max(1)
  return jnp.sum(hit_E)


def expert_bytes(d_model: int, expert_hidden: int, dtype_bytes: int) -> int:
  """Bytes of one expert's gate, up and down matrices."""
  return 3 * d_model * expert_hidden * dtype_bytes


def weight_reads(expert_ids_TK: ArrayLike, method: str) -> int:
  """Expert weight sets a method reads for this routing."""
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  ids = np.asarray(expert_ids_TK)
  return unique_experts(ids) if method == "dedup" else int(ids.size)


def activation_bytes(n_tokens: int, top_k: int, d_model: int, dtype_bytes: int) -> int:
  """Inputs read and outputs written per (token, slot) pair, plus ids and gates."""
  pairs = n_tokens * top_k
  return pairs * (2 * d_model * dtype_bytes + 4 + dtype_bytes)


def bytes_requested(expert_ids_TK: ArrayLike, d_model: int, expert_hidden: int, dtype_bytes: int, method: str) -> int:
  """Weights plus activations a method requests for the routing expert_ids_TK [T, K]."""
  ids = np.asarray(expert_ids_TK)
  n_tokens, top_k = ids.shape
  return weight_reads(ids, method) * expert_bytes(d_model, expert_hidden, dtype_bytes) + activation_bytes(
    n_tokens, top_k, d_model, dtype_bytes
  )


def expected_unique_uniform(n_tokens: int, n_experts: int, top_k: int) -> float:
  """E[unique experts] when each token picks top_k of n_experts uniformly: N[1-(1-k/N)^n]."""
  return n_experts * (1.0 - (1.0 - top_k / n_experts) ** n_tokens)
