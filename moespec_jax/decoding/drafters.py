"""Drafters: n-gram prompt lookup and MTP heads, as pure functions on explicit state.

Every drafter returns K drafts per row, the distributions q they were drawn from (sampled
mode; None in greedy mode where only the tokens matter) and a validity mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moespec_jax.decoding import sampling as sampling_lib
from moespec_jax.decoding.params import SamplingParams
from moespec_jax.model import mtp as mtp_lib

# Longest suffix the n-gram drafter tries to match (bytes or tokens).
NGRAM_MAX = 8


def ngram_propose(seq_BS, n_B, num_draft: int, max_ngram: int = NGRAM_MAX):
  """Prompt lookup: the longest suffix (<= max_ngram) of seq[:n] that occurred earlier.

  Among the earlier occurrences of that longest suffix the most recent wins; the tokens that
  followed it (up to `num_draft`, never past n) are the drafts. Returns (drafts_BK, valid_BK).
  """
  s = seq_BS.shape[1]
  idx_S = jnp.arange(s, dtype=jnp.int32)

  def one_row(seq_S, n):
    # match_S[j]: length of the common suffix of seq[:j+1] and seq[:n], capped at max_ngram.
    run_S = jnp.ones((s,), jnp.bool_)
    length_S = jnp.zeros((s,), jnp.int32)
    for t in range(max_ngram):
      src = idx_S - t
      eq = (src >= 0) & (n - 1 - t >= 0) & (seq_S[jnp.clip(src, 0, s - 1)] == seq_S[jnp.clip(n - 1 - t, 0, s - 1)])
      run_S = run_S & eq
      length_S = length_S + run_S.astype(jnp.int32)
    eligible = (idx_S < n - 1) & (length_S > 0)
    score_S = jnp.where(eligible, length_S * s + idx_S, -1)
    j = jnp.argmax(score_S)
    found = score_S[j] >= 0
    follow_K = j + 1 + jnp.arange(num_draft, dtype=jnp.int32)
    drafts_K = seq_S[jnp.clip(follow_K, 0, s - 1)]
    valid_K = found & (follow_K < n)
    return jnp.where(valid_K, drafts_K, 0).astype(jnp.int32), valid_K

  return jax.vmap(one_row)(seq_BS, n_B)


def choose(key_B, logits_BV, sampling: SamplingParams):
  """A draft token per row and the distribution q it was drawn from (None when greedy)."""
  if sampling.greedy:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), None
  logq_BV = sampling_lib.filtered_logprobs(logits_BV, sampling)
  tok_B = jax.vmap(jax.random.categorical)(key_B, logq_BV).astype(jnp.int32)
  return tok_B, jnp.exp(logq_BV)


def mtp_propose(model, cache, h1_BD, logits1_BV, index_B, keys_BK, num_draft: int,
                sampling: SamplingParams, *, expert_method: str):
  """K drafts from the MTP heads: depth 1 from the last fill, deeper depths one step each.

  `index_B` is the stream index of depth 1 (the position before the pending token).
  Returns (drafts_BK, q_BKV or None, cache).
  """
  m_total = model.config.num_mtp_modules
  tok_B, q_BV = choose(keys_BK[:, 0], logits1_BV, sampling)
  drafts, qs, hidden_BD = [tok_B], [q_BV], h1_BD
  for depth in range(2, num_draft + 1):
    m, offset = mtp_lib.module_for_depth(depth, m_total)
    pos_B1 = (index_B + offset)[:, None]
    h_B1D, logits_B1V, cache = mtp_lib.run_module(
        model, m, hidden_BD[:, None], drafts[-1][:, None], pos_B1, cache, expert_method=expert_method)
    hidden_BD = h_B1D[:, 0]
    tok_B, q_BV = choose(keys_BK[:, depth - 1], logits_B1V[:, 0], sampling)
    drafts.append(tok_B)
    qs.append(q_BV)
  q_BKV = None if sampling.greedy else jnp.stack(qs, axis=1)
  return jnp.stack(drafts, axis=1), q_BKV, cache
