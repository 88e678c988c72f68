"""Choosing a draft tree's nodes by their expert cost (EcoSpec-style) and truncating it to the prefix
that pays (EVICT-style); pure functions on the drafter's candidates.

Each candidate node x carries its path's log-probability under the drafter, log q(x), and the
experts it is predicted to route to per MoE layer (`model.expert_table`). `select_expert_aware`
grows the tree one node at a time: among the candidates whose parent is in the tree, it takes the
one of highest log q(x) - penalty * dC(x), where dC(x) counts the (layer, expert) pairs x would add
to the pass's predicted union (the batch's: the pass reads one union for all rows). Every pair
costs the same bytes within a model, so counting pairs weighs them by bytes. With penalty 0 the
nodes are the N likeliest paths, as the probability policy chooses.

`truncate` keeps, per row, the prefix of the chosen order that maximises the expected committed
tokens over the predicted pass time: E[tokens](n) = 1 + sum of the first n nodes' q(x) (the
drafter's path probability standing for the chance that the target accepts the path), and
T(n) = fixed + per_node * (n + 1) + per_expert * U(n) with U(n) the predicted union after n nodes
(`TreeCost`, in units of a plain pass). Nodes past the prefix are invalid: the pass reads no
expert for them. Choosing which nodes are verified from their token values keeps greedy
verification exact (it checks whatever tokens it is given); sampled verification's residual
scheme does not allow it, so these policies are greedy only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moespec_jax.analysis import regime
from moespec_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class TreeCost:
  """A verification pass's predicted time, in units of a plain pass (one token, its K experts a
  layer): fixed + per_node * tokens + per_expert * (layer, expert) pairs read."""

  fixed: float
  per_node: float
  per_expert: float

  def __post_init__(self) -> None:
    for name in ("fixed", "per_node", "per_expert"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"TreeCost.{name} must be a number >= 0, got {value!r}")
    if self.fixed + self.per_node <= 0:
      raise ValueError("TreeCost needs fixed + per_node > 0 (a pass takes some time)")

  @classmethod
  def from_bytes(cls, config: ModelConfig) -> TreeCost:
    """The bytes model where a pass is bound by the weight bytes it reads (`regime.weight_bytes`):
    everything but the routed experts once, an embedding row a token, each distinct expert once."""
    itemsize = jnp.dtype(config.dtype).itemsize
    expert = 3 * config.d_model * config.expert_hidden * itemsize
    plain = regime.weight_bytes(config, 1, unique_experts=float(config.top_k))
    other = regime.weight_bytes(config, 1, unique_experts=0.0) - config.d_model * itemsize
    return cls(fixed=other / plain, per_node=config.d_model * itemsize / plain, per_expert=expert / plain)

  def pass_time(self, n_tokens: jax.Array, n_pairs: jax.Array) -> jax.Array:
    return self.fixed + self.per_node * n_tokens + self.per_expert * n_pairs


def select_expert_aware(
  score_BX: jax.Array,
  parent_BX: jax.Array,
  sets_BXLE: jax.Array,
  root_BLE: jax.Array,
  n_nodes: int,
  penalty: float,
  active_B: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The tree's N nodes among X candidates, in the order chosen (a parent before its children).

  score_BX: log q of each candidate's path; parent_BX: its parent's candidate index (-1: the
  root); sets_BXLE: its predicted experts; root_BLE: the pending token's. Rows outside `active_B`
  add nothing to the shared union. Returns (chosen_BN candidate indices, added_BN: the pairs each
  added to the union when chosen, union_LE: the batch's predicted union after all N)."""
  batch, n_cands = score_BX.shape
  active_B = jnp.ones((batch,), jnp.bool_) if active_B is None else active_B
  union_LE = jnp.any(root_BLE & active_B[:, None, None], axis=0)
  taken_BX = jnp.zeros((batch, n_cands), jnp.bool_)
  rows_B = jnp.arange(batch)

  def body(i: int, carry: tuple[jax.Array, jax.Array, jax.Array, jax.Array]):
    taken_BX, union_LE, chosen_BN, added_BN = carry
    parent_in_BX = jnp.take_along_axis(taken_BX, jnp.maximum(parent_BX, 0), axis=1) | (parent_BX < 0)
    added_BX = jnp.sum(sets_BXLE & ~union_LE[None, None], axis=(2, 3))
    value_BX = jnp.where(parent_in_BX & ~taken_BX, score_BX - penalty * added_BX, -jnp.inf)
    pick_B = jnp.argmax(value_BX, axis=1).astype(jnp.int32)
    taken_BX = taken_BX.at[rows_B, pick_B].set(True)
    picked_BLE = sets_BXLE[rows_B, pick_B] & active_B[:, None, None]
    union_LE = union_LE | jnp.any(picked_BLE, axis=0)
    chosen_BN = chosen_BN.at[:, i].set(pick_B)
    added_BN = added_BN.at[:, i].set(added_BX[rows_B, pick_B])
    return taken_BX, union_LE, chosen_BN, added_BN

  init = (taken_BX, union_LE, jnp.zeros((batch, n_nodes), jnp.int32), jnp.zeros((batch, n_nodes), jnp.int32))
  _, union_LE, chosen_BN, added_BN = jax.lax.fori_loop(0, n_nodes, body, init)
  return chosen_BN, added_BN, union_LE


def truncate(score_BN: jax.Array, added_BN: jax.Array, root_pairs_B: jax.Array, cost: TreeCost) -> jax.Array:
  """bool [B, N]: each row's kept prefix (at least one node) of nodes in their chosen order, the
  one of highest expected committed tokens per predicted pass time. score_BN: the nodes' path
  log q; added_BN: the (layer, expert) pairs each added; root_pairs_B: the pending token's."""
  n = score_BN.shape[1]
  expected_BN = 1.0 + jnp.cumsum(jnp.exp(score_BN), axis=1)
  pairs_BN = root_pairs_B[:, None] + jnp.cumsum(added_BN, axis=1)
  tokens_N = jnp.arange(2, n + 2, dtype=jnp.float32)
  rate_BN = expected_BN / cost.pass_time(tokens_N[None], pairs_BN.astype(jnp.float32))
  keep_B = jnp.argmax(rate_BN, axis=1) + 1
  return jnp.arange(n)[None] < keep_B[:, None]
