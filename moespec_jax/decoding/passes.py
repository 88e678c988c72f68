"""The traced parts of a generation program: its carry (prefill, first token, drafter state,
statistics), one speculative pass (draft K, verify K + 1 in one target pass, exact rejection
sampling or greedy matching, bonus token, rollback by position) and auto K's segment of passes.

Pure functions on explicit state: the model (merged inside the program), the carry (KV caches
included) in, the next carry out; `decoding.loop` runs them under one `lax.while_loop`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from moespec_jax.decoding import quality as quality_lib
from moespec_jax.decoding import auto_draft
from moespec_jax.decoding import drafters as drafters_lib
from moespec_jax.decoding import rejection
from moespec_jax.decoding import sampling as sampling_lib
from moespec_jax.decoding.params import SamplingParams
from moespec_jax.model import cache as cache_lib
from moespec_jax.model import mtp as mtp_lib
from moespec_jax.model.budget import ExpertBudget
from moespec_jax.model.layers import at_index
from pallas_kernels import cpu as cpu_ffi
from pallas_kernels.policy import KernelPolicy


@dataclasses.dataclass(frozen=True)
class LoopSpec:
  """The static choices of one compiled generation program."""
  max_new_tokens: int
  cache_len: int
  sampling: SamplingParams
  kernels: KernelPolicy  # the experts' method; C++ or XLA head, dense projections, attention (`programs.merge`)
  drafter: str  # none | mtp | ngram | controlled
  num_draft: int  # K; with `auto`, the largest K a pass may choose
  auto: bool = False
  timed: bool = False  # auto K corrects its calibration by the loop's own clock (CPU)
  trace_passes: bool = False  # every pass timed by a clock read as it starts (CPU): SpecParams.pass_trace
  expert_budget: ExpertBudget | None = None
  measure_quality: bool = False
  # (routed experts, top-k), (0, 0) for a dense model: the shape of the experts' part of the
  # pass times that auto K's calibration fits (auto_draft.smooth_step_times)
  routing: tuple[int, int] = (0, 0)
  # False only to measure the pass without its routed experts (the cost model's non-expert time):
  # the verification pass reads no routed expert, so its tokens are not the model's.
  routed_experts: bool = True
  # drafter='mtp': the heads' cache holds the last `mtp_prompt_window` prompt positions of each row
  # (0: all of them), at positions shifted down by the row's `dstate["offset"]` (`init_carry`).
  mtp_prompt_window: int = 0


def _count_unique_experts(expert_ids_LBTK, active_BT, n_experts: int):
  """Per MoE layer, the number of distinct experts chosen by the active (row, token) pairs: the
  experts the pass reads (finished rows and empty draft slots read none)."""
  hit_LBTKE = jax.nn.one_hot(expert_ids_LBTK, n_experts, dtype=jnp.bool_)
  hit_LBTKE = hit_LBTKE & active_BT[None, :, :, None, None]
  return jnp.sum(jnp.any(hit_LBTKE, axis=(1, 2, 3)), axis=-1).astype(jnp.float32)


# The controlled drafter's table draws from this stream of each row's key (passes use 0, 1, ...).
CONTROLLED_TABLE_STREAM = 0x7FFFFFFF


def _stream_keys(row_keys_B, stream):
  """Each row's key for one stream of draws: pass `step` (0: the first token), or
  CONTROLLED_TABLE_STREAM."""
  return jax.vmap(lambda k: jax.random.fold_in(k, stream))(row_keys_B)


def row_keys(seed, batch: int):
  """Each row's PRNG key, split from `seed` (uint32) by row index."""
  return jax.random.split(jax.random.key(seed), batch)


@functools.partial(jax.jit, static_argnames=("length", "vocab_size"))
def controlled_draft_table(reference_BN, seed, acceptance, *, length: int, vocab_size: int):
  """The controlled drafter's proposals for output indices 0..length-1 of every row
  (`drafters.controlled_table`, from each row's key's CONTROLLED_TABLE_STREAM), drawn before the
  generation's program: the table is the experiment's apparatus, standing in for a drafter whose
  proposals cost nothing, so its random draws (rolled threefry loops on CPU, about 0.4 ms at
  batch 1) are not timed as part of decoding."""
  ref_BN = jnp.maximum(reference_BN, 0)
  ref_BN = jnp.pad(ref_BN, ((0, 0), (0, max(length - ref_BN.shape[1], 0))))[:, :length]
  keys_B = _stream_keys(row_keys(seed, ref_BN.shape[0]), CONTROLLED_TABLE_STREAM)
  return drafters_lib.controlled_table(ref_BN, keys_B, acceptance, vocab_size)


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


