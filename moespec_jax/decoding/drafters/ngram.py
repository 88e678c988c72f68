"""n-gram prompt lookup: drafts are the tokens that followed the longest earlier match of the
context's suffix. No model; its state is the committed token sequence of each row."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from moespec_jax.decoding import sampling as sampling_lib
from moespec_jax.decoding.drafters.base import Drafter, DraftTree, Verified
from moespec_jax.decoding.state import LoopSpec, LoopState, ProgramTarget
from moespec_jax.model import cache as cache_lib

if TYPE_CHECKING:
  from moespec_jax.model.transformer import ForwardOutput

# Longest suffix the n-gram drafter tries to match (bytes or tokens).
NGRAM_MAX = 8
# Matches at least this long count as equally good before the number of known followers.
NGRAM_PREFER = 4


def prompt_lookup(
  seq_BS: jax.Array, n_B: jax.Array, num_draft: int, max_ngram: int = NGRAM_MAX
) -> tuple[jax.Array, jax.Array]:
  """Prompt lookup: the longest suffix (<= max_ngram) of seq[:n] that occurred earlier.

  Matches of at least NGRAM_PREFER tokens rank equal, so that one followed by `num_draft`
  known tokens wins over a longer one that is not (in a run of equal tokens the most recent
  match has a single follower); then longer, then more recent. The tokens that followed the
  match (up to `num_draft`, never past n) are the drafts. Returns (drafts_BK, valid_BK).
  """
  s = seq_BS.shape[1]
  idx_S = jnp.arange(s, dtype=jnp.int32)

  def one_row(seq_S: jax.Array, n: jax.Array):
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


@struct.dataclass(kw_only=True)
class NgramState:
  seq_BS: jax.Array
  """int32 [B, cache_len + max_k + 1]: each row's prompt then committed tokens (the pending token
  at its position; entries past it are stale)."""


@dataclasses.dataclass(frozen=True)
class NgramDrafter(Drafter):
  """Prompt lookup. Its drafts cost next to nothing, so plain passes check the draft it would
  have proposed (`shadows`). Auto K reads its acceptance per draft depth (`per_depth`): its
  drafts are often wrong at the first token and then right for a long run."""

  shadows: ClassVar[bool] = True
  per_depth: ClassVar[bool] = True

  def start(
    self,
    model: ProgramTarget,
    tokens_BT: jax.Array,
    lengths_B: jax.Array,
    prompt_BT: jax.Array,
    prefilled: ForwardOutput,
    note: None,
    first_B: jax.Array,
    inputs: None,
    ls: LoopSpec,
  ) -> NgramState:
    batch, prompt_len = tokens_BT.shape
    seq_BS = jnp.zeros((batch, ls.cache_len + ls.max_k + 1), jnp.int32)
    seq_BS = seq_BS.at[:, :prompt_len].set(tokens_BT).at[jnp.arange(batch), lengths_B].set(first_B)
    return NgramState(seq_BS=seq_BS)

  def propose(
    self, model: ProgramTarget, state: LoopState, k: int, keys_B: jax.Array, ls: LoopSpec
  ) -> tuple[DraftTree, NgramState]:
    drafts_BK, valid_BK = prompt_lookup(state.draft_state.seq_BS, state.pos_B + 1, k)
    # A draft that is certain: q is one-hot (accepted with probability p(draft)).
    q_BKV = None if ls.sampling.greedy else jax.nn.one_hot(drafts_BK, model.config.vocab_size, dtype=jnp.float32)
    return DraftTree.chain(drafts_BK, q_BKV, valid_BK), state.draft_state

  def update(self, model: ProgramTarget, draft_state: NgramState, verified: Verified, ls: LoopSpec) -> NgramState:
    return NgramState(seq_BS=cache_lib.write_rows(draft_state.seq_BS, verified.candidates_BS, verified.pos_B + 1))

  def has_proposal(self, state: LoopState, ls: LoopSpec) -> jax.Array:
    """Prompt lookup with no match in any active row has nothing to verify."""
    _, valid_B1 = prompt_lookup(state.draft_state.seq_BS, state.pos_B + 1, 1)
    return jnp.any(valid_B1[:, 0] & ~state.done_B)
