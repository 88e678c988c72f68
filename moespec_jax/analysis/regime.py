"""Which regime a model decodes in on this machine: memory-bound or compute-bound, and why.

A pass of T tokens (batch rows x tokens per row) reads every weight but the routed experts and the
input embedding table, one embedding row per token, and each MoE layer's distinct routed experts
(expected under uniform routing: N [1 - (1 - k/N)^T]); each row also reads its KV cache. Successive
passes route to different experts, so within a few tokens decoding reads every weight but the input
embedding table: that is its working set. Whether a pass's bytes come from memory:

- the pass's own bytes exceed the last-level cache: from memory;
- the working set fits the cache: cache-resident;
- between the two the cache holds part of the working set, and only a measured plain pass decides:
  its effective bandwidth (the pass's bytes over its time) at most 1.5x the streaming bandwidth
  means the bytes arrive at about memory's rate; a measurement, where given, decides in every case.

The pass is memory-bound where its bytes come from memory and its arithmetic intensity (operations
per byte read) is below the machine's balance point (its matmul rate over its streaming bandwidth);
"borderline" where only a measurement could say. The seeds' questions (what verifying K + 1 tokens
costs in expert bytes) are about the memory-bound regime; a cache-resident model is compute-bound
and a pass of n tokens costs close to n single ones. MTP heads are not counted.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp

from moespec_jax.analysis import timing
from moespec_jax.config import ModelConfig

CPU_CACHES = pathlib.Path("/sys/devices/system/cpu/cpu0/cache")
STREAM_BYTES = 256 * 1024 * 1024  # far beyond a CPU's caches
MATMUL_SIZE = 2048
# Effective bandwidth up to this multiple of streaming: the bytes arrive at about memory's rate.
FROM_MEMORY_MAX_STREAM_MULTIPLE = 1.5
Verdict = Literal["memory-bound", "compute-bound", "borderline", "unknown"]


def _size_bytes(text: str) -> int:
  units = {"K": 1024, "M": 1024**2, "G": 1024**3}
  text = text.strip()
  return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def last_level_cache(caches: pathlib.Path = CPU_CACHES) -> tuple[int | None, str]:
  """(bytes, where from) of the last-level cache: the level-3 entry of Linux sysfs (the largest
  level present otherwise), else `os.sysconf("SC_LEVEL3_CACHE_SIZE")`, else (None, "unknown")."""
  found = []
  for index in sorted(caches.glob("index*")):
    try:
      level = int((index / "level").read_text())
      found.append((level, _size_bytes((index / "size").read_text())))
    except (OSError, ValueError):
      continue
  if found:
    level, size = max(found)
    return size, f"sysfs L{level}"
  try:
    size = os.sysconf("SC_LEVEL3_CACHE_SIZE")
  except (ValueError, OSError):
    size = 0
  return (int(size), "sysconf L3") if size and size > 0 else (None, "unknown")


@functools.cache
def matmul_gflops(size: int = MATMUL_SIZE, repeats: int = 3) -> float:
  """This machine's f32 product rate (GFLOP/s): a jitted [size, size] @ [size, size], median of
  `repeats`, measured once per process."""
  a = jnp.ones((size, size), jnp.float32)
  return 2 * size**3 / (timing.median_time_ms(jax.jit(jnp.matmul), (a, a), repeats) / 1e3) / 1e9


@functools.cache
def stream_gbps(repeats: int = 5) -> float:
  """Streaming read bandwidth (GB/s): a jitted sum over 256 MB of f32, median of `repeats`,
  measured once per process."""
  a = jnp.ones((STREAM_BYTES // 4,), jnp.float32)
  return a.nbytes / (timing.median_time_ms(jax.jit(jnp.sum), (a,), repeats) / 1e3) / 1e9


def uniform_unique(n_experts: int, top_k: int, n_tokens: int) -> float:
  """Expected distinct experts of one MoE layer read by n_tokens under uniform routing."""
  return n_experts * (1 - (1 - top_k / n_experts) ** n_tokens)


def weight_bytes(config: ModelConfig, n_tokens: int = 1, unique_experts: float | None = None) -> float:
  """Weight bytes one pass of `n_tokens` reads (MTP heads not counted): everything but the routed
  experts and the input embedding table, one embedding row per token, and each MoE layer's
  distinct experts (`unique_experts` per layer; default the uniform-routing expectation)."""
  itemsize = jnp.dtype(config.dtype).itemsize
  d = config.d_model
  expert = 3 * d * config.expert_hidden * itemsize
  total = config.param_counts()["total"] * itemsize
  other = total - config.n_moe_layers * config.n_routed_experts * expert
  if not config.tie_embeddings:  # the input table is gathered, one row per token
    other -= config.vocab_size * d * itemsize
  other += min(n_tokens, config.vocab_size) * d * itemsize
  if unique_experts is None:
    unique_experts = uniform_unique(config.n_routed_experts, config.top_k, n_tokens) if config.n_moe_layers else 0.0
  return float(other + config.n_moe_layers * unique_experts * expert)


def working_set_bytes(config: ModelConfig) -> float:
  """Weight bytes successive decoding passes read between them: every weight but the input
  embedding table (all routed experts: each layer's routing reaches them within a few tokens)."""
  itemsize = jnp.dtype(config.dtype).itemsize
  total = config.param_counts()["total"] * itemsize
  if not config.tie_embeddings:
    total -= config.vocab_size * config.d_model * itemsize
  return float(total)


def effective_gbps(pass_bytes: float, pass_ms: float | None) -> float | None:
  """A pass's bytes over its measured time (GB/s); None without a time."""
  return None if pass_ms is None else pass_bytes / (pass_ms / 1e3) / 1e9


def kv_bytes_per_token(config: ModelConfig, context: int) -> float:
  """KV-cache bytes one token's attention reads over `context` cached positions, all layers."""
  heads, key_dim, value_dim = config.cache_dims
  return float(context * config.n_layers * heads * (key_dim + value_dim) * jnp.dtype(config.dtype).itemsize)


def flops_per_token(config: ModelConfig, context: int) -> float:
  """Operations (2 per multiply-add) of one token's pass: every active weight but the input
  embedding (a gather) once, and attention's scores and weighted values over `context` positions."""
  matmul_params = config.param_counts()["active"] - config.vocab_size * config.d_model * (not config.tie_embeddings)
  if config.attention_type == "mla":
    per_position = config.n_heads * (2 * config.kv_lora_rank + config.qk_rope_head_dim)
  else:
    per_position = 2 * config.n_heads * config.head_dim
  return float(2 * matmul_params + 2 * context * config.n_layers * per_position)


@dataclasses.dataclass(frozen=True)
class Regime:
  """The bytes and operations of one decoding pass (`batch_size` rows of `tokens_per_row` tokens,
  `context` cached positions per row), this machine's cache and rates, and the verdict."""

  batch_size: int
  tokens_per_row: int
  context: int
  weight_bytes_per_pass: float
  """Weight bytes the pass reads (distinct experts under uniform routing)."""
  weight_bytes_per_token: float
  """The same for a pass of one token."""
  working_set_bytes: float
  """Weight bytes successive passes read between them (`working_set_bytes`)."""
  kv_bytes_per_token: float
  """KV-cache bytes one token's attention reads over `context` positions."""
  flops_per_token: float
  arithmetic_intensity: float
  """Operations per byte read by the pass (weights and KV caches)."""
  cache_bytes: int | None
  cache_source: str
  matmul_gflops: float | None
  stream_gbps: float | None
  measured_pass_ms: float | None
  """A measured plain pass of this shape (ms), where given: its effective bandwidth decides where
  the bytes come from."""
  verdict: Verdict
  reason: str

  @property
  def pass_bytes(self) -> float:
    return self.weight_bytes_per_pass + self.batch_size * self.kv_bytes_per_token

  @property
  def effective_gbps(self) -> float | None:
    """The pass's bytes over its measured time (GB/s), where a time was given."""
    return effective_gbps(self.pass_bytes, self.measured_pass_ms)

  @property
  def balance_flops_per_byte(self) -> float | None:
    """The machine's balance point: its matmul rate over its streaming bandwidth."""
    if not self.matmul_gflops or not self.stream_gbps:
      return None
    return self.matmul_gflops / self.stream_gbps

  def line(self) -> str:
    """One printed line: the verdict and its reason."""
    return f"regime: {self.verdict} ({self.reason})"

  def to_dict(self) -> dict[str, Any]:
    return dict(
      dataclasses.asdict(self),
      pass_bytes=self.pass_bytes,
      balance_flops_per_byte=self.balance_flops_per_byte,
      effective_gbps=self.effective_gbps,
    )


def classify(
  pass_bytes: float,
  intensity: float,
  cache_bytes: int | None,
  balance: float | None,
  *,
  working_set: float | None = None,
  effective_gbps: float | None = None,
  stream_gbps_rate: float | None = None,
) -> tuple[Verdict, str]:
  """The verdict and its reason (the module docstring's rules): memory-bound where the pass's bytes
  come from memory and its arithmetic intensity is below the balance point; compute-bound where
  either fails; borderline where the cache holds part of the working set and no measurement says
  where the bytes come from; unknown where nothing can be checked."""
  mb = pass_bytes / 1e6
  reasons, memory = [], []
  from_memory: bool | None = None
  if cache_bytes:
    ratio = pass_bytes / cache_bytes
    text = f"{mb:.1f} MB read per pass, {ratio:.2f}x the {cache_bytes / 2**20:.0f} MiB last-level cache"
    if ratio > 1.0:
      from_memory = True
    elif working_set is None or working_set <= cache_bytes:
      from_memory = False
    else:
      text += f", working set {working_set / 1e6:.1f} MB ({working_set / cache_bytes:.2f}x)"
    reasons.append(text)
  else:
    reasons.append(f"{mb:.1f} MB read per pass, last-level cache size unknown")
  if effective_gbps and stream_gbps_rate:
    share = effective_gbps / stream_gbps_rate
    reasons.append(f"measured {effective_gbps:.1f} GB/s effective, {share:.2f}x streaming")
    from_memory = share <= FROM_MEMORY_MAX_STREAM_MULTIPLE
  if from_memory is not None:
    memory.append(from_memory)
  if balance:
    reasons.append(f"{intensity:.2f} FLOP/byte against a balance point of {balance:.1f}")
    memory.append(intensity < balance)
  else:
    reasons.append(f"{intensity:.2f} FLOP/byte, balance point unknown")
  reason = "; ".join(reasons)
  if not all(memory):
    return "compute-bound", reason
  if cache_bytes and from_memory is None:
    return "borderline", reason + "; a measured plain pass decides"
  if not memory:
    return "unknown", reason
  return "memory-bound", reason


def regime_of(
  model_or_config: Any,
  batch_size: int = 1,
  *,
  tokens_per_row: int = 1,
  context: int = 256,
  cache_bytes: int | None = -1,
  matmul_gflops_rate: float | None = -1.0,
  stream_gbps_rate: float | None = -1.0,
  measured_pass_ms: float | None = None,
) -> Regime:
  """The regime of a decoding pass of `batch_size` rows of `tokens_per_row` tokens each (plain
  decoding: 1; a verification pass: K + 1) over `context` cached positions per row. The cache
  size and the rates are read and measured here (once per process) unless given: -1 measures,
  None leaves one unknown (tests inject theirs). `measured_pass_ms`: a measured pass of this
  shape, whose effective bandwidth decides where its bytes come from."""
  config = getattr(model_or_config, "config", model_or_config)
  if not isinstance(config, ModelConfig):
    raise ValueError(f"model_or_config must be a Model or a ModelConfig, got {type(model_or_config).__name__}")
  if measured_pass_ms is not None and not measured_pass_ms > 0:
    raise ValueError(f"measured_pass_ms must be > 0, got {measured_pass_ms}")
  if batch_size < 1 or tokens_per_row < 1 or context < 0:
    raise ValueError(
      f"batch_size and tokens_per_row must be >= 1 and context >= 0, got {batch_size, tokens_per_row, context}"
    )
  source = "given"
  if cache_bytes == -1:
    cache_bytes, source = last_level_cache()
  elif cache_bytes is None:
    source = "unknown"
  matmul = matmul_gflops() if matmul_gflops_rate == -1.0 else matmul_gflops_rate
  stream = stream_gbps() if stream_gbps_rate == -1.0 else stream_gbps_rate
  n = batch_size * tokens_per_row
  weights = weight_bytes(config, n)
  kv = kv_bytes_per_token(config, context)
  flops = flops_per_token(config, context)
  intensity = n * flops / (weights + batch_size * kv)
  balance = matmul / stream if matmul and stream else None
  pass_bytes = weights + batch_size * kv
  working_set = working_set_bytes(config) + batch_size * kv
  verdict, reason = classify(
    pass_bytes,
    intensity,
    cache_bytes,
    balance,
    working_set=working_set,
    effective_gbps=effective_gbps(pass_bytes, measured_pass_ms),
    stream_gbps_rate=stream,
  )
  return Regime(
    batch_size=batch_size,
    tokens_per_row=tokens_per_row,
    context=context,
    weight_bytes_per_pass=weights,
    weight_bytes_per_token=weight_bytes(config, 1),
    working_set_bytes=working_set,
    kv_bytes_per_token=kv,
    flops_per_token=flops,
    arithmetic_intensity=intensity,
    cache_bytes=cache_bytes,
    cache_source=source,
    matmul_gflops=matmul,
    stream_gbps=stream,
    measured_pass_ms=measured_pass_ms,
    verdict=verdict,
    reason=reason,
  )


def record(
  model_or_config: Any,
  batch_sizes: Sequence[int] = (1,),
  *,
  context: int = 256,
  log: Callable[[str], None] = print,
  measured_pass_ms: Mapping[int, float] | None = None,
  **machine: Any,
) -> list[dict]:
  """What a bench writes to its metrics (`regime`: one `Regime.to_dict()` per batch size of plain
  decoding) and prints (one line, the smallest batch's verdict, with the larger batches' verdicts).
  `measured_pass_ms`: the measured plain pass (ms) per batch size, where the bench has it;
  `machine`: `regime_of`'s cache size and rates (default: read and measured)."""
  measured = measured_pass_ms or {}
  regimes = [
    regime_of(model_or_config, b, context=context, measured_pass_ms=measured.get(b), **machine)
    for b in sorted(set(batch_sizes))
  ]
  line = regimes[0].line()
  if len(regimes) > 1:
    line += "; " + ", ".join(f"batch {r.batch_size}: {r.verdict}" for r in regimes[1:])
  log(f"{line} [batch {regimes[0].batch_size}, context {context}]")
  return [r.to_dict() for r in regimes]
