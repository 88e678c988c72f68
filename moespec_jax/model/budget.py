"""MoE-Spec expert budgeting: an APPROXIMATE mode for verification passes.

Each MoE layer may load at most `budget` distinct routed experts in a pass. Experts are ranked
by their aggregate routing probability over the pass's valid tokens that selected them (per
batch row, or across the whole batch), the top `budget` kept; experts no token selected rank
last. So a budget at least as large as the pass's union of selected experts cuts nothing and
the pass is bit-identical to exact mode. A token whose chosen expert was cut then either

- `truncate`: drops it (its gate becomes 0) and, where the model renormalises its top-k gates
  (`norm_topk_prob`), renormalises the remaining ones; a token that lost every expert keeps
  its best kept experts instead (as `substitute`), or
- `substitute`: takes its highest-scoring kept experts instead (the router's top-k restricted
  to the kept set; the gates are computed as the router computes them).

Shared experts are never cut. A dropped slot points at one of the token's kept experts with a
zero gate, so the expert kernels read only kept experts: the requested bytes really fall.
The result is not the target's distribution: report it with its quality figures.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

POLICIES = ("truncate", "substitute")
SCOPES = ("batch", "row")


@dataclasses.dataclass(frozen=True)
class ExpertBudget:
  """At most `budget` routed experts per MoE layer per pass (per row when scope='row')."""

  budget: int
  policy: str = "truncate"
  scope: str = "batch"

  def __post_init__(self) -> None:
    if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1:
      raise ValueError(f"expert_budget must be an int >= 1, got {self.budget!r}")
    if self.policy not in POLICIES:
      raise ValueError(f"budget_policy must be one of {POLICIES}, got {self.policy!r}")
    if self.scope not in SCOPES:
      raise ValueError(f"budget_scope must be one of {SCOPES}, got {self.scope!r}")


def kept_experts(
  probs_BTE: jax.Array, expert_ids_BTK: jax.Array, valid_BT: jax.Array, budget: ExpertBudget
) -> jax.Array:
  """bool [B, T, E]: the experts each token may use, top-`budget` by aggregate probability."""
  b, t, e = probs_BTE.shape
  chosen_BTE = jnp.any(jax.nn.one_hot(expert_ids_BTK, e, dtype=jnp.bool_), axis=-2)
  # Selected experts first (their summed probability, in [0, T] per token set), then the rest
  # by probability (scaled below any selected expert's weight).
  weight_BTE = jnp.where(chosen_BTE, probs_BTE + 1.0, probs_BTE * 1e-3)
  weight_BTE = weight_BTE * valid_BT[..., None].astype(probs_BTE.dtype)
  if budget.scope == "batch":
    agg_GE = jnp.sum(weight_BTE, axis=(0, 1))[None]
  else:
    agg_GE = jnp.sum(weight_BTE, axis=1)
  k_keep = min(budget.budget, e)
  _, top_GB = jax.lax.top_k(agg_GE, k_keep)
  kept_GE = jnp.zeros(agg_GE.shape, bool).at[jnp.arange(agg_GE.shape[0])[:, None], top_GB].set(True)
  return jnp.broadcast_to(kept_GE[:, None, :], (b, t, e))


def _gates(
  scores_NE: jax.Array, ids_NK: jax.Array, keep_NK: jax.Array, norm_topk_prob: bool, scale: float
) -> jax.Array:
  gates_NK = jnp.take_along_axis(scores_NE, ids_NK, axis=-1) * keep_NK.astype(scores_NE.dtype)
  if norm_topk_prob:
    gates_NK = gates_NK / (jnp.sum(gates_NK, axis=-1, keepdims=True) + 1e-20)
  return gates_NK * scale


def restrict(
  scores_NE: jax.Array,
  choice_NE: jax.Array,
  ids_NK: jax.Array,
  allowed_NE: jax.Array,
  *,
  top_k: int,
  norm_topk_prob: bool,
  scale: float,
  policy: str,
) -> tuple[jax.Array, jax.Array]:
  """Budgeted routing: (expert_ids [N, K], gates [N, K]) using only `allowed` experts.

  `choice_NE` is the selection score the router ranked by (with group limits applied as -inf);
  `ids_NK` its unbudgeted top-k.
  """
  # Substitution: the router's top-k among kept experts (group limits kept where they leave
  # at least top_k eligible experts, else dropped for that token).
  eligible_NE = allowed_NE & jnp.isfinite(choice_NE)
  enough_N1 = jnp.sum(eligible_NE, axis=-1, keepdims=True) >= top_k
  eligible_NE = jnp.where(enough_N1, eligible_NE, allowed_NE)
  ranked_NE = jnp.where(eligible_NE, jnp.where(jnp.isfinite(choice_NE), choice_NE, scores_NE), -jnp.inf)
  _, sub_ids_NK = jax.lax.top_k(ranked_NE, top_k)
  sub_gates_NK = _gates(scores_NE, sub_ids_NK, jnp.ones(sub_ids_NK.shape, bool), norm_topk_prob, scale)
  if policy == "substitute":
    return sub_ids_NK.astype(jnp.int32), sub_gates_NK

  keep_NK = jnp.take_along_axis(allowed_NE, ids_NK, axis=-1)
  any_N = jnp.any(keep_NK, axis=-1)
  first_kept_N = jnp.argmax(keep_NK, axis=-1)
  stand_in_N1 = jnp.take_along_axis(ids_NK, first_kept_N[:, None], axis=-1)
  trunc_ids_NK = jnp.where(keep_NK, ids_NK, stand_in_N1)
  trunc_gates_NK = _gates(scores_NE, ids_NK, keep_NK, norm_topk_prob, scale)
  ids_NK = jnp.where(any_N[:, None], trunc_ids_NK, sub_ids_NK)
  gates_NK = jnp.where(any_N[:, None], trunc_gates_NK, sub_gates_NK)
  return ids_NK.astype(jnp.int32), gates_NK
