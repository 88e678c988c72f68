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
from moespec_jax.model.kernels import Kernels

# Longest suffix the n-gram drafter tries to match (bytes or tokens).
NGRAM_MAX = 8
# Matches at least this long count as equally good before the number of known followers.
NGRAM_PREFER = 4


def ngram_propose(seq_BS, n_B, num_draft: int, max_ngram: int = NGRAM_MAX):
  """Prompt lookup: the longest suffix (<= max_ngram) of seq[:n] that occurred earlier.

  Matches of at least NGRAM_PREFER tokens rank equal, so that one followed by `num_draft`
  known tokens wins over a longer one that is not (in a run of equal tokens the most recent
  match has a single follower); then longer, then more recent. The tokens that followed the
  match (up to `num_draft`, never past n) are the drafts. Returns (drafts_BK, valid_BK).
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
    # Ranking: match length up to NGRAM_PREFER; then being followed by num_draft known tokens
    # (in a run of equal tokens the most recent match has a single follower); then the full
    # match length; then recency.
    full = (idx_S + num_draft < n).astype(jnp.int32)
    key_S = (jnp.minimum(length_S, NGRAM_PREFER) * 2 + full) * (max_ngram + 1) + length_S
    score_S = jnp.where(eligible, key_S * s + idx_S, -1)
    j = sampling_lib.argmax(score_S)
    found = score_S[j] >= 0
    follow_K = j + 1 + jnp.arange(num_draft, dtype=jnp.int32)
    drafts_K = seq_S[jnp.clip(follow_K, 0, s - 1)]
    valid_K = found & (follow_K < n)
    return jnp.where(valid_K, drafts_K, 0).astype(jnp.int32), valid_K

  return jax.vmap(one_row)(seq_BS, n_B)


def choose(key_B, logits_BV, sampling: SamplingParams):
  """A draft token per row and the distribution q it was drawn from (None when greedy)."""
  if sampling.greedy:
    return sampling_lib.argmax(logits_BV), None
  logq_BV = sampling_lib.filtered_logprobs(logits_BV, sampling)
  tok_B = jax.vmap(sampling_lib.categorical)(key_B, logq_BV)
  return tok_B, jnp.exp(logq_BV)


def mtp_propose(model, cache, h1_BD, logits1_BV, index_B, keys_BK, num_draft: int,
                sampling: SamplingParams, *, kernels: Kernels, active_B=None):
  """K drafts from the MTP heads: depth 1 from the last fill, deeper depths one step each.

  `index_B` is the stream index of depth 1 (the position before the pending token). Depths
  2..M run modules 2..M; the recursive depths beyond M share module M in one `lax.scan`
  (compiled once whatever K). Rows outside `active_B` (finished) read no routed expert. `kernels`:
  the target's (`mtp.run_module`).
  Returns (drafts_BK, q_BKV or None, cache).
  """
  m_total = model.config.num_mtp_modules
  tok_B, q_BV = choose(keys_BK[:, 0], logits1_BV, sampling)
  drafts, qs, hidden_BD = [tok_B], [q_BV], h1_BD

  def step(m, offset, hidden_BD, prev_B, key_B, cache):
    pos_B1 = (index_B + offset)[:, None]
    h_B1D, logits_B1V, cache = mtp_lib.run_module(
        model, m, hidden_BD[:, None], prev_B[:, None], pos_B1, cache, kernels=kernels,
        valid_BT=None if active_B is None else active_B[:, None])
    tok_B, q_BV = choose(key_B, logits_B1V[:, 0], sampling)
    return h_B1D[:, 0], tok_B, q_BV, cache

  for depth in range(2, min(num_draft, m_total) + 1):
    m, offset = mtp_lib.module_for_depth(depth, m_total)
    hidden_BD, tok_B, q_BV, cache = step(m, offset, hidden_BD, drafts[-1], keys_BK[:, depth - 1], cache)
    drafts.append(tok_B)
    qs.append(q_BV)
  first_recursive = max(2, m_total + 1)
  if num_draft >= first_recursive:
    def scan_body(carry, xs):
      hidden_BD, prev_B, cache = carry
      offset, key_B = xs
      hidden_BD, tok_B, q_BV, cache = step(m_total - 1, offset, hidden_BD, prev_B, key_B, cache)
      return (hidden_BD, tok_B, cache), (tok_B, q_BV)

    offsets = jnp.arange(first_recursive, num_draft + 1, dtype=jnp.int32) - m_total
    keys_KB = jnp.moveaxis(keys_BK[:, first_recursive - 1:], 1, 0)
    (_, _, cache), (toks_KB, qs_KBV) = jax.lax.scan(scan_body, (hidden_BD, drafts[-1], cache),
                                                    (offsets, keys_KB))
    drafts.extend(list(toks_KB))
    if qs_KBV is not None:
      qs.extend(list(qs_KBV))
  q_BKV = None if sampling.greedy else jnp.stack(qs, axis=1)
  return jnp.stack(drafts, axis=1), q_BKV, cache


def controlled_table(reference_BN, key_B, acceptance, vocab_size: int):
  """The controlled drafter's proposal for every output index, drawn once per generation.

  Research drafter with controllable acceptance (cost-model validation): the proposal at index
  g of a row is the reference (the target's plain greedy output) at g with probability
  `acceptance`, else a uniformly chosen different token, independently per index. A draft at
  index g is verified at most once (then the output moves past g), so under greedy
  verification the accepted length is exactly geometric in `acceptance`. `generate` draws the
  table before the generation's program (`passes.controlled_draft_table`): decoding pays a
  lookup per pass, as for a drafter whose proposals cost nothing.
  """
  n = reference_BN.shape[1]

  def one_row(key, ref_N):
    k_hit, k_other = jax.random.split(key)
    hit_N = jax.random.uniform(k_hit, (n,)) < acceptance
    offset_N = jax.random.randint(k_other, (n,), 1, vocab_size)
    return jnp.where(hit_N, ref_N, (ref_N + offset_N) % vocab_size).astype(jnp.int32)

  return jax.vmap(one_row)(key_B, reference_BN)


def controlled_propose(table_BN, gen_B, num_draft: int):
  """K drafts per row: the controlled drafter's table (`controlled_table`) from index gen."""
  n = table_BN.shape[1]
  idx_BK = jnp.clip(gen_B[:, None] + jnp.arange(num_draft, dtype=jnp.int32)[None], 0, n - 1)
  return jnp.take_along_axis(table_BN, idx_BK, axis=1)
