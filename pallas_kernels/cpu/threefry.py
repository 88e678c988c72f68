"""The threefry hash on the CPU backend as one fused kernel instead of XLA:CPU's rolled loop.

JAX lowers threefry2x32 (under every `jax.random` call) on CPU as a rolled loop, which XLA:CPU
runs as a loop of small kernels. A sampled decoding pass derives its keys and draws its noise
several times, and those loops, interleaved with the pass's C++ kernels on the same threads, cost
a large part of a sampled pass (docs/findings/2026-12-07-sampled-pass-overhead.md). JAX's own
unrolled lowering (the one it uses on GPU and TPU) computes the same bits as one fused elementwise
kernel. `use_unrolled_threefry` registers it for the CPU backend: process-wide, for every later
compilation (the bits are the same). The primitive and `register_lowering` are public; the
unrolled rule is JAX's internal one (JAX is pinned in pyproject.toml): where it is missing, a
warning is logged and JAX's lowering stays, which is correct, only slower.
"""

from __future__ import annotations

import functools
import logging

from jax.extend import random as jax_random
from jax.interpreters import mlir


@functools.cache
def use_unrolled_threefry() -> bool:
  """Registers JAX's unrolled threefry lowering for CPU (once); whether it is in effect."""
  try:
    from jax._src.random import threefry2x32 as internal

    rule = internal._threefry2x32_lowering_rule  # noqa: SLF001 (the unrolled rule has no public name)
  except (ImportError, AttributeError) as e:
    logging.warning("threefry keeps JAX's rolled CPU lowering (sampling runs slower): %s", e)
    return False
  mlir.register_lowering(jax_random.threefry2x32_p, rule, platform="cpu")
  return True
