"""The routing-statistics report: unique experts under four models, overlap, reuse, IPF error."""

from __future__ import annotations

from typing import Any

import numpy as np

from moespec_jax.analysis import ipf, routing
from moespec_jax.analysis.routing import RoutingTrace
from moespec_jax.io import plots
from moespec_jax.io.atomic import PathLike

# Overlap between the experts of tokens up to this many positions apart (the 1..8).
MAX_DISTANCE = 8


def routing_stats(
  trace: RoutingTrace,
  *,
  max_tokens: int = 16,
  ipf_max_tokens: int = 9,
  max_distance: int = MAX_DISTANCE,
  fit_fraction: float = 0.5,
) -> dict[str, Any]:
  """Fits popularity and co-activation on one part of the trace, evaluates on the other.

  Returns the `routing_stats` metrics: per n, the empirical unique experts (evaluation part)
  beside the uniform, independent and IPF predictions (fit part), averaged over layers and per
  layer; overlap by distance; reuse; and the IPF / independence mean absolute relative errors
  over n = 2..ipf_max_tokens and every layer.
  """
  if len(trace.segments) < 2:
    raise ValueError("need at least two trace segments to fit on one part and evaluate on another")
  if min(max_tokens, ipf_max_tokens) < 2:
    raise ValueError(
      f"need max_tokens and ipf_max_tokens >= 2 (the errors are over n = 2 and up), got "
      f"{max_tokens} and {ipf_max_tokens}"
    )
  fit, held = trace.split(fit_fraction)
  longest = max(seg.shape[1] for seg in held.segments)
  if longest < max(max_tokens, max_distance + 1):
    raise ValueError(
      f"the trace's evaluation segments (at most {longest} tokens) are too short for passes of up "
      f"to {max_tokens} tokens and overlap up to distance {max_distance}"
    )
  e, k, n_layers = trace.n_experts, trace.top_k, trace.n_layers
  p_LE = routing.popularity(fit)
  co_LED = routing.co_activation(fit, max(max_distance, ipf_max_tokens - 1))

  rows, ipf_pairs, ind_pairs = [], [], []
  for n in range(1, max_tokens + 1):
    emp_L = routing.empirical_unique(held, n)
    ind_L = routing.independent_unique(p_LE, n)
    row = {
      "n_tokens": n,
      "empirical": float(emp_L.mean()),
      "independent": float(ind_L.mean()),
      "uniform": routing.uniform_unique(e, k, n),
      "empirical_per_layer": emp_L.tolist(),
      "independent_per_layer": ind_L.tolist(),
    }
    if n <= ipf_max_tokens:
      ipf_L = np.array([ipf.expected_unique(p_LE[layer], co_LED[layer], n) for layer in range(n_layers)])
      row["ipf"] = float(ipf_L.mean())
      row["ipf_per_layer"] = ipf_L.tolist()
      if n >= 2:
        ipf_pairs.extend(zip(ipf_L, emp_L))
        ind_pairs.extend(zip(ind_L, emp_L))
    else:
      row["ipf"] = None
    rows.append(row)

  overlap_LD = routing.overlap_by_distance(held, max_distance)
  ind_overlap_L = routing.independent_overlap(p_LE, k)
  overlap = [
    {
      "distance": d,
      "overlap": float(overlap_LD[:, d - 1].mean()),
      "per_layer": overlap_LD[:, d - 1].tolist(),
      "independent": float(ind_overlap_L.mean()),
      "independent_per_layer": ind_overlap_L.tolist(),
      "uniform": k / e,
    }
    for d in range(1, max_distance + 1)
  ]
  reuse_by_n = []
  for n in (2, 4, 8):
    emp = [r for r in rows if r["n_tokens"] == n]
    if emp:
      reuse_by_n.append({"n_tokens": n, "reuse": 1 - emp[0]["empirical"] / (n * k)})
  return {
    "n_experts": e,
    "top_k": k,
    "n_layers": n_layers,
    # The model layer of each traced (MoE) layer (None where the trace does not say).
    "model_layers": trace.meta.get("model_layers"),
    "tokens_fit": int(sum(s.shape[1] for s in fit.segments)),
    "tokens_eval": int(sum(s.shape[1] for s in held.segments)),
    "unique_experts": rows,
    "overlap_by_distance": overlap,
    "reuse": reuse_by_n,
    "ipf_mean_abs_rel_error": routing.mean_abs_rel_error(*zip(*ipf_pairs)),
    "independent_mean_abs_rel_error": routing.mean_abs_rel_error(*zip(*ind_pairs)),
    "error_range": f"n = 2..{ipf_max_tokens}, every layer",
    "trace": trace.meta,
  }


def layer_label(stats: dict[str, Any], layer: int) -> str:
  """The legend name of traced layer `layer`: the model layer it is (from 0), e.g. 'layer 1 (MoE)';
  for a trace that does not say, its place among the MoE layers."""
  if stats.get("model_layers") is None:
    return f"MoE layer {layer} (of the MoE layers)"
  return f"layer {stats['model_layers'][layer]} (MoE)"


def plot_routing(stats: dict[str, Any], path: PathLike) -> None:
  """unique experts per pass under the four models; overlap by token distance per model layer."""
  plt = plots.pyplot()
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  rows = stats["unique_experts"]
  ns = [r["n_tokens"] for r in rows]
  for key, style in (("uniform", ":"), ("independent", "--"), ("empirical", "-o")):
    ax1.plot(ns, [r[key] for r in rows], style, label=key)
  ipf_rows = [r for r in rows if r["ipf"] is not None]
  ax1.plot([r["n_tokens"] for r in ipf_rows], [r["ipf"] for r in ipf_rows], "-s", label="IPF (max-entropy)")
  plots.finish_axes(
    ax1,
    "tokens per pass n",
    "unique experts per layer",
    f"unique experts ({stats['n_experts']} experts, top-{stats['top_k']})",
  )
  ov = stats["overlap_by_distance"]
  ds = [o["distance"] for o in ov]
  per_layer = np.array([o["per_layer"] for o in ov]).T
  ind_layer = ov[0]["independent_per_layer"]
  for layer, curve in enumerate(per_layer):
    (line,) = ax2.plot(ds, curve, "-o", ms=3, alpha=0.8, label=layer_label(stats, layer))
    ax2.axhline(ind_layer[layer], color=line.get_color(), ls="--", alpha=0.6)
  ax2.plot([], [], "k--", label="independent (per layer)")
  ax2.plot(ds, [o["uniform"] for o in ov], "k:", label="uniform")
  plots.finish_axes(
    ax2, "token distance", "overlap |E(t) ∩ E(t+d)| / k", "expert overlap by distance", legend_fontsize=7
  )
  plots.save(fig, path)
