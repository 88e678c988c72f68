"""auto K's pass times, once per program (`calibrate_step_ms`): whole runs of the generation
program itself held at each K (`measure_held_step_ms`), and the per-K pass times of compiled loops
of real decoding (`measure_step_ms`: the raw measurement the cost-model validation reads, and the
calibration where held runs make too few passes at some K).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moespec_jax.analysis import timing
from moespec_jax.decoding import auto_draft, passes, programs
from moespec_jax.decoding.programs import ModelDefinition, ProgramArgs, ProgramParams
from moespec_jax.decoding.state import LoopSpec, LoopState


def init_program(
  definition: ModelDefinition,
  params: ProgramParams,
  tokens_BT: jax.Array,
  lengths_B: jax.Array,
  seed: jax.Array,
  inputs: Any,
  *,
  ls: LoopSpec,
) -> LoopState:
  """The state after the prefill and first token: where every timed loop starts."""
  return passes.init_state(programs.merge(definition, params, ls), tokens_BT, lengths_B, seed, inputs, ls)


def passes_program(
  definition: ModelDefinition,
  params: ProgramParams,
  state: LoopState,
  k: jax.Array,
  n_passes: jax.Array,
  *,
  ls: LoopSpec,
) -> LoopState:
  """`n_passes` passes of real decoding with K = k from `state`; a row that would reach its end
  (or EOS) starts over from its position in `state`, so that no row ever stops.

  Passes must verify what decoding verifies: replaying the same tokens from the same position
  every pass keeps their experts' weights in the processor's caches, which made drafting passes
  look far cheaper than in decoding (docs/findings/2026-12-04-calibration-held-runs-vs-loops.md).
  """
  model = programs.merge(definition, params, ls)
  start = state

  def one_pass(s: LoopState, kk: int) -> LoopState:
    s = passes.speculative_pass(model, s, kk, ls)
    over_B = s.done_B | (s.generated_B + kk + 1 > ls.max_new_tokens)
    return s.replace(
      done_B=start.done_B,
      pos_B=jnp.where(over_B, start.pos_B, s.pos_B),
      pending_B=jnp.where(over_B, start.pending_B, s.pending_B),
      generated_B=jnp.where(over_B, start.generated_B, s.generated_B),
    )

  for kk in range(ls.max_k + 1):
    state = jax.lax.fori_loop(0, jnp.where(k == kk, n_passes, 0), lambda _, s, kk=kk: one_pass(s, kk), state)
  return state


# Passes per timed loop: the per-pass time is the difference of the two loops' times over the
# difference in passes, so the program call's fixed cost (dispatch, the carry's buffers) cancels.
# The long loop covers the generation's passes (`calibration_passes`): the first passes after a
# prompt are not typical of the rest. Even so, loops put drafting passes below their cost in
# decoding, the most at high acceptance, and neither rows replaying their tokens (a row that
# reaches its end starts over) nor a different program explains it. Hence auto K's calibration
# times held runs of its own program (`measure_held_step_ms`) and these loops only where those pass
# too rarely at some K (docs/findings/2026-12-04-calibration-held-runs-vs-loops.md).
CALIBRATION_SHORT_PASSES = 4
CALIBRATION_LONG_PASSES = (24, 127)  # at least, at most


def calibration_passes(max_new_tokens: int) -> tuple[int, int]:
  """(short, long) loop lengths of `measure_step_ms` for a generation of max_new_tokens."""
  low, high = CALIBRATION_LONG_PASSES
  return CALIBRATION_SHORT_PASSES, int(min(max(max_new_tokens - 1, low), high))


# Rounds of `calibrate_step_ms`. Calibrations taken minutes apart differ by more than further
# rounds narrow (the machine's load drifts), and held runs take less time than loops for the same
# spread (docs/findings/2026-12-04-calibration-held-runs-vs-loops.md).
CALIBRATION_ROUNDS = 7


def measure_step_ms(ls: LoopSpec, args: ProgramArgs, repeats: int = 7) -> np.ndarray:
  """Median time (ms) of one pass for each K in 0..ls.max_k.

  One pass is what the loop runs per iteration (draft K, verify K + 1, drafter upkeep),
  timed in compiled loops of `calibration_passes(ls.max_new_tokens)` passes (the per-pass time is
  the slope between the two lengths, so the call overhead is not counted) of real decoding after
  the prefill of these prompts (`passes_program`). K values are interleaved, and each K's time is
  the median of its ratios to K = 0 within a round times the median K = 0 time: what the
  choice of K depends on is these ratios, and a slow spell of the machine that spans a round
  leaves them intact.
  """
  return measure_step_variants_ms([ls], args, repeats)[0]


def measure_step_variants_ms(lss: Sequence[LoopSpec], args: ProgramArgs, repeats: int = 7) -> np.ndarray:
  """`measure_step_ms` for programs that differ only in what a pass does (e.g. their kernel policy's
  `routed_experts`), timed side by side: within each round every K of every variant runs (the variants in the
  balanced order of `timing.round_order`), and each time is the median of its ratios to the first
  variant's K = 0 within a round times that time's median. Returns [variant, K]. The prefill is
  the first variant's."""
  ls = lss[0]
  definition, params = args[0], args[1]
  short, long = calibration_passes(ls.max_new_tokens)
  cache = programs.PROGRAMS
  state0 = jax.block_until_ready(cache.compiled(init_program, ls, *args)(*args[1:]))
  runs = [
    cache.compiled(passes_program, variant, definition, params, state0, jnp.int32(0), jnp.int32(0), donate_argnums=(2,))
    for variant in lss
  ]

  def timed(run: Callable[..., LoopState], k: int, n: int) -> float:
    state = jax.block_until_ready(jax.tree.map(jnp.copy, state0))
    k_arr, n_arr = jnp.int32(k), jnp.int32(n)
    start = time.perf_counter()
    jax.block_until_ready(run(params, state, k_arr, n_arr))
    return time.perf_counter() - start

  for run in runs:  # warm-up: one program per variant, whatever the loop's length
    for k in range(ls.max_k + 1):
      timed(run, k, short)
  times_VKR = np.zeros((len(runs), ls.max_k + 1, repeats))
  for r in range(repeats):
    for k in range(ls.max_k + 1):
      for v in timing.round_order(range(len(runs)), r + k):
        times_VKR[v, k, r] = (timed(runs[v], k, long) - timed(runs[v], k, short)) * 1e3 / (long - short)
  return _scaled_ratio_medians(times_VKR)


