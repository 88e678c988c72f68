"""Generation: validation, then one compiled program per call shape: prefill and one
`lax.while_loop` of speculative passes (`decoding.passes`: draft K, verify K+1 in one target
pass, exact rejection sampling or greedy matching, bonus token, rollback by position).
`drafter="none"` is plain decoding through the same loop with K = 0.

`num_draft="auto"`: every few passes K in 0..max_draft is chosen by the cost model from the
rows' running acceptance estimates and the per-pass times measured for this model, batch and
drafter (`calibration.calibrate_step_ms`, once per program: whole runs held at each K) and, with
`ResearchOptions(auto_timing=True)` on CPU, corrected by the loop's own clock as it decodes
(`auto_draft.corrected_step_ms`); one inner loop per K, of which the chosen one runs. Its cache
keeps no lookahead room: K shrinks where the cache ends.

Params and the KV caches are explicit pytrees; the NNX module is merged inside the jit
(`decoding.programs`); the loop's carry is a typed `state.LoopState`, and the drafter is reached
through its interface only (`drafters.REGISTRY` maps the user's name to it). Every row has its
own PRNG key (folded with the pass index), its own position and accepted count; a row stops at
its first committed EOS or after exactly max_new_tokens tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

from moespec_jax.config import ModelConfig
from moespec_jax.decoding import drafters as drafters_lib
from moespec_jax.decoding import passes, programs, report
from moespec_jax.decoding.calibration import (
  HeldRunResult,
  calibrate_step_ms,
  measure_step_ms,
  measure_step_variants_ms,
)
from moespec_jax.decoding.drafters.none import NoDrafter
from moespec_jax.decoding.params import ResearchOptions, SamplingParams, SpecParams
from moespec_jax.decoding.programs import (
  ModelDefinition,
  ProgramArgs,
  ProgramParams,
  decode_params,
  kernel_policy,
  merge,
)
from moespec_jax.decoding.state import LoopSpec, Stats
from moespec_jax.model.budget import ExpertBudget
from moespec_jax.parallel import mesh as mesh_lib
from pallas_kernels import cpu as cpu_ffi

if TYPE_CHECKING:
  from moespec_jax.data.tokenizer import Tokenizer
  from moespec_jax.model.handle import ModelHandle


# generate()'s prompts: strings (the model's tokenizer encodes them) or token-id lists, mixed or not.
Prompts = Sequence[str | Sequence[int] | np.ndarray]


@dataclasses.dataclass
class GenerateOutput:
  tokens: np.ndarray  # int32 [B, max_new_tokens]; -1 after a row's EOS
  stats: dict[str, Any]


def _bucket(n: int, minimum: int = 16) -> int:
  """Rounds n up so that nearby shapes share one compiled program: to a multiple of a quarter
  of the power of two below n (at least `minimum`), so padding stays under a quarter of a padded
  length. (Rounding to a power of two doubled the cache an attention pass reads, and the
  prefill, whenever the draft lookahead pushed a length just past one.)"""
  step = max(minimum, (1 << max(int(n), 1).bit_length() - 1) // 4)
  return max(step, -(-int(n) // step) * step)


def encode_prompts(prompts: Prompts, tokenizer: Tokenizer, vocab_size: int, eos_id: int) -> list[np.ndarray]:
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
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids
      )  # beyond int64
      if not (np.issubdtype(ids.dtype, np.integer) or python_ints):
        raise ValueError(f"prompts[{i}] must hold integer token ids, got {ids.dtype}")
      bad = (ids < 0) | (ids >= vocab_size)
      if np.any(bad):
        raise ValueError(
          f"prompts[{i}] has token id {int(ids[np.argmax(bad)])} outside the vocabulary [0, {vocab_size})"
        )
      ids = ids.astype(np.int32)
    out.append(ids)
  return out


_FULL_RUN = np.bool_(False)  # _generate_spec's prefill_only in generate()
_NO_PRIOR = np.zeros(2, np.float32)  # _generate_spec's prior_2 where there is no calibration


def _generate_spec(
  definition: ModelDefinition,
  params: ProgramParams,
  tokens_BT: jax.Array,
  lengths_B: jax.Array,
  seed: jax.Array,
  inputs: Any,
  step_ms_K: jax.Array,
  prior_2: jax.Array,
  prefill_only: jax.Array,
  *,
  ls: LoopSpec,
) -> tuple[jax.Array, jax.Array]:
  """Prefill, then one `lax.while_loop` of passes; returns (tokens_BN, the packed statistics).
  Auto K: `step_ms_K` its calibrated pass times, `prior_2` its starting (accepted, tried) counts
  (`Calibration.prior_2`; zeros while calibrating). `prefill_only` (a bool): stop after the first
  token (auto K's calibration times the prefill so)."""
  model = merge(definition, params, ls)
  state = passes.init_state(model, tokens_BT, lengths_B, seed, inputs, ls, step_ms_K, prior_2)
  state = passes.start_trace(state.replace(done_B=state.done_B | prefill_only), ls)
  if ls.auto:
    # A drafter never started (its first choice the final K = 0): plain passes to the end, in
    # the first loop; otherwise segments of auto K, in the second.
    idle = lambda s: ~jnp.all(s.done_B) & (s.stats.drafter_started == 0)
    state = jax.lax.while_loop(idle, lambda s: passes.speculative_pass(model, s, 0, ls), state)
    body = lambda s: passes.auto_segment(model, s, step_ms_K, ls)
  else:
    body = lambda s: passes.speculative_pass(model, s, ls.max_k, ls)
  state = passes.end_trace(jax.lax.while_loop(lambda s: ~jnp.all(s.done_B), body, state), ls)
  return state.out_BN[:, : ls.max_new_tokens], state.stats.pack(ls)


def _prepare(
  model: ModelHandle,
  prompts: Prompts,
  max_new_tokens: int,
  sampling: SamplingParams | None,
  spec: SpecParams | None,
  seed: int,
  reference_tokens: npt.ArrayLike | None,
) -> tuple[SpecParams, LoopSpec, ProgramArgs]:
  """Validates a generate() call; returns its SpecParams, LoopSpec and the compiled program's
  arguments (model definition, parameters, tokens, lengths, seed, the drafter's inputs)."""
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
  config, research = model.config, spec.research
  drafter_cls = drafters_lib.lookup(spec.drafter)
  auto = spec.num_draft == "auto"
  k_draft = (spec.max_draft if auto else spec.num_draft) if drafter_cls.drafts else 0
  ids = encode_prompts(prompts, model.tokenizer, config.vocab_size, config.eos_id)
  if model.mesh is not None:
    mesh_lib.check_rows(len(ids), model.mesh)
  lengths = np.array([len(p) for p in ids], np.int32)
  longest = int(lengths.max())
  padded_len = min(_bucket(longest), config.max_seq_len)
  drafter = drafter_cls.for_call(spec, config=config, sampling=sampling, prompt_len=padded_len)
  if reference_tokens is not None and not drafter_cls.takes_reference:
    takers = " or ".join(f"drafter={name!r}" for name, d in drafters_lib.REGISTRY.items() if d.takes_reference)
    raise ValueError(f"reference_tokens is used by {takers} only")
  # Room in the cache for a pass's drafts beyond the last position; auto K needs none: it
  # drafts only as far as the cache has room (`auto_segment`).
  # A tree pass writes its N nodes after the pending token; a drafter's levels (the MTP heads'
  # frontiers, at most N + D slots) are written after its own stream.
  lookahead = 0 if auto else ((spec.tree_nodes + k_draft) if spec.tree_nodes else k_draft)
  if longest + max_new_tokens + lookahead > config.max_seq_len:
    extra = f" + {'tree_nodes' if spec.tree_nodes else 'num_draft'} lookahead ({lookahead})" if lookahead else ""
    raise ValueError(
      f"prompt length ({longest}) + max_new_tokens ({max_new_tokens}){extra} exceeds the "
      f"model's max_seq_len ({config.max_seq_len})"
    )
  cache_len = min(_bucket(longest + max_new_tokens + lookahead, 64), config.max_seq_len)
  tokens = np.zeros((len(ids), padded_len), np.int32)
  for i, p in enumerate(ids):
    tokens[i, : len(p)] = p

  budget = resolve_budget(spec, config)
  auto = auto and k_draft > 0
  if research.pass_trace and not clock_available():
    raise ValueError(
      f"pass_trace reads a clock inside the compiled program, which needs the CPU backend "
      f"and the C++ library; not available here ({_no_clock_reason()})"
    )
  ls = LoopSpec(
    max_new_tokens=int(max_new_tokens),
    cache_len=cache_len,
    sampling=sampling,
    kernels=kernel_policy(model, spec),
    drafter=drafter if k_draft else NoDrafter(),
    max_k=k_draft,
    tree_nodes=(spec.tree_nodes or 0) if k_draft else 0,
    auto=auto,
    timed=auto and research.auto_timing and loop_clock_available(),
    trace_passes=research.pass_trace,
    expert_budget=budget,
    measure_quality=bool(research.measure_quality and budget is not None),
    routing=(config.n_routed_experts, config.top_k) if config.n_moe_layers else (0, 0),
  )
  # Host arrays and a uint32 seed go to the compiled program as they are (an eager jnp.asarray
  # or jax.random.key costs a dispatch each); the seed's low 32 bits, as jax.random.key takes them.
  seed_u32 = np.asarray(int(seed) & 0xFFFFFFFF, np.uint32)
  inputs = drafter.host_inputs(
    spec,
    model=model,
    reference_tokens=reference_tokens,
    seed_u32=seed_u32,
    n_rows=len(ids),
    max_new_tokens=int(max_new_tokens),
    length=int(max_new_tokens) + k_draft + 1,
    vocab_size=config.vocab_size,
  )
  leaves, state_treedef = jax.tree.flatten(model.state)
  args = (
    programs.PROGRAMS.definition(model.graphdef, state_treedef),
    decode_params(model, ls.kernels, leaves),
    tokens,
    lengths,
    seed_u32,
    inputs if k_draft else None,
  )
  return spec, ls, args


def clock_available() -> bool:
  """Whether compiled programs can read a clock here (the CPU backend, the C++ library built):
  what `ResearchOptions(pass_trace=True)` and auto K's in-loop timing need."""
  return jax.default_backend() == "cpu" and cpu_ffi.available()


def _no_clock_reason() -> str:
  return f"the {jax.default_backend()} backend" if jax.default_backend() != "cpu" else cpu_ffi.unavailable_reason()


def loop_clock_available() -> bool:
  """`clock_available`; where not, auto K chooses from its calibration alone (logged once)."""
  if clock_available():
    return True
  _warn_no_clock(_no_clock_reason())
  return False


@functools.cache
def _warn_no_clock(reason: str) -> None:
  logging.warning(
    "num_draft='auto' chooses K from calibrated pass times alone: no clock inside compiled programs (%s)", reason
  )


def generate(
  model: ModelHandle,
  prompts: Prompts,
  max_new_tokens: int = 64,
  sampling: SamplingParams | None = None,
  spec: SpecParams | None = None,
  seed: int = 0,
  reference_tokens: npt.ArrayLike | None = None,
  progress: Callable[[str], None] | None = None,
) -> GenerateOutput:
  """Generates `max_new_tokens` tokens per prompt (fewer where a row emits EOS: -1 after it).

  `seed`: the PRNG seed of sampling (its low 32 bits, as `jax.random.key` takes it); each row
  draws from its own stream, split from it by row index.
  `reference_tokens` (drafter='controlled' only): the plain greedy output for these prompts,
  which the controlled drafter proposes with probability `research.controlled_acceptance`.
  With num_draft='auto', the first call for a program also measures its per-K pass times
  (`calibrate_step_ms`; seconds, like compilation, and excluded from stats "seconds"; stats
  "calibration": "held_runs", or "loops" where held runs pass too rarely at some K;
  "calibration_seconds": its wall time, 0.0 where a kept calibration was reused).
  `progress`: called with a line as a calibration starts and as it ends.
  """
  if progress is not None and not callable(progress):
    raise ValueError(f"progress must be a callable taking a line of text, got {progress!r}")
  spec, ls, args = _prepare(model, prompts, max_new_tokens, sampling, spec, seed, reference_tokens)
  batch, n_moe_layers = args[2].shape[0], model.config.n_moe_layers
  step_ms_K, prior_2, calibration = np.zeros((ls.max_k + 1,), np.float32), _NO_PRIOR, None
  fn = programs.PROGRAMS.compiled(_generate_spec, ls, *args, step_ms_K, prior_2, _FULL_RUN)
  if ls.auto:

    def held_run(held_ms_K: np.ndarray, prefill_only: bool) -> HeldRunResult:
      start = time.perf_counter()
      raw = jax.block_until_ready(fn(*args[1:], held_ms_K, _NO_PRIOR, np.bool_(prefill_only))[1])
      seconds = time.perf_counter() - start
      record = Stats.unpack(raw, ls, batch, n_moe_layers)
      drafts_2 = np.array([record.accepted_K.sum(), record.reached_K.sum()], np.float64)
      return HeldRunResult(seconds, record.passes_by_K, drafts_2)

    calibration = calibrate_step_ms(ls, args, held_run, progress)
    step_ms_K, prior_2 = np.asarray(calibration.step_ms_K, np.float32), calibration.prior_2()
  start = time.perf_counter()
  tokens_BN, raw = fn(*args[1:], step_ms_K, prior_2, _FULL_RUN)
  tokens_BN = np.asarray(jax.block_until_ready(tokens_BN))
  seconds = time.perf_counter() - start
  record = Stats.unpack(raw, ls, batch, n_moe_layers)
  stats = report.public_stats(record, tokens_BN, seconds, spec, ls, calibration)
  if model.mesh is not None and n_moe_layers:
    # The replicated dispatch sums each MoE layer's [rows x pass tokens, d_model] output over the
    # expert ranks: the bytes each rank sends (a ring all-reduce), per pass.
    stats["combine_bytes_per_pass"] = mesh_lib.combine_bytes(model.config, model.mesh, batch * _pass_tokens(ls, record))
  return GenerateOutput(tokens=tokens_BN, stats=stats)


def _pass_tokens(ls: LoopSpec, record: Stats) -> float:
  """Tokens a row's verification pass holds (its static shape), averaged over auto K's passes."""
  if ls.auto:
    by_k = np.asarray(record.passes_by_K)
    return float(np.sum((np.arange(by_k.size) + 1) * by_k) / max(by_k.sum(), 1))
  return 1.0 + (ls.tree_nodes or ls.max_k)


def step_times_ms(
  model: ModelHandle,
  prompts: Prompts,
  max_new_tokens: int = 64,
  sampling: SamplingParams | None = None,
  spec: SpecParams | None = None,
  reference_tokens: npt.ArrayLike | None = None,
  repeats: int = 7,
) -> np.ndarray:
  """Measured time (ms) of one loop pass for each K in 0..K of `spec` (raw medians, not smoothed).

  Timed in loops of passes (`calibration.measure_step_ms`; what `num_draft='auto'` calibrates
  with where its held runs pass too rarely at some K); the cost-model validation's measured
  verification time per pass size n = K + 1.
  """
  ls, args = _step_program(model, prompts, max_new_tokens, sampling, spec, reference_tokens)
  return measure_step_ms(ls, args, repeats)


def step_times_with_and_without_experts_ms(
  model: ModelHandle,
  prompts: Prompts,
  max_new_tokens: int = 64,
  sampling: SamplingParams | None = None,
  spec: SpecParams | None = None,
  reference_tokens: npt.ArrayLike | None = None,
  repeats: int = 7,
) -> tuple[np.ndarray, np.ndarray]:
  """`step_times_ms`, and the same passes with no routed expert read (the kernel policy's
  `routed_experts` False), timed side by side in the same rounds: the rest of a pass, and by
  difference the routed experts' part as decoding pays it (the cost model's non-expert time)."""
  ls, args = _step_program(model, prompts, max_new_tokens, sampling, spec, reference_tokens)
  without = dataclasses.replace(ls, kernels=dataclasses.replace(ls.kernels, routed_experts=False))
  with_K, without_K = measure_step_variants_ms([ls, without], args, repeats)
  return with_K, without_K


def draft_step_ms(
  model: ModelHandle,
  prompts: Prompts,
  max_new_tokens: int = 64,
  num_draft: int = 4,
  acceptance: float = 0.7,
  reference_tokens: npt.ArrayLike | None = None,
  repeats: int = 7,
) -> tuple[float, np.ndarray]:
  """What one MTP draft step costs: (a plain pass's ms, [K = 1..num_draft] ms a draft).

  The controlled drafter's passes (its drafts from `reference_tokens`, right with probability
  `acceptance`, greedy) timed side by side with and without the MTP heads' draft computation
  (`controlled_draft_cost` "none" and "mtp"); a draft costs (T_mtp(K) - T_none(K)) / K. The
  verification is the same in both, so the difference is the heads' proposals and cache fills.
  """
  if not model.config.num_mtp_modules:
    raise ValueError("draft_step_ms needs a model with MTP heads (num_mtp_modules >= 1)")
  if num_draft < 1:
    raise ValueError(f"num_draft must be >= 1, got {num_draft}")

  def spec(cost: str) -> SpecParams:
    research = ResearchOptions(controlled_acceptance=acceptance, controlled_draft_cost=cost)
    return SpecParams(drafter="controlled", num_draft=num_draft, research=research)

  if reference_tokens is None:
    reference_tokens = generate(model, prompts, max_new_tokens).tokens
  # Both programs start from the drafting one's state (the "none" passes carry its heads' state
  # along untouched), so they take the same arguments and are timed in the same rounds.
  ls_mtp, args = _step_program(model, prompts, max_new_tokens, None, spec("mtp"), reference_tokens)
  ls_none, _ = _step_program(model, prompts, max_new_tokens, None, spec("none"), reference_tokens)
  ls_none = dataclasses.replace(ls_mtp, drafter=ls_none.drafter)
  mtp_K, none_K = measure_step_variants_ms([ls_mtp, ls_none], args, repeats)
  k = np.arange(1, num_draft + 1)
  return float(none_K[0]), (mtp_K[1:] - none_K[1:]) / k


def _step_program(
  model: ModelHandle,
  prompts: Prompts,
  max_new_tokens: int,
  sampling: SamplingParams | None,
  spec: SpecParams | None,
  reference_tokens: npt.ArrayLike | None,
) -> tuple[LoopSpec, ProgramArgs]:
  """(LoopSpec, arguments) of the program whose passes `step_times_ms` times: auto K at its largest K."""
  spec = SpecParams() if spec is None else spec
  if spec.num_draft == "auto":
    spec = dataclasses.replace(spec, num_draft=spec.max_draft)
  _, ls, args = _prepare(model, prompts, max_new_tokens, sampling, spec, 0, reference_tokens)
  return ls, args


def resolve_budget(spec: SpecParams, config: ModelConfig) -> ExpertBudget | None:
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
