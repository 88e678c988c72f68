"""The traced parts of a generation program: its start (prefill, first token, the drafter's state,
zeroed statistics), one speculative pass as four steps on the typed state (draft K, verify K + 1 in
one target pass with exact rejection sampling or greedy matching and the bonus token, commit and
roll back by position, record the statistics) and auto K's segment of passes.

Pure functions on explicit state: the model (merged inside the program) and a `LoopState` (KV
caches included) in, the next state out; `decoding.loop` runs them under one `lax.while_loop`.
Nothing here asks the drafter its name: it goes through its interface (`drafters.base.Drafter`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from moespec_jax.config import ModelConfig
from moespec_jax.decoding import auto_draft, rejection
from moespec_jax.decoding import quality as quality_lib
from moespec_jax.decoding import sampling as sampling_lib
from moespec_jax.decoding.drafters import DraftTree, Verified
from moespec_jax.decoding.state import LoopSpec, LoopState, ProgramTarget, Stats, row_keys, stream_keys
from moespec_jax.model import cache as cache_lib
from moespec_jax.model.budget import ExpertBudget
from moespec_jax.model.transformer import ForwardOutput
from pallas_kernels import cpu as cpu_ffi


def init_state(
  model: ProgramTarget,
  tokens_BT: jax.Array,
  lengths_B: jax.Array,
  seed: jax.Array,
  inputs: Any,
  ls: LoopSpec,
  step_ms_K: jax.Array | None = None,
  prior_2: jax.Array | None = None,
) -> LoopState:
  """Prefill, the first token, the drafter's state and zeroed statistics: the loop's first state.
  `seed`: uint32, the PRNG seed (the key is made here: `jax.random.key(seed)` called eagerly
  costs a dispatch per call). `inputs`: the drafter's, drawn before the program (`host_inputs`).

  Auto K (`step_ms_K`, the calibrated pass times, and `prior_2`, the calibration's starting
  counts): every row's evidence starts from `prior_2`; a drafter without shadow drafts whose
  first choice is already the final K = 0 is not started (its state zeros, `drafter_started`
  0: the program then runs plain passes to the end, `loop._generate_spec`)."""
  config = model.config
  batch, prompt_len = tokens_BT.shape
  row_keys_B = row_keys(seed, batch)
  cache = model.new_cache(batch, ls.cache_len)
  prompt_BT = jnp.arange(prompt_len, dtype=jnp.int32)[None] < lengths_B[:, None]  # padding reads no experts
  out, last_logits_BV, note = ls.drafter.prefill(model, tokens_BT, lengths_B, prompt_BT, cache, ls)
  first_B = sampling_lib.sample(stream_keys(row_keys_B, 0), last_logits_BV, ls.sampling)
  out_BN = jnp.full((batch, ls.max_new_tokens + ls.max_k + 1), -1, jnp.int32).at[:, 0].set(first_B)

  def start() -> Any:
    return ls.drafter.start(model, tokens_BT, lengths_B, prompt_BT, out, note, first_B, inputs, ls)

  stats = Stats.zeros(ls, batch, config.n_moe_layers)
  if ls.auto and prior_2 is not None:
    evidence_B2 = jnp.broadcast_to(jnp.asarray(prior_2, jnp.float32), (batch, 2))
    stats = stats.replace(acceptance_evidence_B2=evidence_B2)
  if ls.auto and prior_2 is not None and not ls.drafter.shadows:
    remaining_B = jnp.full((batch,), ls.max_new_tokens - 1, jnp.float32)
    first_k, _ = auto_draft.choose_k(stats.acceptance_evidence_B2, step_ms_K, shadow=False, remaining_B=remaining_B)
    started = first_k > 0
    idle = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(start))
    draft_state = jax.lax.cond(started, start, lambda: idle)
    stats = stats.replace(drafter_started=started.astype(jnp.int32))
  else:
    draft_state = start()
  return LoopState(
    step=jnp.int32(1),
    cache=cache_on_rows(out.cache, ls),
    pos_B=lengths_B,
    pending_B=first_B,
    generated_B=jnp.ones((batch,), jnp.int32),
    done_B=(first_B == config.eos_id) | (ls.max_new_tokens <= 1),
    out_BN=out_BN,
    draft_state=draft_state,
    stats=stats,
    row_keys_B=row_keys_B,
  )


def draft(
  model: ProgramTarget, state: LoopState, k: int, keys_B: jax.Array, ls: LoopSpec
) -> tuple[LoopState, DraftTree, tuple | None]:
  """The drafter's proposal of k drafts per row (none at k = 0) and its state after drafting; on
  auto K's plain passes, where the drafter shadows, the one draft it would have proposed
  ((token_B, valid_B): evidence for auto K, not verified; else None)."""
  drafter = ls.drafter
  if k == 0:
    tree = DraftTree.empty(state.pos_B.shape[0])
  else:
    tree, draft_state = drafter.propose(model, state, k, keys_B, ls)
    wanted = f"a tree of {ls.tree_nodes} nodes" if ls.tree_nodes else f"a chain of {k} drafts"
    if tree.num_nodes != (ls.tree_nodes or k) or (not ls.tree_nodes and not tree.is_chain):
      raise ValueError(
        f"{type(drafter).__name__} proposed a draft tree of {tree.num_nodes} nodes (chain: "
        f"{tree.is_chain}) where {wanted} was asked"
      )
    state = state.replace(draft_state=draft_state)
  shadow = None
  if ls.auto and k == 0 and drafter.shadows:
    shadow_B, valid_B = drafter.shadow(model, state, keys_B, ls)
    shadow = (shadow_B, valid_B & state.active_B)
  return state, tree, shadow


def verify(
  model: ProgramTarget,
  state: LoopState,
  tree: DraftTree,
  shadow: tuple[jax.Array, jax.Array] | None,
  keys_B: jax.Array,
  ls: LoopSpec,
) -> Verified:
  """The target's pass over each row's pending token and its drafts, and what it accepts: greedy
  matching, or exact rejection sampling with the residual or bonus token; the shadow draft's
  acceptance; with measure_quality, the exact pass on the same cache against the budgeted one.

  Finished rows and empty draft slots (no n-gram follower) read no experts: no output of theirs
  is used (empty slots are a suffix: no slot after one is reached). A tree (`ls.tree_nodes`) is
  verified by `verify_tree`."""
  if not tree.is_chain:
    return verify_tree(model, state, tree, keys_B, ls)
  config = model.config
  vocab, k, batch = config.vocab_size, tree.num_nodes, state.pos_B.shape[0]
  active_B, pos_B = state.active_B, state.pos_B
  inputs_BS = jnp.concatenate([state.pending_B[:, None], tree.tokens_BN], axis=1)
  positions_BS = pos_B[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None]
  active_BS = active_B[:, None] & jnp.concatenate([jnp.ones((batch, 1), jnp.bool_), tree.valid_BN], axis=1)
  experts_BS = active_BS if ls.kernels.routed_experts else jnp.zeros_like(active_BS)
  vout = model(
    inputs_BS, positions_BS, state.cache, kernels=model.kernels, expert_budget=ls.expert_budget, valid_BT=experts_BS
  )
  shadow_valid_B = shadow_accept_B = None
  if ls.sampling.greedy:
    accept_BK, n_acc_B, next_B = rejection.verify_greedy(vout.logits, tree.tokens_BN, tree.valid_BN)
    if shadow is not None:
      shadow_valid_B, shadow_accept_B = shadow[1], (shadow[0] == next_B).astype(jnp.float32)
  else:
    logp_BSV = sampling_lib.filtered_logprobs(vout.logits.reshape(-1, vocab), ls.sampling)
    logp_BSV = logp_BSV.reshape(batch, k + 1, vocab)
    q_BKV = tree.q_BNV
    if q_BKV is None:  # deterministic drafts: one-hot q
      q_BKV = (
        jax.nn.one_hot(tree.tokens_BN, vocab, dtype=jnp.float32) if k else jnp.zeros((batch, 0, vocab), jnp.float32)
      )
    accept_BK, n_acc_B, next_B = rejection.verify_sampled(keys_B, logp_BSV, tree.tokens_BN, q_BKV, tree.valid_BN)
    if shadow is not None:  # a one-hot draft is accepted with probability p(draft)
      shadow_valid_B = shadow[1]
      shadow_accept_B = jnp.exp(jnp.take_along_axis(logp_BSV[:, 0], shadow[0][:, None], axis=1)[:, 0])
  # [d_1..d_a, y]: the accepted drafts, then the token sampled after them.
  j_S = jnp.arange(k + 1, dtype=jnp.int32)
  drafts_pad_BS = jnp.concatenate([tree.tokens_BN, jnp.zeros((batch, 1), jnp.int32)], axis=1)
  cand_BS = jnp.where(j_S[None] < n_acc_B[:, None], drafts_pad_BS, next_B[:, None])
  quality_3 = None
  if ls.measure_quality:  # how far the budget moved the verified logits
    exact_logits_BSV = model(inputs_BS, positions_BS, state.cache, kernels=model.kernels).logits
    used_BS = active_BS & (j_S[None] <= n_acc_B[:, None])
    agree, kl, count = quality_lib.logit_agreement(
      exact_logits_BSV.reshape(-1, vocab), vout.logits.reshape(-1, vocab), used_BS.reshape(-1)
    )
    quality_3 = jnp.stack([agree, kl, count])
  return Verified(
    tree=tree,
    pos_B=pos_B,
    positions_BS=positions_BS,
    active_B=active_B,
    experts_BS=experts_BS,
    output=vout,
    accept_BN=accept_BK,
    n_accepted_B=n_acc_B,
    next_B=next_B,
    candidates_BS=cand_BS,
    shadow_valid_B=shadow_valid_B,
    shadow_accept_B=shadow_accept_B,
    quality_3=quality_3,
  )


def verify_tree(model: ProgramTarget, state: LoopState, tree: DraftTree, keys_B: jax.Array, ls: LoopSpec) -> Verified:
  """One target pass over each row's pending token and its draft tree (positions by depth, each
  token attending to the committed cache, itself and its ancestors: `Transformer.__call__`'s
  `tree`), the accepted path by `rejection.verify_tree_greedy` / `verify_tree_sampled`,
  and the path's cache entries moved to the consecutive slots after the pending token, so that
  the rest of the loop sees a chain: `accept_BN` per depth, `candidates_BS` the path's tokens
  then the next one, `positions_BS` and the output's hidden states the path's (its logits and
  routing stay the tree's: every node's experts were read). A node under an invalid one is
  invalid (its context was not proposed)."""
  config = model.config
  vocab, n, batch = config.vocab_size, tree.num_nodes, state.pos_B.shape[0]
  depth_max = ls.max_k
  active_B, pos_B = state.active_B, state.pos_B
  valid_BN = tree.valid_BN
  for j in range(n):  # parents come first: an invalid ancestor reaches every descendant
    par_B = tree.parent_BN[:, j]
    parent_valid_B = jnp.take_along_axis(valid_BN, jnp.maximum(par_B, 0)[:, None], axis=1)[:, 0]
    valid_BN = valid_BN.at[:, j].set(valid_BN[:, j] & ((par_B < 0) | parent_valid_B))
  depth_BN = rejection.node_depths(tree.parent_BN)
  inputs_BS = jnp.concatenate([state.pending_B[:, None], tree.tokens_BN], axis=1)
  positions_BS = pos_B[:, None] + jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), depth_BN], axis=1)
  mask_BSS = rejection.ancestor_mask(tree.parent_BN)
  active_BS = active_B[:, None] & jnp.concatenate([jnp.ones((batch, 1), jnp.bool_), valid_BN], axis=1)
  experts_BS = active_BS if ls.kernels.routed_experts else jnp.zeros_like(active_BS)

  def target_pass(budget: ExpertBudget | None) -> ForwardOutput:
    return model(
      inputs_BS,
      positions_BS,
      state.cache,
      kernels=model.kernels,
      expert_budget=budget,
      valid_BT=experts_BS,
      tree=cache_lib.TreeMask.over_pass(pos_B, mask_BSS),
    )

  vout = target_pass(ls.expert_budget)
  if ls.sampling.greedy:
    on_path_BN, n_acc_B, _, next_B = rejection.verify_tree_greedy(vout.logits, tree.tokens_BN, tree.parent_BN, valid_BN)
  else:
    logp_BSV = sampling_lib.filtered_logprobs(vout.logits.reshape(-1, vocab), ls.sampling).reshape(batch, n + 1, vocab)
    q_BNV = tree.q_BNV
    if q_BNV is None:  # deterministic drafts: one-hot q
      q_BNV = jax.nn.one_hot(tree.tokens_BN, vocab, dtype=jnp.float32)
    on_path_BN, n_acc_B, _, next_B = rejection.verify_tree_sampled(
      keys_B, logp_BSV, tree.tokens_BN, tree.parent_BN, q_BNV, valid_BN
    )
  # The path's nodes in depth order (ancestors have lower indices), then the rest.
  order_BN = jnp.argsort(~on_path_BN, axis=1, stable=True).astype(jnp.int32)
  j_N = jnp.arange(n, dtype=jnp.int32)
  source_BN = jnp.where(j_N[None] < n_acc_B[:, None], order_BN, j_N[None])
  cache = vout.cache.move_path(pos_B + 1, source_BN, key_major=config.attention_type != "mla")
  path_tokens_BD = jnp.take_along_axis(tree.tokens_BN, order_BN[:, :depth_max], axis=1)
  j_S = jnp.arange(depth_max + 1, dtype=jnp.int32)
  cand_BS = jnp.where(j_S[None] < n_acc_B[:, None], jnp.pad(path_tokens_BD, ((0, 0), (0, 1))), next_B[:, None])
  quality_3 = None
  if ls.measure_quality:  # how far the budget moved the verified logits
    exact_logits_BSV = target_pass(None).logits
    on_path_BS = jnp.concatenate([jnp.ones((batch, 1), jnp.bool_), on_path_BN], axis=1)
    agree, kl, count = quality_lib.logit_agreement(
      exact_logits_BSV.reshape(-1, vocab), vout.logits.reshape(-1, vocab), (active_BS & on_path_BS).reshape(-1)
    )
    quality_3 = jnp.stack([agree, kl, count])
  # The chain view for drafters: the path's hidden states and positions, root first.
  path_index_BS = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), order_BN[:, :depth_max] + 1], axis=1)
  path_hidden_BSD = jnp.take_along_axis(vout.hidden, path_index_BS[..., None], axis=1)
  return Verified(
    tree=tree,
    pos_B=pos_B,
    positions_BS=pos_B[:, None] + j_S[None],
    active_B=active_B,
    experts_BS=experts_BS,
    output=vout.replace(cache=cache, hidden=path_hidden_BSD),
    accept_BN=j_S[None, :depth_max] < n_acc_B[:, None],
    n_accepted_B=n_acc_B,
    next_B=next_B,
    candidates_BS=cand_BS,
    quality_3=quality_3,
  )


def commit_counts(
  cand_BS: jax.Array, n_acc_B: jax.Array, active_B: jax.Array, gen_B: jax.Array, eos_id: int, max_new_tokens: int
) -> tuple[jax.Array, jax.Array]:
  """How many of the pass's candidate tokens each row keeps (EOS and max_new_tokens cut).

  `cand_BS` holds [d_1..d_a, y, ...]: the a accepted drafts then the sampled token.
  Returns (n_commit_B, hit_eos_B).
  """
  s = cand_BS.shape[1]
  j_S = jnp.arange(s, dtype=jnp.int32)
  is_eos_BS = (cand_BS == eos_id) & (j_S[None] <= n_acc_B[:, None])
  first_eos_B = jnp.min(jnp.where(is_eos_BS, j_S[None], s), axis=1)
  n_B = jnp.minimum(jnp.minimum(n_acc_B + 1, first_eos_B + 1), max_new_tokens - gen_B)
  n_B = jnp.where(active_B, n_B, 0)
  return n_B, active_B & (first_eos_B < n_B)


def commit(state: LoopState, verified: Verified, eos_id: int, ls: LoopSpec) -> tuple[LoopState, jax.Array]:
  """Writes each row's kept tokens, moves its position past them (the cache entries beyond are
  stale: rolled back by position) and marks finished rows; also returns n_commit_B."""
  cand_BS, active_B, gen_B = verified.candidates_BS, verified.active_B, state.generated_B
  n_commit_B, hit_eos_B = commit_counts(cand_BS, verified.n_accepted_B, active_B, gen_B, eos_id, ls.max_new_tokens)
  j_S = jnp.arange(cand_BS.shape[1], dtype=jnp.int32)
  write_BS = jnp.where(j_S[None] < n_commit_B[:, None], cand_BS, -1)
  new_gen_B = gen_B + n_commit_B
  return state.replace(
    cache=verified.output.cache,
    pos_B=jnp.where(active_B, state.pos_B + verified.n_accepted_B + 1, state.pos_B),
    pending_B=jnp.where(active_B, verified.next_B, state.pending_B),
    generated_B=new_gen_B,
    done_B=state.done_B | hit_eos_B | (new_gen_B >= ls.max_new_tokens),
    out_BN=cache_lib.write_rows(state.out_BN, write_BS, gen_B),
  ), n_commit_B


def _count_unique_experts(expert_ids_LBTK: jax.Array, active_BT: jax.Array, n_experts: int) -> jax.Array:
  """Per MoE layer, the number of distinct experts chosen by the active (row, token) pairs: the
  experts the pass reads (finished rows and empty draft slots read none)."""
  hit_LBTKE = jax.nn.one_hot(expert_ids_LBTK, n_experts, dtype=jnp.bool_)
  hit_LBTKE = hit_LBTKE & active_BT[None, :, :, None, None]
  return jnp.sum(jnp.any(hit_LBTKE, axis=(1, 2, 3)), axis=-1).astype(jnp.float32)


def _rank_loads(expert_ids_LBTK: jax.Array, active_BT: jax.Array, n_experts: int, n_ranks: int):
  """Per expert rank (contiguous experts), summed over the MoE layers: the active (row, token,
  slot) pairs routed to it [R], the distinct experts it reads [R], and the slowest rank's pairs over
  the mean rank's (a layer with no pair counts as balanced)."""
  hit_LBTKE = jax.nn.one_hot(expert_ids_LBTK, n_experts, dtype=jnp.float32)
  hit_LBTKE = hit_LBTKE * active_BT[None, :, :, None, None]
  pairs_LE = jnp.sum(hit_LBTKE, axis=(1, 2, 3))
  n_layers = pairs_LE.shape[0]
  load_LR = pairs_LE.reshape(n_layers, n_ranks, -1).sum(-1)
  unique_LR = (pairs_LE > 0).reshape(n_layers, n_ranks, -1).sum(-1).astype(jnp.float32)
  mean_L = jnp.mean(load_LR, axis=-1)
  imbalance_L = jnp.where(mean_L > 0, jnp.max(load_LR, axis=-1) / jnp.maximum(mean_L, 1e-9), 1.0)
  return jnp.sum(load_LR, 0), jnp.sum(unique_LR, 0), jnp.sum(imbalance_L)


