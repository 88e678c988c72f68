"""Expert-matmul kernels: one entry point for the routed SwiGLU expert FFN.

    y_t = sum_k gates[t, k] * SwiGLU_{expert_ids[t, k]}(x_t)

method:
  xla       pure XLA, the oracle: per-(token, slot) matrix-vector products for small passes, the
            sort-based grouped matmul (grouped.py) for large T. Differentiable (training path).
  dedup     each selected expert's weights are read once per pass, whatever the number of
            tokens that chose it.
  per_slot  each (token, slot) pair reads its own expert's weights.
  auto      on the CPU backend with the C++ kernel built: dedup from the measured crossover on
            (tuning.py), at every T (the fastest forward measured, prefill included); on TPU/GPU:
            grouped XLA for large T, otherwise dedup or per_slot from the crossover.
backend (dedup/per_slot): auto (by jax.default_backend()), cpu (the C++ kernel of cpu/, falling
  back to XLA with a logged warning when it cannot be built), tpu (tpu/: Pallas Mosaic), gpu (gpu/:
  Pallas Triton), interpret (the Pallas TPU kernels in interpret mode, for tests on CPU; with
  interpret=True the tpu/gpu backends also run in interpret mode).
dedup/per_slot are differentiable: under differentiation the forward and the VJP are the
grouped XLA path's (one traced computation, no second forward); the kernel runs when not
differentiated.

What a whole program runs (this method, and the C++ or XLA head, dense projections and attention)
is one frozen `KernelPolicy` (policy.py), resolved once per program for a platform.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import cpu, expert_parallel, tuning
from pallas_kernels.grouped import expert_ffn_grouped
from pallas_kernels.policy import BACKENDS, METHODS, KernelPolicy, resolve_backend
from pallas_kernels.reference import expert_ffn_dense, expert_ffn_reference

__all__ = [
  "BACKENDS",
  "GROUPED_MIN_ROWS",
  "METHODS",
  "KernelPolicy",
  "choose_method",
  "expert_ffn",
  "expert_ffn_dense",
  "expert_ffn_grouped",
  "expert_ffn_reference",
  "expert_ffn_xla",
  "resolve_backend",
]

# At or above this many (token, slot) rows (more than any decode pass: 16 tokens x top-8 = 128)
# the XLA path uses the sort-based grouped matmul (the training path: fastest measured fwd+bwd
# on CPU), and `auto` picks it too.
GROUPED_MIN_ROWS = 256


def default_block_rows(n_rows: int, n_experts: int) -> int:
  """Rows per block of the grouped path: the mean group size as a power of two, in [8, 256]."""
  mean = max(1, n_rows // max(1, n_experts))
  return int(min(256, max(8, 1 << (mean - 1).bit_length())))


def expert_ffn_pairs(
  x_TD: jax.Array,
  expert_ids_TK: jax.Array,
  gates_TK: jax.Array,
  w_gate_EDF: jax.Array,
  w_up_EDF: jax.Array,
  w_down_EFD: jax.Array,
) -> jax.Array:
  """One matrix-vector product per (token, slot) pair, pairs sorted by expert (XLA, small T).

  The fastest XLA:CPU formulation measured: a single-row product reads the weight slice in place,
  while multi-row products against a slice become a copy + GEMM call.
  """
  T, K = expert_ids_TK.shape
  ids_R = expert_ids_TK.reshape(-1).astype(jnp.int32)
  g_R = gates_TK.reshape(-1).astype(jnp.float32)
  order_R = jnp.argsort(ids_R, stable=True)
  x = x_TD.astype(jnp.float32)

  def body(i: jax.Array, y_TD: jax.Array):
    r = order_R[i]
    e, t = ids_R[r], r // K
    x_D = lax.dynamic_index_in_dim(x, t, keepdims=False)
    wg = lax.dynamic_index_in_dim(w_gate_EDF, e, keepdims=False).astype(jnp.float32)
    wu = lax.dynamic_index_in_dim(w_up_EDF, e, keepdims=False).astype(jnp.float32)
    wd = lax.dynamic_index_in_dim(w_down_EFD, e, keepdims=False).astype(jnp.float32)
    h_F = jax.nn.silu(jnp.einsum("d,df->f", x_D, wg)) * jnp.einsum("d,df->f", x_D, wu)
    return y_TD.at[t].add(g_R[r] * jnp.einsum("f,fd->d", h_F, wd))

  y_TD = lax.fori_loop(0, T * K, body, jnp.zeros(x.shape, jnp.float32), unroll=2)
  return y_TD.astype(x_TD.dtype)


def expert_ffn_xla(
  x_TD: jax.Array,
  expert_ids_TK: jax.Array,
  gates_TK: jax.Array,
  w_gate_EDF: jax.Array,
  w_up_EDF: jax.Array,
  w_down_EFD: jax.Array,
) -> jax.Array:
  """Pure-XLA path: per-pair products for small passes, sorted grouped matmul for large T."""
  n_rows = expert_ids_TK.size
  if n_rows < GROUPED_MIN_ROWS:
    return expert_ffn_pairs(x_TD, expert_ids_TK, gates_TK, w_gate_EDF, w_up_EDF, w_down_EFD)
  block_rows = default_block_rows(n_rows, w_gate_EDF.shape[0])
  return expert_ffn_grouped(x_TD, expert_ids_TK, gates_TK, w_gate_EDF, w_up_EDF, w_down_EFD, block_rows=block_rows)


_warned = set()


def _forward(method: str, backend: str, interpret: bool) -> Callable[..., jax.Array]:
  """The (non-differentiable) forward of a kernel method on a resolved backend."""
  if backend == "cpu":
    try:
      cpu.ensure_built()
      return functools.partial(cpu.expert_ffn_cpu, method=method)
    except cpu.CpuKernelUnavailable as e:
      if str(e) not in _warned:
        _warned.add(str(e))
        logging.warning("expert_ffn(method=%r, backend='cpu'): %s; falling back to the XLA path", method, e)
      return expert_ffn_xla
  if backend in ("tpu", "interpret"):
    from pallas_kernels import tpu  # pylint: disable=g-import-not-at-top

    return functools.partial(tpu.expert_ffn_tpu, method=method, interpret=bool(interpret) or backend == "interpret")
  from pallas_kernels import gpu  # pylint: disable=g-import-not-at-top

  return functools.partial(gpu.expert_ffn_gpu, method=method, interpret=bool(interpret))


@functools.cache
def _with_grouped_vjp(method: str, backend: str, interpret: bool) -> Callable[..., jax.Array]:
  """Kernel forward + the grouped XLA path's VJP (so every method trains)."""
  fwd_fn = _forward(method, backend, interpret)

  @jax.custom_vjp
  def f(
    x_TD: jax.Array,
    expert_ids_TK: jax.Array,
    gates_TK: jax.Array,
    w_gate_EDF: jax.Array,
    w_up_EDF: jax.Array,
    w_down_EFD: jax.Array,
  ):
    return fwd_fn(x_TD, expert_ids_TK, gates_TK, w_gate_EDF, w_up_EDF, w_down_EFD)

  def fwd(x_TD: jax.Array, expert_ids_TK: jax.Array, gates_TK: jax.Array, wg: jax.Array, wu: jax.Array, wd: jax.Array):
    def diff(x: jax.Array, g: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array):
      return (
        expert_ffn_xla(x, expert_ids_TK, g, a, b, c)
        if expert_ids_TK.size >= GROUPED_MIN_ROWS
        else (expert_ffn_grouped(x, expert_ids_TK, g, a, b, c, block_rows=8))
      )

    return jax.vjp(diff, x_TD, gates_TK, wg, wu, wd)

  def bwd(vjp: Callable[[jax.Array], tuple[jax.Array, ...]], dy_TD: jax.Array):
    dx, dg, dwg, dwu, dwd = vjp(dy_TD)
    return dx, None, dg, dwg, dwu, dwd

  f.defvjp(fwd, bwd)
  return f


