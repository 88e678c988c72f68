"""Generation: validation, then one compiled program per call shape: prefill and one
`lax.while_loop` of speculative passes (draft K, verify K+1 in one target pass, exact rejection
sampling or greedy matching, bonus token, rollback by position). `drafter="none"` is plain
decoding through the same loop with K = 0.

`num_draft="auto"`: every few passes K in 0..max_draft is chosen by the cost model from the
rows' running acceptance estimates and the per-pass times measured for this model, batch and
drafter (`calibrate_step_ms`, once per program) and, with `SpecParams(auto_timing=True)` on
CPU, corrected by the loop's own clock as it decodes (`auto_draft.corrected_step_ms`); one
inner loop per K, of which the chosen one runs. Its cache keeps no lookahead room: K shrinks where the cache ends.

Params and the KV caches are explicit pytrees; the NNX module is merged inside the jit.
Every row has its own PRNG key (folded with the pass index), its own position and accepted
count; a row stops at its first committed EOS or after exactly max_new_tokens tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moespec_jax.analysis import quality as quality_lib
from moespec_jax.decoding import auto_draft
from moespec_jax.decoding import drafters as drafters_lib
from moespec_jax.decoding import rejection
from moespec_jax.decoding import sampling as sampling_lib
from moespec_jax.decoding.params import SamplingParams, SpecParams
from moespec_jax.model import cache as cache_lib
from moespec_jax.model import mtp as mtp_lib
from moespec_jax.model.budget import ExpertBudget
from pallas_kernels import cpu_ffi


@dataclasses.dataclass
class GenerateOutput:
  tokens: np.ndarray  # int32 [B, max_new_tokens]; -1 after a row's EOS
  stats: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class LoopSpec:
  """The static choices of one compiled generation program."""
  max_new_tokens: int
  cache_len: int
  sampling: SamplingParams
  expert_method: str
  drafter: str  # none | mtp | ngram | controlled
  num_draft: int  # K; with `auto`, the largest K a pass may choose
  auto: bool = False
  timed: bool = False  # auto K corrects its calibration by the loop's own clock (CPU)
  expert_budget: ExpertBudget | None = None
  measure_quality: bool = False
  cpu_attention: bool = False  # attention against the cache on the C++ kernel, row-invariant norms (`_merge`)
  # (routed experts, top-k), (0, 0) for a dense model: the shape of the experts' part of the
  # pass times that auto K's calibration fits (auto_draft.smooth_step_times)
  routing: tuple[int, int] = (0, 0)


def _bucket(n: int, minimum: int = 16) -> int:
  """Rounds n up so that nearby shapes share one compiled program: to a multiple of a quarter
  of the power of two below n (at least `minimum`), so at most ~25% of a padded length is
  padding. (Rounding to a power of two doubled the cache an attention pass reads, and the
  prefill, whenever the draft lookahead pushed a length just past one.)"""
  step = max(minimum, (1 << max(int(n), 1).bit_length() - 1) // 4)
  return max(step, -(-int(n) // step) * step)


def encode_prompts(prompts, tokenizer, vocab_size: int, eos_id: int) -> list[np.ndarray]:
  """Validates prompts (strings or token-id lists) and returns them as int32 token-id arrays.

  A string prompt becomes `tokenizer.prompt_ids`: after EOS, the document boundary our models
  saw in training; framed by its own special tokens (e.g. BOS) for an imported checkpoint.
  """
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
    raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
  out = []
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      if not p:
        raise ValueError(f"prompts[{i}] is an empty string")
      ids = np.asarray(list(tokenizer.prompt_ids(p)), np.int32)
    else:
      ids = np.asarray(p).reshape(-1) if len(p) else np.zeros((0,), np.int32)
      if not ids.size:
        raise ValueError(f"prompts[{i}] is empty")
      python_ints = ids.dtype == object and all(
          isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids)  # beyond int64
      if not (np.issubdtype(ids.dtype, np.integer) or python_ints):
        raise ValueError(f"prompts[{i}] must hold integer token ids, got {ids.dtype}")
      bad = (ids < 0) | (ids >= vocab_size)
      if np.any(bad):
        raise ValueError(f"prompts[{i}] has token id {int(ids[np.argmax(bad)])} outside the vocabulary [0, {vocab_size})")
      ids = ids.astype(np.int32)
    out.append(ids)
  return out


def _count_unique_experts(expert_ids_LBTK, active_BT, n_experts: int):
  """Per MoE layer, the number of distinct experts chosen by the active (row, token) pairs: the
  experts the pass reads (finished rows and empty draft slots read none)."""
  hit_LBTKE = jax.nn.one_hot(expert_ids_LBTK, n_experts, dtype=jnp.bool_)
  hit_LBTKE = hit_LBTKE & active_BT[None, :, :, None, None]
  return jnp.sum(jnp.any(hit_LBTKE, axis=(1, 2, 3)), axis=-1).astype(jnp.float32)


# The controlled drafter's table draws from this stream of each row's key (passes use 0, 1, ...).
CONTROLLED_TABLE_STREAM = 0x7FFFFFFF


def _row_keys(row_keys_B, step):
  return jax.vmap(lambda k: jax.random.fold_in(k, step))(row_keys_B)


def _commit(cand_BS, n_acc_B, active_B, gen_B, eos_id: int, max_new_tokens: int):
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


def _statistics(ls: LoopSpec, batch: int, n_moe_layers: int) -> dict[str, tuple[tuple[int, ...], Any]]:
  """Every statistic the loop carries, as (shape, dtype): `_init` starts them at zero and
  `_unpack_stats` reads the reported ones' shapes here."""
  k_max, f32, i32 = ls.num_draft, jnp.float32, jnp.int32
  return {
      "verify_passes": ((), i32),
      "row_passes": ((), f32),
      "accepted_tokens": ((), f32),
      "reached_K": ((k_max,), f32),
      "accepted_K": ((k_max,), f32),
      "unique_L": ((n_moe_layers,), f32),
      "quality": ((3,), f32),  # top-1 agreements, KL sum, positions (budgeted)
      "passes_by_K": ((k_max + 1,), f32),
      # auto K: each row's decayed (accepted, tried) draft counts (shadow drafts included).
      "acceptance_evidence": ((batch, 2), f32),
      # auto K with DEPTH_DRAFTERS: the same per draft depth, (accepted, reached) (shadow drafts
      # at depth 0).
      "depth_evidence": ((batch, k_max, 2), f32),
      "auto_k": ((), i32),  # auto K: the K of the last segment
      # auto K, timed (CPU): per-K evidence of measured / calibrated pass time
      # (auto_draft.record_pass_time), the clock at the last segment's start and the passes run
      # before it (-1: no segment yet).
      "pass_timing": ((k_max + 1, 2), f32),
      "segment_clock": ((2,), i32),
      "segment_start_passes": ((), i32),
  }