def _record_evidence(stats: Stats, verified: Verified, reached_BK: jax.Array, ls: LoopSpec) -> Stats:
  """Auto K's evidence from a drafting pass, or a plain pass's shadow drafts: each row that brings
  some decays all its counts (every depth's too) and adds its own. An empty draft slot (no
  n-gram match) costs a verified position like a rejected draft."""
  accept_BK = verified.accept_BN
  if verified.tree.num_nodes:
    tried_B = jnp.sum(reached_BK, axis=1).astype(jnp.float32)
    accepted_B = jnp.sum(reached_BK & accept_BK, axis=1).astype(jnp.float32)
  else:
    tried_B = verified.shadow_valid_B.astype(jnp.float32)
    accepted_B = jnp.where(verified.shadow_valid_B, verified.shadow_accept_B, 0.0)
  brings_B = tried_B > 0
  evidence_B2 = stats.acceptance_evidence_B2
  stats = stats.replace(
    acceptance_evidence_B2=jnp.where(
      brings_B[:, None], auto_draft.EVIDENCE_DECAY * evidence_B2 + jnp.stack([accepted_B, tried_B], 1), evidence_B2
    )
  )
  if not ls.drafter.per_depth:
    return stats
  if verified.tree.num_nodes:
    depth_BK2 = jnp.stack([(reached_BK & accept_BK), reached_BK], axis=-1).astype(jnp.float32)
  else:  # shadow drafts at depth 0
    depth_BK2 = jnp.stack([accepted_B, tried_B], axis=-1)[:, None]
  depth_BK2 = jnp.pad(depth_BK2, ((0, 0), (0, ls.max_k - depth_BK2.shape[1]), (0, 0)))
  depth_evidence_BK2 = stats.depth_evidence_BK2
  return stats.replace(
    depth_evidence_BK2=jnp.where(
      brings_B[:, None, None], auto_draft.EVIDENCE_DECAY * depth_evidence_BK2 + depth_BK2, depth_evidence_BK2
    )
  )


