"""Measured kernel choices per backend (from experiments/kernel_bench.py; update when re-measured).

DEDUP_MIN_TOKENS[backend]: the smallest pass size (tokens) from which `auto` uses dedup.
cpu: the C++ dedup kernel does the same work as per-slot at n = 1 and reads fewer bytes from
n = 2 at equal effective bandwidth (kernel_bench on the 2-core development machine), so 1.
tpu/gpu: not measured yet (no accelerator); dedup pads rows to a tile, per-slot is a GEMV, so
per-slot at n = 1 and dedup from 2 until experiments/gpu_check.sh measures the crossover.
"""

from __future__ import annotations

DEDUP_MIN_TOKENS = {"cpu": 1, "tpu": 2, "gpu": 2, "interpret": 2}


def dedup_min_tokens(backend: str) -> int:
  return DEDUP_MIN_TOKENS.get(backend, 2)