def _init(model, tokens_BT, lengths_B, seed, draft_inputs, ls: LoopSpec):
  """Prefill, the first token, the drafter's state and zeroed statistics: the loop's carry.
  `seed`: uint32, the PRNG seed (the key is made here: `jax.random.key(seed)` called eagerly
  costs a dispatch per call)."""
  config = model.config
  k_max = ls.num_draft
  batch, prompt_len = tokens_BT.shape
  b_idx = jnp.arange(batch)
  row_keys_B = jax.random.split(jax.random.key(seed), batch)

  cache = model.new_cache(batch, ls.cache_len)
  prompt_BT = jnp.arange(prompt_len, dtype=jnp.int32)[None] < lengths_B[:, None]  # padding reads no experts
  out = model(tokens_BT, None, cache, expert_method=ls.expert_method, valid_BT=prompt_BT, compute_logits=False,
              fresh_cache=True)
  last_logits_BV = model.head(out.hidden[b_idx, lengths_B - 1][:, None])[:, 0]
  first_B = sampling_lib.sample(_row_keys(row_keys_B, 0), last_logits_BV, ls.sampling)
  out_BN = jnp.full((batch, ls.max_new_tokens + k_max + 1), -1, jnp.int32).at[:, 0].set(first_B)

  dstate = {}
  if ls.drafter == "ngram":
    seq_BS = jnp.zeros((batch, ls.cache_len + k_max + 1), jnp.int32)
    seq_BS = seq_BS.at[:, :prompt_len].set(tokens_BT).at[b_idx, lengths_B].set(first_B)
    dstate = {"seq": seq_BS}
  elif ls.drafter == "mtp":
    m_total = config.num_mtp_modules
    j_P = jnp.arange(prompt_len + m_total - 1, dtype=jnp.int32)
    shifted_BP = jnp.concatenate([tokens_BT[:, 1:], jnp.zeros((batch, m_total), jnp.int32)], axis=1)
    next_BP = jnp.where(j_P[None] < (lengths_B - 1)[:, None], shifted_BP, first_B[:, None])
    positions_BP = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
    h1_BD, logits1_BV, mcache = mtp_lib.fill(model, out.hidden, next_BP, positions_BP,
                                             mtp_lib.new_cache(config, batch, ls.cache_len),
                                             expert_method=ls.expert_method, at_B=lengths_B - 1,
                                             valid_BT=prompt_BT, fresh_cache=True)
    dstate = {"cache": mcache, "h1": h1_BD, "logits1": logits1_BV}
  elif ls.drafter == "controlled":
    ref_BN = jnp.maximum(draft_inputs["reference"], 0)
    pad = ls.max_new_tokens + k_max + 1 - ref_BN.shape[1]
    ref_BN = jnp.pad(ref_BN, ((0, 0), (0, max(pad, 0))))[:, :ls.max_new_tokens + k_max + 1]
    dstate = {"table": drafters_lib.controlled_table(ref_BN, _row_keys(row_keys_B, CONTROLLED_TABLE_STREAM),
                                                     draft_inputs["acceptance"], config.vocab_size)}

  stats = {name: jnp.zeros(shape, dtype) for name, (shape, dtype) in
           _statistics(ls, batch, config.n_moe_layers).items()}
  stats["segment_start_passes"] = jnp.int32(-1)  # no segment yet
  return {"step": jnp.int32(1), "cache": out.cache, "pos": lengths_B, "pending": first_B,
          "gen": jnp.ones((batch,), jnp.int32), "done": (first_B == config.eos_id) | (ls.max_new_tokens <= 1),
          "out": out_BN, "dstate": dstate, "stats": stats, "row_keys": row_keys_B}


def _draft(model, carry, k: int, draft_keys_B, ls: LoopSpec):
  """K drafts per row: (drafts_BK, valid_BK, q_BKV or None, dstate)."""
  batch, vocab = carry["pos"].shape[0], model.config.vocab_size
  dstate = carry["dstate"]
  if k == 0:
    return jnp.zeros((batch, 0), jnp.int32), jnp.zeros((batch, 0), jnp.bool_), None, dstate
  if ls.drafter == "ngram":
    drafts_BK, valid_BK = drafters_lib.ngram_propose(dstate["seq"], carry["pos"] + 1, k)
    q_BKV = None if ls.sampling.greedy else jax.nn.one_hot(drafts_BK, vocab, dtype=jnp.float32)
    return drafts_BK, valid_BK, q_BKV, dstate
  if ls.drafter == "controlled":
    drafts_BK = drafters_lib.controlled_propose(dstate["table"], carry["gen"], k)
    return drafts_BK, jnp.ones((batch, k), jnp.bool_), None, dstate
  keys_BK = jax.vmap(lambda key: jax.random.split(key, k))(draft_keys_B)
  drafts_BK, q_BKV, mcache = drafters_lib.mtp_propose(
      model, dstate["cache"], dstate["h1"], dstate["logits1"], carry["pos"] - 1, keys_BK, k,
      ls.sampling, expert_method=ls.expert_method, active_B=~carry["done"])
  return drafts_BK, jnp.ones((batch, k), jnp.bool_), q_BKV, dict(dstate, cache=mcache)