def record(
  state: LoopState,
  verified: Verified,
  n_commit_B: jax.Array,
  config: ModelConfig,
  ls: LoopSpec,
  started_2: jax.Array | None = None,
) -> LoopState:
  """The pass's statistics over its active rows; with pass_trace, its row of the trace (`started_2`:
  the clock as it began)."""
  stats = state.stats
  # K: the drafts of a chain, the depth of a tree (its statistics are per depth of the path).
  k, active_B, n_acc_B = verified.accept_BN.shape[1], verified.active_B, verified.n_accepted_B
  act = active_B.astype(jnp.float32)
  reached_BK = (jnp.arange(k, dtype=jnp.int32)[None] <= n_acc_B[:, None]) & active_B[:, None]
  pad = (0, ls.max_k - k)
  stats = stats.replace(
    verify_passes=stats.verify_passes + 1,
    row_passes=stats.row_passes + jnp.sum(act),
    accepted_tokens=stats.accepted_tokens + jnp.sum(act * (n_acc_B + 1)),
    reached_K=stats.reached_K + jnp.pad(jnp.sum(reached_BK, axis=0).astype(jnp.float32), pad),
    accepted_K=stats.accepted_K + jnp.pad(jnp.sum(reached_BK & verified.accept_BN, axis=0).astype(jnp.float32), pad),
    passes_by_K=stats.passes_by_K.at[k].add(1.0),
  )
  if ls.auto and (k or verified.shadow_valid_B is not None):  # auto K's evidence (fixed K reads none of it)
    stats = _record_evidence(stats, verified, reached_BK, ls)
  if verified.quality_3 is not None:
    stats = stats.replace(quality_3=stats.quality_3 + verified.quality_3)
  unique_L = jnp.zeros((config.n_moe_layers,), jnp.float32)
  if config.n_moe_layers:
    unique_L = _count_unique_experts(verified.output.routing.expert_ids, verified.experts_BS, config.n_routed_experts)
    stats = stats.replace(unique_L=stats.unique_L + unique_L)
    if ls.kernels.experts is not None:
      load_R, rank_unique_R, imbalance = _rank_loads(
        verified.output.routing.expert_ids, verified.experts_BS, config.n_routed_experts, ls.kernels.experts.n_ranks
      )
      stats = stats.replace(
        rank_load_R=stats.rank_load_R + load_R,
        rank_unique_R=stats.rank_unique_R + rank_unique_R,
        rank_imbalance=stats.rank_imbalance + imbalance,
      )
  if ls.tree_nodes and verified.tree.num_nodes:
    valid_nodes = jnp.sum(verified.tree.valid_BN & active_B[:, None]).astype(jnp.float32)
    stats = stats.replace(verified_nodes=stats.verified_nodes + valid_nodes)
  if verified.tree.predicted_unique_L is not None:
    stats = stats.replace(predicted_unique_L=stats.predicted_unique_L + verified.tree.predicted_unique_L)
  if ls.trace_passes:  # passes past the trace's rows (the calibration's loops) are not recorded
    row_4 = jnp.stack(
      [
        cpu_ffi.elapsed_ms(stats.trace_clock_2, started_2),
        jnp.float32(verified.tree.num_nodes),
        jnp.sum(n_commit_B).astype(jnp.float32),
        jnp.sum(unique_L),
      ]
    )
    stats = stats.replace(pass_trace_P4=stats.pass_trace_P4.at[state.step - 1].set(row_4, mode="drop"))
  return state.replace(stats=stats)


