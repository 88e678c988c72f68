"""What a generation reports: `out.stats`, built in one function (`public_stats`) from the
program's statistics record (`state.Stats`, unpacked on the host), and the pass trace's views."""

from __future__ import annotations

from typing import Any, Protocol

import jax.numpy as jnp
import numpy as np

from moespec_jax.decoding import auto_draft
from moespec_jax.decoding.params import SpecParams
from moespec_jax.decoding.state import LoopSpec, Stats


class CalibrationRecord(Protocol):
  """auto K's calibration as the report reads it (`calibration.Calibration`, a layer above)."""

  @property
  def step_ms_K(self) -> np.ndarray: ...

  @property
  def method(self) -> str: ...

  @property
  def seconds(self) -> float: ...

  @property
  def acceptance(self) -> float | None: ...


def public_stats(
  raw: Stats,
  tokens_BN: np.ndarray,
  seconds: float,
  spec: SpecParams,
  ls: LoopSpec,
  calibration: CalibrationRecord | None,
) -> dict[str, Any]:
  """`out.stats` from the program's statistics (`Stats.unpack`: NumPy arrays, the reported ones);
  `calibration`: auto K's (`calibration.Calibration`), None without auto."""
  verify_passes = int(raw.verify_passes)
  row_passes = float(raw.row_passes)
  generated = int(np.sum(tokens_BN >= 0))
  reached = raw.reached_K
  budget = ls.expert_budget
  stats = {
    "passes": verify_passes + 1,  # the prefill pass included
    "verify_passes": verify_passes,
    "generated_tokens": generated,
    # Tokens committed per verify pass and active row (accepted drafts + 1); 1.0 for plain.
    "mean_accepted_length": float(raw.accepted_tokens) / row_passes if row_passes else 1.0,
    # Depth j: P(draft j accepted | drafts 1..j-1 accepted), over active rows' passes.
    "acceptance_by_depth": [float(a / r) if r else float("nan") for a, r in zip(raw.accepted_K, reached)],
    "tokens_per_second": generated / seconds,
    "seconds": seconds,
    # Distinct experts per MoE layer among the verified tokens of the active rows, per pass.
    "unique_experts_per_pass": (raw.unique_L / max(verify_passes, 1)).tolist(),
    "drafter": spec.drafter,
    "num_draft": "auto" if ls.auto else ls.max_k,
    "expert_method": ls.kernels.expert_method,
    "mode": spec.mode,
    "approximate": budget is not None,
    "expert_budget": None if budget is None else budget.budget,
  }
  if ls.auto:
    by_k = raw.passes_by_K
    stats["max_draft"] = ls.max_k
    stats["passes_by_num_draft"] = [int(c) for c in by_k]
    # The K auto chose most often, and the mean K over passes.
    stats["chosen_num_draft"] = int(np.argmax(by_k))
    stats["mean_num_draft"] = float(np.sum(np.arange(by_k.size) * by_k) / max(by_k.sum(), 1))
    step_ms_K = calibration.step_ms_K
    stats["calibrated_step_ms"] = [float(t) for t in step_ms_K]
    stats["calibration"] = calibration.method  # "held_runs" or "loops"
    stats["calibration_seconds"] = float(calibration.seconds)  # 0.0: a kept calibration was reused
    # The drafts its held runs accepted (auto's prior; None where it counted none), and whether
    # the drafter ran at all (0: its first choice was the final K = 0).
    stats["calibration_acceptance"] = calibration.acceptance
    stats["drafter_started"] = bool(raw.drafter_started)
    stats["auto_timing"] = ls.timed
    if ls.timed:  # the pass times auto chose with at the end: calibration corrected by the loop's clock
      stats["corrected_step_ms"] = [
        float(t)
        for t in auto_draft.corrected_step_ms(jnp.asarray(step_ms_K, jnp.float32), jnp.asarray(raw.pass_timing_K2))
      ]
    # The acceptance estimate at the end, pooled over the rows (decayed evidence from drafts
    # and shadow drafts).
    stats["acceptance_estimate"] = float(auto_draft.acceptance_estimate(raw.acceptance_evidence_B2.sum(0)))
  if ls.tree_nodes:
    stats["tree_nodes"] = ls.tree_nodes
    # Valid draft nodes verified per active row and pass (a truncated tree verifies fewer).
    stats["verified_nodes_per_pass"] = float(raw.verified_nodes) / row_passes if row_passes else 0.0
  if raw.predicted_unique_L is not None:
    # What the drafter predicted the same passes to read (`unique_experts_per_pass`: what they read).
    stats["predicted_unique_experts_per_pass"] = (raw.predicted_unique_L / max(verify_passes, 1)).tolist()
  if ls.kernels.experts is not None:
    layer_passes = max(verify_passes, 1) * max(len(raw.unique_L), 1)
    stats["expert_ranks"] = ls.kernels.experts.n_ranks
    # Per MoE layer and pass: the active (token, slot) pairs each expert rank runs, the distinct
    # experts it reads, and the slowest rank's pairs over the mean rank's (what the pass waits for).
    stats["assignments_per_rank_per_pass"] = (raw.rank_load_R / layer_passes).tolist()
    stats["unique_experts_per_rank_per_pass"] = (raw.rank_unique_R / layer_passes).tolist()
    stats["max_over_mean_rank_load"] = float(raw.rank_imbalance) / layer_passes
  if ls.trace_passes:
    stats["pass_trace"] = pass_trace(raw.pass_trace_P4[:verify_passes], float(raw.trace_end_ms_1[0]))
  if budget is not None:
    stats["budget_policy"], stats["budget_scope"] = budget.policy, budget.scope
  if ls.measure_quality:
    agree, kl, count = (float(x) for x in raw.quality_3)
    stats["top1_agreement"] = agree / count if count else float("nan")
    stats["mean_kl"] = kl / count if count else float("nan")
    stats["quality_positions"] = int(count)
  return stats