def statistic_shapes(ls: LoopSpec, batch: int, n_moe_layers: int) -> dict[str, tuple[tuple[int, ...], Any]]:
  """Every statistic the loop carries, as (shape, dtype): `init_carry` starts them at zero and
  `loop._unpack_stats` reads the reported ones' shapes here."""
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
      # SpecParams.pass_trace: the clock when the first token is out (`start_trace`); per pass
      # (at most max_new_tokens - 1), [ms from then to the pass's start, K, tokens committed over
      # the rows, distinct experts read summed over the MoE layers]; ms from then to the end of
      # the last pass (`end_trace`).
      "trace_clock": ((2,), i32),
      "pass_trace": ((ls.max_new_tokens if ls.trace_passes else 0, 4), f32),
      "trace_end_ms": ((1,), f32),
  }


def init_carry(model, tokens_BT, lengths_B, seed, draft_inputs, ls: LoopSpec):
  """Prefill, the first token, the drafter's state and zeroed statistics: the loop's carry.
  `seed`: uint32, the PRNG seed (the key is made here: `jax.random.key(seed)` called eagerly
  costs a dispatch per call)."""
  config = model.config
  k_max = ls.num_draft
  batch, prompt_len = tokens_BT.shape
  b_idx = jnp.arange(batch)
  row_keys_B = row_keys(seed, batch)

  cache = model.new_cache(batch, ls.cache_len)
  prompt_BT = jnp.arange(prompt_len, dtype=jnp.int32)[None] < lengths_B[:, None]  # padding reads no experts
  if ls.drafter == "mtp":  # the MTP fill reads the hidden state at the window's prompt positions
    window = ls.mtp_prompt_window or prompt_len
    offset_B = jnp.maximum(lengths_B - window, 0)
    window_BW = offset_B[:, None] + jnp.arange(window, dtype=jnp.int32)[None]
    out = model(tokens_BT, None, cache, kernels=model.kernels, valid_BT=prompt_BT, compute_logits=False,
                fresh_cache=True, hidden_at_B=window_BW if ls.mtp_prompt_window else None)
    last_logits_BV = model.head(at_index(out.hidden, lengths_B - 1 - offset_B), model.kernels)[:, 0]
  else:
    out = model(tokens_BT, None, cache, kernels=model.kernels, valid_BT=prompt_BT, fresh_cache=True,
                hidden_at_B=lengths_B - 1)
    last_logits_BV = out.logits[:, 0]
  first_B = sampling_lib.sample(_stream_keys(row_keys_B, 0), last_logits_BV, ls.sampling)
  out_BN = jnp.full((batch, ls.max_new_tokens + k_max + 1), -1, jnp.int32).at[:, 0].set(first_B)

  dstate = {}
  if ls.drafter == "ngram":
    seq_BS = jnp.zeros((batch, ls.cache_len + k_max + 1), jnp.int32)
    seq_BS = seq_BS.at[:, :prompt_len].set(tokens_BT).at[b_idx, lengths_B].set(first_B)
    dstate = {"seq": seq_BS}
  elif ls.drafter == "mtp":
    # The heads' stream over the window: index j holds prompt position offset + j (RoPE is
    # relative, so shifting a row's positions by a constant leaves its attention unchanged).
    m_total = config.num_mtp_modules
    j_P = jnp.arange(prompt_len + m_total - 1, dtype=jnp.int32)
    shifted_BP = jnp.concatenate([tokens_BT[:, 1:], jnp.zeros((batch, m_total), jnp.int32)], axis=1)
    next_BP = jnp.where(j_P[None] < (lengths_B - 1)[:, None], shifted_BP, first_B[:, None])
    next_BW = at_index(next_BP, offset_B[:, None] + jnp.arange(window + m_total - 1, dtype=jnp.int32)[None])
    positions_BW = jnp.broadcast_to(jnp.arange(window, dtype=jnp.int32), (batch, window))
    h1_BD, logits1_BV, mcache = mtp_lib.fill(model, out.hidden, next_BW, positions_BW,
                                             mtp_lib.new_cache(config, batch, ls.cache_len),
                                             kernels=model.kernels, at_B=lengths_B - 1 - offset_B,
                                             valid_BT=at_index(prompt_BT, window_BW), fresh_cache=True)
    dstate = {"cache": mcache, "h1": h1_BD, "logits1": logits1_BV, "offset": offset_B}
  elif ls.drafter == "controlled":
    dstate = {"table": draft_inputs["table"]}

  stats = {name: jnp.zeros(shape, dtype) for name, (shape, dtype) in
           statistic_shapes(ls, batch, config.n_moe_layers).items()}
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
      model, dstate["cache"], dstate["h1"], dstate["logits1"], carry["pos"] - 1 - dstate["offset"], keys_BK, k,
      ls.sampling, kernels=model.kernels, active_B=~carry["done"])
  return drafts_BK, jnp.ones((batch, k), jnp.bool_), q_BKV, dict(dstate, cache=mcache)