def cache_on_rows(cache: Any, ls: LoopSpec) -> Any:
  """On a mesh with a data axis, the KV cache's rows (every leaf's leading axis: rows, or rows x
  heads) sharded on it: each data shard holds its own rows' cache. Elsewhere the cache as it is."""
  experts = ls.kernels.experts
  if experts is None or experts.n_data == 1:
    return cache
  rows = NamedSharding(experts.mesh, PartitionSpec(experts.data_axis))
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, rows), cache)


def speculative_pass(model: ProgramTarget, state: LoopState, k: int, ls: LoopSpec) -> LoopState:
  """One speculative pass with K = k drafts: draft, verify k + 1 tokens, commit, update the
  drafter, record."""
  started_2 = None
  if ls.trace_passes:  # everything of the pass before (a loop iteration) is done by now
    pos_B, started_2 = cpu_ffi.clock_after(state.pos_B)
    state = state.replace(pos_B=pos_B)
  split = jax.vmap(lambda key: jax.random.split(key, 2))(stream_keys(state.row_keys_B, state.step))
  state, tree, shadow = draft(model, state, k, split[:, 0], ls)
  verified = verify(model, state, tree, shadow, split[:, 1], ls)
  state, n_commit_B = commit(state, verified, model.config.eos_id, ls)
  state = state.replace(draft_state=ls.drafter.update(model, state.draft_state, verified, ls))
  state = record(state, verified, n_commit_B, model.config, ls, started_2)
  return state.replace(step=state.step + 1, cache=cache_on_rows(state.cache, ls))


