"""Expert parallelism measured on a model's routing traces and projected on clusters
(experiments/ep_bench).

- **Rank load** per verification pass of n = 1..16 consecutive tokens (a pass with K = n - 1 drafts)
  on the held-out trace: the slowest rank's (token, slot) pairs over the mean rank's, the slowest
  rank's distinct experts, per placement (contiguous; by popularity; fitted to the passes' loads;
  and the fitted one with each layer's hottest experts on every rank), the placements fitted on the
  first half of the trace and judged on the second.
- **Dispatch**: bytes a pass moves: the replicated dispatch's all-reduce per MoE layer, and the
  exchanged dispatch's pairs sent off their home rank and back; on a two-node layout the share of
  those pairs that cross nodes.
- **Projection** (the cost model, not measured): a pass's time on each cluster of the config (stated
  bandwidths), split into non-expert weights, the slowest rank's experts and the combine.
- **Functional check** on simulated CPU devices: greedy tokens on each mesh equal one device's; wall
  times only as a check that it runs (the devices share this machine's cores).
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import moespec_jax as msj
from moespec_jax.analysis import cost_model
from moespec_jax.analysis.routing import RoutingTrace
from moespec_jax.config import ModelConfig
from moespec_jax.io import atomic, plots
from moespec_jax.parallel import mesh as mesh_lib
from moespec_jax.parallel import placement
from moespec_jax.research import roofline, traces
from pallas_kernels import bytes as kbytes

PLACEMENTS = ("contiguous", "popularity", "pass_load", "pass_load+hot")
# (name, expert ranks, ranks a node holds): the meshes (8,) and (2, 4) (its expert axis), and two
# nodes of four ranks.
LAYOUTS = (("mesh (8,)", 8, 8), ("mesh (2, 4)", 4, 4), ("two nodes x 4", 8, 4))
FIT_TOKENS = 8  # the pass size `pass_load` placements are fitted to
FUNCTIONAL_MESHES = ((1, 8), (2, 4))


def placements_for(fit: RoutingTrace, n_ranks: int, hot: int) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
  """{placement: (rank_LE, hot experts bool [L, E] or None)}, fitted on `fit`."""
  n_layers, n_experts = fit.n_layers, fit.n_experts
  popularity_LE = np.stack([c.sum(0) for c in placement.pass_pair_counts(fit.segments, n_experts, 1)]) / sum(
    seg.shape[1] for seg in fit.segments
  )
  fitted = placement.by_pass_load(placement.pass_pair_counts(fit.segments, n_experts, FIT_TOKENS), n_ranks)
  hot_LE = np.zeros((n_layers, n_experts), bool)
  for layer in range(n_layers):
    hot_LE[layer, np.argsort(-popularity_LE[layer])[:hot]] = True
  return {
    "contiguous": (placement.contiguous(n_layers, n_experts, n_ranks), None),
    "popularity": (placement.by_popularity(popularity_LE, n_ranks), None),
    "pass_load": (fitted, None),
    "pass_load+hot": (fitted, hot_LE),
  }


def layout_rows(
  evaluation: RoutingTrace,
  placed: dict[str, tuple[np.ndarray, np.ndarray | None]],
  *,
  n_ranks: int,
  ranks_per_node: int,
  d_model: int,
  activation_bytes: int,
  max_tokens: int,
) -> list[dict[str, Any]]:
  """One row per (placement, n): rank load and dispatch of the evaluation trace's passes."""
  rows = []
  for n in range(1, max_tokens + 1):
    counts_LPE = placement.pass_pair_counts(evaluation.segments, evaluation.n_experts, n)
    n_passes = counts_LPE[0].shape[0]
    home_P = np.arange(n_passes) % n_ranks  # rows spread over the ranks, a pass's tokens on its row's
    uniform_floor = uniform_imbalance(evaluation.n_experts, evaluation.top_k, n_ranks, n)
    for name, (rank_LE, hot_LE) in placed.items():
      imbalance, slowest_unique, unique, crossing, off_rank = [], [], [], [], []
      for layer, counts_PE in enumerate(counts_LPE):
        rank_E = rank_LE[layer]
        if hot_LE is None:
          imbalance.append(placement.imbalance(placement.rank_loads(counts_PE, rank_E, n_ranks)))
        else:
          imbalance.append(placement.replicated_imbalance(counts_PE, rank_E, hot_LE[layer], n_ranks))
        present_PR = placement.rank_loads((counts_PE > 0).astype(float), rank_E, n_ranks)
        slowest_unique.append(present_PR.max(axis=1))
        unique.append(present_PR.sum(axis=1))
        crossing.append(placement.cross_node_share(counts_PE, rank_E, home_P, ranks_per_node))
        off_rank_PE = rank_E[None, :] != home_P[:, None]
        off_rank.append((counts_PE * off_rank_PE).sum(axis=1))
      imbalance_P = np.concatenate(imbalance)
      n_layers = len(counts_LPE)
      rows.append(
        {
          "placement": name,
          "n_tokens": n,
          "uniform_routing_max_over_mean_load": uniform_floor,
          "num_draft": n - 1,
          "passes": int(n_passes),
          "max_over_mean_load": float(imbalance_P.mean()),
          "max_over_mean_load_p95": float(np.percentile(imbalance_P, 95)),
          "slowest_rank_experts": float(np.mean(slowest_unique)),
          "mean_rank_experts": float(np.mean(unique)) / n_ranks,
          # Bytes a pass moves (all MoE layers): the replicated dispatch's all-reduce of the
          # layer's output (each rank's part of a ring), or the exchanged dispatch's off-rank pairs
          # there and back.
          "allreduce_bytes_per_rank": float(n_layers * 2.0 * (n_ranks - 1) / n_ranks * n * d_model * activation_bytes),
          "exchange_bytes": float(np.sum(np.mean(off_rank, axis=1)) * 2 * d_model * activation_bytes),
          "cross_node_share": float(np.mean(crossing)) if ranks_per_node < n_ranks else 0.0,
        }
      )
  return rows


