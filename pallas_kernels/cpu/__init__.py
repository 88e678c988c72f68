"""The C++ CPU kernels, called through the XLA FFI: the routed expert FFN (dedup and per-slot),
the column-packed products of the decoding output head and dense projections, attention against
the KV cache (GQA, draft trees' passes too; MLA against its compressed cache) and a clock read inside compiled programs.
`build.py` compiles and loads the library (csrc/), `ffi.py` holds the calls, `packing.py` the
weight layout of the packed products."""

from pallas_kernels.cpu.build import (
  CpuKernelUnavailable,
  available,
  cache_dir,
  ensure_built,
  library_path,
  reset_for_tests,
  unavailable_reason,
)
from pallas_kernels.cpu.ffi import (
  MODES,
  TREE_WINDOW,
  cached_attention,
  clock_after,
  elapsed_ms,
  expert_ffn_cpu,
  mla_attention,
  packed_matmul,
  tree_attention,
)
from pallas_kernels.cpu.packing import PACK_COLUMNS, pack_columns

__all__ = [
  "CpuKernelUnavailable",
  "MODES",
  "PACK_COLUMNS",
  "TREE_WINDOW",
  "available",
  "cache_dir",
  "cached_attention",
  "clock_after",
  "elapsed_ms",
  "ensure_built",
  "expert_ffn_cpu",
  "library_path",
  "mla_attention",
  "pack_columns",
  "packed_matmul",
  "reset_for_tests",
  "tree_attention",
  "unavailable_reason",
]