def start_trace(state: LoopState, ls: LoopSpec) -> LoopState:
  """pass_trace: the clock once the prefill and first token are done (passes' times count from
  it). Read after the first tokens: the rows' positions are the prompts' lengths, known before
  the prefill."""
  if not ls.trace_passes:
    return state
  pending_B, now_2 = cpu_ffi.clock_after(state.pending_B)
  return state.replace(pending_B=pending_B, stats=state.stats.replace(trace_clock_2=now_2))


def end_trace(state: LoopState, ls: LoopSpec) -> LoopState:
  """pass_trace: the clock once the loop is done (the last pass's end)."""
  if not ls.trace_passes:
    return state
  pos_B, now_2 = cpu_ffi.clock_after(state.pos_B)
  end_ms_1 = cpu_ffi.elapsed_ms(state.stats.trace_clock_2, now_2)[None]
  return state.replace(pos_B=pos_B, stats=state.stats.replace(trace_end_ms_1=end_ms_1))


def cache_room(pos_B: jax.Array, done_B: jax.Array, cache_len: int) -> jax.Array:
  """Positions left in the cache after the furthest active row's pending token."""
  return jnp.min(jnp.where(done_B, cache_len, cache_len - 1 - pos_B))


def _run_passes(
  model: ProgramTarget,
  state: LoopState,
  k: int,
  run_k: jax.Array,
  n_passes: jax.Array,
  ls: LoopSpec,
  pays_at: jax.Array | None = None,
) -> LoopState:
  """Up to `n_passes` passes with K = k when `run_k == k` (none otherwise), stopping early
  when every row is done, when the cache has no room for k drafts (auto K's cache has no
  lookahead beyond max_new_tokens), or after a drafting pass in which no active row accepted a
  draft: its evidence is read at once (prompt lookup's runs end abruptly, and at a long K each
  pass past a run's end costs several plain passes). A plain segment of a drafter with shadow
  drafts ends early once some row's optimistic pooled acceptance reaches `pays_at`, the geometric
  rate at which drafting would pay (`auto_draft.drafting_pays_at`): plain segments can then be
  long (each choice of K costs about a plain pass) without holding K = 0 where drafting pays
  again. The check is a trigger, not the choice: `choose_k` then decides, with a per-depth
  drafter's acceptance by depth where it has them."""

  def cond(loop: tuple[LoopState, jax.Array, jax.Array]):
    s, i, ended = loop
    room = cache_room(s.pos_B, s.done_B, ls.cache_len) >= k
    return (run_k == k) & (i < n_passes) & ~jnp.all(s.done_B) & room & ~ended

  def body(loop: tuple[LoopState, jax.Array, jax.Array]):
    s, i, _ = loop
    after = speculative_pass(model, s, k, ls)
    if k:  # no draft accepted
      ended = jnp.sum(after.stats.accepted_K) == jnp.sum(s.stats.accepted_K)
    elif pays_at is not None:  # the shadow drafts' evidence says drafting would pay
      a_B = auto_draft.optimistic_acceptance(after.stats.acceptance_evidence_B2)
      ended = jnp.any((a_B >= pays_at) & after.active_B)
    else:
      ended = jnp.bool_(False)
    return after, i + 1, ended

  return jax.lax.while_loop(cond, body, (state, jnp.int32(0), jnp.bool_(False)))[0]