def uniform_imbalance(n_experts: int, top_k: int, n_ranks: int, n_tokens: int, *, samples: int = 2000) -> float:
  """`placement.imbalance` of passes of `n_tokens` tokens each routed to `top_k` distinct experts
  uniformly at random, contiguous placement (Monte Carlo): what balanced, independent routing
  leaves; a placement can go below it only by using the routing's correlations, or replication."""
  rng = np.random.default_rng(0)
  ids = np.argsort(rng.random((samples, n_tokens, n_experts)), axis=-1)[..., :top_k].reshape(samples, -1)
  counts_PE = np.zeros((samples, n_experts))
  np.add.at(counts_PE, (np.arange(samples)[:, None], ids), 1.0)
  rank_E = placement.contiguous(1, n_experts, n_ranks)[0]
  return float(placement.imbalance(placement.rank_loads(counts_PE, rank_E, n_ranks)).mean())


def uniform_slowest_rank_experts(config: ModelConfig, n_ranks: int, n_tokens: int, *, samples: int = 400) -> float:
  """The slowest rank's distinct experts per MoE layer for a pass of `n_tokens` tokens routed
  uniformly at random (top-k distinct), contiguous placement (Monte Carlo)."""
  rng = np.random.default_rng(0)
  per_rank = config.n_routed_experts // n_ranks
  values = []
  for _ in range(samples):
    chosen = np.zeros(config.n_routed_experts, bool)
    for _ in range(n_tokens):
      chosen[rng.choice(config.n_routed_experts, config.top_k, replace=False)] = True
    values.append(chosen.reshape(n_ranks, per_rank).sum(axis=1).max())
  return float(np.mean(values))


def projection_rows(
  config: ModelConfig,
  cluster: dict[str, Any],
  slowest_by_n: Callable[[int], float],
  *,
  label: str,
  max_tokens: int,
) -> list[dict[str, Any]]:
  """The cost model's pass time of `config` on `cluster` for n = 1..max_tokens (batch 1), weights
  and activations at the config's dtype (the runs project bfloat16); `slowest_by_n(n)`: the slowest
  rank's distinct experts per MoE layer."""
  itemsize = jnp.dtype(config.dtype).itemsize
  link = cost_model.Interconnect(
    link_gbps=cluster["link_gbps"],
    cross_node_gbps=cluster["cross_node_gbps"],
    latency_us=cluster["collective_latency_us"],
    ranks_per_node=cluster["ranks_per_node"],
  )
  other_bytes = roofline.decode_weight_bytes(config, [0.0] * config.n_moe_layers)  # every weight but the experts
  rows = []
  for n in range(1, max_tokens + 1):
    slowest = slowest_by_n(n)
    parts = cost_model.ep_verify_ms(
      other_bytes=float(other_bytes),
      expert_bytes=float(kbytes.expert_bytes(config.d_model, config.expert_hidden, itemsize)),
      slowest_rank_experts_L=[slowest] * config.n_moe_layers,
      tokens=n,
      d_model=config.d_model,
      activation_bytes=itemsize,
      ranks=cluster["ranks"],
      read_gbps=cluster["hbm_gbps"],
      link=link,
      fixed_ms=cluster["fixed_ms"],
    )
    rows.append(
      {
        "model": label,
        "cluster": cluster["name"],
        "n_tokens": n,
        "slowest_rank_experts": slowest,
        **{f"{k}_ms": v for k, v in parts.items()},
        "dispatch_share": parts["combine"] / parts["total"],
      }
    )
  return rows