def speculative_pass(model, carry, k: int, ls: LoopSpec):
  """One speculative pass with K = k drafts: draft, verify k + 1 tokens, commit, roll back."""
  config = model.config
  vocab, eos, k_max = config.vocab_size, config.eos_id, ls.num_draft
  step = carry["step"]
  pos_B, pend_B, gen_B, done_B = carry["pos"], carry["pending"], carry["gen"], carry["done"]
  batch = pos_B.shape[0]
  if ls.trace_passes:  # everything of the pass before (a loop iteration) is done by now
    pos_B, started_2 = cpu_ffi.clock_after(pos_B)
    carry = dict(carry, pos=pos_B)
  active_B = ~done_B
  keys_B = _stream_keys(carry["row_keys"], step)
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
  experts_BS = active_BS if ls.routed_experts else jnp.zeros_like(active_BS)
  vout = model(inputs_BS, positions_BS, carry["cache"], kernels=model.kernels,
               expert_budget=ls.expert_budget, valid_BT=experts_BS)
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
    h1_BD, logits1_BV, mcache = mtp_lib.fill(model, vout.hidden, next_BT, positions_BS - dstate["offset"][:, None],
                                             dstate["cache"], kernels=model.kernels, at_B=n_acc_B,
                                             valid_BT=kept_BS)
    dstate = dict(dstate, cache=mcache, h1=h1_BD, logits1=logits1_BV)

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
    exact_logits_BSV = model(inputs_BS, positions_BS, carry["cache"], kernels=model.kernels).logits
    used_BS = active_BS & (j_S[None] <= n_acc_B[:, None])
    agree, kl, count = quality_lib.logit_agreement(exact_logits_BSV.reshape(-1, vocab),
                                                   vout.logits.reshape(-1, vocab), used_BS.reshape(-1))
    stats["quality"] = stats["quality"] + jnp.stack([agree, kl, count])
  unique_L = jnp.zeros((config.n_moe_layers,), jnp.float32)
  if config.n_moe_layers:
    unique_L = _count_unique_experts(vout.routing.expert_ids, experts_BS, config.n_routed_experts)
    stats["unique_L"] = stats["unique_L"] + unique_L
  if ls.trace_passes:  # passes past the trace's rows (the calibration's loops) are not recorded
    record = jnp.stack([cpu_ffi.elapsed_ms(stats["trace_clock"], started_2), jnp.float32(k),
                        jnp.sum(n_commit_B).astype(jnp.float32), jnp.sum(unique_L)])
    stats["pass_trace"] = stats["pass_trace"].at[step - 1].set(record, mode="drop")
  return dict(carry, step=step + 1, cache=vout.cache, pos=new_pos_B, pending=new_pend_B, gen=new_gen_B,
              done=new_done_B, out=out_BN, dstate=dstate, stats=stats)


def start_trace(carry, ls: LoopSpec):
  """SpecParams.pass_trace: the clock once the prefill and first token are done (passes'
  times count from it). Read after the first tokens: the rows' positions are the prompts'
  lengths, known before the prefill."""
  if not ls.trace_passes:
    return carry
  pending_B, now_2 = cpu_ffi.clock_after(carry["pending"])
  return dict(carry, pending=pending_B, stats=dict(carry["stats"], trace_clock=now_2))


def end_trace(carry, ls: LoopSpec):
  """SpecParams.pass_trace: the clock once the loop is done (the last pass's end)."""
  if not ls.trace_passes:
    return carry
  pos_B, now_2 = cpu_ffi.clock_after(carry["pos"])
  end_ms = cpu_ffi.elapsed_ms(carry["stats"]["trace_clock"], now_2)[None]
  return dict(carry, pos=pos_B, stats=dict(carry["stats"], trace_end_ms=end_ms))


def cache_room(carry, cache_len: int):
  """Positions left in the cache after the furthest active row's pending token."""
  return jnp.min(jnp.where(carry["done"], cache_len, cache_len - 1 - carry["pos"]))


def _run_passes(model, carry, k: int, run_k, n_passes, ls: LoopSpec):
  """Up to `n_passes` passes with K = k when `run_k == k` (none otherwise), stopping early
  when every row is done or when the cache has no room for k drafts (auto K's cache has no
  lookahead beyond max_new_tokens)."""
  def cond(state):
    c, i = state
    return (run_k == k) & (i < n_passes) & ~jnp.all(c["done"]) & (cache_room(c, ls.cache_len) >= k)

  def body(state):
    c, i = state
    return speculative_pass(model, c, k, ls), i + 1

  return jax.lax.while_loop(cond, body, (carry, jnp.int32(0)))[0]


def auto_segment(model, carry, step_ms_K, ls: LoopSpec):
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
  k = jnp.clip(k, 0, jnp.minimum(cache_room(carry, ls.cache_len), jnp.max(remaining_B) - 1))
  carry = dict(carry, stats=dict(stats, auto_k=k))
  for kk in range(ls.num_draft + 1):
    carry = _run_passes(model, carry, kk, k, n_passes, ls)
  return carry