def _pass(model, carry, k: int, ls: LoopSpec):
  """One speculative pass with K = k drafts: draft, verify k + 1 tokens, commit, roll back."""
  config = model.config
  vocab, eos, k_max = config.vocab_size, config.eos_id, ls.num_draft
  step = carry["step"]
  pos_B, pend_B, gen_B, done_B = carry["pos"], carry["pending"], carry["gen"], carry["done"]
  batch = pos_B.shape[0]
  active_B = ~done_B
  keys_B = _row_keys(carry["row_keys"], step)
  split = jax.vmap(lambda key: jax.random.split(key, 2))(keys_B)
  drafts_BK, valid_BK, q_BKV, dstate = _draft(model, carry, k, split[:, 0], ls)
  shadow = ls.auto and k == 0 and ls.drafter in auto_draft.SHADOW_DRAFTERS
  if shadow:  # the one draft the drafter would have proposed: evidence for auto K, not verified
    shadow_B, shadow_valid_B, _, _ = _draft(model, carry, 1, split[:, 0], ls)
    shadow_B, shadow_valid_B = shadow_B[:, 0], shadow_valid_B[:, 0] & active_B

  # Verify K + 1 tokens in one target pass.
  # Finished rows and empty draft slots (no n-gram follower) read no experts: no output of
  # theirs is used (the n-gram drafter's empty slots are a suffix: no slot after one is reached).
  inputs_BS = jnp.concatenate([pend_B[:, None], drafts_BK], axis=1)
  positions_BS = pos_B[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None]
  active_BS = active_B[:, None] & jnp.concatenate([jnp.ones((batch, 1), jnp.bool_), valid_BK], axis=1)
  vout = model(inputs_BS, positions_BS, carry["cache"], expert_method=ls.expert_method,
               expert_budget=ls.expert_budget, valid_BT=active_BS)
  if ls.sampling.greedy:
    accept_BK, n_acc_B, next_B = rejection.verify_greedy(vout.logits, drafts_BK, valid_BK)
    if shadow:
      shadow_accept_B = (shadow_B == next_B).astype(jnp.float32)
  else:
    logp_BSV = sampling_lib.filtered_logprobs(vout.logits.reshape(-1, vocab), ls.sampling)
    logp_BSV = logp_BSV.reshape(batch, k + 1, vocab)
    if q_BKV is None:
      q_BKV = jnp.zeros((batch, 0, vocab), jnp.float32)
    accept_BK, n_acc_B, next_B = rejection.verify_sampled(split[:, 1], logp_BSV, drafts_BK, q_BKV, valid_BK)
    if shadow:  # a one-hot draft is accepted with probability p(draft)
      shadow_accept_B = jnp.exp(jnp.take_along_axis(logp_BSV[:, 0], shadow_B[:, None], axis=1)[:, 0])

  # Commit [d_1..d_a, y], cut at EOS and at max_new_tokens.
  j_S = jnp.arange(k + 1, dtype=jnp.int32)
  drafts_pad_BS = jnp.concatenate([drafts_BK, jnp.zeros((batch, 1), jnp.int32)], axis=1)
  cand_BS = jnp.where(j_S[None] < n_acc_B[:, None], drafts_pad_BS, next_B[:, None])
  n_commit_B, hit_eos_B = _commit(cand_BS, n_acc_B, active_B, gen_B, eos, ls.max_new_tokens)
  write_BS = jnp.where(j_S[None] < n_commit_B[:, None], cand_BS, -1)
  out_BN = cache_lib.write_rows(carry["out"], write_BS, gen_B)
  new_gen_B = gen_B + n_commit_B
  new_done_B = done_B | hit_eos_B | (new_gen_B >= ls.max_new_tokens)
  new_pos_B = jnp.where(active_B, pos_B + n_acc_B + 1, pos_B)
  new_pend_B = jnp.where(active_B, next_B, pend_B)

  # Drafter state for the next pass. (MTP with K = 0, possible only under auto K, skips the heads:
  # their state goes stale and auto K does not draft with them again.)
  if ls.drafter == "ngram":
    seq_BS = cache_lib.write_rows(dstate["seq"], cand_BS, pos_B + 1)
    dstate = dict(dstate, seq=seq_BS)
  elif ls.drafter == "mtp" and k:
    m_total = config.num_mtp_modules
    j_T = jnp.arange(k + m_total, dtype=jnp.int32)
    base_BT = jnp.concatenate([drafts_BK, jnp.zeros((batch, m_total), jnp.int32)], axis=1)
    next_BT = jnp.where(j_T[None] < n_acc_B[:, None], base_BT, next_B[:, None])
    # Indices past the accepted ones are rolled back: they read no experts.
    kept_BS = active_B[:, None] & (j_S[None] <= n_acc_B[:, None])
    h1_BD, logits1_BV, mcache = mtp_lib.fill(model, vout.hidden, next_BT, positions_BS, dstate["cache"],
                                             expert_method=ls.expert_method, at_B=n_acc_B, valid_BT=kept_BS)
    dstate = {"cache": mcache, "h1": h1_BD, "logits1": logits1_BV}

  # Statistics over the active rows.
  stats = dict(carry["stats"])
  act = active_B.astype(jnp.float32)
  depth_K = jnp.arange(k, dtype=jnp.int32)
  reached_BK = (depth_K[None] <= n_acc_B[:, None]) & active_B[:, None]
  pad = (0, k_max - k)
  stats["verify_passes"] = stats["verify_passes"] + 1
  stats["row_passes"] = stats["row_passes"] + jnp.sum(act)
  stats["accepted_tokens"] = stats["accepted_tokens"] + jnp.sum(act * (n_acc_B + 1))
  stats["reached_K"] = stats["reached_K"] + jnp.pad(jnp.sum(reached_BK, axis=0).astype(jnp.float32), pad)
  stats["accepted_K"] = stats["accepted_K"] + jnp.pad(
      jnp.sum(reached_BK & accept_BK, axis=0).astype(jnp.float32), pad)
  stats["passes_by_K"] = stats["passes_by_K"].at[k].add(1.0)
  if ls.auto and (k or shadow):  # auto K's evidence (fixed K reads none of it)
    if k:  # an empty draft slot (no n-gram match) costs a verified position like a rejected draft
      tried_B = jnp.sum(reached_BK, axis=1).astype(jnp.float32)
      accepted_B = jnp.sum(reached_BK & accept_BK, axis=1).astype(jnp.float32)
    else:
      tried_B = shadow_valid_B.astype(jnp.float32)
      accepted_B = jnp.where(shadow_valid_B, shadow_accept_B, 0.0)
    # A row that brings evidence decays all of its counts, every depth's too.
    brings_B = tried_B > 0
    evidence_B2 = stats["acceptance_evidence"]
    stats["acceptance_evidence"] = jnp.where(
        brings_B[:, None], auto_draft.EVIDENCE_DECAY * evidence_B2 + jnp.stack([accepted_B, tried_B], 1), evidence_B2)
    if ls.drafter in auto_draft.DEPTH_DRAFTERS:
      if k:
        depth_BK2 = jnp.stack([(reached_BK & accept_BK), reached_BK], axis=-1).astype(jnp.float32)
      else:
        depth_BK2 = jnp.stack([accepted_B, tried_B], axis=-1)[:, None]
      depth_BK2 = jnp.pad(depth_BK2, ((0, 0), (0, k_max - depth_BK2.shape[1]), (0, 0)))
      depth_evidence_BK2 = stats["depth_evidence"]
      stats["depth_evidence"] = jnp.where(
          brings_B[:, None, None], auto_draft.EVIDENCE_DECAY * depth_evidence_BK2 + depth_BK2, depth_evidence_BK2)
  if ls.measure_quality:
    # The exact pass over the same cache: how far the budget moved the verified logits.
    exact_logits_BSV = model(inputs_BS, positions_BS, carry["cache"], expert_method=ls.expert_method).logits
    used_BS = active_BS & (j_S[None] <= n_acc_B[:, None])
    agree, kl, count = quality_lib.logit_agreement(exact_logits_BSV.reshape(-1, vocab),
                                                   vout.logits.reshape(-1, vocab), used_BS.reshape(-1))
    stats["quality"] = stats["quality"] + jnp.stack([agree, kl, count])
  if config.n_moe_layers:
    stats["unique_L"] = stats["unique_L"] + _count_unique_experts(
        vout.routing.expert_ids, active_BS, config.n_routed_experts)
  return dict(carry, step=step + 1, cache=vout.cache, pos=new_pos_B, pending=new_pend_B, gen=new_gen_B,
              done=new_done_B, out=out_BN, dstate=dstate, stats=stats)