def choose_method(n_tokens: int, top_k: int, backend: str = "auto") -> str:
  """What `auto` runs for a pass of n_tokens: 'xla' (grouped, large T), 'dedup' or 'per_slot'."""
  resolved = resolve_backend(backend)
  cpu_kernel = resolved == "cpu" and cpu.available()
  if n_tokens * top_k >= GROUPED_MIN_ROWS and not cpu_kernel:
    return "xla"
  return "dedup" if n_tokens >= tuning.dedup_min_tokens(resolved) else "per_slot"


def expert_ffn(
  x_TD: jax.Array,
  expert_ids_TK: jax.Array,
  gates_TK: jax.Array,
  w_gate_EDF: jax.Array,
  w_up_EDF: jax.Array,
  w_down_EFD: jax.Array,
  *,
  method: str = "xla",
  backend: str = "auto",
  interpret: bool = False,
  sharding: expert_parallel.ExpertSharding | None = None,
) -> jax.Array:
  """y_t = sum_k gates[t, k] * SwiGLU_{expert_ids[t, k]}(x_t); shapes: x [T, D], ids/gates [T, K].

  `sharding`: the experts' weights are sharded over a mesh's expert axis (expert_parallel.py): each
  rank runs `method` on its own experts, the tokens replicated or exchanged (`expert_parallel.exchanges`)."""
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  if sharding is not None:
    local_ffn = functools.partial(expert_ffn, method=method, backend=backend, interpret=interpret)
    args = (x_TD, expert_ids_TK, gates_TK, w_gate_EDF, w_up_EDF, w_down_EFD)
    if not expert_parallel.exchanges(x_TD.shape[0], sharding):
      return expert_parallel.replicated_dispatch(*args, sharding=sharding, local_ffn=local_ffn)
    ragged = expert_parallel.ragged_all_to_all_compiles(resolve_backend(backend))
    return expert_parallel.exchanged_dispatch(*args, sharding=sharding, local_ffn=local_ffn, ragged=ragged)
  if method == "auto":
    method = choose_method(x_TD.shape[0], expert_ids_TK.shape[1], backend)
  if method == "xla":
    return expert_ffn_xla(x_TD, expert_ids_TK, gates_TK, w_gate_EDF, w_up_EDF, w_down_EFD)
  return _with_grouped_vjp(method, resolve_backend(backend), bool(interpret))(
    x_TD, expert_ids_TK, gates_TK, w_gate_EDF, w_up_EDF, w_down_EFD
  )