def pass_trace(records_P4: np.ndarray, end_ms: float) -> dict[str, list]:
  """stats["pass_trace"] from the program's per-pass records ([ms from the first token to the
  pass's start, K, tokens, experts]) and the loop's end: each pass's `ms` (from its start to the
  next pass's, the last to the loop's end: the auto K choices between passes included),
  `num_draft`, `tokens` (committed over the batch's rows) and `experts` (the distinct routed
  experts the pass read, summed over the MoE layers: what its expert bytes scale with)."""
  starts = records_P4[:, 0].astype(np.float64)
  ends = np.append(starts[1:], end_ms)
  return {
    "ms": (ends - starts).tolist(),
    "num_draft": records_P4[:, 1].astype(int).tolist(),
    "tokens": records_P4[:, 2].astype(int).tolist(),
    "experts": records_P4[:, 3].astype(int).tolist(),
  }


def describe_pass_trace(trace: dict[str, list], first: int = 8) -> str:
  """One line of stats["pass_trace"]: the first passes' times, then the median time of the later
  passes at each K, and the total. (Over repeated runs, analysis/pass_times sets the passes'
  times against the experts they read.)"""
  ms, ks = np.asarray(trace["ms"]), np.asarray(trace["num_draft"])
  if not ms.size:
    return "pass times: no passes (every token came from the prefill)"
  head = " ".join(f"{t:.2f}" for t in ms[:first])
  later = ", ".join(
    f"K={k} {np.median(ms[first:][ks[first:] == k]):.3f} ({np.sum(ks[first:] == k)})" for k in np.unique(ks[first:])
  )
  return (
    f"pass times (ms): the first {min(first, ms.size)}: {head}"
    + (f"; later, median at each K (passes): {later}" if later else "")
    + f"; {ms.sum():.2f} ms over {ms.size} passes"
  )


def accepted_drafts(trace: dict[str, list], tokens_N: np.ndarray) -> np.ndarray:
  """Which of one row's generated tokens were accepted drafts, from its pass trace (batch 1:
  the trace's `tokens` are the row's committed tokens per pass). The first token comes from the
  prefill; a pass that commits n tokens commits n - 1 accepted drafts, then the target's own
  token. The last pass is left out (a cut at EOS or at max_new_tokens can end it on a draft):
  the result covers the tokens before it, [len] booleans."""
  committed = np.asarray(trace["tokens"], int)
  if np.any(committed < 1):
    raise ValueError("accepted_drafts reads a batch-1 trace: every pass commits at least one token")
  drafted = [False]  # the prefill's token
  for n in committed[:-1]:
    drafted += [True] * (int(n) - 1) + [False]
  if len(drafted) > len(tokens_N):
    raise ValueError(f"the trace commits {len(drafted)} tokens before its last pass; the row has {len(tokens_N)}")
  return np.asarray(drafted, bool)