def _cache_room(carry, cache_len: int):
  """Positions left in the cache after the furthest active row's pending token."""
  return jnp.min(jnp.where(carry["done"], cache_len, cache_len - 1 - carry["pos"]))


def _run_passes(model, carry, k: int, run_k, n_passes, ls: LoopSpec):
  """Up to `n_passes` passes with K = k when `run_k == k` (none otherwise), stopping early
  when every row is done or when the cache has no room for k drafts (auto K's cache has no
  lookahead beyond max_new_tokens)."""
  def cond(state):
    c, i = state
    return (run_k == k) & (i < n_passes) & ~jnp.all(c["done"]) & (_cache_room(c, ls.cache_len) >= k)

  def body(state):
    c, i = state
    return _pass(model, c, k, ls), i + 1

  return jax.lax.while_loop(cond, body, (carry, jnp.int32(0)))[0]


def _auto_segment(model, carry, step_ms_K, ls: LoopSpec):
  """A few passes at the K the cost model chooses from the rows' running acceptance estimates
  and remaining tokens (the batch finishes with its slowest row).

  One inner `while_loop` per K, in sequence, of which only the chosen one iterates: unlike a
  `lax.switch`, whose branches copy the carry (the KV caches included) on this backend, loops
  update the state in place.
  """
  stats = carry["stats"]
  if ls.timed:  # the last segment's time per pass corrects its K's calibrated time
    pos_B, now_2 = cpu_ffi.clock_after(carry["pos"])
    started = stats["segment_start_passes"]
    passes = jnp.where(started >= 0, stats["verify_passes"] - started, 0)
    timing_K2 = auto_draft.record_pass_time(stats["pass_timing"], stats["auto_k"], passes,
                                            cpu_ffi.elapsed_ms(stats["segment_clock"], now_2), step_ms_K)
    stats = dict(stats, pass_timing=timing_K2, segment_clock=now_2, segment_start_passes=stats["verify_passes"])
    carry = dict(carry, pos=pos_B)
    step_ms_K = auto_draft.corrected_step_ms(step_ms_K, timing_K2)
  remaining_B = jnp.where(carry["done"], 0, ls.max_new_tokens - carry["gen"])
  k, n_passes = auto_draft.choose_k(stats["acceptance_evidence"], step_ms_K, remaining_B=remaining_B,
                                    shadow=ls.drafter in auto_draft.SHADOW_DRAFTERS, current_k=stats["auto_k"],
                                    depth_evidence_BJ2=(stats["depth_evidence"]
                                                        if ls.drafter in auto_draft.DEPTH_DRAFTERS else None))
  if ls.drafter == "ngram":
    # Prompt lookup with no match in any active row has nothing to verify: plain passes.
    _, valid_B1 = drafters_lib.ngram_propose(carry["dstate"]["seq"], carry["pos"] + 1, 1)
    any_match = jnp.any(valid_B1[:, 0] & ~carry["done"])
    k = jnp.where(any_match, k, 0)
    n_passes = jnp.where(any_match, n_passes, auto_draft.NO_MATCH_PASSES)
  # Never more drafts than the cache has room for after any active row's position, nor than
  # any row can still commit.
  k = jnp.clip(k, 0, jnp.minimum(_cache_room(carry, ls.cache_len), jnp.max(remaining_B) - 1))
  carry = dict(carry, stats=dict(stats, auto_k=k))
  for kk in range(ls.num_draft + 1):
    carry = _run_passes(model, carry, kk, k, n_passes, ls)
  return carry