def functional_check(model: msj.Model, prompts: Sequence[str], max_new_tokens: int) -> list[dict[str, Any]]:
  """Greedy tokens on each of FUNCTIONAL_MESHES against one device's, for plain and MTP (K = 3)
  decoding where the model has MTP heads; wall times as a functional check only."""
  if len(jax.devices()) < 8:
    return []
  specs = {"plain": msj.SpecParams()}
  if model.config.num_mtp_modules:
    specs["mtp3"] = msj.SpecParams(drafter="mtp", num_draft=3)
  rows = []
  for name, spec in specs.items():
    want = msj.generate(model, prompts, max_new_tokens, spec=spec).tokens
    for shape in FUNCTIONAL_MESHES:
      placed = model.on_mesh(mesh_lib.make_mesh(*shape))
      msj.generate(placed, prompts, max_new_tokens, spec=spec)  # compiled once, then timed
      began = time.perf_counter()
      out = msj.generate(placed, prompts, max_new_tokens, spec=spec)
      rows.append(
        {
          "spec": name,
          "mesh": list(shape),
          "tokens_equal_one_device": bool(np.array_equal(out.tokens, want)),
          "wall_seconds_functional_only": time.perf_counter() - began,
          "max_over_mean_rank_load": out.stats["max_over_mean_rank_load"],
          "assignments_per_rank_per_pass": out.stats["assignments_per_rank_per_pass"],
        }
      )
  return rows


def run_ep_bench(
  model: msj.Model,
  workdir: atomic.PathLike,
  *,
  clusters: Sequence[dict[str, Any]],
  projected_configs: dict[str, ModelConfig],
  n_segments: int = 64,
  max_tokens: int = 16,
  hot: int = 1,
  functional: bool = True,
  log: Callable[[str], None] = print,
) -> dict[str, Any]:
  """The rank loads, dispatch bytes, projections and functional check; writes
  `workdir/metrics.json` (key `ep_bench`) and `workdir/ep_load.png`; returns the metrics."""
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  began = time.perf_counter()
  config = model.config
  if not config.n_moe_layers:
    raise ValueError("the model has no MoE layers: no expert to place")
  for _, ranks, _ in LAYOUTS:
    if config.n_routed_experts % ranks:
      raise ValueError(f"the model's {config.n_routed_experts} routed experts do not divide over {ranks} ranks")
  log(f"routing trace: {n_segments} held-out windows ...")
  trace = traces.heldout_trace(model, n_segments=n_segments)
  fit, evaluation = trace.split(0.5)
  itemsize = jnp.dtype(config.dtype).itemsize
  popularity_LE = np.stack([c.sum(0) for c in placement.pass_pair_counts(fit.segments, fit.n_experts, 1)])
  skew_L = (popularity_LE.max(axis=1) / popularity_LE.mean(axis=1)).tolist()
  log(f"the most chosen expert over the mean, by MoE layer (fit half): {np.round(skew_L, 2).tolist()}")
  layouts = []
  for name, ranks, per_node in LAYOUTS:
    log(f"{name}: fitting placements on {len(fit.segments)} windows, judging on {len(evaluation.segments)} ...")
    placed = placements_for(fit, ranks, hot)
    rows = layout_rows(
      evaluation,
      placed,
      n_ranks=ranks,
      ranks_per_node=per_node,
      d_model=config.d_model,
      activation_bytes=itemsize,
      max_tokens=max_tokens,
    )
    layouts.append({"layout": name, "ranks": ranks, "ranks_per_node": per_node, "rows": rows})

  def trained_slowest(ranks: int) -> Callable[[int], float]:
    entry = next(e for e in layouts if e["ranks"] == ranks and e["ranks_per_node"] == ranks)
    table = {r["n_tokens"]: r["slowest_rank_experts"] for r in entry["rows"] if r["placement"] == "contiguous"}
    return lambda n: table[n]

  projections = []
  for cluster in clusters:
    projections += projection_rows(
      config.replace(dtype="bfloat16"),
      cluster,
      trained_slowest(cluster["ranks"]),
      label="this model (its traces)",
      max_tokens=max_tokens,
    )
    for label, projected in projected_configs.items():
      cache = {}

      def uniform(n: int, projected=projected, cluster=cluster, cache=cache) -> float:
        if n not in cache:
          cache[n] = uniform_slowest_rank_experts(projected, cluster["ranks"], n)
        return cache[n]

      projections += projection_rows(
        projected, cluster, uniform, label=f"{label} (uniform routing)", max_tokens=max_tokens
      )
  checks = []
  if functional:
    log("functional check on simulated devices ...")
    checks = functional_check(model, ["def main():\n", "import os\n"], 16)
  result = {
    "ep_bench": {
      "layouts": layouts,
      "projections": projections,
      "functional_check": checks,
      "fit_tokens": FIT_TOKENS,
      "popularity_max_over_mean_by_layer": skew_L,
      "hot_experts_replicated": hot,
      "trace_windows": {"fit": len(fit.segments), "evaluation": len(evaluation.segments)},
      "clusters": list(clusters),
      "seconds": time.perf_counter() - began,
    }
  }
  atomic.write_json_atomic(workdir / "metrics.json", result)
  plot_loads(layouts, workdir / "ep_load.png")
  for line in summary_lines(result["ep_bench"]):
    log(line)
  return result


