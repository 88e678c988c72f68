"""Statistics of timings taken in interleaved rounds: a median over rounds and how far this
machine's timing noise leaves it uncertain."""

from __future__ import annotations

from typing import Sequence

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