class ModelDefinition:
  """A program's static view of the model: its NNX graphdef and the tree structure of its state,
  which programs take as a flat list of arrays (flattening an NNX State walks it in Python, about
  80 us a time, and a call did so four times). Its hash is computed once: hashing a GraphDef
  walks the whole module tree, and a generate() call looks its program up two to four times
  (about 1 ms of host time per call, 5% of a 64-token batch-1 call on a tiny model). Equal
  definitions (models of the same structure) share programs."""

  __slots__ = ("graphdef", "state_treedef", "_hash")

  def __init__(self, graphdef, state_treedef):
    self.graphdef, self.state_treedef = graphdef, state_treedef
    self._hash = hash((graphdef, state_treedef))

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    return isinstance(other, ModelDefinition) and (self is other or (
        self._hash == other._hash and self.graphdef == other.graphdef and self.state_treedef == other.state_treedef))


# id(graphdef) -> its definition, whose graphdef field keeps the id from being reused.
_DEFINITIONS: dict[int, ModelDefinition] = {}


def _definition(graphdef, state_treedef) -> ModelDefinition:
  """The one definition object per (graphdef object, state structure), hashed once."""
  found = _DEFINITIONS.get(id(graphdef))
  if found is None or found.graphdef is not graphdef or found.state_treedef != state_treedef:
    found = _DEFINITIONS[id(graphdef)] = ModelDefinition(graphdef, state_treedef)
  return found


def _merge(definition: ModelDefinition, params, ls: LoopSpec):
  """The module inside a program. `params`: (the state's leaves, the packed output head or
  None, the packed dense projections or None: see `_decode_params`); `ls.cpu_attention`:
  passes against the cache on the C++ kernel, and norms whose rows do not depend on each other."""
  leaves, packed_head_NDC, packed_dense = params
  model = nnx.merge(definition.graphdef, jax.tree.unflatten(definition.state_treedef, leaves))
  if packed_head_NDC is not None:
    model.packed_head_NDC = nnx.data(packed_head_NDC)
  if packed_dense is not None:
    model.use_packed_dense(packed_dense)
  if ls.cpu_attention:
    model.use_cpu_cached_attention()
    model.use_row_invariant_norms()
  return model


def _decode_params(model, spec: SpecParams, leaves):
  """What the programs take as parameters: the leaves of the model's state (`leaves`:
  `jax.tree.leaves(model.state)`, flattened once per call by the caller) and, on the CPU backend
  with the C++ library, its output head (head_kernel='auto') and its dense projections
  (dense_kernel='auto') packed for `cpu_ffi.packed_matmul`, once per model: a decode step reads
  them from memory, and XLA's dot read the head at a third of the streaming rate and re-packs
  the projections on every multi-row product."""
  return (leaves, model.packed_head() if _cpu_kernels(spec.head_kernel) else None,
          model.packed_dense(leaves) if _cpu_kernels(spec.dense_kernel) else None)


def _cpu_kernels(choice: str) -> bool:
  """Whether a head_kernel / attention_kernel choice runs the C++ kernel here."""
  return choice == "auto" and jax.default_backend() == "cpu" and cpu_ffi.available()


def _generate_spec(definition, params, tokens_BT, lengths_B, seed, draft_inputs, step_ms_K, *, ls: LoopSpec):
  """Prefill, then one `lax.while_loop` of passes; returns (tokens_BN, raw statistics)."""
  model = _merge(definition, params, ls)
  carry = _init(model, tokens_BT, lengths_B, seed, draft_inputs, ls)
  if ls.auto:
    body = lambda c: _auto_segment(model, c, step_ms_K, ls)
  else:
    body = lambda c: _pass(model, c, ls.num_draft if ls.drafter != "none" else 0, ls)
  carry = jax.lax.while_loop(lambda c: ~jnp.all(c["done"]), body, carry)
  return carry["out"][:, :ls.max_new_tokens], _reported_stats(carry["stats"], ls)


def _reported_keys(ls: LoopSpec) -> list[str]:
  """The statistics `_stats` reads for this program."""
  keys = ["verify_passes", "row_passes", "accepted_tokens", "reached_K", "accepted_K", "unique_L"]
  keys += ["passes_by_K", "acceptance_evidence"] if ls.auto else []
  keys += ["pass_timing"] if ls.timed else []
  keys += ["quality"] if ls.measure_quality else []
  return keys


def _reported_stats(stats, ls: LoopSpec) -> jax.Array:
  """The statistics `_stats` reads, raveled into one float32 vector (`_unpack_stats` splits it):
  one copy to the host per call instead of one per statistic (each about 40 us after a run has
  left the processor's caches cold). Counts stay exact in float32 (below 2^24)."""
  return jnp.concatenate([jnp.ravel(stats[k]).astype(jnp.float32) for k in _reported_keys(ls)])


def _unpack_stats(packed, ls: LoopSpec, batch: int, n_moe_layers: int) -> dict[str, np.ndarray]:
  """`_reported_stats`' vector as a dict of arrays in their shapes (`_statistics`)."""
  statistics = _statistics(ls, batch, n_moe_layers)
  packed = np.asarray(packed)
  out, start = {}, 0
  for key in _reported_keys(ls):
    shape = statistics[key][0]
    size = math.prod(shape)
    out[key] = packed[start:start + size].reshape(shape)
    start += size
  if start != packed.size:
    raise AssertionError(f"packed statistics hold {packed.size} values, their layout {start}")
  return out


_COMPILED: dict[Any, Any] = {}


def forget_compiled(keep=frozenset()) -> None:
  """Drops the compiled programs whose signatures are not in `keep` (a set of earlier
  `compiled_signatures()`): a sweep over dozens of programs does not fit in memory otherwise.
  Models that no remaining program or calibration refers to are forgotten too (their
  definitions hold their graphdefs)."""
  for sig in set(_COMPILED) - set(keep):
    del _COMPILED[sig]
  live = {id(_signature_definition(sig)) for sig in (*_COMPILED, *_CALIBRATED)}
  for graphdef_id in [i for i, definition in _DEFINITIONS.items() if id(definition) not in live]:
    del _DEFINITIONS[graphdef_id]
  jax.clear_caches()


