"""The bytes/bandwidth step-time model and what it predicts (seed 000, seed 002's Amdahl split).

- A kernel's time for a pass: bytes it requests / its effective bandwidth + a fixed time,
  both fitted on single-layer expert runs (`fit_kernel`).
- Dedup beats per-slot exactly where u(n) = bytes_dedup / bytes_per_slot < r(n) =
  BW_dedup / BW_per_slot; the crossover is the first pass size where it does.
- A verification pass of n tokens: the non-expert fixed time plus each MoE layer's expert time
  (`verify_time`); Amdahl: T(n)/T(1) = f * unique(n)/k + (1 - f).
- Geometric acceptance with rate a: tokens per pass (1 - a^(K+1)) / (1 - a); speedup =
  tokens per pass * T_plain / (T_draft(K) + T_verify(K+1)); the best K is a monotone
  staircase in a, and speculation pays only where that speedup exceeds 1.
- On R expert ranks (expert parallelism): the slowest rank's distinct experts per MoE layer, and the
  collectives that combine the ranks' outputs (`ep_verify_ms`; seed 004's dispatch/combine terms).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt


@dataclasses.dataclass(frozen=True)
class KernelFit:
  """time_ms = bytes / (gbps * 1e9) * 1e3 + fixed_ms."""

  gbps: float
  fixed_ms: float

  def time_ms(self, n_bytes: npt.ArrayLike) -> np.ndarray:
    return np.asarray(n_bytes, float) / (self.gbps * 1e6) + self.fixed_ms


def fit_kernel(bytes_requested: Sequence[float], time_ms: Sequence[float]) -> KernelFit:
  """Least-squares fit of time = bytes / bandwidth + fixed (fixed clipped at >= 0)."""
  b, t = np.asarray(bytes_requested, float), np.asarray(time_ms, float)
  if b.size < 2 or np.ptp(b) == 0:
    raise ValueError("need at least two distinct byte counts to fit a bandwidth")
  slope, fixed = np.polyfit(b, t, 1)
  if fixed < 0:
    slope, fixed = float(np.sum(b * t) / np.sum(b * b)), 0.0
  if slope <= 0:
    raise ValueError("time does not grow with bytes: no bandwidth can be fitted")
  return KernelFit(gbps=float(1.0 / slope / 1e6), fixed_ms=float(fixed))


def bandwidth_ratio(dedup: KernelFit, per_slot: KernelFit) -> float:
  """r = BW_dedup / BW_per_slot."""
  return dedup.gbps / per_slot.gbps


def crossover(
  pass_sizes: Sequence[int], time_dedup_ms: Sequence[float], time_per_slot_ms: Sequence[float], for_good: bool = False
) -> int | None:
  """The first pass size at which dedup is faster (None if it never is).

  `for_good`: the first size from which dedup is faster at every larger size given. Measured
  times cross back and forth where the two kernels cost about the same (at n = 1 they read the
  same experts): the first win there is timing noise, not the crossover.
  """
  wins = [(int(n), td < tp) for n, td, tp in zip(pass_sizes, time_dedup_ms, time_per_slot_ms)]
  if for_good:
    first = None
    for n, won in wins:
      first = (first or n) if won else None
    return first
  return next((n for n, won in wins if won), None)


def amdahl_ratio(f: float, unique_n: float, top_k: int) -> float:
  """T(n)/T(1) = f * unique(n)/k + (1 - f), f the routed-expert share of a one-token pass."""
  return f * unique_n / top_k + (1.0 - f)


def amdahl_fraction(t1_ms: float, expert_t1_ms: float) -> float:
  """f: the share of a one-token pass spent in routed experts."""
  if t1_ms <= 0:
    raise ValueError("t1_ms must be > 0")
  return float(np.clip(expert_t1_ms / t1_ms, 0.0, 1.0))


def tokens_per_pass(a: npt.ArrayLike, k: int) -> np.ndarray:
  """Expected committed tokens per pass with K drafts under geometric acceptance a."""
  a = np.asarray(a, float)
  if k == 0:
    return np.ones_like(a)
  with np.errstate(divide="ignore", invalid="ignore"):
    out = (1 - a ** (k + 1)) / (1 - a)
  return np.where(np.isclose(a, 1.0), k + 1.0, out)


def speedup(
  a: npt.ArrayLike, k: int, t_plain_ms: float, t_draft_ms: Callable[[int], float], t_verify_ms: Callable[[int], float]
) -> np.ndarray:
  """Tokens per pass * T_plain / (T_draft(K) + T_verify(K + 1)); K = 0 is plain decoding (1.0)."""
  if k == 0:
    return np.ones_like(np.asarray(a, float))
  return tokens_per_pass(a, k) * t_plain_ms / (t_draft_ms(k) + t_verify_ms(k + 1))


def best_k(
  a: float, max_k: int, t_plain_ms: float, t_draft_ms: Callable[[int], float], t_verify_ms: Callable[[int], float]
) -> tuple[int, float]:
  """(argmax_K speedup, that speedup) over K = 0..max_k; K = 0 when speculation does not pay."""
  values = [float(speedup(a, k, t_plain_ms, t_draft_ms, t_verify_ms)) for k in range(max_k + 1)]
  k = int(np.argmax(values))
  return k, values[k]


def staircase(
  alphas: Sequence[float],
  max_k: int,
  t_plain_ms: float,
  t_draft_ms: Callable[[int], float],
  t_verify_ms: Callable[[int], float],
) -> list[int]:
  """The best K for each acceptance rate."""
  return [best_k(a, max_k, t_plain_ms, t_draft_ms, t_verify_ms)[0] for a in alphas]


def break_even_acceptance(
  k: int, t_plain_ms: float, t_draft_ms: Callable[[int], float], t_verify_ms: Callable[[int], float], tol: float = 1e-6
) -> float | None:
  """The acceptance rate above which K drafts beat plain decoding (None if never below a = 1)."""
  lo, hi = 0.0, 1.0
  if speedup(hi, k, t_plain_ms, t_draft_ms, t_verify_ms) <= 1.0:
    return None
  if speedup(lo, k, t_plain_ms, t_draft_ms, t_verify_ms) > 1.0:
    return 0.0
  while hi - lo > tol:
    mid = (lo + hi) / 2
    if speedup(mid, k, t_plain_ms, t_draft_ms, t_verify_ms) > 1.0:
      hi = mid
    else:
      lo = mid
  return hi


# Expert parallelism ------------------------------------------------------------------------------
# A verification pass on R expert ranks (the replicated dispatch, pallas_kernels.expert_parallel):
# every rank reads the non-expert weights and runs the layers outside the experts on all tokens; per
# MoE layer it reads its own distinct experts, and the pass waits for the slowest rank; then the
# partial outputs [tokens, d_model] are summed over the ranks (an all-reduce). The exchanged dispatch
# (prefill, training) instead sends each (token, slot) pair's activations to its expert's rank and
# back (two all-to-alls).


@dataclasses.dataclass(frozen=True)
class Interconnect:
  """What a collective costs: per-device bandwidths (GB/s, one direction) within a node and between
  nodes, a fixed time per collective (µs), and the ranks a node holds."""

  link_gbps: float
  cross_node_gbps: float
  latency_us: float
  ranks_per_node: int

  def __post_init__(self) -> None:
    if not (self.link_gbps > 0 and self.cross_node_gbps > 0):
      raise ValueError(f"bandwidths must be > 0, got {self.link_gbps}, {self.cross_node_gbps}")
    if self.latency_us < 0 or self.ranks_per_node < 1:
      raise ValueError(f"need latency_us >= 0 and ranks_per_node >= 1, got {self.latency_us}, {self.ranks_per_node}")


def allreduce_ms(message_bytes: float, ranks: int, link: Interconnect) -> float:
  """A ring all-reduce of `message_bytes` over `ranks`: each rank sends and receives 2 (R - 1) / R
  of the message, over the slowest link the ring crosses (between nodes where the ranks span
  several), plus the fixed time."""
  if ranks <= 1:
    return 0.0
  gbps = link.cross_node_gbps if ranks > link.ranks_per_node else link.link_gbps
  return 2.0 * (ranks - 1) / ranks * message_bytes / (gbps * 1e6) + link.latency_us * 1e-3


def all_to_all_ms(sent_bytes: float, cross_node_share: float, link: Interconnect) -> float:
  """An all-to-all in which a rank sends `sent_bytes` to the others, `cross_node_share` of it to
  other nodes (each part at its link's bandwidth, the parts in turn), plus the fixed time."""
  within = sent_bytes * (1.0 - cross_node_share) / (link.link_gbps * 1e6)
  across = sent_bytes * cross_node_share / (link.cross_node_gbps * 1e6)
  return within + across + link.latency_us * 1e-3


def ep_verify_ms(
  *,
  other_bytes: float,
  expert_bytes: float,
  slowest_rank_experts_L: Sequence[float],
  tokens: int,
  d_model: int,
  activation_bytes: int,
  ranks: int,
  read_gbps: float,
  link: Interconnect,
  fixed_ms: float = 0.0,
) -> dict[str, float]:
  """A verification pass of `tokens` tokens (all rows) on `ranks` expert ranks, replicated dispatch:
  {"other": the non-expert weights read by every rank, "experts": each MoE layer's slowest rank's
  distinct experts (`slowest_rank_experts_L`) read, "combine": an all-reduce of the layer's output
  per MoE layer, "fixed", "total"} in ms; `expert_bytes`: one expert's weights."""
  other = other_bytes / (read_gbps * 1e6)
  experts = float(np.sum(slowest_rank_experts_L)) * expert_bytes / (read_gbps * 1e6)
  message = tokens * d_model * activation_bytes
  combine = len(slowest_rank_experts_L) * allreduce_ms(message, ranks, link)
  return {
    "other": other,
    "experts": experts,
    "combine": combine,
    "fixed": fixed_ms,
    "total": other + experts + combine + fixed_ms,
  }