def auto_segment(model: ProgramTarget, state: LoopState, step_ms_K: jax.Array, ls: LoopSpec) -> LoopState:
  """A few passes at the K the cost model chooses from the rows' running acceptance estimates
  and remaining tokens (the batch finishes with its slowest row).

  One inner `while_loop` per K, in sequence, of which only the chosen one iterates: unlike a
  `lax.switch`, whose branches copy the carry (the KV caches included) on this backend, loops
  update the state in place.
  """
  stats, drafter = state.stats, ls.drafter
  if ls.timed:  # the last segment's time per pass corrects its K's calibrated time
    pos_B, now_2 = cpu_ffi.clock_after(state.pos_B)
    started = stats.segment_start_passes
    passes = jnp.where(started >= 0, stats.verify_passes - started, 0)
    timing_K2 = auto_draft.record_pass_time(
      stats.pass_timing_K2, stats.auto_k, passes, cpu_ffi.elapsed_ms(stats.segment_clock_2, now_2), step_ms_K
    )
    stats = stats.replace(pass_timing_K2=timing_K2, segment_clock_2=now_2, segment_start_passes=stats.verify_passes)
    state = state.replace(pos_B=pos_B)
    step_ms_K = auto_draft.corrected_step_ms(step_ms_K, timing_K2)
  remaining_B = jnp.where(state.done_B, 0, ls.max_new_tokens - state.generated_B)
  k, n_passes = auto_draft.choose_k(
    stats.acceptance_evidence_B2,
    step_ms_K,
    remaining_B=remaining_B,
    shadow=drafter.shadows,
    current_k=stats.auto_k,
    depth_evidence_BJ2=stats.depth_evidence_BK2 if drafter.per_depth else None,
  )
  proposes = drafter.has_proposal(state, ls)
  if proposes is not None:  # no active row has anything to verify: plain passes
    k = jnp.where(proposes, k, 0)
    n_passes = jnp.where(proposes, n_passes, auto_draft.PLAIN_SEGMENT_PASSES)
  # Never more drafts than the cache has room for after any active row's position, nor than
  # any row can still commit.
  k = jnp.clip(k, 0, jnp.minimum(cache_room(state.pos_B, state.done_B, ls.cache_len), jnp.max(remaining_B) - 1))
  state = state.replace(stats=stats.replace(auto_k=k))
  pays_at = auto_draft.drafting_pays_at(step_ms_K) if drafter.shadows else None
  for kk in range(ls.max_k + 1):
    state = _run_passes(model, state, kk, k, n_passes, ls, pays_at)
  return state
