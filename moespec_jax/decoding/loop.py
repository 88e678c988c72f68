"""Generation: validation, then one compiled program per call shape: prefill and one
`lax.while_loop` of speculative passes (`decoding.passes`: draft K, verify K+1 in one target
pass, exact rejection sampling or greedy matching, bonus token, rollback by position).
`drafter="none"` is plain decoding through the same loop with K = 0.

`num_draft="auto"`: every few passes K in 0..max_draft is chosen by the cost model from the
rows' running acceptance estimates and the per-pass times measured for this model, batch and
drafter (`calibration.calibrate_step_ms`, once per program: whole runs held at each K) and, with
`SpecParams(auto_timing=True)` on CPU, corrected by the loop's own clock as it decodes
(`auto_draft.corrected_step_ms`); one inner loop per K, of which the chosen one runs. Its cache
keeps no lookahead room: K shrinks where the cache ends.

Params and the KV caches are explicit pytrees; the NNX module is merged inside the jit
(`decoding.programs`). Every row has its own PRNG key (folded with the pass index), its own
position and accepted count; a row stops at its first committed EOS or after exactly
max_new_tokens tokens.
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

from moespec_jax.decoding import auto_draft
from moespec_jax.decoding.calibration import calibrate_step_ms, measure_step_ms, measure_step_variants_ms
from moespec_jax.decoding.params import SamplingParams, SpecParams
from moespec_jax.decoding.passes import (LoopSpec, auto_segment, controlled_draft_table, end_trace, init_carry,
                                         speculative_pass, start_trace, statistic_shapes)
from moespec_jax.decoding.programs import compiled, decode_params, kernel_policy, merge, model_definition
# Re-exported: experiments drop programs between sweeps through the loop's API.
from moespec_jax.decoding.programs import compiled_signatures, forget_compiled  # noqa: F401
from moespec_jax.model.budget import ExpertBudget
from pallas_kernels import cpu as cpu_ffi


@dataclasses.dataclass
class GenerateOutput:
  tokens: np.ndarray  # int32 [B, max_new_tokens]; -1 after a row's EOS
  stats: dict[str, Any]


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


_FULL_RUN = np.bool_(False)  # _generate_spec's prefill_only in generate()


def _generate_spec(definition, params, tokens_BT, lengths_B, seed, draft_inputs, step_ms_K, prefill_only, *,
                   ls: LoopSpec):
  """Prefill, then one `lax.while_loop` of passes; returns (tokens_BN, raw statistics).
  `prefill_only` (a bool): stop after the first token (auto K's calibration times the prefill so)."""
  model = merge(definition, params, ls)
  carry = init_carry(model, tokens_BT, lengths_B, seed, draft_inputs, ls)
  carry = start_trace(dict(carry, done=carry["done"] | prefill_only), ls)
  if ls.auto:
    body = lambda c: auto_segment(model, c, step_ms_K, ls)
  else:
    body = lambda c: speculative_pass(model, c, ls.num_draft if ls.drafter != "none" else 0, ls)
  carry = end_trace(jax.lax.while_loop(lambda c: ~jnp.all(c["done"]), body, carry), ls)
  return carry["out"][:, :ls.max_new_tokens], _reported_stats(carry["stats"], ls)


def _reported_keys(ls: LoopSpec) -> list[str]:
  """The statistics `_stats` reads for this program."""
  keys = ["verify_passes", "row_passes", "accepted_tokens", "reached_K", "accepted_K", "unique_L"]
  keys += ["passes_by_K", "acceptance_evidence"] if ls.auto else []
  keys += ["pass_timing"] if ls.timed else []
  keys += ["pass_trace", "trace_end_ms"] if ls.trace_passes else []
  keys += ["quality"] if ls.measure_quality else []
  return keys


def _reported_stats(stats, ls: LoopSpec) -> jax.Array:
  """The statistics `_stats` reads, raveled into one float32 vector (`_unpack_stats` splits it):
  one copy to the host per call instead of one per statistic (each about 40 us after a run has
  left the processor's caches cold). Counts stay exact in float32 (below 2^24)."""
  return jnp.concatenate([jnp.ravel(stats[k]).astype(jnp.float32) for k in _reported_keys(ls)])


def _unpack_stats(packed, ls: LoopSpec, batch: int, n_moe_layers: int) -> dict[str, np.ndarray]:
  """`_reported_stats`' vector as a dict of arrays in their shapes (`statistic_shapes`)."""
  statistics = statistic_shapes(ls, batch, n_moe_layers)
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
  # drafts only as far as the cache has room (`auto_segment`).
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
  if spec.pass_trace and not (jax.default_backend() == "cpu" and cpu_ffi.available()):
    where = (f"the {jax.default_backend()} backend" if jax.default_backend() != "cpu"
             else cpu_ffi.unavailable_reason())
    raise ValueError(f"pass_trace reads a clock inside the compiled program, which needs the CPU backend "
                     f"and the C++ library; not available here ({where})")
  # 0: the heads read every prompt position (a window as long as the padded prompt is all of it).
  window = spec.mtp_prompt_window if spec.drafter == "mtp" and spec.mtp_prompt_window else 0
  window = window if window < padded_len else 0
  ls = LoopSpec(max_new_tokens=int(max_new_tokens), cache_len=cache_len, sampling=sampling,
                kernels=kernel_policy(model, spec), drafter=spec.drafter if k_draft else "none",
                num_draft=k_draft, auto=auto, timed=auto and spec.auto_timing and loop_clock_available(),
                trace_passes=spec.pass_trace,
                expert_budget=budget,
                measure_quality=bool(spec.measure_quality and budget is not None),
                routing=(config.n_routed_experts, config.top_k) if config.n_moe_layers else (0, 0),
                mtp_prompt_window=window)
  # Host arrays and a uint32 seed go to the compiled program as they are (an eager jnp.asarray
  # or jax.random.key costs a dispatch each); the seed's low 32 bits, as jax.random.key takes them.
  seed_u32 = np.asarray(int(seed) & 0xFFFFFFFF, np.uint32)
  draft_inputs = {}
  # The controlled drafter's table, drawn before the program and fetched to the host (dispatch is
  # asynchronous: a table still being drawn would be timed with the program); its acceptance rate
  # rides along for the calibration's cache key (calibrate_step_ms), the program reads only the table.
  if reference is not None:
    acceptance = np.float32(spec.controlled_acceptance)
    table = controlled_draft_table(np.asarray(reference, np.int32), seed_u32, acceptance,
                                   length=int(max_new_tokens) + k_draft + 1, vocab_size=config.vocab_size)
    draft_inputs = {"table": np.asarray(table), "acceptance": acceptance}
  leaves, state_treedef = jax.tree.flatten(model.state)
  args = (model_definition(model.graphdef, state_treedef), decode_params(model, ls.kernels, leaves), tokens, lengths,
          seed_u32, draft_inputs)
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
  (`calibrate_step_ms`; seconds, like compilation, and excluded from the timing; stats
  "calibration": "held_runs", or "loops" where held runs pass too rarely at some K).
  """
  spec, ls, args = _prepare(model, prompts, max_new_tokens, sampling, spec, seed, reference_tokens)
  batch, n_moe_layers = args[2].shape[0], model.config.n_moe_layers
  step_ms_K, calibration = np.zeros((ls.num_draft + 1,), np.float32), None
  fn = compiled(_generate_spec, ls, *args, step_ms_K, _FULL_RUN)
  if ls.auto:
    def held_run(held_ms_K, prefill_only):
      start = time.perf_counter()
      raw = jax.block_until_ready(fn(*args[1:], held_ms_K, np.bool_(prefill_only))[1])
      seconds = time.perf_counter() - start
      return seconds, _unpack_stats(raw, ls, batch, n_moe_layers)["passes_by_K"]
    calibration = calibrate_step_ms(ls, args, held_run)
    step_ms_K = np.asarray(calibration.step_ms_K, np.float32)
  start = time.perf_counter()
  tokens_BN, raw = fn(*args[1:], step_ms_K, _FULL_RUN)
  tokens_BN = np.asarray(jax.block_until_ready(tokens_BN))
  seconds = time.perf_counter() - start
  raw = _unpack_stats(raw, ls, batch, n_moe_layers)
  return GenerateOutput(tokens=tokens_BN, stats=_stats(raw, tokens_BN, seconds, spec, ls, calibration))


def step_times_ms(model, prompts, max_new_tokens: int = 64, sampling: SamplingParams | None = None,
                  spec: SpecParams | None = None, reference_tokens=None, repeats: int = 7) -> np.ndarray:
  """Measured time (ms) of one loop pass for each K in 0..K of `spec` (raw medians, not smoothed).

  Timed in loops of passes (`calibration.measure_step_ms`; what `num_draft='auto'` calibrates
  with where its held runs pass too rarely at some K); the cost-model validation's measured
  verification time per pass size n = K + 1.
  """
  ls, args = _step_program(model, prompts, max_new_tokens, sampling, spec, reference_tokens)
  return measure_step_ms(ls, args, repeats)


def step_times_with_and_without_experts_ms(model, prompts, max_new_tokens: int = 64,
                                           sampling: SamplingParams | None = None, spec: SpecParams | None = None,
                                           reference_tokens=None, repeats: int = 7) -> tuple[np.ndarray, np.ndarray]:
  """`step_times_ms`, and the same passes with no routed expert read (LoopSpec.routed_experts
  False), timed side by side in the same rounds: the rest of a pass, and by difference the routed
  experts' part as decoding pays it (the cost model's non-expert time)."""
  ls, args = _step_program(model, prompts, max_new_tokens, sampling, spec, reference_tokens)
  with_K, without_K = measure_step_variants_ms([ls, dataclasses.replace(ls, routed_experts=False)], args, repeats)
  return with_K, without_K


def _step_program(model, prompts, max_new_tokens, sampling, spec, reference_tokens):
  """(LoopSpec, arguments) of the program whose passes `step_times_ms` times: auto K at its largest K."""
  spec = SpecParams() if spec is None else spec
  if spec.num_draft == "auto":
    spec = dataclasses.replace(spec, num_draft=spec.max_draft)
  _, ls, args = _prepare(model, prompts, max_new_tokens, sampling, spec, 0, reference_tokens)
  return ls, args


def _stats(raw, tokens_BN, seconds: float, spec: SpecParams, ls: LoopSpec, calibration) -> dict[str, Any]:
  """The public statistics from the program's (`_unpack_stats`); `calibration`: auto K's
  (`calibration.Calibration`), None without auto."""
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
      "expert_method": ls.kernels.expert_method,
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
    step_ms_K = calibration.step_ms_K
    stats["calibrated_step_ms"] = [float(t) for t in step_ms_K]
    stats["calibration"] = calibration.method  # "held_runs" or "loops"
    stats["auto_timing"] = ls.timed
    if ls.timed:  # the pass times auto chose with at the end: calibration corrected by the loop's clock
      stats["corrected_step_ms"] = [float(t) for t in auto_draft.corrected_step_ms(
          jnp.asarray(step_ms_K, jnp.float32), jnp.asarray(raw["pass_timing"]))]
    # The acceptance estimate at the end, pooled over the rows (decayed evidence from drafts
    # and shadow drafts).
    stats["acceptance_estimate"] = float(auto_draft.acceptance_estimate(raw["acceptance_evidence"].sum(0)))
  if ls.trace_passes:
    stats["pass_trace"] = pass_trace(raw["pass_trace"][:verify_passes], float(raw["trace_end_ms"][0]))
  if budget is not None:
    stats["budget_policy"], stats["budget_scope"] = budget.policy, budget.scope
  if ls.measure_quality:
    agree, kl, count = (float(x) for x in raw["quality"])
    stats["top1_agreement"] = agree / count if count else float("nan")
    stats["mean_kl"] = kl / count if count else float("nan")
    stats["quality_positions"] = int(count)
  return stats


def pass_trace(records_P4, end_ms: float) -> dict[str, list]:
  """stats["pass_trace"] from the program's per-pass records ([ms from the first token to the
  pass's start, K, tokens, experts]) and the loop's end: each pass's `ms` (from its start to the
  next pass's, the last to the loop's end: the auto K choices between passes included),
  `num_draft`, `tokens` (committed over the batch's rows) and `experts` (the distinct routed
  experts the pass read, summed over the MoE layers: what its expert bytes scale with)."""
  starts = records_P4[:, 0].astype(np.float64)
  ends = np.append(starts[1:], end_ms)
  return {"ms": (ends - starts).tolist(), "num_draft": records_P4[:, 1].astype(int).tolist(),
          "tokens": records_P4[:, 2].astype(int).tolist(), "experts": records_P4[:, 3].astype(int).tolist()}


def describe_pass_trace(trace: dict[str, list], first: int = 8) -> str:
  """One line of stats["pass_trace"]: the first passes' times, then the median time of the later
  passes at each K, and the total. (Over repeated runs, analysis/pass_times sets the passes'
  times against the experts they read.)"""
  ms, ks = np.asarray(trace["ms"]), np.asarray(trace["num_draft"])
  if not ms.size:
    return "pass times: no passes (every token came from the prefill)"
  head = " ".join(f"{t:.2f}" for t in ms[:first])
  later = ", ".join(f"K={k} {np.median(ms[first:][ks[first:] == k]):.3f} ({np.sum(ks[first:] == k)})"
                    for k in np.unique(ks[first:]))
  return (f"pass times (ms): the first {min(first, ms.size)}: {head}"
          + (f"; later, median at each K (passes): {later}" if later else "")
          + f"; {ms.sum():.2f} ms over {ms.size} passes")


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
