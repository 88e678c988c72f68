"""User-facing generation parameters. Frozen (hashable): they select compiled programs."""

from __future__ import annotations

import dataclasses

from moespec_jax.model.budget import ExpertBudget

# `controlled` is a research drafter: it proposes the target's own greedy token with probability
# `controlled_acceptance` (else another token), for cost-model validation; see generate().
DRAFTERS = ("none", "mtp", "ngram", "controlled")
AVAILABLE_DRAFTERS = DRAFTERS
MODES = ("exact", "budgeted")
KERNELS = ("auto", "dedup", "per_slot", "xla")
# The output head's product, the attention against the KV cache and the dense projections
# (attention, dense and shared SwiGLUs) in decoding: "auto" is the C++ kernel on the CPU backend
# (pallas_kernels.cpu.packed_matmul / cached_attention; XLA where the library cannot be
# built, or on TPU/GPU); "xla" keeps XLA's ops.
HEAD_KERNELS = ATTENTION_KERNELS = DENSE_KERNELS = ("auto", "xla")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature == 0 means greedy; top_k == 0 and top_p == 1 disable those filters."""

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
      raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
    if not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
    if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


@dataclasses.dataclass(frozen=True)
class SpecParams:
  """How to draft and verify. `drafter="none"` is plain decoding through the same loop.

  num_draft: K, or "auto": each pass chooses K in 0..max_draft with the cost model from the
  running acceptance estimate (decoding/auto_draft.py; K = 0 where speculation does not pay).
  auto_timing (num_draft="auto", CPU; experimental, off by default): also correct the calibrated
  pass times by the times the loop measures while it decodes (auto_draft.corrected_step_ms);
  so far measured slower than the calibration alone (auto_draft's module docstring).
  pass_trace (CPU): time every pass inside the program (a clock read as each pass starts, no
  host round trip) and report them in stats["pass_trace"] with each pass's K, tokens and the
  distinct experts it read (analysis/pass_times: medians over runs, a fit against experts read).
  """

  drafter: str = "none"
  num_draft: int | str = 3
  max_draft: int = 8
  auto_timing: bool = False
  pass_trace: bool = False
  controlled_acceptance: float = 0.5
  # drafter='mtp': the heads' cache holds the last this many prompt positions of each row (None:
  # all), so the prefill runs the target's last layer and the heads' projections there only;
  # every generated position enters. It changes drafts only (verification keeps the output
  # exact). Default model, 192-byte prompts, batch 1, the prefill's extra time over plain's:
  # 2.6-2.7 ms with every position, 0.8-0.9 at 32, 0.5 at 16, 0.15 at 1 (batch 8: 15.9, 4.3, 2.5 ms).
  # Tokens accepted per pass (16 held-out prompts, greedy, K = 2 and 4): 2.950 and 4.733 with
  # every position and with 16, 8 or 4, 2.950 and 4.718 with 1; its heads draw on the target's
  # hidden state more than on their own attention. Heads that attend further may want more.
  mtp_prompt_window: int | None = 16
  mode: str = "exact"
  expert_budget: int | None = None
  kernel: str = "auto"
  head_kernel: str = "auto"
  attention_kernel: str = "auto"
  dense_kernel: str = "auto"
  # Budgeted (APPROXIMATE) mode only: what happens to a token whose expert was cut, and whether
  # the budget holds for the whole batch's pass (what the kernels read) or per row.
  budget_policy: str = "truncate"
  budget_scope: str = "batch"
  # Budgeted mode: also run the exact pass on the same cache to measure top-1 agreement and KL
  # (doubles the target cost; off for speed measurements).
  measure_quality: bool = False

  def __post_init__(self):
    if self.drafter not in DRAFTERS:
      raise ValueError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
    if self.drafter not in AVAILABLE_DRAFTERS:
      raise ValueError(f"drafter {self.drafter!r} is not implemented yet; available: {AVAILABLE_DRAFTERS}")
    if self.mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
    if self.mode == "budgeted":
      if self.expert_budget is None:
        raise ValueError("mode='budgeted' needs expert_budget (an int >= the model's top_k)")
      # Validates expert_budget, budget_policy and budget_scope.
      ExpertBudget(self.expert_budget, self.budget_policy, self.budget_scope)
    elif self.expert_budget is not None:
      raise ValueError("expert_budget applies to mode='budgeted' only (exact mode loads every expert)")
    if self.measure_quality and self.mode != "budgeted":
      raise ValueError("measure_quality applies to mode='budgeted' only")
    if self.kernel not in KERNELS:
      raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
    if self.head_kernel not in HEAD_KERNELS:
      raise ValueError(f"head_kernel must be one of {HEAD_KERNELS}, got {self.head_kernel!r}")
    if self.attention_kernel not in ATTENTION_KERNELS:
      raise ValueError(f"attention_kernel must be one of {ATTENTION_KERNELS}, got {self.attention_kernel!r}")
    if self.dense_kernel not in DENSE_KERNELS:
      raise ValueError(f"dense_kernel must be one of {DENSE_KERNELS}, got {self.dense_kernel!r}")
    if self.num_draft != "auto" and (isinstance(self.num_draft, bool) or not isinstance(self.num_draft, int)
                                     or self.num_draft < 0):
      raise ValueError(f"num_draft must be an int >= 0 or 'auto', got {self.num_draft!r}")
    if isinstance(self.max_draft, bool) or not isinstance(self.max_draft, int) or not 1 <= self.max_draft <= 16:
      raise ValueError(f"max_draft (the largest K of num_draft='auto') must be an int in [1, 16], "
                       f"got {self.max_draft!r}")
    if not isinstance(self.auto_timing, bool):
      raise ValueError(f"auto_timing must be a bool, got {self.auto_timing!r}")
    if not isinstance(self.pass_trace, bool):
      raise ValueError(f"pass_trace must be a bool, got {self.pass_trace!r}")
    if self.mtp_prompt_window is not None and (isinstance(self.mtp_prompt_window, bool) or not isinstance(
        self.mtp_prompt_window, int) or self.mtp_prompt_window < 1):
      raise ValueError(f"mtp_prompt_window must be an int >= 1 or None (every prompt position), "
                       f"got {self.mtp_prompt_window!r}")
    if not isinstance(self.controlled_acceptance, (int, float)) or not 0.0 <= self.controlled_acceptance <= 1.0:
      raise ValueError(f"controlled_acceptance must be in [0, 1], got {self.controlled_acceptance!r}")
