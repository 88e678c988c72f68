"""User-facing generation parameters. Frozen (hashable): they select compiled programs.

`SpecParams` holds what a user chooses (drafter, K, mode, budget, expert kernel); the research and
diagnostic settings sit apart in `ResearchOptions`, given as `SpecParams(..., research=...)`.
"""

from __future__ import annotations

import dataclasses

from moespec_jax.decoding import drafters as drafters_lib
from moespec_jax.decoding.sampling_params import SamplingParams
from moespec_jax.decoding.tree_select import TreeCost
from moespec_jax.model.budget import ExpertBudget

__all__ = ["ResearchOptions", "SamplingParams", "SpecParams", "TreeCost"]

MODES = ("exact", "budgeted")
KERNELS = ("auto", "dedup", "per_slot", "xla")
# The output head's product, the attention against the KV cache and the dense projections
# (attention, dense and shared SwiGLUs) in decoding: "auto" is the C++ kernel on the CPU backend
# (pallas_kernels.cpu.packed_matmul / cached_attention; XLA where the library cannot be
# built, or on TPU/GPU); "xla" keeps XLA's ops.
HEAD_KERNELS = ATTENTION_KERNELS = DENSE_KERNELS = ("auto", "xla")
# How a drafter that branches chooses a tree's nodes: by its own ranking of the continuations
# (prompt lookup: its matches in rank order); or, the MTP heads at T = 0, by that ranking less
# the experts each node is predicted to add to the pass (`decoding.tree_select`).
TREE_POLICIES = ("probability", "expert_aware")
# The largest draft tree a pass verifies.
MAX_TREE_NODES = 64
# What the controlled drafter's passes pay for drafting: nothing (a table lookup), or the model's
# MTP heads' draft computation, run every pass beside the table (decoding/drafters/controlled.py).
CONTROLLED_DRAFT_COSTS = ("none", "mtp")