def _signature_definition(sig) -> ModelDefinition:
  """The model definition of a program signature, or of a calibration's ((signature,
  acceptance) for the controlled drafter: `calibrate_step_ms`)."""
  return sig[2] if isinstance(sig[0], str) else sig[0][2]


def compiled_signatures() -> frozenset:
  return frozenset(_COMPILED)


def _signature(fn, ls: LoopSpec, definition, *args):
  return (fn.__name__, ls, definition, tuple((a.shape, a.dtype) for a in jax.tree.leaves(args)))


def _compiled(fn, ls: LoopSpec, *args, donate_argnums=()):
  """AOT-compiles `fn` once per (LoopSpec, argument shapes) so timing excludes compilation."""
  sig = _signature(fn, ls, *args)
  if sig not in _COMPILED:
    jitted = jax.jit(fn, static_argnums=(0,), static_argnames=("ls",), donate_argnums=donate_argnums)
    _COMPILED[sig] = jitted.lower(*args, ls=ls).compile()
  return _COMPILED[sig]


def _init_program(definition, params, tokens_BT, lengths_B, seed, draft_inputs, *, ls: LoopSpec):
  return _init(_merge(definition, params, ls), tokens_BT, lengths_B, seed, draft_inputs, ls)


def _passes_program(definition, params, carry, k, n_passes, *, ls: LoopSpec):
  """`n_passes` passes of real decoding with K = k from `carry`; a row that would reach its end
  (or EOS) starts over from its position in `carry`, so that no row ever stops.

  Passes must verify what decoding verifies: replaying the same tokens from the same position
  every pass keeps their experts' weights in the processor's caches, which made drafting passes
  look 25-45% cheaper than in decoding (default model, batch 1 and 8).
  """
  model = _merge(definition, params, ls)
  start = {name: carry[name] for name in ("pos", "pending", "gen", "done")}

  def one_pass(c, kk):
    c = _pass(model, c, kk, ls)
    over_B = c["done"] | (c["gen"] + kk + 1 > ls.max_new_tokens)
    rewound = {name: jnp.where(over_B, start[name], c[name]) for name in ("pos", "pending", "gen")}
    return dict(c, done=start["done"], **rewound)

  for kk in range(ls.num_draft + 1):
    carry = jax.lax.fori_loop(0, jnp.where(k == kk, n_passes, 0), lambda _, c, kk=kk: one_pass(c, kk), carry)
  return carry


# Passes per timed loop: the per-pass time is the difference of the two loops' times over the
# difference in passes, so the program call's fixed cost (dispatch, the carry's buffers) cancels.
# The long loop covers the generation's passes (`calibration_passes`): the first passes after a
# prompt are not typical of the rest. On the default model (batch 1, 128 tokens, controlled drafter
# at a = 0 and 0.4) a long loop of 24 passes put the K = 1..8 pass times at 0.84-0.95 of their
# ratios to a plain pass in decoding (fixed-K programs, the decode phase of whole runs) and its
# plain pass at 1.14x decoding's; one of 127 passes at 0.91-0.99 and 1.03x. Too low a ratio makes
# auto draft where plain decoding is faster.
CALIBRATION_SHORT_PASSES = 4
CALIBRATION_LONG_PASSES = (24, 127)  # at least, at most


def calibration_passes(max_new_tokens: int) -> tuple[int, int]:
  """(short, long) loop lengths of `measure_step_ms` for a generation of max_new_tokens."""
  low, high = CALIBRATION_LONG_PASSES
  return CALIBRATION_SHORT_PASSES, int(min(max(max_new_tokens - 1, low), high))


# Rounds of `calibrate_step_ms`. On the default model (batch 1, controlled drafter at a = 0.2,
# 128 tokens) the smoothed K = 1 / K = 0 pass-time ratios of four calibrations were 1.24-1.37
# with 7 rounds and 1.28-1.39 with 10 (8.6 and 11.9 s, once per program); with 24-pass loops
# they were 1.15-1.23 at 15 rounds (4.3 s): steadier, and low. The MTP drafter's programs take
# longest (128 tokens, 7 rounds: 14 s at batch 1 and 42 s at batch 8, against 8 and 24 s with
# 24-pass loops at 15 rounds).
CALIBRATION_ROUNDS = 7
_CALIBRATED: dict[Any, np.ndarray] = {}


def measure_step_ms(ls: LoopSpec, args, repeats: int = 7) -> np.ndarray:
  """Median time (ms) of one pass for each K in 0..ls.num_draft.

  One pass is what the loop runs per iteration (draft K, verify K + 1, drafter upkeep),
  timed in compiled loops of `calibration_passes(ls.max_new_tokens)` passes (the per-pass time is
  the slope between the two lengths, so the call overhead is not counted) of real decoding after
  the prefill of these prompts (`_passes_program`). K values are interleaved, and each K's time is
  the median of its ratios to K = 0 within a round times the median K = 0 time: what the
  choice of K depends on is these ratios, and a slow spell of the machine that spans a round
  leaves them intact.
  """
  definition, params = args[0], args[1]
  short, long = calibration_passes(ls.max_new_tokens)
  carry0 = jax.block_until_ready(_compiled(_init_program, ls, *args)(*args[1:]))
  run = _compiled(_passes_program, ls, definition, params, carry0, jnp.int32(0), jnp.int32(0),
                  donate_argnums=(2,))

  def timed(k: int, n: int) -> float:
    carry = jax.block_until_ready(jax.tree.map(jnp.copy, carry0))
    k_arr, n_arr = jnp.int32(k), jnp.int32(n)
    start = time.perf_counter()
    jax.block_until_ready(run(params, carry, k_arr, n_arr))
    return time.perf_counter() - start

  for k in range(ls.num_draft + 1):  # warm-up: one program, whatever the loop's length
    timed(k, short)
  times_KR = np.zeros((ls.num_draft + 1, repeats))
  for r in range(repeats):
    for k in range(ls.num_draft + 1):
      times_KR[k, r] = (timed(k, long) - timed(k, short)) * 1e3 / (long - short)
  times_KR = np.maximum(times_KR, 1e-3)  # noise can drive a slope to zero or below: keep ratios finite
  return np.median(times_KR / times_KR[:1], axis=1) * np.median(times_KR[0])