def _scaled_ratio_medians(times_VKR: np.ndarray) -> np.ndarray:
  """[variant, K] times from per-round times [variant, K, round]: each the median over rounds of
  its ratio to the first variant's K = 0 in the same round, times that time's median (a slow
  spell of the machine that spans a round leaves the ratios intact)."""
  times_VKR = np.maximum(times_VKR, 1e-3)  # noise can drive a time to zero or below: keep ratios finite
  return np.median(times_VKR / times_VKR[:1, :1], axis=2) * np.median(times_VKR[0, 0])


# Step times that hold auto K at one K: the held K's pass costs 1 ms, every other K's HELD_OTHER_MS.
HELD_OTHER_MS = 1e6
# Passes a calibration's held runs must make at each K (all runs together) to be solved for its
# pass time; fewer (short generations, early EOS, prompt lookup without matches), and the passes
# are timed in loops instead (`measure_step_ms`).
CALIBRATION_MIN_PASSES = 8


class HeldRunResult(NamedTuple):
  """One held run of a generation program: its seconds, the passes it made at each K ([K + 1]) and
  the drafts it verified, (accepted, tried) summed over its rows and passes ([2])."""

  seconds: float
  passes_K: np.ndarray
  drafts_2: np.ndarray


# `run(step_ms_K, prefill_only)`: the program run once, held by `step_ms_K`.
HeldRun = Callable[[np.ndarray, bool], HeldRunResult]


def held_step_ms(max_k: int, k: int) -> np.ndarray:
  """Step times under which auto K chooses K = k in every segment (where the cache and the rows'
  remaining tokens allow k drafts; the MTP heads draft before K = 0 may be chosen)."""
  step_ms_K = np.full((max_k + 1,), HELD_OTHER_MS, np.float32)
  step_ms_K[k] = 1.0
  return step_ms_K


def measure_held_step_ms(max_k: int, run: HeldRun, repeats: int = 7) -> np.ndarray | None:
  """Median time (ms) of one pass for each K in 0..max_k, from whole runs of the generation
  program itself: each round runs it held at every K (`held_step_ms`) and once stopped after its
  first token (the prefill, and the MTP heads' fill), in the balanced order of
  `timing.round_order`. A held run's time less the prefill's is the sum over K of the passes it
  made at K times K's pass time, and the round's per-K times solve that linear system by least
  squares. As in `measure_step_ms`, each K's time is the median of its ratios to K = 0 within a
  round times the median K = 0 time.

  None where the held runs make fewer than CALIBRATION_MIN_PASSES passes at some K.

  What auto K pays is measured so: the passes of decoding itself, at the positions and with the
  tokens decoding verifies, and auto's own upkeep. Loops of passes put drafting passes below their
  cost in decoding (`measure_step_ms`; docs/findings/2026-12-04-calibration-held-runs-vs-loops.md).
  """
  labels = ["prefill"] + list(range(max_k + 1))
  steps = {k: held_step_ms(max_k, k) for k in range(max_k + 1)}

  def call(label: str | int):
    return run(steps[0], True) if label == "prefill" else run(steps[label], False)

  def solvable(passes_KK: np.ndarray):
    return np.min(passes_KK.sum(axis=0)) >= CALIBRATION_MIN_PASSES and np.linalg.matrix_rank(passes_KK) == max_k + 1

  for label in labels:  # warm-up
    call(label)
  times_RK = np.zeros((repeats, max_k + 1))
  for r in range(repeats):
    seconds, passes = {}, {}
    for label in timing.round_order(labels, r):
      result = call(label)
      seconds[label], passes[label] = result.seconds, result.passes_K
    # The same seed gives the same passes; each round solves with its own, should a backend's
    # nondeterministic sums ever change a token.
    passes_KK = np.stack([passes[k] for k in range(max_k + 1)]).astype(float)
    if not solvable(passes_KK):
      return None
    decode_ms_K = np.array([seconds[k] - seconds["prefill"] for k in range(max_k + 1)]) * 1e3
    times_RK[r] = np.linalg.lstsq(passes_KK, decode_ms_K, rcond=None)[0]
  return _scaled_ratio_medians(times_RK.T[None])[0]


