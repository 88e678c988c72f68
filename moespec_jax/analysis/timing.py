"""Statistics of timings taken in interleaved rounds: a median over rounds and how far this
machine's timing noise leaves it uncertain."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np


def median_interval(
  values: Sequence[float], level: float = 0.9, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
  """A percentile-bootstrap interval (rounds resampled) for the median of `values`, one value
  per round (e.g. a ratio of two timings taken in the same round)."""
  values = np.asarray(values, float)
  if values.ndim != 1 or values.size == 0:
    raise ValueError(f"median_interval needs a non-empty 1-D sequence, got shape {values.shape}")
  picks = np.random.default_rng(seed).integers(0, values.size, (resamples, values.size))
  medians = np.median(values[picks], axis=1)
  tail = (1.0 - level) / 2.0
  return float(np.quantile(medians, tail)), float(np.quantile(medians, 1.0 - tail))


def round_order(labels: Sequence[Any], r: int) -> list:
  """The order in which round `r` runs `labels`: a balanced Latin square (Williams design).

  Over a cycle of len(labels) rounds (twice that for an odd count) every label runs at every
  position equally often and right after every other label equally often. A comparison against a
  label always run first and last (right after the round's untimed setup, or never after a long
  speculative run) would carry what running after another program costs here, which measured a
  few percent (docs/findings/2026-12-04-balanced-round-order.md). Two labels alternate.
  """
  n = len(labels)
  if n == 0:
    return []
  # 0, 1, n-1, 2, n-2, ...: consecutive differences are distinct modulo n (even n).
  base = [0]
  for i in range(1, n):
    base.append((i + 1) // 2 if i % 2 == 1 else n - i // 2)
  row = [labels[(b + r) % n] for b in base]
  return row[::-1] if n % 2 == 1 and (r // n) % 2 == 1 else row


def interleaved_seconds(
  fns: dict[Any, Callable[[], Any]],
  rounds: int,
  *,
  before: Callable[[], None],
  on_round: Callable[[int], None] | None = None,
) -> tuple[dict, dict]:
  """Wall seconds of every function in `fns`, once per round, in a balanced order (`round_order`):
  every measurement of a round sees the same stretch of this machine's load, so
  ratios are taken within rounds. `before` runs ahead of every call, untimed (benchmarks pass
  `roofline.flush_caches`, so that no call finds its weights left in the processor's caches by a
  call of its own kind); `on_round(r)` after round r (progress). Returns ({label: [seconds per
  round]}, {label: last output})."""
  labels = list(fns)
  seconds, last = {k: [] for k in labels}, {}
  for r in range(rounds):
    for k in round_order(labels, r):
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


def median_time_ms(fn: Callable[..., Any], args: Sequence[Any], repeats: int) -> float:
  """Median wall time (ms) of `fn(*args)` after one warm-up call."""
  return median_times_alternating_ms({"call": lambda: fn(*args)}, repeats)["call"]


def median_times_alternating_ms(calls: dict, repeats: int) -> dict:
  """Median wall time (ms) of each zero-argument call in `calls`, timed in alternation (in the
  balanced order of `round_order`) after one warm-up call each: a slow spell of the
  machine moves every median together, so their comparison is not decided by when each was
  timed."""
  for call in calls.values():
    jax.block_until_ready(call())
  names = list(calls)
  times = {name: [] for name in names}
  for r in range(repeats):
    for name in round_order(names, r):
      start = time.perf_counter()
      jax.block_until_ready(calls[name]())
      times[name].append(time.perf_counter() - start)
  return {name: float(np.median(t)) * 1e3 for name, t in times.items()}
