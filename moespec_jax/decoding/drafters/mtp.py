"""MTP heads (DeepSeek-V3 style) as a drafter: depth 1 from the heads' last fill, deeper depths
one module step each; the heads' own KV cache is filled from the target's hidden states after
every verification pass (the accepted positions only)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from moespec_jax.config import ModelConfig
from moespec_jax.decoding import sampling as sampling_lib
from moespec_jax.decoding import tree_select
from moespec_jax.decoding.drafters.base import Drafter, DraftSpec, DraftTree, Verified
from moespec_jax.decoding.sampling_params import SamplingParams
from moespec_jax.decoding.state import LoopSpec, LoopState, ProgramTarget
from moespec_jax.model import mtp as mtp_lib
from moespec_jax.model.cache import KVCache, TreeMask
from moespec_jax.model.expert_table import ExpertTable
from moespec_jax.model.kernels import Kernels
from moespec_jax.model.layers import at_index

if TYPE_CHECKING:
  from jax.typing import ArrayLike

  from moespec_jax.model.handle import ModelHandle
  from moespec_jax.model.transformer import ForwardOutput


def choose(key_B: jax.Array, logits_BV: jax.Array, sampling: SamplingParams) -> tuple[jax.Array, jax.Array | None]:
  """A draft token per row and the distribution q it was drawn from (None when greedy)."""
  if sampling.greedy:
    return sampling_lib.argmax(logits_BV), None
  logq_BV = sampling_lib.filtered_logprobs(logits_BV, sampling)
  tok_B = jax.vmap(sampling_lib.categorical)(key_B, logq_BV)
  return tok_B, jnp.exp(logq_BV)


def module_step(
  model: ProgramTarget,
  m: int,
  hidden_BD: jax.Array,
  token_B: jax.Array,
  position_B: jax.Array,
  cache: KVCache,
  *,
  kernels: Kernels,
  active_B: jax.Array | None,
) -> tuple[jax.Array, jax.Array, KVCache]:
  """Module `m` one token a row (a chain's step): (its hidden state [B, D], logits [B, V], cache).
  Rows outside `active_B` read no routed expert."""
  h_B1D, logits_B1V, cache = mtp_lib.run_module(
    model,
    m,
    hidden_BD[:, None],
    token_B[:, None],
    position_B[:, None],
    cache,
    kernels=kernels,
    valid_BT=None if active_B is None else active_B[:, None],
  )
  return h_B1D[:, 0], logits_B1V[:, 0], cache


def mtp_propose(
  model: ProgramTarget,
  cache: KVCache,
  h1_BD: jax.Array,
  logits1_BV: jax.Array,
  index_B: jax.Array,
  keys_BK: jax.Array,
  num_draft: int,
  sampling: SamplingParams,
  *,
  kernels: Kernels,
  active_B: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None, KVCache]:
  """K drafts from the MTP heads: depth 1 from the last fill, deeper depths one step each.

  `index_B` is the stream index of depth 1 (the position before the pending token). Depths
  2..M run modules 2..M; the recursive depths beyond M share module M in one `lax.scan`
  (compiled once whatever K). Rows outside `active_B` (finished) read no routed expert.
  Returns (drafts_BK, q_BKV or None, cache).
  """
  m_total = model.config.num_mtp_modules
  tok_B, q_BV = choose(keys_BK[:, 0], logits1_BV, sampling)
  drafts, qs, hidden_BD = [tok_B], [q_BV], h1_BD

  def step(m: int, offset: int | jax.Array, hidden_BD: jax.Array, prev_B: jax.Array, key_B: jax.Array, cache: KVCache):
    h_BD, logits_BV, cache = module_step(
      model, m, hidden_BD, prev_B, index_B + offset, cache, kernels=kernels, active_B=active_B
    )
    tok_B, q_BV = choose(key_B, logits_BV, sampling)
    return h_BD, tok_B, q_BV, cache

  for depth in range(2, min(num_draft, m_total) + 1):
    m, offset = mtp_lib.module_for_depth(depth, m_total)
    hidden_BD, tok_B, q_BV, cache = step(m, offset, hidden_BD, drafts[-1], keys_BK[:, depth - 1], cache)
    drafts.append(tok_B)
    qs.append(q_BV)
  first_recursive = max(2, m_total + 1)
  if num_draft >= first_recursive:

    def scan_body(carry: tuple[jax.Array, jax.Array, KVCache], xs: tuple[jax.Array, jax.Array]):
      hidden_BD, prev_B, cache = carry
      offset, key_B = xs
      hidden_BD, tok_B, q_BV, cache = step(m_total - 1, offset, hidden_BD, prev_B, key_B, cache)
      return (hidden_BD, tok_B, cache), (tok_B, q_BV)

    offsets = jnp.arange(first_recursive, num_draft + 1, dtype=jnp.int32) - m_total
    keys_KB = jnp.moveaxis(keys_BK[:, first_recursive - 1 :], 1, 0)
    (_, _, cache), (toks_KB, qs_KBV) = jax.lax.scan(scan_body, (hidden_BD, drafts[-1], cache), (offsets, keys_KB))
    drafts.extend(list(toks_KB))
    if qs_KBV is not None:
      qs.extend(list(qs_KBV))
  q_BKV = None if sampling.greedy else jnp.stack(qs, axis=1)
  return jnp.stack(drafts, axis=1), q_BKV, cache


def tree_width(n_nodes: int, depth: int) -> int:
  """The frontier a draft tree keeps per level: ceil(N / D) (a chain when N = D)."""
  return -(-n_nodes // depth)


def mtp_propose_tree(
  model: ProgramTarget,
  cache: KVCache,
  h1_BD: jax.Array,
  logits1_BV: jax.Array,
  index_B: jax.Array,
  depth: int,
  n_nodes: int,
  *,
  kernels: Kernels,
  active_B: jax.Array | None = None,
  by_experts: ExpertChoice | None = None,
) -> tuple[DraftTree, KVCache]:
  """A greedy draft tree of `n_nodes` nodes and depth <= `depth` from one MTP module, chosen by the
  drafter's path probability (EAGLE-2's expansion): each level keeps the W = ceil(N / D) likeliest
  paths as its frontier; the module runs over the whole frontier in one call, each node at its
  depth's position and attending to the committed stream, its ancestors and itself (its tree slots
  after the stream: `TreeMask`), and proposes each frontier node's W likeliest children; the N
  likeliest paths among all candidates are the tree (a node's parent is likelier than it, so the
  tree is closed under parents). Children are deterministic (for greedy verification; sampled
  decoding's trees: `mtp_propose_sampled_tree`).

  `by_experts`: the nodes are chosen among the same candidates by their predicted experts too
  (`tree_select.select_expert_aware`; with a cost, truncated: `tree_select.truncate`)."""
  batch = h1_BD.shape[0]
  width = tree_width(n_nodes, depth)
  window = max(1, (depth - 1) * width)

  def logq(logits_XV: jax.Array) -> jax.Array:
    return jax.nn.log_softmax(logits_XV.astype(jnp.float32), axis=-1)

  score_BW, tok_BW = jax.lax.top_k(logq(logits1_BV), width)
  cand_tok, cand_score = [tok_BW], [score_BW]
  cand_parent = [jnp.full((batch, width), -1, jnp.int32)]
  frontier_id_BW = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
  frontier_tok_BW, frontier_score_BW = tok_BW, score_BW
  hidden_BWD = jnp.broadcast_to(h1_BD[:, None], (batch, width, h1_BD.shape[-1]))
  mask_BWM = jnp.broadcast_to(jnp.eye(width, window, dtype=jnp.bool_), (batch, width, window))
  n_cands = width
  for d in range(2, depth + 1):
    level_valid_BW = None if active_B is None else jnp.broadcast_to(active_B[:, None], (batch, width))
    h_BWD, logits_BWV, cache = mtp_lib.run_module(
      model,
      0,
      hidden_BWD,
      frontier_tok_BW,
      jnp.broadcast_to((index_B + d - 1)[:, None], (batch, width)),
      cache,
      kernels=kernels,
      valid_BT=level_valid_BW,
      tree=TreeMask(base_B=index_B + 1, write_B=index_B + 1 + (d - 2) * width, mask_BTM=mask_BWM),
    )
    child_score_BWC, child_tok_BWC = jax.lax.top_k(logq(logits_BWV.reshape(batch * width, -1)), width)
    child_score_BX = (frontier_score_BW[:, :, None] + child_score_BWC.reshape(batch, width, width)).reshape(batch, -1)
    child_tok_BX = child_tok_BWC.reshape(batch, -1)
    from_BX = jnp.repeat(jnp.arange(width, dtype=jnp.int32), width)[None]  # the frontier node each follows
    cand_tok.append(child_tok_BX)
    cand_score.append(child_score_BX)
    cand_parent.append(jnp.take_along_axis(frontier_id_BW, jnp.broadcast_to(from_BX, child_tok_BX.shape), axis=1))
    if d < depth:  # the next frontier: the likeliest children, their hidden states and masks
      frontier_score_BW, pick_BW = jax.lax.top_k(child_score_BX, width)
      parent_BW = pick_BW // width
      frontier_tok_BW = jnp.take_along_axis(child_tok_BX, pick_BW, axis=1)
      frontier_id_BW = n_cands + pick_BW
      hidden_BWD = jnp.take_along_axis(h_BWD, parent_BW[..., None], axis=1)
      own_BWM = jax.nn.one_hot((d - 1) * width + jnp.arange(width), window, dtype=jnp.bool_)[None]
      mask_BWM = jnp.take_along_axis(mask_BWM, parent_BW[..., None], axis=1) | own_BWM
    n_cands += width * width
  tok_BX, score_BX, parent_BX = (jnp.concatenate(x, axis=1) for x in (cand_tok, cand_score, cand_parent))
  valid_BN, predicted_L = jnp.ones((batch, n_nodes), jnp.bool_), None
  if by_experts is None:
    # The N likeliest candidates (ties: the lower index, an ancestor before its descendants), in
    # candidate order: parents come first.
    _, chosen_BN = jax.lax.top_k(score_BX, n_nodes)
    chosen_BN = jnp.sort(chosen_BN, axis=1)
  else:
    chosen_BN, valid_BN, predicted_L = by_experts.choose(score_BX, parent_BX, tok_BX, n_nodes, active_B)
  parent_id_BN = jnp.take_along_axis(parent_BX, chosen_BN, axis=1)
  # A parent's node index: its place among the chosen (-1: the root).
  is_parent_BNN = chosen_BN[:, None, :] == parent_id_BN[:, :, None]
  parent_BN = jnp.where(parent_id_BN < 0, -1, jnp.argmax(is_parent_BNN, axis=2)).astype(jnp.int32)
  tree = DraftTree(
    tokens_BN=jnp.take_along_axis(tok_BX, chosen_BN, axis=1).astype(jnp.int32),
    parent_BN=parent_BN,
    q_BNV=None,
    valid_BN=valid_BN,
    predicted_unique_L=predicted_L,
  )
  return tree, cache


@struct.dataclass(kw_only=True)
class ExpertChoice:
  """A greedy tree's nodes chosen by their predicted experts (`SpecParams.tree_policy`
  "expert_aware" and `tree_truncate`): the table, the pending tokens (the root), the penalty and
  the pass-time model of the truncation (None: no truncation)."""

  table: ExpertTable
  pending_B: jax.Array
  n_experts: int = struct.field(pytree_node=False)
  penalty: float = struct.field(pytree_node=False)
  cost: tree_select.TreeCost | None = struct.field(pytree_node=False, default=None)

  def choose(
    self, score_BX: jax.Array, parent_BX: jax.Array, tok_BX: jax.Array, n_nodes: int, active_B: jax.Array | None
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(chosen_BN candidate indices in their chosen order, valid_BN, the predicted distinct experts
    per layer of the pass [L])."""
    batch = score_BX.shape[0]
    act_B = jnp.ones((batch,), jnp.bool_) if active_B is None else active_B
    sets_BXLE = self.table.expert_sets(tok_BX, self.n_experts)
    root_BLE = self.table.expert_sets(self.pending_B, self.n_experts)
    chosen_BN, added_BN, _ = tree_select.select_expert_aware(
      score_BX, parent_BX, sets_BXLE, root_BLE, n_nodes, self.penalty, act_B
    )
    valid_BN = jnp.ones((batch, n_nodes), jnp.bool_)
    if self.cost is not None:
      score_BN = jnp.take_along_axis(score_BX, chosen_BN, axis=1)
      valid_BN = tree_select.truncate(score_BN, added_BN, jnp.sum(root_BLE, axis=(1, 2)), self.cost)
    chosen_BNLE = jnp.take_along_axis(sets_BXLE, chosen_BN[:, :, None, None], axis=1)
    read_BNLE = chosen_BNLE & (valid_BN & act_B[:, None])[:, :, None, None]
    union_LE = jnp.any(root_BLE & act_B[:, None, None], axis=0) | jnp.any(read_BNLE, axis=(0, 1))
    return chosen_BN, valid_BN, jnp.sum(union_LE, axis=-1).astype(jnp.float32)


