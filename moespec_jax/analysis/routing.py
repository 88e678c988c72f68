"""Routing traces and their statistics: unique experts per pass, overlap by distance, reuse.

A trace is `expert_ids` int [L, N, K]: for each MoE layer, the top-k experts of N consecutive
tokens of one stream (several streams are kept apart by `segments`, a list of traces).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence

import numpy as np

from moespec_jax.io import atomic


@dataclasses.dataclass
class RoutingTrace:
  """Per-layer top-k expert ids of consecutive tokens, in segments of one stream each."""

  segments: list[np.ndarray]  # each int [L, N_s, K]
  n_experts: int
  meta: dict

  @property
  def n_layers(self) -> int:
    return self.segments[0].shape[0]

  @property
  def top_k(self) -> int:
    return self.segments[0].shape[2]

  def split(self, fraction: float) -> tuple[RoutingTrace, RoutingTrace]:
    """First `fraction` of the segments (fit) and the rest (evaluation)."""
    cut = max(1, min(len(self.segments) - 1, int(round(len(self.segments) * fraction))))
    return (
      RoutingTrace(self.segments[:cut], self.n_experts, {**self.meta, "part": "fit"}),
      RoutingTrace(self.segments[cut:], self.n_experts, {**self.meta, "part": "eval"}),
    )

  def save(self, path: atomic.PathLike) -> None:
    """An .npz with the segments and a JSON metadata entry, written atomically."""
    path = pathlib.Path(path)
    arrays = {f"segment_{i}": s for i, s in enumerate(self.segments)}
    arrays["meta"] = np.frombuffer(json.dumps({**self.meta, "n_experts": self.n_experts}).encode(), np.uint8)
    import io

    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    atomic.write_bytes_atomic(path, buf.getvalue())

  @classmethod
  def load(cls, path: atomic.PathLike) -> RoutingTrace:
    with np.load(path) as z:
      meta = json.loads(bytes(z["meta"]).decode())
      n = sum(1 for k in z.files if k.startswith("segment_"))
      segments = [z[f"segment_{i}"] for i in range(n)]
    return cls(segments, meta.pop("n_experts"), meta)


def activations(ids_NK: np.ndarray, n_experts: int) -> np.ndarray:
  """Binary activation matrix bool [N, E] of one layer."""
  act = np.zeros((ids_NK.shape[0], n_experts), bool)
  act[np.arange(ids_NK.shape[0])[:, None], ids_NK] = True
  return act


def popularity(trace: RoutingTrace) -> np.ndarray:
  """p_e per layer, [L, E]: the probability that a token selects expert e (sum_e p_e = k)."""
  out = np.zeros((trace.n_layers, trace.n_experts))
  total = 0
  for seg in trace.segments:
    for layer in range(trace.n_layers):
      out[layer] += activations(seg[layer], trace.n_experts).sum(0)
    total += seg.shape[1]
  return out / total


def co_activation(trace: RoutingTrace, max_distance: int) -> np.ndarray:
  """P(a_t = 1, a_{t+d} = 1) per layer, expert and distance d = 1..max_distance: [L, E, D]."""
  sums = np.zeros((trace.n_layers, trace.n_experts, max_distance))
  counts = np.zeros(max_distance)
  for seg in trace.segments:
    n = seg.shape[1]
    for layer in range(trace.n_layers):
      act = activations(seg[layer], trace.n_experts).astype(np.float64)
      for d in range(1, max_distance + 1):
        if n > d:
          sums[layer, :, d - 1] += (act[:-d] * act[d:]).sum(0)
    counts += np.array([max(0, n - d) for d in range(1, max_distance + 1)])
  return sums / np.maximum(counts, 1)


def empirical_unique(trace: RoutingTrace, n_tokens: int) -> np.ndarray:
  """Mean number of distinct experts over windows of n consecutive tokens, per layer [L]."""
  sums, count = np.zeros(trace.n_layers), 0
  for seg in trace.segments:
    n = seg.shape[1]
    if n < n_tokens:
      continue
    for layer in range(trace.n_layers):
      act = activations(seg[layer], trace.n_experts).astype(np.int32)
      csum = np.concatenate([np.zeros((1, trace.n_experts), np.int32), np.cumsum(act, 0)])
      window = csum[n_tokens:] - csum[:-n_tokens]  # [n - n_tokens + 1, E]
      sums[layer] += (window > 0).sum()
    count += n - n_tokens + 1
  if not count:
    raise ValueError(
      f"no segment of the trace has {n_tokens} tokens (longest: "
      f"{max((seg.shape[1] for seg in trace.segments), default=0)})"
    )
  return sums / count


def uniform_unique(n_experts: int, top_k: int, n_tokens: int) -> float:
  """N [1 - (1 - k/N)^B]: uniform popularity, independent tokens."""
  return n_experts * (1 - (1 - top_k / n_experts) ** n_tokens)


def independent_unique(p_LE: np.ndarray, n_tokens: int) -> np.ndarray:
  """sum_e [1 - (1 - p_e)^B] per layer: measured popularity, independent tokens."""
  return np.sum(1 - (1 - p_LE) ** n_tokens, axis=-1)


def overlap_by_distance(trace: RoutingTrace, max_distance: int) -> np.ndarray:
  """Mean |experts(t) ∩ experts(t+d)| / k per layer and distance, [L, D]."""
  co_LED = co_activation(trace, max_distance)
  return co_LED.sum(axis=1) / trace.top_k


def independent_overlap(p_LE: np.ndarray, top_k: int) -> np.ndarray:
  """(1/k) sum_e p_e^2 per layer: the overlap of independent tokens."""
  return np.sum(p_LE**2, axis=-1) / top_k


def reuse(ids_LNK: np.ndarray) -> np.ndarray:
  """1 - |union of experts| / sum of |experts per token|, per layer, for one pass of tokens."""
  n_layers, n, k = ids_LNK.shape
  return np.array([1 - len(np.unique(ids_LNK[layer])) / (n * k) for layer in range(n_layers)])


def mean_abs_rel_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
  p, m = np.asarray(predicted, float), np.asarray(measured, float)
  return float(np.mean(np.abs(p - m) / np.abs(m)))
