"""Expert-matmul kernels: one entry point for the routed SwiGLU expert FFN."""

from pallas_kernels.reference import expert_ffn_dense, expert_ffn_reference

METHODS = ("xla",)


def expert_ffn(x_TD, expert_ids_TK, gates_TK, w_gate_EDF, w_up_EDF, w_down_EFD, *, method="xla"):
  """y_t = sum_k gates[t, k] * SwiGLU_{expert_ids[t, k]}(x_t); shapes: x [T, D], ids/gates [T, K]."""
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  return expert_ffn_reference(x_TD, expert_ids_TK, gates_TK, w_gate_EDF, w_up_EDF, w_down_EFD)
