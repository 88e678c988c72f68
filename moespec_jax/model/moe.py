"""The MoE FFN: top-k routing variants, routed experts (through `pallas_kernels`), shared experts.

Routing variants (all dropless: every token gets its top_k experts):
- scores: softmax (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2) or sigmoid (DeepSeek-V3) of the router logits;
- selection: top_k of the scores, plus a correction bias when `use_score_bias` (DeepSeek-V3:
  the bias steers selection only, gates use the unbiased scores);
- group-limited: experts split in `n_groups` groups, only the best `topk_groups` groups are
  eligible (group score: top-2 sum with a score bias as in V3, max otherwise as in V2);
- gates: the chosen scores, renormalised to sum 1 when `norm_topk_prob`, times
  `routed_scaling_factor`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

import pallas_kernels
from moespec_jax.config import ModelConfig
from moespec_jax.model import budget as budget_lib
from moespec_jax.model.kernels import PLAIN, Kernels, use_packed
from moespec_jax.model.layers import SwiGLU, fan_in_init
from pallas_kernels import cpu

# The routed experts' weights, stacked on a leading expert axis (what a mesh shards on `expert`).
ROUTED_EXPERT_PARAMS = ("w_gate_EDF", "w_up_EDF", "w_down_EFD")

# One MoE layer's routing: expert_ids [..., K] int32, gates [..., K] f32, probs [..., E] f32 (`route`).
LayerRouting = tuple[jax.Array, jax.Array, jax.Array]


class RouterBias(nnx.Variable):
  """DeepSeek-V3's load-balancing correction bias: not a trained parameter."""


