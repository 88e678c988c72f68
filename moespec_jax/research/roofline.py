"""The memory-bound ceiling of decoding: the bytes one decode step must read (weights and KV
cache), and the machine's streaming read bandwidth; the compute floor of a prefill: the products
it must compute, and the machine's best measured matmul rate.

No implementation of the same weights in the same dtype decodes faster than
bandwidth / bytes-per-step steps per second, so this ceiling over a peer's measured tokens/s is
the largest speed ratio any decoder of those weights can reach over that peer
(experiments/peer_bench reports it beside the measured ratios). Likewise a prefill takes at least
its products' operations over the matmul rate: the floor under a first token (experiments/peer_bench:
what a faster prefill could still buy a whole run).
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import moespec_jax as msj
from moespec_jax.analysis import regime, timing
from pallas_kernels import bytes as kbytes

STREAM_BYTES = 256 * 1024 * 1024  # far beyond the processor's caches


def stream_read_gbps(repeats: int = 7) -> float:
  """Streaming read bandwidth (GB/s): a jitted jnp.sum over a 256 MB f32 array, median of repeats."""
  a = jnp.ones((STREAM_BYTES // 4,), jnp.float32)
  t_ms = timing.median_time_ms(jax.jit(jnp.sum), (a,), repeats)
  return a.nbytes / (t_ms / 1e3) / 1e9


MATMUL_SIZE = 2048  # a square product far from the small shapes' overheads


def matmul_gflops(repeats: int = 5, size: int = MATMUL_SIZE) -> float:
  """The machine's f32 matrix-product rate (GFLOP/s, 2 per multiply-add): a jitted [size, size] @
  [size, size], median of repeats. The rate of a large product, not the processor's peak: the
  prefills' own products ran near it, below and above, so operations over it are an approximate
  floor on their time; the rate itself drifts within minutes, so peer_bench takes the median of
  samples spread over its run (docs/findings/2026-12-05-peer-bench.md)."""
  a = jnp.ones((size, size), jnp.float32)
  t_ms = timing.median_time_ms(jax.jit(jnp.matmul), (a, a), repeats)
  return 2 * size**3 / (t_ms / 1e3) / 1e9


def _attention_macs(config, positions: int, queries: int, pairs: int) -> int:
  """Multiply-adds of one attention layer over `positions` keys/values written, `queries` query
  positions and `pairs` (query, visible key) pairs. MLA: the cheaper of its two forms (the latent
  expanded to keys and values at every position, or absorbed into queries and outputs)."""
  c = config
  d, h = c.d_model, c.n_heads
  if c.attention_type != "mla":
    g, k = c.n_kv_heads, c.head_dim
    return positions * d * 2 * g * k + queries * 2 * d * h * k + pairs * 2 * h * k
  nope, rope, v, lat = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
  q = d * h * (nope + rope) if not c.q_lora_rank else d * c.q_lora_rank + c.q_lora_rank * h * (nope + rope)
  common = queries * (q + h * v * d) + positions * d * (lat + rope)
  expanded = positions * lat * h * (nope + v) + pairs * h * (nope + rope + v)
  absorbed = queries * h * lat * (nope + v) + pairs * h * (2 * lat + rope)
  return common + min(expanded, absorbed)


def _ffn_macs(config, layer: int) -> int:
  """Multiply-adds of one position through layer `layer`'s FFN: dense, or router, top_k routed
  experts, shared experts and their gate."""
  c = config
  if not c.is_moe_layer(layer):
    return 3 * c.d_model * c.dense_hidden
  shared = 3 * c.d_model * c.shared_width + (c.d_model if c.shared_expert_gate else 0)
  return c.d_model * c.n_routed_experts + c.top_k * 3 * c.d_model * c.expert_hidden + shared


def prefill_flops(config, prompt_len: int, batch_size: int = 1) -> float:
  """Operations (2 per multiply-add) of the products that a prefill of `batch_size` prompts of
  `prompt_len` tokens cannot skip where only its last position's output is read (plain decoding's
  first token): every layer's keys and values at every position (the cache holds them) and,
  except in the last layer, queries, causal attention, output projection and FFN at every
  position (routed experts: top_k per token); the last layer's at the last position; the output
  head there. Elementwise work (norms, rotary, softmax, SwiGLU, gates) is not counted."""
  if prompt_len < 1 or batch_size < 1:
    raise ValueError(f"prompt_len and batch_size must be >= 1, got {prompt_len} and {batch_size}")
  t, last = prompt_len, config.n_layers - 1
  macs = 0
  for layer in range(config.n_layers):
    queries, pairs = (1, t) if layer == last else (t, t * (t + 1) // 2)
    macs += _attention_macs(config, t, queries, pairs) + queries * _ffn_macs(config, layer)
  macs += config.d_model * config.vocab_size
  return float(2 * macs * batch_size)


CPU_CACHES = pathlib.Path("/sys/devices/system/cpu/cpu0/cache")


def last_level_cache_bytes(caches: pathlib.Path = CPU_CACHES) -> int | None:
  """The largest processor cache's size in bytes (Linux sysfs), None where it cannot be read. A
  decode step whose weights fit in it can read some of them from there on the next step."""
  units = {"K": 1024, "M": 1024**2, "G": 1024**3}
  sizes = []
  for index in caches.glob("index*"):
    try:
      text = (index / "size").read_text().strip()
    except OSError:
      continue
    sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
  return max(sizes) if sizes else None


_FLUSH: list = []


def flush_caches(nbytes: int = 4 * 32 * 1024 * 1024) -> None:
  """Reads `nbytes` (default four times this machine's 32 MB last-level cache) of other data, so
  that what runs next finds none of its weights in the processor's caches. Benchmarks that
  alternate implementations call it before every timed call: otherwise a call that follows its
  own kind finds its weights cached (a ~20M-parameter model fits there) and one that follows the
  other implementation does not, which favours whichever order repeats a kind."""
  if not _FLUSH or _FLUSH[0].nbytes != nbytes:
    _FLUSH[:] = [np.ones(nbytes // 4, np.float32)]
  float(_FLUSH[0].sum())


def decode_weight_bytes(config, unique_experts_L: Sequence[float]) -> float:
  """Weight bytes one decode step of the target reads: every weight but the routed experts and
  the input embedding table (a step gathers one row per token of it; it is read whole only as
  a tied output head), plus each MoE layer's distinct routed experts (`unique_experts_L`, e.g.
  `generate(...).stats["unique_experts_per_pass"]`). MTP heads are not counted."""
  unique_L = np.asarray(unique_experts_L, float)
  if unique_L.shape != (config.n_moe_layers,):
    raise ValueError(
      f"unique_experts_L must have one entry per MoE layer ({config.n_moe_layers}), got shape {unique_L.shape}"
    )
  if np.any(unique_L < 0) or np.any(unique_L > config.n_routed_experts):
    raise ValueError(f"unique_experts_L must lie in [0, {config.n_routed_experts}], got {unique_L.tolist()}")
  itemsize = jnp.dtype(config.dtype).itemsize
  expert = kbytes.expert_bytes(config.d_model, config.expert_hidden, itemsize)
  other = config.param_counts()["total"] * itemsize - config.n_moe_layers * config.n_routed_experts * expert
  if not config.tie_embeddings:
    other -= config.vocab_size * config.d_model * itemsize
  return float(other + unique_L.sum() * expert)


def decode_cache_bytes(config, context_tokens: float) -> float:
  """KV-cache bytes one decode step reads: `context_tokens` cached positions (summed over the
  batch's rows), each layer's keys and values (MLA: the compressed latent and the rotary key,
  `ModelConfig.cache_dims`). At batch 8 and a few hundred positions this is a tenth or more of
  the weight bytes of a small model's step; a decoder reads it on top of the weights."""
  if context_tokens < 0:
    raise ValueError(f"context_tokens must be >= 0, got {context_tokens}")
  heads, key_dim, value_dim = config.cache_dims
  return float(context_tokens * config.n_layers * heads * (key_dim + value_dim) * jnp.dtype(config.dtype).itemsize)


def bound_tokens_per_second(weight_bytes: float, read_gbps: float, batch_size: int) -> float:
  """Tokens/s of a decoder that does nothing but read `weight_bytes` per step at `read_gbps`."""
  return read_gbps * 1e9 / weight_bytes * batch_size


def plain_pass_ms(model: msj.Model, prompts: Sequence, new_tokens: int = 32, repeats: int = 3) -> float | None:
  """A measured plain decoding pass of these prompts' batch (ms): the fastest of `repeats` plain runs
  of 2 x `new_tokens` new tokens less the fastest of as many of `new_tokens` (alternated), over
  `new_tokens` (the prefill cancels). The fastest, not the median: a shared machine only ever
  adds time, and on a small model a pass is short enough for a median of differences to be lost
  in it. Both programs run once untimed first. None where the longer runs were not slower (the
  difference lost in noise): no measurement."""
  if new_tokens < 1 or repeats < 1:
    raise ValueError(f"new_tokens and repeats must be >= 1, got {new_tokens}, {repeats}")
  plain, sampling = msj.SpecParams(drafter="none"), msj.SamplingParams()

  def run(n: int) -> float:
    began = time.perf_counter()
    np.asarray(msj.generate(model, list(prompts), max_new_tokens=n, sampling=sampling, spec=plain, seed=0).tokens)
    return time.perf_counter() - began

  run(new_tokens), run(2 * new_tokens)
  pairs = [(run(new_tokens), run(2 * new_tokens)) for _ in range(repeats)]
  diff = min(long for _, long in pairs) - min(short for short, _ in pairs)
  return diff * 1e3 / new_tokens if diff > 0 else None


def measured_regimes(
  model: msj.Model,
  prompts: Sequence,
  batch_sizes: Sequence[int],
  *,
  context: int,
  max_new_tokens: int,
  log: Callable[[str], None] = print,
) -> list[dict]:
  """`analysis.regime.record` with each batch size's plain pass measured (`plain_pass_ms`, the
  first `batch` prompts, runs of at most `max_new_tokens` new tokens: the bench's own, which fit
  the model's context): its effective bandwidth decides where the pass's bytes come from (where
  no pass could be measured, the verdict says what the bytes alone say)."""
  new_tokens = max(1, min(32, max_new_tokens // 2))
  measured = {b: plain_pass_ms(model, prompts[:b], new_tokens) for b in sorted(set(batch_sizes))}
  return regime.record(model, batch_sizes, context=context, measured_pass_ms=measured, log=log)