def summary_lines(bench: dict[str, Any], n_tokens: int = 8) -> list[str]:
  """The rank-load table at `n_tokens` (or the largest pass size run) per layout and placement, the
  projections' combine shares."""
  n_tokens = min(n_tokens, max(r["n_tokens"] for r in bench["layouts"][0]["rows"]))
  lines = [f"rank load of {n_tokens}-token passes (K = {n_tokens - 1}), held-out half of the trace:"]
  lines.append(f"{'layout':<16}{'placement':<16}{'max/mean':>9}{'p95':>7}{'vs contig.':>11}{'cross-node':>11}")
  for entry in bench["layouts"]:
    rows = {r["placement"]: r for r in entry["rows"] if r["n_tokens"] == n_tokens}
    base = rows["contiguous"]["max_over_mean_load"]
    for name, r in rows.items():
      lines.append(
        f"{entry['layout']:<16}{name:<16}{r['max_over_mean_load']:>9.3f}{r['max_over_mean_load_p95']:>7.2f}"
        f"{100 * (r['max_over_mean_load'] / base - 1):>10.1f}%{r['cross_node_share']:>11.2f}"
      )
    floor = rows["contiguous"]["uniform_routing_max_over_mean_load"]
    lines.append(
      f"{entry['layout']:<16}{'(uniform iid)':<16}{floor:>9.3f}{'':>7}{100 * (floor / base - 1):>10.1f}%"
      "   independent uniform routing, contiguous"
    )
  lines.append("PROJECTED (cost model, stated bandwidths, not measured): pass time and the combine's share")
  for r in bench["projections"]:
    if r["n_tokens"] in (1, n_tokens):
      lines.append(
        f"  {r['model']:<36}{r['cluster']:<26}n={r['n_tokens']:<3}{r['total_ms'] * 1e3:>9.1f} us"
        f"  combine {100 * r['dispatch_share']:.0f}%"
      )
  for r in bench["functional_check"]:
    lines.append(
      f"functional check {r['spec']} mesh {tuple(r['mesh'])}: tokens equal one device's: "
      f"{r['tokens_equal_one_device']} ({r['wall_seconds_functional_only']:.2f} s, simulated devices)"
    )
  return lines


def plot_loads(layouts: Sequence[dict[str, Any]], path: pathlib.Path) -> None:
  """Max/mean rank load against pass size per placement, one panel per layout."""
  plt = plots.pyplot()
  fig, axes = plt.subplots(1, len(layouts), figsize=(5 * len(layouts), 4), squeeze=False)
  for ax, entry in zip(axes[0], layouts):
    for name in PLACEMENTS:
      rows = [r for r in entry["rows"] if r["placement"] == name]
      ax.plot([r["n_tokens"] for r in rows], [r["max_over_mean_load"] for r in rows], marker="o", label=name)
    ax.set_title(entry["layout"])
    ax.set_xlabel("tokens a pass (K + 1)")
    ax.set_ylabel("slowest rank's pairs / mean rank's")
    ax.legend()
  plots.save(fig, path)
