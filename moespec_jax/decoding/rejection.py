"""Batched verification of drafted tokens: exact rejection sampling and greedy matching.

Exact sampling (Leviathan et al. 2023; Chen et al. 2023): draft x_j, drawn from q_j, is
accepted with probability min(1, p_j(x_j) / q_j(x_j)), i.e. when u_j * q_j(x_j) < p_j(x_j)
for a uniform u_j in (0, 1); at the first rejection j the token is drawn from
norm(max(p_j - q_j, 0)); when all K drafts are accepted a bonus token is drawn from p_K.
p and q are both `sampling.filtered_logprobs` of the same SamplingParams, so p is exactly
what plain sampling draws from and q exactly what the draft was drawn from. A one-hot q
(n-gram drafts) accepts with probability p(x). An invalid draft slot (no proposal) has q = 0:
it is rejected and its token drawn from p, which is plain sampling at that position.

Greedy: accept while the draft equals argmax p; the next token is argmax p at the first
mismatch (or the bonus position).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moespec_jax.decoding import sampling as sampling_lib


def uniform_open(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Float32 uniforms strictly inside (0, 1)."""
  return jax.random.uniform(key, shape, jnp.float32, minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)


def residual_probs(p_BV: jax.Array, q_BV: jax.Array) -> jax.Array:
  """The (unnormalised) distribution to sample from after rejecting a draft: max(p - q, 0)."""
  return jnp.maximum(p_BV - q_BV, 0.0)


def accepted_count(accept_BK: jax.Array) -> jax.Array:
  """Number of leading accepted drafts per row."""
  return jnp.sum(jnp.cumprod(accept_BK.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def _at(x_BS: jax.Array, n_B: jax.Array) -> jax.Array:
  return jnp.take_along_axis(x_BS, n_B[:, None, None] if x_BS.ndim == 3 else n_B[:, None], axis=1)[:, 0]


def verify_greedy(
  logits_BSV: jax.Array, drafts_BK: jax.Array, valid_BK: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Greedy verification. Returns (accept_BK, n_accepted_B, next_token_B)."""
  k = drafts_BK.shape[1]
  target_BS = sampling_lib.argmax(logits_BSV)
  accept_BK = valid_BK & (drafts_BK == target_BS[:, :k])
  n_B = accepted_count(accept_BK)
  return accept_BK, n_B, _at(target_BS, n_B)


def verify_sampled(
  keys_B: jax.Array, logp_BSV: jax.Array, drafts_BK: jax.Array, q_BKV: jax.Array, valid_BK: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Exact rejection sampling over S = K + 1 target distributions per row.

  Args:
    keys_B: one PRNG key per row.
    logp_BSV: filtered target log-probabilities at the K + 1 verified positions.
    drafts_BK: drafted tokens.
    q_BKV: the draft distributions the drafts were drawn from (one-hot for n-gram).
    valid_BK: False where the drafter proposed nothing (rejected, token drawn from p).

  Returns:
    (accept_BK, n_accepted_B, next_token_B): next_token is the residual sample at the first
    rejection, or the bonus token from p_K when all K drafts are accepted.
  """
  b, s, _ = logp_BSV.shape
  k = s - 1
  p_BSV = jnp.exp(logp_BSV)
  split = jax.vmap(lambda key: jax.random.split(key, 2))(keys_B)
  u_BK = jax.vmap(lambda key: uniform_open(key, (k,)))(split[:, 0])
  p_draft_BK = jnp.take_along_axis(p_BSV[:, :k], drafts_BK[..., None], axis=-1)[..., 0]
  q_draft_BK = jnp.take_along_axis(q_BKV, drafts_BK[..., None], axis=-1)[..., 0]
  accept_BK = valid_BK & (u_BK * q_draft_BK < p_draft_BK)
  n_B = accepted_count(accept_BK)
  q_BSV = jnp.concatenate(
    [jnp.where(valid_BK[..., None], q_BKV, 0.0), jnp.zeros((b, 1, q_BKV.shape[-1]), q_BKV.dtype)], axis=1
  )
  p_n_BV, q_n_BV = _at(p_BSV, n_B), _at(q_BSV, n_B)
  r_BV = residual_probs(p_n_BV, q_n_BV)
  # p == q leaves no residual mass; rejection then has probability 0 (numerical guard only).
  r_BV = jnp.where(jnp.sum(r_BV, axis=-1, keepdims=True) > 0, r_BV, p_n_BV)
  logr_BV = jnp.where(r_BV > 0, jnp.log(jnp.where(r_BV > 0, r_BV, 1.0)), -jnp.inf)
  next_B = jax.vmap(sampling_lib.categorical)(split[:, 1], logr_BV)
  return accept_BK, n_B, next_B