def route(
  logits_TE: jax.Array,
  config: ModelConfig,
  score_bias_E: jax.Array | None = None,
  *,
  allowed_TE: jax.Array | None = None,
  budget_policy: str = "truncate",
) -> LayerRouting:
  """Top-k routing. Returns expert_ids [T, K] int32, gates [T, K] f32, probs [T, E] f32.

  `probs` are the per-token routing probabilities (scores normalised to sum 1), used by
  the load-balancing loss and the routing analysis. With `allowed_TE` (expert budgeting,
  model/budget.py) only allowed experts are used, by `budget_policy`; probs are unchanged.
  """
  logits_TE = logits_TE.astype(jnp.float32)
  if config.score_func == "softmax":
    scores_TE = jax.nn.softmax(logits_TE, axis=-1)
  else:
    scores_TE = jax.nn.sigmoid(logits_TE)
  choice_TE = scores_TE if score_bias_E is None else scores_TE + score_bias_E.astype(jnp.float32)

  if config.n_groups > 1:
    t, e = choice_TE.shape
    grouped_TGE = choice_TE.reshape(t, config.n_groups, e // config.n_groups)
    if score_bias_E is not None:
      group_score_TG = jnp.sum(jax.lax.top_k(grouped_TGE, 2)[0], axis=-1)
    else:
      group_score_TG = jnp.max(grouped_TGE, axis=-1)
    _, top_groups_TG = jax.lax.top_k(group_score_TG, config.topk_groups)
    group_mask_TG = jnp.zeros_like(group_score_TG, bool).at[jnp.arange(t)[:, None], top_groups_TG].set(True)
    expert_mask_TE = jnp.repeat(group_mask_TG, e // config.n_groups, axis=-1)
    choice_TE = jnp.where(expert_mask_TE, choice_TE, -jnp.inf)

  _, expert_ids_TK = jax.lax.top_k(choice_TE, config.top_k)
  probs_TE = scores_TE / jnp.sum(scores_TE, axis=-1, keepdims=True)
  if allowed_TE is not None:
    ids_TK, gates_TK = budget_lib.restrict(
      scores_TE,
      choice_TE,
      expert_ids_TK,
      allowed_TE,
      top_k=config.top_k,
      norm_topk_prob=config.norm_topk_prob,
      scale=config.routed_scaling_factor,
      policy=budget_policy,
    )
    return ids_TK, gates_TK, probs_TE
  gates_TK = jnp.take_along_axis(scores_TE, expert_ids_TK, axis=-1)
  if config.norm_topk_prob:
    gates_TK = gates_TK / (jnp.sum(gates_TK, axis=-1, keepdims=True) + 1e-20)
  gates_TK = gates_TK * config.routed_scaling_factor
  return expert_ids_TK.astype(jnp.int32), gates_TK, probs_TE


def masked_to_read_experts(ids_NK: jax.Array, gates_NK: jax.Array, valid_N: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Expert ids and gates for the kernel, such that masked tokens cost no expert read.

  A masked token's slots point at the experts of the pass's first valid token, with gate 0:
  the dedup kernel reads each selected expert once per pass, so its reads are those of the
  valid tokens alone, and the masked token's routed output is zero. (A whole slot-skipping
  id would need every kernel to know it; this needs none to.)
  """
  first = jnp.argmax(valid_N)
  keep_N1 = valid_N[:, None]
  return (jnp.where(keep_N1, ids_NK, ids_NK[first][None]), jnp.where(keep_N1, gates_NK, jnp.zeros_like(gates_NK)))


class MoE(nnx.Module):
  """Routed experts (SwiGLU, width expert_hidden) plus fused shared experts (optionally gated)."""

  def __init__(self, config: ModelConfig, *, out_scale: float, rngs: nnx.Rngs, dtype: DTypeLike = jnp.float32) -> None:
    d, e, f = config.d_model, config.n_routed_experts, config.expert_hidden
    self.config = config
    self.w_router_DE = nnx.Param(fan_in_init(d)(rngs.params(), (d, e), jnp.float32))
    self.score_bias_E = RouterBias(jnp.zeros((e,), jnp.float32)) if config.use_score_bias else None
    self.w_gate_EDF = nnx.Param(fan_in_init(d)(rngs.params(), (e, d, f), dtype))
    self.w_up_EDF = nnx.Param(fan_in_init(d)(rngs.params(), (e, d, f), dtype))
    self.w_down_EFD = nnx.Param(fan_in_init(f, out_scale)(rngs.params(), (e, f, d), dtype))
    if config.n_shared_experts:
      self.shared = SwiGLU(d, config.shared_width, out_scale=out_scale, rngs=rngs, dtype=dtype)
    else:
      self.shared = None
    # Qwen2-MoE: the shared-expert output is scaled by sigmoid(x . w) per token.
    self.w_shared_gate_D = nnx.Param(jnp.zeros((d,), dtype)) if config.shared_expert_gate else None

  def __call__(
    self,
    x_BTD: jax.Array,
    *,
    kernels: Kernels = PLAIN,
    expert_budget: budget_lib.ExpertBudget | None = None,
    valid_BT: jax.Array | None = None,
  ) -> tuple[jax.Array, LayerRouting]:
    """Routed + shared experts. With `expert_budget` (approximate), at most that many routed
    experts are used, ranked over the pass's `valid_BT` tokens (default: all). Tokens outside
    `valid_BT` (finished rows, empty draft slots) read no expert of their own: their routed
    output is zero (`masked_to_read_experts`). The returned routing is the router's choice.

    `kernels`: the policy's expert method (default: the config's) and platform, and a `PackedMoE`
    or None. Passes of few rows route with the C++ product of the packed router, whose rows do not
    depend on the other rows of the pass (XLA's dot gave a row other last bits alone than among 5
    or 8 rows): a token is routed, and its expert output computed (the C++ expert kernel), with the
    same bits in a plain step and in a verification pass."""
    b, t, d = x_BTD.shape
    x_ND = x_BTD.reshape(b * t, d)
    n_experts = self.w_router_DE.shape[1]
    shared_logit_BT = None
    packed = kernels.dense
    if packed is not None and use_packed(packed.router_NDC, x_BTD):
      gated = self.w_shared_gate_D is not None
      scores_NC = cpu.packed_matmul(x_ND.astype(jnp.float32), packed.router_NDC, n_experts + gated)
      logits_NE = scores_NC[:, :n_experts]
      if gated:
        shared_logit_BT = scores_NC[:, n_experts].reshape(b, t)
    else:
      logits_NE = jnp.einsum("nd,de->ne", x_ND.astype(jnp.float32), self.w_router_DE[...])
    bias = None if self.score_bias_E is None else self.score_bias_E[...]
    ids_NK, gates_NK, probs_NE = route(logits_NE, self.config, bias)
    if expert_budget is not None:
      valid_BT = jnp.ones((b, t), bool) if valid_BT is None else valid_BT
      allowed_BTE = budget_lib.kept_experts(
        probs_NE.reshape(b, t, -1), ids_NK.reshape(b, t, -1), valid_BT, expert_budget
      )
      ids_NK, gates_NK, _ = route(
        logits_NE, self.config, bias, allowed_TE=allowed_BTE.reshape(b * t, -1), budget_policy=expert_budget.policy
      )
    run_ids_NK, run_gates_NK = ids_NK, gates_NK
    if valid_BT is not None:
      run_ids_NK, run_gates_NK = masked_to_read_experts(ids_NK, gates_NK, valid_BT.reshape(-1))
    if kernels.policy.routed_experts:
      y_ND = pallas_kernels.expert_ffn(
        x_ND,
        run_ids_NK,
        run_gates_NK,
        self.w_gate_EDF[...],
        self.w_up_EDF[...],
        self.w_down_EFD[...],
        method=kernels.policy.expert_method or self.config.expert_method,
        backend=kernels.policy.backend,
        sharding=kernels.policy.experts,
      )
    else:  # the diagnostic policy without routed experts: none is read
      y_ND = jnp.zeros_like(x_ND)
    y_BTD = y_ND.reshape(b, t, d)
    if self.shared is not None:
      shared_BTD = self.shared(x_BTD, kernels.child("shared"))
      if self.w_shared_gate_D is not None:
        if shared_logit_BT is None:
          shared_logit_BT = jnp.einsum("btd,d->bt", x_BTD, self.w_shared_gate_D[...])
        gate_BT = jax.nn.sigmoid(shared_logit_BT.astype(x_BTD.dtype))
        shared_BTD = shared_BTD * gate_BT[..., None]
      y_BTD = y_BTD + shared_BTD
    k = self.config.top_k
    return y_BTD, (ids_NK.reshape(b, t, k), gates_NK.reshape(b, t, k), probs_NE.reshape(b, t, -1))
