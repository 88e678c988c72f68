"""Token sampling with temperature, top-k and top-p filters.

`filtered_logprobs` is the single definition of the distribution a sampling setting draws
from; speculative verification must use it for both target and draft so that exactness holds.
Ties at a filter's threshold are kept (top-k keeps every token whose logit equals the
k-th largest; top-p keeps every token whose probability equals the smallest kept one), so
the result does not depend on the order of equal tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moespec_jax.decoding.sampling_params import SamplingParams


def filtered_logprobs(logits_BV: jax.Array, params: SamplingParams) -> jax.Array:
  """Log-probabilities after temperature, top-k, then top-p (-inf outside the support)."""
  logits_BV = logits_BV.astype(jnp.float32)
  if params.greedy:
    raise ValueError("filtered_logprobs needs temperature > 0; greedy decoding takes the argmax")
  logits_BV = logits_BV / params.temperature
  vocab = logits_BV.shape[-1]
  if 0 < params.top_k < vocab:
    kth_B1 = jax.lax.top_k(logits_BV, params.top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV >= kth_B1, logits_BV, -jnp.inf)
  logprobs_BV = jax.nn.log_softmax(logits_BV, axis=-1)
  if params.top_p < 1.0:
    probs_BV = jnp.exp(logprobs_BV)
    sorted_BV = jnp.sort(probs_BV, axis=-1)[:, ::-1]
    mass_before_BV = jnp.cumsum(sorted_BV, axis=-1) - sorted_BV
    # The smallest probability whose preceding mass is still below top_p stays in.
    keep_sorted_BV = mass_before_BV < params.top_p
    threshold_B1 = jnp.min(jnp.where(keep_sorted_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    logprobs_BV = jnp.where(probs_BV >= threshold_B1, logprobs_BV, -jnp.inf)
    logprobs_BV = jax.nn.log_softmax(logprobs_BV, axis=-1)
  return logprobs_BV


def argmax(x: jax.Array, axis: int = -1) -> jax.Array:
  """`jnp.argmax` (first maximal index; the first NaN if any) as two vectorised reductions.

  XLA:CPU lowers `jnp.argmax` to a scalar (value, index) reduction, several times slower over a
  large vocabulary than a max followed by a min over the matching indices
  (docs/findings/2026-11-29-sampling-argmax.md).
  """
  axis = axis % x.ndim
  top = jnp.max(x, axis=axis, keepdims=True)
  hit = (x == top) | jnp.isnan(x)
  index = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
  return jnp.min(jnp.where(hit, index, x.shape[axis]), axis=axis)


def categorical(key: jax.Array, logits_V: jax.Array) -> jax.Array:
  """`jax.random.categorical(key, logits_V)` (the same Gumbel noise, so the same draws) with
  the vectorised `argmax`."""
  return argmax(jax.random.gumbel(key, logits_V.shape, logits_V.dtype) + logits_V)


def sample(keys_B: jax.Array, logits_BV: jax.Array, params: SamplingParams) -> jax.Array:
  """One token per row; row b uses its own key. Greedy takes the argmax (lowest id on ties)."""
  if params.greedy:
    return argmax(logits_BV)
  logprobs_BV = filtered_logprobs(logits_BV, params)
  return jax.vmap(categorical)(keys_B, logprobs_BV)
