"""Expert-matmul kernels: one entry point for the routed SwiGLU expert FFN."""

from pallas_kernels.grouped import expert_ffn_grouped
from pallas_kernels.reference import expert_ffn_dense, expert_ffn_reference

METHODS = ("xla", "dedup", "per_slot", "auto")

# Below this many (token, slot) rows the XLA path uses the per-row reference; at or above it,
# the sort-based grouped matmul (the training path: fastest measured fwd+bwd on CPU).
GROUPED_MIN_ROWS = 64


def default_block_rows(n_rows, n_experts):
  """Rows per block of the grouped path: the mean group size as a power of two, in [8, 256]."""
  mean = max(1, n_rows // max(1, n_experts))
  return int(min(256, max(8, 1 << (mean - 1).bit_length())))


def expert_ffn_xla(x_TD, expert_ids_TK, gates_TK, w_gate_EDF, w_up_EDF, w_down_EFD):
  """Pure-XLA path: per-row reference for small passes, sorted grouped matmul for large T."""
  n_rows = expert_ids_TK.size
  if n_rows < GROUPED_MIN_ROWS:
    return expert_ffn_reference(x_TD, expert_ids_TK, gates_TK, w_gate_EDF, w_up_EDF, w_down_EFD)
  block_rows = default_block_rows(n_rows, w_gate_EDF.shape[0])
  return expert_ffn_grouped(x_TD, expert_ids_TK, gates_TK, w_gate_EDF, w_up_EDF, w_down_EFD,
                            block_rows=block_rows)


def expert_ffn(x_TD, expert_ids_TK, gates_TK, w_gate_EDF, w_up_EDF, w_down_EFD, *, method="xla"):
  """y_t = sum_k gates[t, k] * SwiGLU_{expert_ids[t, k]}(x_t); shapes: x [T, D], ids/gates [T, K]."""
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  return expert_ffn_xla(x_TD, expert_ids_TK, gates_TK, w_gate_EDF, w_up_EDF, w_down_EFD)