class Calibration(NamedTuple):
  """auto K's per-K pass times (ms, [K + 1]), how they were measured: "held_runs"
  (`measure_held_step_ms`) or "loops" (`measure_step_ms`), the seconds the measurement took
  in this call (0.0 where a kept calibration was reused), and the drafts its held runs verified,
  (accepted, tried) over all of them ([2]; None where none were counted): the drafter's
  acceptance on the calibrating call's prompts, auto K's prior in later calls
  (`auto_draft.calibrated_prior`)."""

  step_ms_K: np.ndarray
  method: str
  seconds: float = 0.0
  drafts_2: np.ndarray | None = None

  @property
  def acceptance(self) -> float | None:
    """The share of its held runs' drafts accepted (None where it counted none)."""
    return None if self.drafts_2 is None else float(self.drafts_2[0] / self.drafts_2[1])

  def prior_2(self) -> np.ndarray:
    """auto K's starting evidence (float32 [2]) from this calibration's drafts."""
    return auto_draft.calibrated_prior(self.drafts_2)


def calibrate_step_ms(
  ls: LoopSpec, args: ProgramArgs, run: HeldRun, progress: Callable[[str], None] | None = None
) -> Calibration:
  """Per-K pass times, once per program (kept in `programs.PROGRAMS`, like compilation):
  `measure_held_step_ms` on the program `run` calls (else, logged, `measure_step_ms`), smoothed and
  made non-decreasing in K (`auto_draft.smooth_step_times`). `progress` gets a line as a
  measurement starts and one as it ends (nothing where a kept calibration is reused).

  A drafter whose passes cost more or less with its inputs (`Drafter.calibration_key`: the
  controlled drafter's acceptance rate) is calibrated once per key.
  """
  cache = programs.PROGRAMS
  # Timed and untimed programs pass alike: they share one calibration.
  key = (
    programs.signature(calibrate_step_ms, dataclasses.replace(ls, timed=False), *args),
    ls.drafter.calibration_key(args[-1]),
  )
  kept = cache.calibration(key)
  if kept is not None:
    return kept._replace(seconds=0.0)
  batch = args[2].shape[0]
  if progress is not None:
    progress(
      f"calibrating num_draft='auto': pass times at K = 0..{ls.max_k}, batch {batch}, "
      f"{ls.max_new_tokens} tokens (once per program and batch shape)"
    )
  start = time.perf_counter()
  drafts_2 = np.zeros(2)

  def counted(step_ms_K: np.ndarray, prefill_only: bool) -> HeldRunResult:
    result = run(step_ms_K, prefill_only)
    drafts_2[:] += result.drafts_2
    return result

  raw_K, method = measure_held_step_ms(ls.max_k, counted, CALIBRATION_ROUNDS), "held_runs"
  if raw_K is None:
    logging.info(
      "auto K (%s, max_draft=%d, %d new tokens): too few passes at some K in whole runs; "
      "pass times measured in loops of passes",
      type(ls.drafter).__name__,
      ls.max_k,
      ls.max_new_tokens,
    )
    raw_K, method = measure_step_ms(ls, args, CALIBRATION_ROUNDS), "loops"
  step_ms_K = auto_draft.smooth_step_times(raw_K, ls.routing).astype(np.float32)
  counted_drafts = drafts_2 if method == "held_runs" and drafts_2[1] > 0 else None
  calibration = Calibration(step_ms_K, method, time.perf_counter() - start, counted_drafts)
  cache.set_calibration(key, calibration)
  if progress is not None:
    progress(
      f"calibrated in {calibration.seconds:.1f} s ({method.replace('_', ' ')}): pass times (ms) "
      + " ".join(f"K={k} {t:.3f}" for k, t in enumerate(step_ms_K))
      + ("" if calibration.acceptance is None else f"; drafts accepted {calibration.acceptance:.3f}")
    )
  return calibration