def level_sizes(n_nodes: int, depth: int) -> list[int]:
  """Children a sampled tree keeps at each depth: N spread over D levels, the first ones larger."""
  return [n_nodes // depth + (1 if d < n_nodes % depth else 0) for d in range(depth)]


def mtp_propose_sampled_tree(
  model: ProgramTarget,
  cache: KVCache,
  h1_BD: jax.Array,
  logits1_BV: jax.Array,
  index_B: jax.Array,
  keys_B: jax.Array,
  depth: int,
  n_nodes: int,
  sampling: SamplingParams,
  *,
  kernels: Kernels,
  active_B: jax.Array | None = None,
) -> tuple[DraftTree, KVCache]:
  """A sampled draft tree (T > 0) from one MTP module: at each depth the expanded node's children
  are drawn from the drafter's q without replacement (Gumbel top-c: child i follows q without
  the siblings before it, renormalised, which is its q_i for verification), c the depth's share of
  N (`level_sizes`); the first draw is expanded next, one module step a depth at the chain's
  positions (so the heads' cache is written as a chain's): the first draws are a sampled chain
  and the other draws siblings beside it, tried when it is rejected. Which nodes are in the tree
  never depends on the drawn values (each node's children are a fixed number of draws), so tree
  verification against the running residual stays exact. (Choosing nodes by their sampled
  probability, as the greedy trees do, would not.)"""
  batch, vocab = logits1_BV.shape
  sizes = level_sizes(n_nodes, depth)
  keys_BD = jax.vmap(lambda key: jax.random.split(key, depth))(keys_B)
  tokens, parents, qs, valid = [], [], [], []
  logq_BV, hidden_BD, prev_B = sampling_lib.filtered_logprobs(logits1_BV, sampling), h1_BD, None
  first = 0  # the node index of this depth's first child
  parent_B = jnp.full((batch,), -1, jnp.int32)
  for d, c in enumerate(sizes):
    if d:  # the expanded node's step: its children's distribution
      hidden_BD, logits_BV, cache = module_step(
        model, 0, hidden_BD, prev_B, index_B + d, cache, kernels=kernels, active_B=active_B
      )
      logq_BV = sampling_lib.filtered_logprobs(logits_BV, sampling)
    gumbel_BV = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,)))(keys_BD[:, d])
    _, tok_BC = jax.lax.top_k(logq_BV + gumbel_BV, c)  # draws without replacement, in order
    q_BV = jnp.exp(logq_BV)
    for i in range(c):
      drawn_BV = jax.nn.one_hot(tok_BC[:, :i], vocab, dtype=jnp.bool_).any(axis=1) if i else None
      q_i_BV = q_BV if drawn_BV is None else jnp.where(drawn_BV, 0.0, q_BV)
      qs.append(q_i_BV / jnp.maximum(jnp.sum(q_i_BV, axis=-1, keepdims=True), 1e-30))
    tokens.append(tok_BC)
    parents.append(jnp.broadcast_to(parent_B[:, None], (batch, c)))
    # Past q's support (top-k / top-p) there is nothing left to draw: no proposal there.
    valid.append(jnp.isfinite(jnp.take_along_axis(logq_BV, tok_BC, axis=1)))
    # The child to expand: the first draw, a sample from q as a chain's draft (and the first tried,
    # so the likeliest to be accepted): the tree holds the chain and adds siblings to it.
    prev_B = tok_BC[:, 0]
    parent_B = jnp.full((batch,), first, jnp.int32)
    first += c
  tree = DraftTree(
    tokens_BN=jnp.concatenate(tokens, axis=1).astype(jnp.int32),
    parent_BN=jnp.concatenate(parents, axis=1).astype(jnp.int32),
    q_BNV=jnp.stack(qs, axis=1),
    valid_BN=jnp.concatenate(valid, axis=1),
  )
  return tree, cache