def _is_int(value: object) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class ResearchOptions:
  """Research and diagnostic settings of a generation; the defaults are what users get.

  controlled_acceptance: drafter="controlled" only (and required there): the probability that
    it proposes the target's own greedy token (generate's `reference_tokens`), else another.
  controlled_draft_cost (drafter="controlled"): "none", its drafts cost a table lookup; "mtp", each
    pass also runs the model's MTP heads as the MTP drafter would (their drafts computed and
    discarded, their cache filled after verification), so the pass pays a real drafter's cost.
  auto_timing (num_draft="auto", CPU; experimental, off): also correct the calibrated pass times
    by the times the loop measures while it decodes (auto_draft.corrected_step_ms).
  pass_trace (CPU): time every pass inside the program (a clock read as each pass starts, no
    host round trip) and report them in stats["pass_trace"] with each pass's K, tokens and the
    distinct experts it read (research/pass_times: medians over runs, a fit against experts read).
  measure_quality (mode="budgeted" only): also run the exact pass on the same cache and report
    top-1 agreement and KL against it (doubles the target's cost; off for speed measurements).
  mtp_prompt_window (drafter="mtp"): the heads' cache holds the last this many prompt positions
    of each row (None: all), so the prefill runs the target's last layer and the heads there only;
    every generated position enters. It changes drafts only (verification keeps the output exact).
  head_kernel / attention_kernel / dense_kernel: "auto" runs the output head, the attention
    against the KV cache and the dense projections on the C++ kernels on CPU; "xla" keeps XLA's ops.
  """

  controlled_acceptance: float | None = None
  controlled_draft_cost: str = "none"
  auto_timing: bool = False
  pass_trace: bool = False
  measure_quality: bool = False
  mtp_prompt_window: int | None = 16
  head_kernel: str = "auto"
  attention_kernel: str = "auto"
  dense_kernel: str = "auto"

  def __post_init__(self) -> None:
    if self.controlled_acceptance is not None and (
      isinstance(self.controlled_acceptance, bool)
      or not isinstance(self.controlled_acceptance, (int, float))
      or not 0.0 <= self.controlled_acceptance <= 1.0
    ):
      raise ValueError(f"controlled_acceptance must be in [0, 1], got {self.controlled_acceptance!r}")
    for name in ("auto_timing", "pass_trace", "measure_quality"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
    if self.mtp_prompt_window is not None and (not _is_int(self.mtp_prompt_window) or self.mtp_prompt_window < 1):
      raise ValueError(
        f"mtp_prompt_window must be an int >= 1 or None (every prompt position), got {self.mtp_prompt_window!r}"
      )
    for name, choices in (
      ("controlled_draft_cost", CONTROLLED_DRAFT_COSTS),
      ("head_kernel", HEAD_KERNELS),
      ("attention_kernel", ATTENTION_KERNELS),
      ("dense_kernel", DENSE_KERNELS),
    ):
      if getattr(self, name) not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class SpecParams:
  """How to draft and verify. `drafter="none"` is plain decoding through the same loop.

  drafter: a name of the drafters' registry (`decoding.drafters.REGISTRY`: none, mtp, ngram, and
  the research drafter controlled, which needs `research.controlled_acceptance`).
  num_draft: K, or "auto": each pass chooses K in 0..max_draft with the cost model from the
  running acceptance estimate (decoding/auto_draft.py; K = 0 where speculation does not pay).
  mode "budgeted" (APPROXIMATE) caps the experts of each verification pass at expert_budget;
  budget_policy: what happens to a token whose expert was cut; budget_scope: whether the budget
  holds for the whole batch's pass (what the kernels read) or per row.
  kernel: the routed experts' kernel. research: the research and diagnostic settings.
  tree_nodes: None, chains of num_draft drafts; N, every pass verifies a draft tree of N nodes
  and depth at most num_draft (drafters that branch: `Drafter.branches`), in one target pass with
  exact tree verification (`rejection.verify_tree_sampled`). tree_policy: how the drafter chooses
  the tree's nodes (TREE_POLICIES); "expert_aware" ranks a node by log q(path) - expert_penalty *
  the (layer, expert) pairs it is predicted to add to the pass's union (`Model.expert_table`).
  tree_truncate: each pass verifies only the prefix of the chosen nodes that maximises expected
  committed tokens over the pass time `tree_cost` predicts (default `TreeCost.from_bytes`: a pass
  bound by the weight bytes it reads). Both choose nodes by their tokens: greedy decoding only.
  """

  drafter: str = "none"
  num_draft: int | str = 3
  max_draft: int = 8
  mode: str = "exact"
  expert_budget: int | None = None
  kernel: str = "auto"
  budget_policy: str = "truncate"
  budget_scope: str = "batch"
  tree_nodes: int | None = None
  tree_policy: str = "probability"
  expert_penalty: float = 0.5
  tree_truncate: bool = False
  tree_cost: TreeCost | None = None
  research: ResearchOptions = ResearchOptions()

  def __post_init__(self) -> None:
    if not isinstance(self.research, ResearchOptions):
      raise ValueError(f"research must be a ResearchOptions, got {type(self.research).__name__}")
    drafters_lib.lookup(self.drafter).check_spec(self)
    if self.mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
    if self.mode == "budgeted":
      if self.expert_budget is None:
        raise ValueError("mode='budgeted' needs expert_budget (an int >= the model's top_k)")
      # Validates expert_budget, budget_policy and budget_scope.
      ExpertBudget(self.expert_budget, self.budget_policy, self.budget_scope)
    elif self.expert_budget is not None:
      raise ValueError("expert_budget applies to mode='budgeted' only (exact mode loads every expert)")
    if self.research.measure_quality and self.mode != "budgeted":
      raise ValueError("measure_quality applies to mode='budgeted' only")
    if self.kernel not in KERNELS:
      raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
    if self.num_draft != "auto" and (not _is_int(self.num_draft) or self.num_draft < 0):
      raise ValueError(f"num_draft must be an int >= 0 or 'auto', got {self.num_draft!r}")
    if not _is_int(self.max_draft) or not 1 <= self.max_draft <= 16:
      raise ValueError(
        f"max_draft (the largest K of num_draft='auto') must be an int in [1, 16], got {self.max_draft!r}"
      )
    if self.tree_policy not in TREE_POLICIES:
      raise ValueError(f"tree_policy must be one of {TREE_POLICIES}, got {self.tree_policy!r}")
    penalty = self.expert_penalty
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not 0 <= penalty < float("inf"):
      raise ValueError(f"expert_penalty must be a finite number >= 0, got {penalty!r}")
    if not isinstance(self.tree_truncate, bool):
      raise ValueError(f"tree_truncate must be a bool, got {self.tree_truncate!r}")
    if self.tree_cost is not None and not isinstance(self.tree_cost, TreeCost):
      raise ValueError(f"tree_cost must be a TreeCost or None, got {type(self.tree_cost).__name__}")
    if self.tree_cost is not None and not self.tree_truncate:
      raise ValueError("tree_cost is what tree_truncate reads: set tree_truncate=True")
    if self.tree_nodes is None and (self.tree_policy != "probability" or self.tree_truncate):
      raise ValueError("tree_policy='expert_aware' and tree_truncate choose a draft tree's nodes: give tree_nodes")
    if self.tree_nodes is not None:
      if not _is_int(self.tree_nodes) or not 1 <= self.tree_nodes <= MAX_TREE_NODES:
        raise ValueError(
          f"tree_nodes must be None (chains) or an int in [1, {MAX_TREE_NODES}], got {self.tree_nodes!r}"
        )
      drafter_cls = drafters_lib.lookup(self.drafter)
      if not drafter_cls.branches:
        can = ", ".join(repr(name) for name, d in drafters_lib.REGISTRY.items() if d.branches)
        raise ValueError(f"drafter {self.drafter!r} does not branch: tree_nodes needs one that does ({can})")
      if (self.tree_policy != "probability" or self.tree_truncate) and not drafter_cls.weighs_experts:
        can = ", ".join(repr(name) for name, d in drafters_lib.REGISTRY.items() if d.weighs_experts)
        raise ValueError(
          f"drafter {self.drafter!r} cannot weigh its tree's nodes by their experts "
          f"(tree_policy='expert_aware', tree_truncate): {can} can"
        )
      if self.num_draft == "auto":
        raise ValueError("num_draft='auto' chooses chains only: give the trees' depth (an int) with tree_nodes")
      if self.num_draft < 1 or self.tree_nodes < self.num_draft:
        raise ValueError(
          f"tree_nodes ({self.tree_nodes}) must be >= num_draft ({self.num_draft}), the trees' depth, which "
          f"must be >= 1"
        )