def calibrate_step_ms(ls: LoopSpec, args) -> np.ndarray:
  """`measure_step_ms` smoothed and made non-decreasing in K (`auto_draft.smooth_step_times`),
  once per program (cached, like compilation).

  The controlled drafter's programs are calibrated once per acceptance rate: a pass costs more
  when its drafts are wrong (random tokens route to more distinct experts than the model's
  own continuation), so the pass times at one rate misjudge another.
  """
  # Timed and untimed programs pass alike: they share one calibration.
  sig = _signature(_generate_spec, dataclasses.replace(ls, timed=False), *args)
  if ls.drafter == "controlled":
    draft_inputs = args[-1]  # as _prepare builds them
    sig = (sig, float(draft_inputs["acceptance"]))
  if sig not in _CALIBRATED:
    _CALIBRATED[sig] = auto_draft.smooth_step_times(measure_step_ms(ls, args, CALIBRATION_ROUNDS),
                                                    ls.routing).astype(np.float32)
  return _CALIBRATED[sig]


def _check_controlled(spec: SpecParams, sampling: SamplingParams, reference_tokens, n_rows: int,
                      max_new_tokens: int):
  if spec.drafter != "controlled":
    if reference_tokens is not None:
      raise ValueError("reference_tokens is used by drafter='controlled' only")
    return None
  if not sampling.greedy:
    raise ValueError("drafter='controlled' needs greedy sampling (temperature 0): its acceptance is "
                     "geometric in controlled_acceptance only against the target's greedy tokens")
  if reference_tokens is None:
    raise ValueError("drafter='controlled' needs reference_tokens: the plain greedy output "
                     "(generate(...).tokens) for the same prompts")
  ref = np.asarray(reference_tokens)
  if ref.ndim != 2 or ref.shape[0] != n_rows or ref.shape[1] < max_new_tokens or not np.issubdtype(ref.dtype, np.integer):
    raise ValueError(f"reference_tokens must be an int array [{n_rows}, >= {max_new_tokens}], got "
                     f"shape {ref.shape} and dtype {ref.dtype}")
  return ref[:, :max_new_tokens].astype(np.int32)


def _prepare(model, prompts, max_new_tokens, sampling, spec, seed, reference_tokens):
  """Validates a generate() call; returns its LoopSpec and the compiled program's arguments."""
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
  auto = spec.num_draft == "auto"
  k_draft = 0 if spec.drafter == "none" else (spec.max_draft if auto else spec.num_draft)
  if spec.drafter == "mtp" and config.num_mtp_modules == 0:
    raise ValueError("drafter 'mtp' needs MTP heads, but the model has num_mtp_modules=0 "
                     "(train them with experiments.train_mtp, or use drafter='ngram' or 'none')")
  ids = encode_prompts(prompts, model.tokenizer, config.vocab_size, config.eos_id)
  reference = _check_controlled(spec, sampling, reference_tokens, len(ids), int(max_new_tokens))
  lengths = np.array([len(p) for p in ids], np.int32)
  longest = int(lengths.max())
  # Room in the cache for a pass's drafts beyond the last position; auto K needs none: it
  # drafts only as far as the cache has room (`_auto_segment`).
  lookahead = 0 if auto else k_draft
  if longest + max_new_tokens + lookahead > config.max_seq_len:
    extra = f" + num_draft lookahead ({lookahead})" if lookahead else ""
    raise ValueError(
        f"prompt length ({longest}) + max_new_tokens ({max_new_tokens}){extra} exceeds the "
        f"model's max_seq_len ({config.max_seq_len})")
  padded_len = min(_bucket(longest), config.max_seq_len)
  cache_len = min(_bucket(longest + max_new_tokens + lookahead, 64), config.max_seq_len)
  tokens = np.zeros((len(ids), padded_len), np.int32)
  for i, p in enumerate(ids):
    tokens[i, :len(p)] = p

  budget = resolve_budget(spec, config)
  auto = auto and k_draft > 0
  ls = LoopSpec(max_new_tokens=int(max_new_tokens), cache_len=cache_len, sampling=sampling,
                expert_method=model.expert_method(spec.kernel), drafter=spec.drafter if k_draft else "none",
                num_draft=k_draft, auto=auto, timed=auto and spec.auto_timing and loop_clock_available(),
                expert_budget=budget,
                measure_quality=bool(spec.measure_quality and budget is not None),
                cpu_attention=_cpu_kernels(spec.attention_kernel),
                routing=(config.n_routed_experts, config.top_k) if config.n_moe_layers else (0, 0))
  draft_inputs = {}
  if reference is not None:
    draft_inputs = {"reference": np.asarray(reference, np.int32),
                    "acceptance": np.float32(spec.controlled_acceptance)}
  # Host arrays and a uint32 seed go to the compiled program as they are (an eager jnp.asarray
  # or jax.random.key costs a dispatch each); the seed's low 32 bits, as jax.random.key takes them.
  leaves, state_treedef = jax.tree.flatten(model.state)
  args = (_definition(model.graphdef, state_treedef), _decode_params(model, spec, leaves), tokens, lengths,
          np.asarray(int(seed) & 0xFFFFFFFF, np.uint32), draft_inputs)
  return spec, ls, args


def loop_clock_available() -> bool:
  """Whether compiled programs can read a clock here (CPU backend, C++ library built); where
  not, auto K chooses from its calibration alone (logged once)."""
  if jax.default_backend() == "cpu" and cpu_ffi.available():
    return True
  _warn_no_clock(f"the {jax.default_backend()} backend" if jax.default_backend() != "cpu"
                 else cpu_ffi.unavailable_reason())
  return False


@functools.cache
def _warn_no_clock(reason: str) -> None:
  logging.warning("num_draft='auto' chooses K from calibrated pass times alone: no clock inside "
                  "compiled programs (%s)", reason)


