"""n-gram prompt lookup: drafts are the tokens that followed the longest earlier match of the
context's suffix (with `SpecParams.tree_nodes`, the continuations of several matches as a tree).
No model; its state is the committed token sequence of each row."""

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


def _match_scores(seq_BS: jax.Array, n_B: jax.Array, num_draft: int, max_ngram: int) -> jax.Array:
  """int32 [B, S]: each earlier position's rank as the end of a match of seq[:n]'s suffix
  (higher is better; -1: no match there). See `prompt_lookup`."""
  batch, s = seq_BS.shape
  idx_S = jnp.arange(s, dtype=jnp.int32)
  n_B1 = n_B[:, None]
  # The suffix, last token first: tail_BT[:, t] = seq[n - 1 - t] (where n - 1 - t >= 0).
  tail_at_BT = n_B1 - 1 - jnp.arange(max_ngram, dtype=jnp.int32)[None]
  tail_BT = jnp.take_along_axis(seq_BS, jnp.clip(tail_at_BT, 0, s - 1), axis=1)
  # length_BS[:, j]: the common suffix of seq[:j+1] and seq[:n], capped at max_ngram. Each t
  # compares the sequence shifted by a static t (a slice, not a gather) with one suffix token.
  run_BS = jnp.ones((batch, s), jnp.bool_)
  length_BS = jnp.zeros((batch, s), jnp.int32)
  for t in range(max_ngram):
    shifted_BS = jnp.pad(seq_BS, ((0, 0), (t, 0)))[:, :s]
    run_BS = run_BS & (shifted_BS == tail_BT[:, t : t + 1]) & (tail_at_BT[:, t : t + 1] >= 0) & (idx_S >= t)[None]
    length_BS = length_BS + run_BS.astype(jnp.int32)
  eligible_BS = (idx_S[None] < n_B1 - 1) & (length_BS > 0)
  # Ranking: match length up to NGRAM_PREFER; then being followed by num_draft known tokens
  # (in a run of equal tokens the most recent match has a single follower); then the full
  # match length; then recency.
  full_BS = (idx_S[None] + num_draft < n_B1).astype(jnp.int32)
  key_BS = (jnp.minimum(length_BS, NGRAM_PREFER) * 2 + full_BS) * (max_ngram + 1) + length_BS
  return jnp.where(eligible_BS, key_BS * s + idx_S[None], -1)


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
  n_B1 = n_B[:, None]
  score_BS = _match_scores(seq_BS, n_B, num_draft, max_ngram)
  found_B1 = jnp.max(score_BS, axis=1, keepdims=True) >= 0
  follow_BK = sampling_lib.argmax(score_BS)[:, None] + 1 + jnp.arange(num_draft, dtype=jnp.int32)[None]
  drafts_BK = jnp.take_along_axis(seq_BS, jnp.clip(follow_BK, 0, s - 1), axis=1)
  valid_BK = found_B1 & (follow_BK < n_B1)
  return jnp.where(valid_BK, drafts_BK, 0).astype(jnp.int32), valid_BK


def prompt_lookup_tree(
  seq_BS: jax.Array, n_B: jax.Array, depth: int, n_nodes: int, max_ngram: int = NGRAM_MAX
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Prompt lookup as a tree: the continuations (up to `depth` tokens) of the best `n_nodes`
  matches in `prompt_lookup`'s rank order, merged where they share a prefix, and the first
  `n_nodes` distinct nodes taken match by match (the best match's whole continuation first).
  Returns (tokens_BN, parent_BN, valid_BN): nodes after their parents, unused nodes invalid
  (children of the root)."""
  batch, s = seq_BS.shape
  m = min(n_nodes, s)
  score_BS = _match_scores(seq_BS, n_B, depth, max_ngram)
  top_BM, at_BM = jax.lax.top_k(score_BS, m)
  follow_BMD = at_BM[..., None] + 1 + jnp.arange(depth, dtype=jnp.int32)
  tok_BMD = jnp.take_along_axis(seq_BS, jnp.clip(follow_BMD, 0, s - 1).reshape(batch, -1), axis=1).reshape(
    follow_BMD.shape
  )
  known_BMD = (top_BM >= 0)[..., None] & (follow_BMD < n_B[:, None, None])
  # same_BMMD[b, i, j, d]: continuations i and j agree on their first d + 1 tokens.
  same_BMMD = jnp.cumprod((tok_BMD[:, :, None] == tok_BMD[:, None]).astype(jnp.int32), axis=-1).astype(jnp.bool_)
  same_BMMD = same_BMMD & known_BMD[:, :, None] & known_BMD[:, None]
  earlier_MM = jnp.arange(m)[None, :] < jnp.arange(m)[:, None]  # [i, j]: j before i
  # Each candidate's canonical copy: the first continuation with the same prefix (itself if none).
  canon_BMD = jnp.argmax(same_BMMD | (jnp.arange(m)[:, None] == jnp.arange(m)[None, :])[None, :, :, None], axis=2)
  new_BMD = known_BMD & ~jnp.any(same_BMMD & earlier_MM[None, :, :, None], axis=2)
  rank_BC = jnp.cumsum(new_BMD.reshape(batch, -1), axis=1) - 1  # match-major order
  take_BC = new_BMD.reshape(batch, -1) & (rank_BC < n_nodes)
  # A node's parent: the canonical copy of its continuation's previous token (-1 at depth 1).
  parent_canon_BMD = jnp.pad(canon_BMD[..., :-1], ((0, 0), (0, 0), (1, 0)))
  parent_at_BC = (parent_canon_BMD * depth + jnp.maximum(jnp.arange(depth) - 1, 0)).reshape(batch, -1)
  at_depth1_C = jnp.tile(jnp.arange(depth) == 0, m)
  parent_rank_BC = jnp.where(at_depth1_C[None], -1, jnp.take_along_axis(rank_BC, parent_at_BC, axis=1))
  slot_BC = jnp.where(take_BC, rank_BC, n_nodes)
  rows_B1 = jnp.arange(batch)[:, None]
  tokens_BN = jnp.zeros((batch, n_nodes), jnp.int32).at[rows_B1, slot_BC].set(tok_BMD.reshape(batch, -1), mode="drop")
  parent_BN = jnp.full((batch, n_nodes), -1, jnp.int32).at[rows_B1, slot_BC].set(parent_rank_BC, mode="drop")
  valid_BN = jnp.zeros((batch, n_nodes), jnp.bool_).at[rows_B1, slot_BC].set(True, mode="drop")
  return tokens_BN, parent_BN, valid_BN


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
  branches: ClassVar[bool] = True

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
    if ls.tree_nodes:  # several matches' continuations, merged; deterministic (one-hot q)
      tokens_BN, parent_BN, valid_BN = prompt_lookup_tree(state.draft_state.seq_BS, state.pos_B + 1, k, ls.tree_nodes)
      return DraftTree(tokens_BN=tokens_BN, parent_BN=parent_BN, q_BNV=None, valid_BN=valid_BN), state.draft_state
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
