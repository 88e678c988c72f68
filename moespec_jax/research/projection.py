"""Projected speculative decoding for any model config on a machine you describe: the
bytes/bandwidth model (analysis/cost_model) applied to published dimensions (configs/*.py), with
no weights and no measurement. PROJECTIONS: every figure here is computed, none is measured.

A verification pass of n tokens for B rows reads the weights outside the routed experts once,
each MoE layer's routed experts (all B n (token, slot) pairs' inputs and outputs too) and the
KV cache of the context. Dedup reads each distinct expert of the pass once, per-slot once per
(token, slot); distinct experts assume uniformly routed, independent tokens, N (1 - (1 - k/N)^(Bn)),
an upper bound: real routing overlaps. Given a `routing_stats` measurement (`RoutingCurve`: the
distinct experts u(n) of n consecutive tokens of one sequence, on a model with the same N and k),
a row reads u(n) and B independent rows N (1 - (1 - u(n)/N)^B).
A pass costs its bytes over the read bandwidth (dedup at `dedup_bandwidth_ratio` of it: seed 000
measured 0.32-0.75 on real engines) plus a fixed time; drafting K tokens costs K * draft_cost
plain passes (0 for prompt lookup; an MTP module is about one decoder layer of the target).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moespec_jax.analysis import cost_model
from moespec_jax.analysis import routing as routing_lib
from moespec_jax.config import ModelConfig
from moespec_jax.io import atomic, plots
from moespec_jax.model.cache import KVCache
from moespec_jax.research import roofline
from pallas_kernels import bytes as kbytes

METHODS = ("dedup", "per_slot")


@dataclasses.dataclass(frozen=True)
class Machine:
  """What the projection assumes of the hardware."""

  read_gbps: float  # effective read bandwidth of weights and cache (the per-slot expert kernel's)
  fixed_ms: float = 0.0  # per pass: launches, synchronisation, everything that is not bytes
  dedup_bandwidth_ratio: float = 1.0  # r = dedup kernel's effective bandwidth / per-slot's

  def __post_init__(self):
    if not self.read_gbps > 0:
      raise ValueError(f"read_gbps must be > 0, got {self.read_gbps}")
    if self.fixed_ms < 0:
      raise ValueError(f"fixed_ms must be >= 0, got {self.fixed_ms}")
    if not 0 < self.dedup_bandwidth_ratio <= 4:
      raise ValueError(f"dedup_bandwidth_ratio must be in (0, 4], got {self.dedup_bandwidth_ratio}")


@dataclasses.dataclass(frozen=True)
class RoutingCurve:
  """Measured distinct routed experts per MoE layer for n consecutive tokens of one sequence
  (`experiments.routing_stats`: its empirical curve, averaged over layers)."""

  n_experts: int
  top_k: int
  unique_by_n: tuple[float, ...]  # [n - 1]: n = 1, 2, ...
  source: str = "(unnamed)"

  def unique(self, n_tokens: int, batch: int = 1) -> float:
    """Distinct experts of a pass of n tokens in each of `batch` independent rows."""
    if n_tokens > len(self.unique_by_n):
      raise ValueError(
        f"the routing measurement {self.source} covers passes up to "
        f"{len(self.unique_by_n)} tokens, not {n_tokens} (rerun routing_stats with "
        f"--max_tokens={n_tokens})"
      )
    per_row = self.unique_by_n[n_tokens - 1]
    return self.n_experts * (1.0 - (1.0 - per_row / self.n_experts) ** batch)

  def check(self, config: ModelConfig) -> None:
    if (self.n_experts, self.top_k) != (config.n_routed_experts, config.top_k):
      raise ValueError(
        f"the routing measurement {self.source} is of {self.n_experts} experts, top-{self.top_k}; "
        f"the config routes to {config.top_k} of {config.n_routed_experts}"
      )


def load_routing_curve(path: atomic.PathLike) -> RoutingCurve:
  """The empirical unique-expert curve of a `routing_stats` metrics.json."""
  stats = atomic.read_json(path).get("routing_stats")
  if not isinstance(stats, dict) or not stats.get("unique_experts"):
    raise ValueError(f"{path} holds no routing_stats measurement (write one with experiments.routing_stats)")
  rows = sorted(stats["unique_experts"], key=lambda r: r["n_tokens"])
  if [r["n_tokens"] for r in rows] != list(range(1, len(rows) + 1)):
    raise ValueError(f"{path}: unique_experts rows must cover n = 1, 2, ... without gaps")
  return RoutingCurve(
    int(stats["n_experts"]), int(stats["top_k"]), tuple(float(r["empirical"]) for r in rows), str(path)
  )


@functools.cache
def kv_values_per_token(config: ModelConfig) -> int:
  """Cached values per token over all layers (MLA: its latent and rope key)."""
  cache = jax.eval_shape(lambda: KVCache.for_config(config, 1, 1))
  return int(sum(x.size for x in jax.tree.leaves(cache)))


def pass_bytes(
  config: ModelConfig,
  n_tokens: int,
  *,
  batch: int = 1,
  context: int = 0,
  method: str = "dedup",
  routing: RoutingCurve | None = None,
) -> dict[str, float]:
  """Bytes one verification pass of `n_tokens` per row reads (weights at config.dtype); dedup's
  distinct experts from `routing` when given, else uniform routing."""
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  if n_tokens < 1 or batch < 1 or context < 0:
    raise ValueError(f"need n_tokens >= 1, batch >= 1, context >= 0; got {n_tokens}, {batch}, {context}")
  itemsize = jnp.dtype(config.dtype).itemsize
  tokens = n_tokens * batch
  layers = config.n_moe_layers
  other = roofline.decode_weight_bytes(config, [0.0] * layers)
  if method == "per_slot":
    reads = float(tokens * config.top_k)
  elif not layers:
    reads = 0.0
  elif routing is not None:
    routing.check(config)
    reads = routing.unique(n_tokens, batch)
  else:
    reads = routing_lib.uniform_unique(config.n_routed_experts, config.top_k, tokens)
  experts = layers * (
    reads * kbytes.expert_bytes(config.d_model, config.expert_hidden, itemsize)
    + kbytes.activation_bytes(tokens, config.top_k, config.d_model, itemsize)
  )
  kv = batch * context * kv_values_per_token(config) * itemsize
  return {
    "other_weights": float(other),
    "experts": float(experts),
    "kv_cache": float(kv),
    "total": float(other + experts + kv),
  }


def pass_ms(
  config: ModelConfig,
  machine: Machine,
  n_tokens: int,
  *,
  batch: int = 1,
  context: int = 0,
  method: str = "dedup",
  routing: RoutingCurve | None = None,
) -> float:
  """Projected time of one verification pass: bytes over bandwidth plus the fixed time (the
  routed experts at the dedup kernel's bandwidth under method='dedup')."""
  b = pass_bytes(config, n_tokens, batch=batch, context=context, method=method, routing=routing)
  return _time_ms(b, machine, method)


def _expert_ms(pass_bytes_: dict[str, float], machine: Machine, method: str) -> float:
  gbps = machine.read_gbps * (machine.dedup_bandwidth_ratio if method == "dedup" else 1.0)
  return pass_bytes_["experts"] / (gbps * 1e6)


def _time_ms(pass_bytes_: dict[str, float], machine: Machine, method: str) -> float:
  other = pass_bytes_["other_weights"] + pass_bytes_["kv_cache"]
  return other / (machine.read_gbps * 1e6) + _expert_ms(pass_bytes_, machine, method) + machine.fixed_ms


def project(
  config: ModelConfig,
  machine: Machine,
  *,
  batch: int = 1,
  context: int = 1024,
  draft_cost: float = 0.0,
  max_k: int = 8,
  alphas: Sequence[float] | None = None,
  max_tokens: int = 16,
  routing: RoutingCurve | None = None,
) -> dict[str, Any]:
  """Pass times per size and kernel, the crossover, the Amdahl share of routed experts, and the
  best draft length per acceptance rate (the faster kernel at each pass size), as a JSON-ready
  dict."""
  if draft_cost < 0 or max_k < 1 or max_tokens < max_k + 1:
    raise ValueError(
      f"need draft_cost >= 0, max_k >= 1 and max_tokens >= max_k + 1; got {draft_cost}, {max_k}, {max_tokens}"
    )
  alphas = [round(float(a), 4) for a in (np.linspace(0.0, 1.0, 21) if alphas is None else alphas)]
  sizes = list(range(1, max_tokens + 1))
  rows, one_token = [], {}
  for n in sizes:
    row = {"n_tokens": n}
    for method in METHODS:
      b = pass_bytes(config, n, batch=batch, context=context, method=method, routing=routing)
      row[f"{method}_bytes"], row[f"{method}_ms"] = b["total"], _time_ms(b, machine, method)
      if n == 1:
        one_token[method] = b
    row["faster"] = "dedup" if row["dedup_ms"] < row["per_slot_ms"] else "per_slot"
    rows.append(row)
  verify_ms = {r["n_tokens"]: min(r["dedup_ms"], r["per_slot_ms"]) for r in rows}
  t_plain = verify_ms[1]
  t_draft = lambda k: k * draft_cost * t_plain
  t_verify = lambda n: verify_ms[n]
  best = []
  for a in alphas:
    k, s = cost_model.best_k(a, max_k, t_plain, t_draft, t_verify)
    best.append({"alpha": a, "best_k": k, "speedup": float(s)})
  plain_method = rows[0]["faster"]  # the kernel of the plain pass whose time is t_plain
  expert_ms = _expert_ms(one_token[plain_method], machine, plain_method)
  return {
    "projection": True,  # computed from the bytes model, not measured
    "model": {
      "params": config.param_counts(),
      "dtype": config.dtype,
      "n_moe_layers": config.n_moe_layers,
      "n_routed_experts": config.n_routed_experts,
      "top_k": config.top_k,
      "kv_values_per_token": kv_values_per_token(config),
    },
    "machine": dataclasses.asdict(machine),
    "batch_size": batch,
    "context": context,
    "draft_cost": draft_cost,
    "routing": (
      "uniform (independent tokens: an upper bound on distinct experts)"
      if routing is None
      else f"measured: {routing.source} (rows independent)"
    ),
    "passes": rows,
    "crossover_n": cost_model.crossover(sizes, [r["dedup_ms"] for r in rows], [r["per_slot_ms"] for r in rows]),
    "amdahl_expert_fraction": cost_model.amdahl_fraction(t_plain, expert_ms),
    "best_k": best,
    "break_even_acceptance": {
      k: cost_model.break_even_acceptance(k, t_plain, t_draft, t_verify) for k in range(1, max_k + 1)
    },
  }


def describe(result: dict[str, Any]) -> str:
  """The projection as a text table (pass sizes, then the staircase)."""
  lines = [
    f"distinct experts per pass: {result['routing']}",
    f"{'n':>3} {'dedup GB':>9} {'ms':>8} {'per-slot GB':>12} {'ms':>8}  faster",
  ]
  for r in result["passes"]:
    lines.append(
      f"{r['n_tokens']:>3} {r['dedup_bytes'] / 1e9:>9.3f} {r['dedup_ms']:>8.3f} "
      f"{r['per_slot_bytes'] / 1e9:>12.3f} {r['per_slot_ms']:>8.3f}  {r['faster']}"
    )
  lines.append(
    f"crossover (dedup first faster): n = {result['crossover_n']}; routed experts' share of a "
    f"one-token pass (Amdahl f): {result['amdahl_expert_fraction']:.2f}"
  )
  lines.append(
    "best K by acceptance: "
    + ", ".join(f"{b['alpha']:g}: {b['best_k']} ({b['speedup']:.2f}x)" for b in result["best_k"])
  )
  return "\n".join(lines)


def plot(result: dict[str, Any], path: atomic.PathLike) -> pathlib.Path:
  """Pass time by pass size and kernel, and the best K staircase (labelled as projected)."""
  plt = plots.pyplot()
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
  n = [r["n_tokens"] for r in result["passes"]]
  for method in METHODS:
    ax1.plot(n, [r[f"{method}_ms"] for r in result["passes"]], marker="o", label=method)
  ax1.set(xlabel="tokens per pass (per row)", ylabel="projected pass time (ms)", title="verification pass")
  ax1.legend()
  ax2.step([b["alpha"] for b in result["best_k"]], [b["best_k"] for b in result["best_k"]], where="mid")
  ax2.set(xlabel="acceptance rate a", ylabel="best K", title="best draft length (projected)")
  return plots.save(fig, path)