def generate(model, prompts, max_new_tokens: int = 64, sampling: SamplingParams | None = None,
             spec: SpecParams | None = None, seed: int = 0, reference_tokens=None) -> GenerateOutput:
  """Generates `max_new_tokens` tokens per prompt (fewer where a row emits EOS: -1 after it).

  `seed`: the PRNG seed of sampling (its low 32 bits, as `jax.random.key` takes it); each row
  draws from its own stream, split from it by row index.
  `reference_tokens` (drafter='controlled' only): the plain greedy output for these prompts,
  which the controlled drafter proposes with probability `spec.controlled_acceptance`.
  With num_draft='auto', the first call for a program also measures its per-K pass times
  (`calibrate_step_ms`; seconds, like compilation, and excluded from the timing).
  """
  spec, ls, args = _prepare(model, prompts, max_new_tokens, sampling, spec, seed, reference_tokens)
  step_ms_K = calibrate_step_ms(ls, args) if ls.auto else np.zeros((ls.num_draft + 1,), np.float32)
  args = args + (np.asarray(step_ms_K, np.float32),)
  fn = _compiled(_generate_spec, ls, *args)
  start = time.perf_counter()
  tokens_BN, raw = fn(*args[1:])
  tokens_BN = np.asarray(jax.block_until_ready(tokens_BN))
  seconds = time.perf_counter() - start
  raw = _unpack_stats(raw, ls, tokens_BN.shape[0], model.config.n_moe_layers)
  return GenerateOutput(tokens=tokens_BN, stats=_stats(raw, tokens_BN, seconds, spec, ls, step_ms_K))


def step_times_ms(model, prompts, max_new_tokens: int = 64, sampling: SamplingParams | None = None,
                  spec: SpecParams | None = None, reference_tokens=None, repeats: int = 7) -> np.ndarray:
  """Measured time (ms) of one loop pass for each K in 0..K of `spec` (raw medians, not smoothed).

  What `num_draft='auto'` calibrates with (there made non-decreasing); the cost-model
  validation's measured verification time per pass size n = K + 1.
  """
  spec = SpecParams() if spec is None else spec
  if spec.num_draft == "auto":
    spec = dataclasses.replace(spec, num_draft=spec.max_draft)
  _, ls, args = _prepare(model, prompts, max_new_tokens, sampling, spec, 0, reference_tokens)
  return measure_step_ms(ls, args, repeats)


def _stats(raw, tokens_BN, seconds: float, spec: SpecParams, ls: LoopSpec, step_ms_K) -> dict[str, Any]:
  """The public statistics from the program's (`_unpack_stats`)."""
  verify_passes = int(raw["verify_passes"])
  row_passes = float(raw["row_passes"])
  generated = int(np.sum(tokens_BN >= 0))
  reached = raw["reached_K"]
  budget = ls.expert_budget
  stats = {
      "passes": verify_passes + 1,  # the prefill pass included
      "verify_passes": verify_passes,
      "generated_tokens": generated,
      # Tokens committed per verify pass and active row (accepted drafts + 1); 1.0 for plain.
      "mean_accepted_length": float(raw["accepted_tokens"]) / row_passes if row_passes else 1.0,
      # Depth j: P(draft j accepted | drafts 1..j-1 accepted), over active rows' passes.
      "acceptance_by_depth": [float(a / r) if r else float("nan")
                              for a, r in zip(raw["accepted_K"], reached)],
      "tokens_per_second": generated / seconds,
      "seconds": seconds,
      # Distinct experts per MoE layer among the verified tokens of the active rows, per pass.
      "unique_experts_per_pass": (raw["unique_L"] / max(verify_passes, 1)).tolist(),
      "drafter": spec.drafter,
      "num_draft": "auto" if ls.auto else ls.num_draft,
      "expert_method": ls.expert_method,
      "mode": spec.mode,
      "approximate": budget is not None,
      "expert_budget": None if budget is None else budget.budget,
  }
  if ls.auto:
    by_k = raw["passes_by_K"]
    stats["max_draft"] = ls.num_draft
    stats["passes_by_num_draft"] = [int(c) for c in by_k]
    # The K auto chose most often, and the mean K over passes.
    stats["chosen_num_draft"] = int(np.argmax(by_k))
    stats["mean_num_draft"] = float(np.sum(np.arange(by_k.size) * by_k) / max(by_k.sum(), 1))
    stats["calibrated_step_ms"] = [float(t) for t in step_ms_K]
    stats["auto_timing"] = ls.timed
    if ls.timed:  # the pass times auto chose with at the end: calibration corrected by the loop's clock
      stats["corrected_step_ms"] = [float(t) for t in auto_draft.corrected_step_ms(
          jnp.asarray(step_ms_K, jnp.float32), jnp.asarray(raw["pass_timing"]))]
    # The acceptance estimate at the end, pooled over the rows (decayed evidence from drafts
    # and shadow drafts).
    stats["acceptance_estimate"] = float(auto_draft.acceptance_estimate(raw["acceptance_evidence"].sum(0)))
  if budget is not None:
    stats["budget_policy"], stats["budget_scope"] = budget.policy, budget.scope
  if ls.measure_quality:
    agree, kl, count = (float(x) for x in raw["quality"])
    stats["top1_agreement"] = agree / count if count else float("nan")
    stats["mean_kl"] = kl / count if count else float("nan")
    stats["quality_positions"] = int(count)
  return stats


def resolve_budget(spec: SpecParams, config) -> ExpertBudget | None:
  """The verification-pass expert budget of `spec` for this model (None: exact mode).

  expert_budget < top_k is refused; expert_budget >= n_routed_experts cuts nothing and is
  treated as exact mode (bit-identical).
  """
  if spec.mode != "budgeted":
    return None
  if config.n_moe_layers == 0:
    raise ValueError("mode='budgeted' needs a model with MoE layers")
  if spec.expert_budget < config.top_k:
    raise ValueError(f"expert_budget ({spec.expert_budget}) must be >= the model's top_k ({config.top_k})")
  if spec.expert_budget >= config.n_routed_experts:
    return None
  return ExpertBudget(spec.expert_budget, spec.budget_policy, spec.budget_scope)
