"""Statistics of timings taken in interleaved rounds: a median over rounds and how far this
machine's timing noise leaves it uncertain."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np


def median_interval(values: Sequence[float], level: float = 0.9, resamples: int = 2000,
                    seed: int = 0) -> tuple[float, float]:
  """A percentile-bootstrap interval (rounds resampled) for the median of `values`, one value
  per round (e.g. a ratio of two timings taken in the same round)."""
  values = np.asarray(values, float)
  if values.ndim != 1 or values.size == 0:
    raise ValueError(f"median_interval needs a non-empty 1-D sequence, got shape {values.shape}")
  picks = np.random.default_rng(seed).integers(0, values.size, (resamples, values.size))
  medians = np.median(values[picks], axis=1)
  tail = (1.0 - level) / 2.0
  return float(np.quantile(medians, tail)), float(np.quantile(medians, 1.0 - tail))


def interleaved_seconds(fns: dict[Any, Callable[[], Any]], rounds: int, *, before: Callable[[], None],
                        on_round: Callable[[int], None] | None = None) -> tuple[dict, dict]:
  """Wall seconds of every function in `fns`, once per round, the order reversing from one round
  to the next: every measurement of a round sees the same stretch of this machine's load, so
  ratios are taken within rounds. `before` runs ahead of every call, untimed (benchmarks pass
  `roofline.flush_caches`, so that no call finds its weights left in the processor's caches by a
  call of its own kind); `on_round(r)` after round r (progress). Returns ({label: [seconds per
  round]}, {label: last output})."""
  labels = list(fns)
  seconds, last = {k: [] for k in labels}, {}
  for r in range(rounds):
    for k in (labels if r % 2 == 0 else labels[::-1]):
      before()
      start = time.perf_counter()
      last[k] = fns[k]()
      seconds[k].append(time.perf_counter() - start)
    if on_round is not None:
      on_round(r)
  return seconds, last


def decode_ms_per_step(seconds: Sequence[float], first_token_seconds: Sequence[float], max_new: int) -> list[float]:
  """Per round: the decode phase of a plain run of `max_new` tokens (all but its first token,
  which carries the prefill; `first_token_seconds`: the same run stopped after one token, timed
  in the same round) in ms per step."""
  if max_new < 2:
    raise ValueError(f"a decode phase needs max_new_tokens >= 2, got {max_new}")
  return [(t - t1) * 1e3 / (max_new - 1) for t, t1 in zip(seconds, first_token_seconds)]
