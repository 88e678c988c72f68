"""Generation: validation of the inputs, a jitted prefill, and one `lax.while_loop` decode.

The whole generation of a batch is one compiled program: no host round trip per token.
Params and the KV cache are explicit pytrees; the NNX module is merged inside the jit.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moespec_jax.decoding import sampling as sampling_lib
from moespec_jax.decoding.params import SamplingParams, SpecParams


@dataclasses.dataclass
class GenerateOutput:
  tokens: np.ndarray  # int32 [B, max_new_tokens]; -1 after a row's EOS
  stats: dict[str, Any]


def _bucket(n: int, minimum: int = 8) -> int:
  """Rounds up to a power of two so that nearby shapes share one compiled program."""
  return max(minimum, 1 << math.ceil(math.log2(max(n, 1))))


def encode_prompts(prompts, tokenizer, vocab_size: int, eos_id: int) -> list[list[int]]:
  """Validates prompts (strings or token-id lists) and returns token-id lists.

  A string prompt is encoded by the tokenizer and preceded by the EOS token, the document
  boundary the model saw in training.
  """
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
    raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
  out = []
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      if not p:
        raise ValueError(f"prompts[{i}] is an empty string")
      ids = [eos_id] + list(tokenizer.encode(p))
    else:
      ids = [int(t) for t in np.asarray(p).reshape(-1)] if len(p) else []
      if not ids:
        raise ValueError(f"prompts[{i}] is empty")
      bad = [t for t in ids if not 0 <= t < vocab_size]
      if bad:
        raise ValueError(f"prompts[{i}] has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    out.append(ids)
  return out


def _count_unique_experts(expert_ids_LBTK, active_B, n_experts: int):
  """Per MoE layer, the number of distinct experts chosen by the active rows' tokens."""
  hit_LBTKE = jax.nn.one_hot(expert_ids_LBTK, n_experts, dtype=jnp.bool_)
  hit_LBTKE = hit_LBTKE & active_B[None, :, None, None, None]
  return jnp.sum(jnp.any(hit_LBTKE, axis=(1, 2, 3)), axis=-1).astype(jnp.float32)


def _generate_plain(graphdef, state, tokens_BT, lengths_B, key, *, max_new_tokens: int,
                    cache_len: int, sampling: SamplingParams, expert_method: str):
  """Prefill then decode one token per pass until max_new_tokens or every row hit EOS."""
  model = nnx.merge(graphdef, state)
  config = model.config
  batch = tokens_BT.shape[0]
  row_keys_B = jax.random.split(key, batch)

  def step_keys(step):
    return jax.vmap(lambda k: jax.random.fold_in(k, step))(row_keys_B)

  cache = model.new_cache(batch, cache_len)
  out = model(tokens_BT, None, cache, expert_method=expert_method)
  last_logits_BV = jnp.take_along_axis(out.logits, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
  first_B = sampling_lib.sample(step_keys(0), last_logits_BV, sampling)
  tokens_BN = jnp.full((batch, max_new_tokens), -1, jnp.int32).at[:, 0].set(first_B)
  done_B = first_B == config.eos_id
  n_moe = config.n_moe_layers
  unique_sum_L = jnp.zeros((n_moe,), jnp.float32)

  def cond(carry):
    step, _, _, _, done_B, _, _ = carry
    return (step < max_new_tokens) & ~jnp.all(done_B)

  def body(carry):
    step, cache, last_B, pos_B, done_B, tokens_BN, unique_sum_L = carry
    out = model(last_B[:, None], pos_B[:, None], cache, expert_method=expert_method)
    next_B = sampling_lib.sample(step_keys(step), out.logits[:, 0], sampling)
    next_B = jnp.where(done_B, -1, next_B)
    tokens_BN = jax.lax.dynamic_update_slice_in_dim(tokens_BN, next_B[:, None], step, axis=1)
    if n_moe:
      unique_sum_L += _count_unique_experts(out.routing.expert_ids, ~done_B, config.n_routed_experts)
    done_B = done_B | (next_B == config.eos_id)
    return step + 1, out.cache, next_B, pos_B + 1, done_B, tokens_BN, unique_sum_L

  carry = (jnp.int32(1), out.cache, first_B, lengths_B, done_B, tokens_BN, unique_sum_L)
  step, _, _, _, _, tokens_BN, unique_sum_L = jax.lax.while_loop(cond, body, carry)
  return tokens_BN, {"passes": step, "unique_experts_sum": unique_sum_L}


_COMPILED: dict[Any, Any] = {}


def _compiled(fn, statics: dict, *args):
  """AOT-compiles `fn` once per (statics, argument shapes) so timing excludes compilation."""
  sig = (fn.__name__, tuple(sorted(statics.items())), args[0],
         tuple((a.shape, a.dtype) for a in jax.tree.leaves(args[1:])))
  if sig not in _COMPILED:
    jitted = jax.jit(fn, static_argnums=(0,), static_argnames=tuple(statics))
    _COMPILED[sig] = jitted.lower(*args, **statics).compile()
  return _COMPILED[sig]


def generate(model, prompts, max_new_tokens: int = 64, sampling: SamplingParams | None = None,
             spec: SpecParams | None = None, seed: int = 0) -> GenerateOutput:
  """Generates `max_new_tokens` tokens per prompt (fewer where a row emits EOS: -1 after it)."""
  sampling = SamplingParams() if sampling is None else sampling
  spec = SpecParams() if spec is None else spec
  if not isinstance(sampling, SamplingParams):
    raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
  if not isinstance(spec, SpecParams):
    raise ValueError(f"spec must be a SpecParams, got {type(spec).__name__}")
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
  if not isinstance(seed, (int, np.integer)):
    raise ValueError(f"seed must be an int, got {seed!r}")
  config = model.config
  ids = encode_prompts(prompts, model.tokenizer, config.vocab_size, config.eos_id)
  lengths = np.array([len(p) for p in ids], np.int32)
  longest = int(lengths.max())
  if longest + max_new_tokens > config.max_seq_len:
    raise ValueError(
        f"prompt length ({longest}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
        f"max_seq_len ({config.max_seq_len})")
  padded_len = min(_bucket(longest), config.max_seq_len)
  cache_len = min(_bucket(longest + max_new_tokens, 64), config.max_seq_len)
  tokens = np.zeros((len(ids), padded_len), np.int32)
  for i, p in enumerate(ids):
    tokens[i, :len(p)] = p

  expert_method = model.expert_method(spec.kernel)
  statics = dict(max_new_tokens=int(max_new_tokens), cache_len=cache_len, sampling=sampling,
                 expert_method=expert_method)
  args = (model.graphdef, model.state, jnp.asarray(tokens), jnp.asarray(lengths),
          jax.random.key(int(seed)))
  fn = _compiled(_generate_plain, statics, *args)
  start = time.perf_counter()
  tokens_BN, raw = fn(*args[1:])
  tokens_BN = np.asarray(jax.block_until_ready(tokens_BN))
  seconds = time.perf_counter() - start

  passes = int(raw["passes"])
  decode_passes = max(passes - 1, 1)
  generated = int(np.sum(tokens_BN >= 0))
  stats = {
      "passes": passes,
      "generated_tokens": generated,
      "mean_accepted_length": generated / len(ids) / passes,
      "acceptance_by_depth": [],
      "tokens_per_second": generated / seconds,
      "seconds": seconds,
      "unique_experts_per_pass": (np.asarray(raw["unique_experts_sum"]) / decode_passes).tolist(),
      "drafter": spec.drafter,
      "expert_method": expert_method,
  }
  return GenerateOutput(tokens=tokens_BN, stats=stats)
