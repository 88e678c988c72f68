"""Generation: validation, then one compiled program per call shape: prefill and one
`lax.while_loop` of speculative passes (draft K, verify K+1 in one target pass, exact rejection
sampling or greedy matching, bonus token, rollback by position). `drafter="none"` is plain
decoding through the same loop with K = 0.

Params and the KV caches are explicit pytrees; the NNX module is merged inside the jit.
Every row has its own PRNG key (folded with the pass index), its own position and accepted
count; a row stops at its first committed EOS or after exactly max_new_tokens tokens.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moespec_jax.analysis import quality as quality_lib
from moespec_jax.decoding import drafters as drafters_lib
from moespec_jax.decoding import rejection
from moespec_jax.decoding import sampling as sampling_lib
from moespec_jax.decoding.params import SamplingParams, SpecParams
from moespec_jax.model import cache as cache_lib
from moespec_jax.model import mtp as mtp_lib
from moespec_jax.model.budget import ExpertBudget


@dataclasses.dataclass
class GenerateOutput:
  tokens: np.ndarray  # int32 [B, max_new_tokens]; -1 after a row's EOS
  stats: dict[str, Any]


def _bucket(n: int, minimum: int = 8) -> int:
  """Rounds up to a power of two so that nearby shapes share one compiled program."""
  return max(minimum, 1 << math.ceil(math.log2(max(n, 1))))


def encode_prompts(prompts, tokenizer, vocab_size: int, eos_id: int) -> list[list[int]]:
  """Validates prompts (strings or token-id lists) and returns token-id lists.

  A string prompt is encoded by the tokenizer and preceded by the EOS token, the document
  boundary the model saw in training.
  """
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
    raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
  out = []
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      if not p:
        raise ValueError(f"prompts[{i}] is an empty string")
      ids = [eos_id] + list(tokenizer.encode(p))
    else:
      ids = [int(t) for t in np.asarray(p).reshape(-1)] if len(p) else []
      if not ids:
        raise ValueError(f"prompts[{i}] is empty")
      bad = [t for t in ids if not 0 <= t < vocab_size]
      if bad:
        raise ValueError(f"prompts[{i}] has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    out.append(ids)
  return out


def _count_unique_experts(expert_ids_LBTK, active_BT, n_experts: int):
  """Per MoE layer, the number of distinct experts chosen by the active (row, token) pairs."""
  hit_LBTKE = jax.nn.one_hot(expert_ids_LBTK, n_experts, dtype=jnp.bool_)
  hit_LBTKE = hit_LBTKE & active_BT[None, :, :, None, None]
  return jnp.sum(jnp.any(hit_LBTKE, axis=(1, 2, 3)), axis=-1).astype(jnp.float32)


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


def _generate_spec(graphdef, state, tokens_BT, lengths_B, key, *, max_new_tokens: int,
                   cache_len: int, sampling: SamplingParams, expert_method: str, drafter: str,
                   num_draft: int, expert_budget=None, measure_quality: bool = False):
  """Prefill, then one `lax.while_loop` of draft K / verify K+1 / accept / roll back.

  `drafter="none"` (or K = 0) is plain decoding: each pass verifies the pending token only.
  The pending token (committed, not yet fed to the target) sits at position pos_B; a pass
  feeds [pending, d_1..d_K] at positions [pos, pos+K] and commits a+1 tokens; the cache
  rolls back by position only (entries beyond the committed length are rewritten before any
  query can read them).
  """
  model = nnx.merge(graphdef, state)
  config = model.config
  k_draft = 0 if drafter == "none" else num_draft
  batch, prompt_len = tokens_BT.shape
  vocab, eos = config.vocab_size, config.eos_id
  n_moe = config.n_moe_layers
  row_keys_B = jax.random.split(key, batch)
  b_idx = jnp.arange(batch)

  # Prefill: the prompt, then the first token from the logits at each row's last position.
  cache = model.new_cache(batch, cache_len)
  out = model(tokens_BT, None, cache, expert_method=expert_method)
  last_logits_BV = out.logits[b_idx, lengths_B - 1]
  first_B = sampling_lib.sample(_row_keys(row_keys_B, 0), last_logits_BV, sampling)
  out_BN = jnp.full((batch, max_new_tokens + k_draft + 1), -1, jnp.int32).at[:, 0].set(first_B)
  done_B = (first_B == eos) | (max_new_tokens <= 1)
  gen_B = jnp.ones((batch,), jnp.int32)
  pos_B = lengths_B

  dstate = {}
  if drafter == "ngram":
    seq_BS = jnp.zeros((batch, cache_len + k_draft + 1), jnp.int32)
    seq_BS = seq_BS.at[:, :prompt_len].set(tokens_BT).at[b_idx, lengths_B].set(first_B)
    dstate = {"seq": seq_BS}
  elif drafter == "mtp":
    m_total = config.num_mtp_modules
    j_P = jnp.arange(prompt_len + m_total - 1, dtype=jnp.int32)
    shifted_BP = jnp.concatenate([tokens_BT[:, 1:], jnp.zeros((batch, m_total), jnp.int32)], axis=1)
    next_BP = jnp.where(j_P[None] < (lengths_B - 1)[:, None], shifted_BP, first_B[:, None])
    positions_BP = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
    h_BPD, logits_BPV, mcache = mtp_lib.fill(model, out.hidden, next_BP, positions_BP,
                                             mtp_lib.new_cache(config, batch, cache_len),
                                             expert_method=expert_method)
    dstate = {"cache": mcache, "h1": h_BPD[b_idx, lengths_B - 1], "logits1": logits_BPV[b_idx, lengths_B - 1]}

  stats = {
      "verify_passes": jnp.int32(0),
      "row_passes": jnp.float32(0),
      "accepted_tokens": jnp.float32(0),
      "reached_K": jnp.zeros((k_draft,), jnp.float32),
      "accepted_K": jnp.zeros((k_draft,), jnp.float32),
      "unique_L": jnp.zeros((n_moe,), jnp.float32),
      "quality": jnp.zeros((3,), jnp.float32),  # top-1 agreements, KL sum, positions (budgeted)
  }

  def cond(carry):
    return ~jnp.all(carry["done"])

  def body(carry):
    step = carry["step"]
    pos_B, pend_B, gen_B, done_B = carry["pos"], carry["pending"], carry["gen"], carry["done"]
    dstate, stats = carry["dstate"], carry["stats"]
    active_B = ~done_B
    keys_B = _row_keys(row_keys_B, step)
    split = jax.vmap(lambda k: jax.random.split(k, 2))(keys_B)
    draft_keys_B, verify_keys_B = split[:, 0], split[:, 1]

    # Draft.
    q_BKV = None
    if k_draft == 0:
      drafts_BK = jnp.zeros((batch, 0), jnp.int32)
      valid_BK = jnp.zeros((batch, 0), jnp.bool_)
    elif drafter == "ngram":
      drafts_BK, valid_BK = drafters_lib.ngram_propose(dstate["seq"], pos_B + 1, k_draft)
      if not sampling.greedy:
        q_BKV = jax.nn.one_hot(drafts_BK, vocab, dtype=jnp.float32)
    else:
      keys_BK = jax.vmap(lambda k: jax.random.split(k, k_draft))(draft_keys_B)
      drafts_BK, q_BKV, mcache = drafters_lib.mtp_propose(
          model, dstate["cache"], dstate["h1"], dstate["logits1"], pos_B - 1, keys_BK, k_draft,
          sampling, expert_method=expert_method)
      dstate = dict(dstate, cache=mcache)
      valid_BK = jnp.ones((batch, k_draft), jnp.bool_)

    # Verify K + 1 tokens in one target pass.
    inputs_BS = jnp.concatenate([pend_B[:, None], drafts_BK], axis=1)
    positions_BS = pos_B[:, None] + jnp.arange(k_draft + 1, dtype=jnp.int32)[None]
    active_BS = jnp.broadcast_to(active_B[:, None], inputs_BS.shape)
    vout = model(inputs_BS, positions_BS, carry["cache"], expert_method=expert_method,
                 expert_budget=expert_budget, valid_BT=active_BS)
    if sampling.greedy:
      accept_BK, n_acc_B, next_B = rejection.verify_greedy(vout.logits, drafts_BK, valid_BK)
    else:
      logp_BSV = sampling_lib.filtered_logprobs(vout.logits.reshape(-1, vocab), sampling)
      logp_BSV = logp_BSV.reshape(batch, k_draft + 1, vocab)
      if q_BKV is None:
        q_BKV = jnp.zeros((batch, 0, vocab), jnp.float32)
      accept_BK, n_acc_B, next_B = rejection.verify_sampled(verify_keys_B, logp_BSV, drafts_BK,
                                                            q_BKV, valid_BK)

    # Commit [d_1..d_a, y], cut at EOS and at max_new_tokens.
    j_S = jnp.arange(k_draft + 1, dtype=jnp.int32)
    drafts_pad_BS = jnp.concatenate([drafts_BK, jnp.zeros((batch, 1), jnp.int32)], axis=1)
    cand_BS = jnp.where(j_S[None] < n_acc_B[:, None], drafts_pad_BS, next_B[:, None])
    n_commit_B, hit_eos_B = _commit(cand_BS, n_acc_B, active_B, gen_B, eos, max_new_tokens)
    write_BS = jnp.where(j_S[None] < n_commit_B[:, None], cand_BS, -1)
    out_BN = cache_lib.write_rows(carry["out"][..., None], write_BS[..., None], gen_B)[..., 0]
    new_gen_B = gen_B + n_commit_B
    new_done_B = done_B | hit_eos_B | (new_gen_B >= max_new_tokens)
    new_pos_B = jnp.where(active_B, pos_B + n_acc_B + 1, pos_B)
    new_pend_B = jnp.where(active_B, next_B, pend_B)

    # Drafter state for the next pass.
    if drafter == "ngram" and k_draft:
      seq_BS = cache_lib.write_rows(dstate["seq"][..., None], cand_BS[..., None], pos_B + 1)[..., 0]
      dstate = dict(dstate, seq=seq_BS)
    elif drafter == "mtp" and k_draft:
      m_total = config.num_mtp_modules
      j_T = jnp.arange(k_draft + m_total, dtype=jnp.int32)
      base_BT = jnp.concatenate([drafts_BK, jnp.zeros((batch, m_total), jnp.int32)], axis=1)
      next_BT = jnp.where(j_T[None] < n_acc_B[:, None], base_BT, next_B[:, None])
      h_BSD, logits_BSV, mcache = mtp_lib.fill(model, vout.hidden, next_BT, positions_BS,
                                               dstate["cache"], expert_method=expert_method)
      dstate = {"cache": mcache, "h1": h_BSD[b_idx, n_acc_B], "logits1": logits_BSV[b_idx, n_acc_B]}

    # Statistics over the active rows.
    act = active_B.astype(jnp.float32)
    depth_K = jnp.arange(k_draft, dtype=jnp.int32)
    reached_BK = (depth_K[None] <= n_acc_B[:, None]) & active_B[:, None]
    stats = dict(stats)
    stats["verify_passes"] = stats["verify_passes"] + 1
    stats["row_passes"] = stats["row_passes"] + jnp.sum(act)
    stats["accepted_tokens"] = stats["accepted_tokens"] + jnp.sum(act * (n_acc_B + 1))
    stats["reached_K"] = stats["reached_K"] + jnp.sum(reached_BK, axis=0)
    stats["accepted_K"] = stats["accepted_K"] + jnp.sum(reached_BK & accept_BK, axis=0)
    if measure_quality:
      # The exact pass over the same cache: how far the budget moved the verified logits.
      exact_logits_BSV = model(inputs_BS, positions_BS, carry["cache"], expert_method=expert_method).logits
      used_BS = active_BS & (j_S[None] <= n_acc_B[:, None])
      agree, kl, count = quality_lib.logit_agreement(exact_logits_BSV.reshape(-1, vocab),
                                                     vout.logits.reshape(-1, vocab), used_BS.reshape(-1))
      stats["quality"] = stats["quality"] + jnp.stack([agree, kl, count])
    if n_moe:
      stats["unique_L"] = stats["unique_L"] + _count_unique_experts(
          vout.routing.expert_ids, active_BS, config.n_routed_experts)
    return {"step": step + 1, "cache": vout.cache, "pos": new_pos_B, "pending": new_pend_B,
            "gen": new_gen_B, "done": new_done_B, "out": out_BN, "dstate": dstate, "stats": stats}

  carry = {"step": jnp.int32(1), "cache": out.cache, "pos": pos_B, "pending": first_B, "gen": gen_B,
           "done": done_B, "out": out_BN, "dstate": dstate, "stats": stats}
  carry = jax.lax.while_loop(cond, body, carry)
  return carry["out"][:, :max_new_tokens], carry["stats"]


_COMPILED: dict[Any, Any] = {}


def _compiled(fn, statics: dict, *args):
  """AOT-compiles `fn` once per (statics, argument shapes) so timing excludes compilation."""
  sig = (fn.__name__, tuple(sorted(statics.items())), args[0],
         tuple((a.shape, a.dtype) for a in jax.tree.leaves(args[1:])))
  if sig not in _COMPILED:
    jitted = jax.jit(fn, static_argnums=(0,), static_argnames=tuple(statics))
    _COMPILED[sig] = jitted.lower(*args, **statics).compile()
  return _COMPILED[sig]


def generate(model, prompts, max_new_tokens: int = 64, sampling: SamplingParams | None = None,
             spec: SpecParams | None = None, seed: int = 0) -> GenerateOutput:
  """Generates `max_new_tokens` tokens per prompt (fewer where a row emits EOS: -1 after it)."""
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
  k_draft = 0 if spec.drafter == "none" else spec.num_draft
  if spec.drafter == "mtp" and config.num_mtp_modules == 0:
    raise ValueError("drafter 'mtp' needs MTP heads, but the model has num_mtp_modules=0 "
                     "(train them with experiments.train_mtp, or use drafter='ngram' or 'none')")
  ids = encode_prompts(prompts, model.tokenizer, config.vocab_size, config.eos_id)
  lengths = np.array([len(p) for p in ids], np.int32)
  longest = int(lengths.max())
  if longest + max_new_tokens + k_draft > config.max_seq_len:
    lookahead = f" + num_draft lookahead ({k_draft})" if k_draft else ""
    raise ValueError(
        f"prompt length ({longest}) + max_new_tokens ({max_new_tokens}){lookahead} exceeds the "
        f"model's max_seq_len ({config.max_seq_len})")
  padded_len = min(_bucket(longest), config.max_seq_len)
  cache_len = min(_bucket(longest + max_new_tokens + k_draft, 64), config.max_seq_len)
  tokens = np.zeros((len(ids), padded_len), np.int32)
  for i, p in enumerate(ids):
    tokens[i, :len(p)] = p

  expert_method = model.expert_method(spec.kernel)
  drafter = spec.drafter if k_draft else "none"
  budget = resolve_budget(spec, config)
  statics = dict(max_new_tokens=int(max_new_tokens), cache_len=cache_len, sampling=sampling,
                 expert_method=expert_method, drafter=drafter, num_draft=k_draft,
                 expert_budget=budget, measure_quality=bool(spec.measure_quality and budget is not None))
  args = (model.graphdef, model.state, jnp.asarray(tokens), jnp.asarray(lengths),
          jax.random.key(int(seed)))
  fn = _compiled(_generate_spec, statics, *args)
  start = time.perf_counter()
  tokens_BN, raw = fn(*args[1:])
  tokens_BN = np.asarray(jax.block_until_ready(tokens_BN))
  seconds = time.perf_counter() - start

  raw = jax.tree.map(np.asarray, raw)
  verify_passes = int(raw["verify_passes"])
  row_passes = float(raw["row_passes"])
  generated = int(np.sum(tokens_BN >= 0))
  reached = raw["reached_K"]
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
      "num_draft": k_draft,
      "expert_method": expert_method,
      "mode": spec.mode,
      "approximate": budget is not None,
      "expert_budget": None if budget is None else budget.budget,
  }
  if budget is not None:
    stats["budget_policy"], stats["budget_scope"] = budget.policy, budget.scope
  if statics["measure_quality"]:
    agree, kl, count = (float(x) for x in raw["quality"])
    stats["top1_agreement"] = agree / count if count else float("nan")
    stats["mean_kl"] = kl / count if count else float("nan")
    stats["quality_positions"] = int(count)
  return GenerateOutput(tokens=tokens_BN, stats=stats)


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
