"""Pass times from ResearchOptions(pass_trace=True) (`stats["pass_trace"]`), over repeated runs:
a median per pass, and a line in the distinct experts each pass reads.

One run's times carry this machine's noise (and a process's first run, its first execution);
runs of the same prompts and parameters verify the same tokens, so their passes line up and a
median per pass keeps what is systematic. Against the experts read, the fit separates what a
pass costs because of its tokens' routing from what it costs because of where it falls in the
generation (the first passes after the prefill).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_SHARED = ("num_draft", "tokens", "experts")


def median_trace(traces: Sequence[dict]) -> dict[str, list]:
  """The per-pass median time of runs whose passes line up (the same K, tokens and experts at
  every pass: the same prompts, parameters and seed); ValueError where they do not."""
  if not traces:
    raise ValueError("median_trace needs at least one pass trace")
  first = traces[0]
  for i, trace in enumerate(traces[1:], 1):
    for key in _SHARED:
      if list(trace[key]) != list(first[key]):
        raise ValueError(
          f"pass trace {i} differs from trace 0 in {key!r}: its passes do not line up "
          "(different prompts, parameters or seed?)"
        )
  ms = np.median(np.asarray([trace["ms"] for trace in traces], float), axis=0)
  return dict({key: list(first[key]) for key in _SHARED}, ms=ms.tolist())


def expert_read_fit(trace: dict[str, list], skip: int = 8) -> dict | None:
  """Pass times against the experts they read: least squares over the passes after the first
  `skip`, with a level of its own for each K and one slope, ms = level[K] + slope * experts
  (what one more distinct expert read costs), and each pass's time less that prediction
  (`excess_ms`; None for a K the later passes did not run). None where the later passes are too
  few (fewer than four more than the fit's coefficients) or all read the same number of experts."""
  ms, ks, experts = (np.asarray(trace[key], float) for key in ("ms", "num_draft", "experts"))
  later_ks = np.unique(ks[skip:]).astype(int)
  if ms[skip:].size < later_ks.size + 5 or np.ptp(experts[skip:]) == 0:
    return None
  columns = [ks[skip:] == k for k in later_ks] + [experts[skip:]]
  coef = np.linalg.lstsq(np.stack(columns, axis=1).astype(float), ms[skip:], rcond=None)[0]
  level = dict(zip(later_ks.tolist(), coef[:-1].tolist()))
  excess = [float(t - level[int(k)] - coef[-1] * e) if int(k) in level else None for t, k, e in zip(ms, ks, experts)]
  return {"slope_ms_per_expert": float(coef[-1]), "level_ms": level, "excess_ms": excess}
