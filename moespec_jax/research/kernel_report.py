"""What experiments/kernel_bench measured, per layer shape and routing: the bandwidth ratio
r(n) = BW_dedup / BW_per_slot beside the byte share u(n) = dedup bytes / per-slot bytes (dedup is
faster exactly where u < r), the crossover, and the best kernel's share of the streaming rate."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from moespec_jax.analysis import cost_model


def summarize(rows: Sequence[dict[str, Any]], stream_gbps: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
  """r(n) = BW_dedup / BW_per_slot, u(n) = dedup bytes / per-slot bytes, crossover per shape."""
  ratio, crossover = [], []
  by = {(r["shape"], r["routing"], r["n_tokens"], r["method"]): r for r in rows}
  for shape in sorted({r["shape"] for r in rows}):
    for routing in sorted({r["routing"] for r in rows if r["shape"] == shape}):
      ns = sorted({r["n_tokens"] for r in rows if r["shape"] == shape and r["routing"] == routing})
      both = []  # (n, dedup ms, per-slot ms)
      for n in ns:
        dd, ps = by.get((shape, routing, n, "dedup")), by.get((shape, routing, n, "per_slot"))
        if dd is None or ps is None:
          continue
        ratio.append(
          dict(
            shape=shape,
            routing=routing,
            n_tokens=n,
            r=dd["effective_gbps"] / ps["effective_gbps"],
            u=dd["bytes_requested"] / ps["bytes_requested"],
            dedup_faster=dd["time_ms"] < ps["time_ms"],
          )
        )
        both.append((n, dd["time_ms"], ps["time_ms"]))
      curves = [list(c) for c in zip(*both)] if both else [[], [], []]
      best = {}
      for n in ns:
        cands = [by[(shape, routing, n, m)] for m in ("dedup", "per_slot") if (shape, routing, n, m) in by]
        if cands:
          best[n] = max(c["effective_gbps"] for c in cands) / stream_gbps
      # measured_n: the first n from which dedup stays faster (where the two cost about the same,
      # as at n = 1, a single win is timing noise); first_faster_n: its first win.
      crossover.append(
        dict(
          shape=shape,
          routing=routing,
          measured_n=cost_model.crossover(*curves, for_good=True),
          first_faster_n=cost_model.crossover(*curves),
          best_fraction_of_stream={str(n): v for n, v in best.items()},
        )
      )
  return ratio, crossover