@struct.dataclass(kw_only=True)
class MtpState:
  cache: KVCache
  """The heads' KV cache, over each row's stream (its prompt window, then every generated position)."""
  h1_BD: jax.Array
  """[B, D]: module 1's hidden state at the stream's last index (what depth 2 continues)."""
  logits1_BV: jax.Array
  """[B, V]: module 1's logits there: the depth-1 draft's distribution."""
  offset_B: jax.Array
  """int32 [B]: the prompt position at stream index 0 (the window's start; 0: every position)."""
  expert_table: ExpertTable | None = None
  """The target's predicted experts per token, where the trees are chosen by them."""


@dataclasses.dataclass(frozen=True)
class MtpDrafter(Drafter):
  """The model's MTP heads. They are not run on plain passes (their state goes stale there), so
  they bring auto K no evidence at K = 0: no shadow drafts. Auto K reads their acceptance
  geometrically, not per depth: it was measured about flat in depth, where the depth model's
  optimism about rarely reached depths chose longer drafts than paid at batch 8
  (docs/findings/2026-12-02-auto-k-depth-acceptance.md).

  prompt_window: the heads' cache starts from each prompt's last this many positions (0: all of
  them), shifted to stream index 0 (RoPE is relative, so shifting a row's positions by a constant
  leaves its attention unchanged); the prefill computes the target's hidden states there only.
  """

  prompt_window: int = 0
  tree_policy: str = "probability"
  expert_penalty: float = 0.0
  tree_cost: tree_select.TreeCost | None = None
  """Where trees are truncated (`SpecParams.tree_truncate`): the pass-time model; else None."""

  branches: ClassVar[bool] = True
  weighs_experts: ClassVar[bool] = True

  @property
  def predicts_experts(self) -> bool:
    return self.tree_policy == "expert_aware" or self.tree_cost is not None

  @classmethod
  def for_call(cls, spec: DraftSpec, *, config: ModelConfig, sampling: SamplingParams, prompt_len: int) -> MtpDrafter:
    if config.num_mtp_modules == 0:
      raise ValueError(
        "drafter 'mtp' needs MTP heads, but the model has num_mtp_modules=0 "
        "(train them with experiments.train_mtp, or use drafter='ngram' or 'none')"
      )
    tree_nodes = spec.tree_nodes
    if tree_nodes and tree_width(tree_nodes, spec.num_draft) > config.vocab_size:
      raise ValueError(
        f"tree_nodes={tree_nodes} with num_draft={spec.num_draft} keeps {tree_width(tree_nodes, spec.num_draft)} "
        f"children a level, more than the vocabulary's {config.vocab_size} tokens"
      )
    if tree_nodes and config.num_mtp_modules != 1:
      raise ValueError(
        f"MTP draft trees run one MTP module at every depth; the model has {config.num_mtp_modules} "
        "(use tree_nodes=None for chains)"
      )
    # 0: every prompt position (a window as long as the padded prompt is all of it).
    window = spec.research.mtp_prompt_window or 0
    window = window if window < prompt_len else 0
    if not tree_nodes or (spec.tree_policy == "probability" and not spec.tree_truncate):
      return cls(prompt_window=window)
    if not sampling.greedy:
      raise ValueError(
        "tree_policy='expert_aware' and tree_truncate choose nodes by their tokens, which keeps greedy "
        "verification exact but not sampled verification: use temperature 0, or tree_policy='probability'"
      )
    if not config.n_moe_layers:
      raise ValueError("tree_policy='expert_aware' and tree_truncate weigh experts: the model has no MoE layer")
    cost = (spec.tree_cost or tree_select.TreeCost.from_bytes(config)) if spec.tree_truncate else None
    penalty = float(spec.expert_penalty) if spec.tree_policy == "expert_aware" else 0.0
    return cls(prompt_window=window, tree_policy=spec.tree_policy, expert_penalty=penalty, tree_cost=cost)

  def host_inputs(
    self,
    spec: DraftSpec,
    *,
    model: ModelHandle,
    reference_tokens: ArrayLike | None,
    seed_u32: np.ndarray,
    n_rows: int,
    max_new_tokens: int,
    length: int,
    vocab_size: int,
  ) -> ExpertTable | None:
    """The target's expert table (`ModelHandle.expert_table`) where trees are chosen by it."""
    del spec, reference_tokens, seed_u32, n_rows, max_new_tokens, length, vocab_size
    return model.expert_table() if self.predicts_experts else None

  def prefill(
    self,
    model: ProgramTarget,
    tokens_BT: jax.Array,
    lengths_B: jax.Array,
    prompt_BT: jax.Array,
    cache: KVCache,
    ls: LoopSpec,
  ) -> tuple[ForwardOutput, jax.Array, tuple[int, jax.Array, jax.Array]]:
    """The fill reads the hidden state at the window's prompt positions."""
    window = self.prompt_window or tokens_BT.shape[1]
    offset_B = jnp.maximum(lengths_B - window, 0)
    window_BW = offset_B[:, None] + jnp.arange(window, dtype=jnp.int32)[None]
    out = model(
      tokens_BT,
      None,
      cache,
      kernels=model.kernels,
      valid_BT=prompt_BT,
      compute_logits=False,
      fresh_cache=True,
      hidden_at_B=window_BW if self.prompt_window else None,
    )
    last_logits_BV = model.head(at_index(out.hidden, lengths_B - 1 - offset_B), model.kernels)[:, 0]
    return out, last_logits_BV, (window, offset_B, window_BW)

  def start(
    self,
    model: ProgramTarget,
    tokens_BT: jax.Array,
    lengths_B: jax.Array,
    prompt_BT: jax.Array,
    prefilled: ForwardOutput,
    note: tuple[int, jax.Array, jax.Array],
    first_B: jax.Array,
    inputs: ExpertTable | None,
    ls: LoopSpec,
  ) -> MtpState:
    """The heads' stream over the window: index j holds prompt position offset + j."""
    window, offset_B, window_BW = note
    config = model.config
    batch, prompt_len = tokens_BT.shape
    m_total = config.num_mtp_modules
    j_P = jnp.arange(prompt_len + m_total - 1, dtype=jnp.int32)
    shifted_BP = jnp.concatenate([tokens_BT[:, 1:], jnp.zeros((batch, m_total), jnp.int32)], axis=1)
    next_BP = jnp.where(j_P[None] < (lengths_B - 1)[:, None], shifted_BP, first_B[:, None])
    next_BW = at_index(next_BP, offset_B[:, None] + jnp.arange(window + m_total - 1, dtype=jnp.int32)[None])
    positions_BW = jnp.broadcast_to(jnp.arange(window, dtype=jnp.int32), (batch, window))
    h1_BD, logits1_BV, mcache = mtp_lib.fill(
      model,
      prefilled.hidden,
      next_BW,
      positions_BW,
      mtp_lib.new_cache(config, batch, ls.cache_len),
      kernels=model.kernels,
      at_B=lengths_B - 1 - offset_B,
      valid_BT=at_index(prompt_BT, window_BW),
      fresh_cache=True,
    )
    return MtpState(cache=mcache, h1_BD=h1_BD, logits1_BV=logits1_BV, offset_B=offset_B, expert_table=inputs)

  def propose(
    self, model: ProgramTarget, state: LoopState, k: int, keys_B: jax.Array, ls: LoopSpec
  ) -> tuple[DraftTree, MtpState]:
    mtp = state.draft_state
    # What every proposal starts from: the heads' cache and last fill, depth 1's stream index.
    start = (mtp.cache, mtp.h1_BD, mtp.logits1_BV, state.pos_B - 1 - mtp.offset_B)
    run = dict(kernels=model.kernels, active_B=state.active_B)
    if ls.tree_nodes and not ls.sampling.greedy:
      tree, mcache = mtp_propose_sampled_tree(model, *start, keys_B, k, ls.tree_nodes, ls.sampling, **run)
    elif ls.tree_nodes:
      by_experts = None
      if mtp.expert_table is not None:
        by_experts = ExpertChoice(
          table=mtp.expert_table,
          pending_B=state.pending_B,
          n_experts=model.config.n_routed_experts,
          penalty=self.expert_penalty,
          cost=self.tree_cost,
        )
      tree, mcache = mtp_propose_tree(model, *start, k, ls.tree_nodes, by_experts=by_experts, **run)
    else:
      keys_BK = jax.vmap(lambda key: jax.random.split(key, k))(keys_B)
      drafts_BK, q_BKV, mcache = mtp_propose(model, *start, keys_BK, k, ls.sampling, **run)
      tree = DraftTree.chain(drafts_BK, q_BKV)
    return tree, mtp.replace(cache=mcache)

  def update(self, model: ProgramTarget, draft_state: MtpState, verified: Verified, ls: LoopSpec) -> MtpState:
    """The heads' fill over the accepted positions. After a plain pass (possible only under auto
    K) the heads are skipped: their state goes stale and auto K does not draft with them again.
    After a tree pass, the accepted path as a chain (`Verified`'s chain view)."""
    k = verified.accept_BN.shape[1]
    if not k:
      return draft_state
    batch, m_total = verified.pos_B.shape[0], model.config.num_mtp_modules
    n_acc_B = verified.n_accepted_B
    j_T = jnp.arange(k + m_total, dtype=jnp.int32)
    # The accepted drafts are the candidates' first n_acc tokens (past them: the next token).
    base_BT = jnp.concatenate([verified.candidates_BS[:, :k], jnp.zeros((batch, m_total), jnp.int32)], axis=1)
    next_BT = jnp.where(j_T[None] < n_acc_B[:, None], base_BT, verified.next_B[:, None])
    # Indices past the accepted ones are rolled back: they read no experts.
    j_S = jnp.arange(k + 1, dtype=jnp.int32)
    kept_BS = verified.active_B[:, None] & (j_S[None] <= n_acc_B[:, None])
    h1_BD, logits1_BV, mcache = mtp_lib.fill(
      model,
      verified.output.hidden,
      next_BT,
      verified.positions_BS - draft_state.offset_B[:, None],
      draft_state.cache,
      kernels=model.kernels,
      at_B=n_acc_B,
      valid_BT=kept_BS,
    )
    return draft_state.replace(cache=mcache, h1_BD=h1_BD, logits1_BV=logits1_BV)
