"""`num_draft="auto"`: the draft length chosen each pass by the cost model.

Under geometric acceptance with rate a, a pass with K drafts commits (1 - a^(K+1)) / (1 - a)
tokens per row (analysis/cost_model.tokens_per_pass) and costs step_ms[K] (draft K, verify
K + 1, drafter upkeep), measured once per compiled program by `calibration.calibrate_step_ms`
(whole runs of the program itself, held at each K). Each segment of passes picks the K that
finishes the batch soonest (its slowest row: for one row,
the K with the most tokens per millisecond; drafting only where it beats plain decoding by
DRAFT_MARGIN), from per-row estimates: one pass while the estimate rests on few drafts, then
SEGMENT_PASSES (PLAIN_SEGMENT_PASSES at K = 0; each choice runs one loop per K, a small cost
kept off most passes); K = 0 is plain decoding, chosen where speculation does not pay. A drafting
segment ends early after a pass in which no active row accepted a draft (`passes._run_passes`):
K is chosen again at once on that evidence, since a prompt-lookup run ends abruptly and at a long
K every pass past its end costs several plain passes.

Each row's a is estimated from its decayed counts of accepted and tried drafts, starting from a
weak prior, and read optimistically (plus OPTIMISM standard errors). The tokens a pass commits
follow each draft depth's own conditional acceptance, from per-depth counts each shrunk towards
the depth before it, depth 0 towards that pooled rate (`depth_acceptance`), for prompt lookup
(drafters with `Drafter.per_depth`), whose drafts are wrong at once or right for a long run: it
gets the K its runs pay for. Drafters whose proposals
cost next to nothing (n-gram lookup, the controlled drafter: `Drafter.shadows`) keep the evidence
flowing at K = 0: each plain pass checks the one draft they would have proposed against the token
the target produced ("shadow" drafts: greedy, whether it matches; sampled, its acceptance
probability), so auto leaves K = 0 as soon as drafting pays again. The MTP heads skip their
upkeep at K = 0 (their state goes stale), so with them K = 0 is final: it is chosen only after
MIN_EVIDENCE tried drafts and only where drafting would not pay even at a high bound on the
acceptance (the Wilson score bound, STOP_CONFIDENCE standard errors above the estimate, each
row's and the batch's pooled): a start
that accepts less than the rest of the text (a prompt's continuation, then boilerplate) must not
end drafting.
The counts start from the calibration's (`calibrated_prior`): the acceptance the drafter showed in
the held runs that timed the program's passes, on the calibrating call's prompts, worth
CALIBRATION_PRIOR_WEIGHT tried drafts and decaying like any evidence. Where drafting cannot pay
even at that prior's high bound, the MTP heads' first choice is the final K = 0: such a run
never starts the heads (`passes.init_state`) and decodes plainly from its first pass, instead of
paying MIN_EVIDENCE drafts to learn what the calibration already measured.
With the n-gram drafter, a segment where no active row's context has a match is
PLAIN_SEGMENT_PASSES plain passes (nothing to verify; transformers' prompt lookup also decodes
plainly without a match).

The calibrated pass times are a snapshot, and on a shared machine the ratios between K's pass
times drift within minutes (memory bandwidth taken by others slows long passes more than short
ones). So with ResearchOptions(auto_timing=True), on CPU, the loop also times its own
segments (a clock read inside the program, pallas_kernels.cpu.clock_after, no host round
trip): `record_pass_time` keeps, per K, decayed evidence of the log ratio of measured to
calibrated time per pass, and `corrected_step_ms` scales each K's calibrated time by it (K's
not yet run take the level of all K's run so far): a K chosen on a wrong calibration is thus
meant to be measured and corrected within a few segments. Experimental, off by default: it has
not yet been shown faster than the calibration alone, even where the calibration was off, and its
clock reads cost time of their own (docs/findings/2026-12-01-auto-timing.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from moespec_jax.analysis import routing as routing_lib

PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0  # in tried drafts
EVIDENCE_DECAY = 0.95  # per pass that brings evidence (drafts or shadow drafts)
MIN_EVIDENCE = 6.0  # tried drafts before K = 0 may be chosen (drafters without shadow drafts)
OPTIMISM = 0.5  # standard errors added to the acceptance estimate when choosing K
STOP_CONFIDENCE = 2.0  # the same for the final K = 0 of drafters without shadow drafts
SEGMENT_PASSES = 4  # passes per choice of K once the estimate is settled
# Passes per K = 0 choice, the estimate young or settled, and where no row has an n-gram match.
# Long: a choice of K costs about a plain pass, and a plain segment of a drafter with shadow
# drafts ends early once its evidence says drafting would pay (`drafting_pays_at`,
# `passes._run_passes`), so a long one does not hold K = 0 where drafting pays
# (docs/findings/2026-12-07-auto-k-calibrated-prior.md).
PLAIN_SEGMENT_PASSES = 64
SETTLED_EVIDENCE = 16.0  # tried drafts before drafting segments grow from 1 pass to SEGMENT_PASSES
# Acceptance rates `drafting_pays_at` tries between 0 and MAX_ACCEPTANCE.
PAYS_AT_GRID = 512
MAX_ACCEPTANCE = 0.999
# The calibration's measured acceptance starts each row's counts as this many tried drafts: enough
# for MIN_EVIDENCE (the MTP heads stop at once where the calibration says drafting cannot pay),
# few enough that a row's own drafts outweigh it within a few passes.
CALIBRATION_PRIOR_WEIGHT = 8.0
# Reached drafts at which a depth's own acceptance weighs as much as the depth before it; standard
# errors added to a depth's estimate while it has no evidence of its own (fading with it).
# Simulated, they bring auto closer to the best fixed K under prompt lookup's depth profile and
# cost little under geometric acceptance (docs/findings/2026-12-02-auto-k-depth-acceptance.md).
DEPTH_PRIOR_WEIGHT = 4.0
DEPTH_OPTIMISM = 0.5
# Drafting is chosen only where it is predicted at least this much faster than plain decoding:
# calibrated pass times carry about this much noise, and near the break-even acceptance a
# drafting pass chosen on noise (or on a lucky early estimate) costs more than it can gain
# (docs/findings/2026-11-30-auto-k-margins.md).
DRAFT_MARGIN = 0.1
# The final K = 0 of drafters without shadow drafts needs plain decoding faster than every K by
# this margin at the acceptance's high bound. A smaller margin recovers a weak start and drafts at
# a loss where the calibration is low; simulated with smaller margins down to none, the
# calibration's noise, not the margin, decided, so it is kept at DRAFT_MARGIN
# (docs/findings/2026-11-30-auto-k-margins.md).
STOP_MARGIN = DRAFT_MARGIN
# A change of K, once the estimate is settled, is charged SWITCH_COST_PASSES plain passes: after a
# change, the next pass runs slower, the most where a short pass follows a long one (the long
# pass's experts evicted what the short one reads). The charge is a time, not a fraction of the
# remaining time: a relative margin held a K that was slower over a long remainder and let K flip
# near the end, where a change cannot pay back. Measured and simulated:
# docs/findings/2026-11-30-auto-k-margins.md.
SWITCH_COST_PASSES = 0.4
# Pass times measured in the loop: evidence per K decays by TIMING_DECAY per segment run at that
# K; a K's own evidence outweighs the level pooled over all K's once it has more than
# TIMING_PRIOR_PASSES passes; a segment's ratio to calibration is clipped to within a factor
# MAX_TIMING_RATIO (a stall of the machine is not the pass's cost).
TIMING_DECAY = 0.8
TIMING_PRIOR_PASSES = 4.0
MAX_TIMING_RATIO = 4.0


def calibrated_prior(drafts_2: ArrayLike | None) -> np.ndarray:
  """Starting (accepted, tried) counts (float32 [2]) from a calibration's drafts (accepted, tried):
  its acceptance worth CALIBRATION_PRIOR_WEIGHT tried drafts; zeros (no prior beyond
  PRIOR_ACCEPTANCE's) where it counted none."""
  if drafts_2 is None:
    return np.zeros(2, np.float32)
  accepted, tried = (float(x) for x in np.asarray(drafts_2, np.float64))
  if not tried > 0 or not 0 <= accepted <= tried:
    raise ValueError(f"a calibration's drafts must be (accepted, tried), 0 <= accepted <= tried, tried > 0: {drafts_2}")
  return np.array([accepted / tried * CALIBRATION_PRIOR_WEIGHT, CALIBRATION_PRIOR_WEIGHT], np.float32)


def acceptance_estimate(evidence_2: ArrayLike) -> np.ndarray | jax.Array:
  """(accepted + prior) / (tried + prior weight), from decayed (accepted, tried) counts
  (the last axis; leading axes are rows). NumPy in, NumPy out (generate's statistics, no eager
  dispatch); otherwise jax."""
  xp = np if isinstance(evidence_2, np.ndarray) else jnp
  evidence_2 = xp.asarray(evidence_2)
  a = (evidence_2[..., 0] + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (evidence_2[..., 1] + PRIOR_WEIGHT)
  return xp.clip(a, 0.0, MAX_ACCEPTANCE)


def optimistic_acceptance(evidence_2: ArrayLike, standard_errors: float | None = None) -> jax.Array:
  """The estimate plus `standard_errors` (default OPTIMISM) binomial standard errors."""
  evidence_2 = jnp.asarray(evidence_2)
  a = acceptance_estimate(evidence_2)
  spread = jnp.sqrt(a * (1.0 - a) / (evidence_2[..., 1] + PRIOR_WEIGHT))
  z = OPTIMISM if standard_errors is None else standard_errors
  return jnp.clip(a + z * spread, 0.0, MAX_ACCEPTANCE)


def acceptance_upper_bound(evidence_2: ArrayLike, standard_errors: float) -> jax.Array:
  """The Wilson score bound `standard_errors` above the estimate (prior included in the counts).

  Near a = 1, where the binomial standard error shrinks with the estimate, the normal bound
  a + z SE overshoots (27 of 30 accepted reaches 1 at z = 2; Wilson's bound stays below it), and
  where drafting pays only at an acceptance close to 1 (the MTP heads at batch 8 on CPU) the
  normal bound kept drafting at a loss for the whole generation
  (docs/findings/2026-11-30-auto-k-margins.md).
  """
  evidence_2 = jnp.asarray(evidence_2)
  a = acceptance_estimate(evidence_2)
  n = evidence_2[..., 1] + PRIOR_WEIGHT
  z2 = standard_errors * standard_errors
  bound = (a + z2 / (2 * n) + standard_errors * jnp.sqrt(a * (1 - a) / n + z2 / (4 * n * n))) / (1 + z2 / n)
  return jnp.clip(bound, 0.0, MAX_ACCEPTANCE)


def drafting_pays_at(step_ms_K: jax.Array) -> jax.Array:
  """The lowest acceptance (of PAYS_AT_GRID rates up to MAX_ACCEPTANCE) at which some K >= 1
  commits tokens faster than plain decoding by DRAFT_MARGIN under geometric acceptance, as
  `choose_k` compares them; 1.0 where none does. A pass's tokens grow with the acceptance at every
  K, so drafting pays at every rate above it and at none below (to the grid's step). Where a plain
  segment's evidence reaches it, K is chosen again (`passes._run_passes`)."""
  a_A = jnp.linspace(0.0, MAX_ACCEPTANCE, PAYS_AT_GRID)
  rate_AK = tokens_per_pass_K(a_A, step_ms_K.shape[0]) / step_ms_K
  pays_A = jnp.any(rate_AK[:, 1:] > (1.0 + DRAFT_MARGIN) * rate_AK[:, :1], axis=1)
  return jnp.min(jnp.where(pays_A, a_A, 1.0))


def tokens_per_pass_K(a: jax.Array, num_k: int) -> jax.Array:
  """Expected committed tokens per pass, (1 - a^(K+1)) / (1 - a), for every K in 0..num_k - 1
  at once (a: any shape, a < 1; the K axis is appended). The traced counterpart of
  analysis/cost_model.tokens_per_pass (NumPy, one K)."""
  a = jnp.asarray(a, jnp.float32)[..., None]
  k_K = jnp.arange(num_k, dtype=jnp.float32)
  return (1.0 - a ** (k_K + 1.0)) / (1.0 - a)


def depth_acceptance(depth_evidence_BJ2: ArrayLike, pooled_a_B: ArrayLike) -> jax.Array:
  """Each depth's conditional acceptance (draft j accepted, given drafts 0..j-1 were) from that
  depth's decayed (accepted, reached) counts, shrunk with weight DEPTH_PRIOR_WEIGHT towards the
  depth before it (depth 0: towards the row's pooled rate `pooled_a_B`): a depth without
  evidence continues the one before it, so a drafter right at depth 1 far more often than at
  depth 0 (prompt lookup) is expected to stay right deeper, and one with much evidence takes its
  own rate. Each rate is read DEPTH_OPTIMISM standard errors high, scaled by the prior's share
  of its weight (exploration of depths rarely reached). [..., J]."""
  depth_evidence_BJ2 = jnp.asarray(depth_evidence_BJ2, jnp.float32)
  prior_B = jnp.asarray(pooled_a_B, jnp.float32)
  rates = []
  for j in range(depth_evidence_BJ2.shape[-2]):
    accepted_B, reached_B = depth_evidence_BJ2[..., j, 0], depth_evidence_BJ2[..., j, 1]
    prior_B = (accepted_B + DEPTH_PRIOR_WEIGHT * prior_B) / (reached_B + DEPTH_PRIOR_WEIGHT)
    # Optimism while the depth has little evidence of its own (exploration: a depth that is
    # never reached is never measured), fading as that evidence outweighs the prior.
    fresh_B = DEPTH_PRIOR_WEIGHT / (reached_B + DEPTH_PRIOR_WEIGHT)
    spread_B = jnp.sqrt(prior_B * (1.0 - prior_B) / (reached_B + DEPTH_PRIOR_WEIGHT))
    rates.append(jnp.clip(prior_B + DEPTH_OPTIMISM * fresh_B * spread_B, 0.0, MAX_ACCEPTANCE))
  if not rates:
    return jnp.zeros(depth_evidence_BJ2.shape[:-1], jnp.float32)
  return jnp.stack(rates, axis=-1)


def tokens_per_pass_depths(a_BJ: ArrayLike, num_k: int) -> jax.Array:
  """Expected committed tokens per pass for every K in 0..num_k - 1 from the conditional
  acceptance at each depth (a_BJ: [..., J], J >= num_k - 1): 1 + sum_{j<K} prod_{i<=j} a_i.
  Constant a gives tokens_per_pass_K."""
  a_BJ = jnp.asarray(a_BJ, jnp.float32)[..., : num_k - 1]
  reach_BJ = jnp.cumprod(a_BJ, axis=-1)
  first = jnp.ones(a_BJ.shape[:-1] + (1,), jnp.float32)
  return jnp.concatenate([first, 1.0 + jnp.cumsum(reach_BJ, axis=-1)], axis=-1)


def finish_ms(
  a_B: jax.Array, remaining_B: jax.Array, step_ms_K: jax.Array, tokens_BK: jax.Array | None = None
) -> jax.Array:
  """Predicted time (ms) until every row is done at each K: a batch finishes with its slowest
  row, max_b remaining_b / tokens_per_pass(a_b, K) passes of step_ms[K] each. (For one row,
  the K with the most tokens per millisecond; with ragged acceptance, rows that accept less
  set the pace and long drafts of the others are wasted.) `tokens_BK`: tokens per pass of each
  row and K, in place of geometric acceptance at a_B."""
  if tokens_BK is None:
    tokens_BK = tokens_per_pass_K(a_B, step_ms_K.shape[0])
  passes_BK = remaining_B[:, None] / tokens_BK
  return jnp.max(passes_BK, axis=0) * step_ms_K


def choose_k(
  evidence_B2: ArrayLike,
  step_ms_K: ArrayLike,
  *,
  shadow: bool,
  remaining_B: jax.Array | None = None,
  current_k: jax.Array | None = None,
  depth_evidence_BJ2: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """(K, passes) for the next segment (int32 scalars).

  evidence_B2: each row's decayed (accepted, tried) draft counts ([2] for one row);
  remaining_B: tokens each row has still to generate (0 once done; default 1 each).
  K minimises `finish_ms` at the rows' optimistic acceptance estimates, K >= 1 only where it
  beats plain decoding by DRAFT_MARGIN; one pass while the estimate rests on few drafts (in
  any unfinished row), then SEGMENT_PASSES; at K = 0, PLAIN_SEGMENT_PASSES.
  `shadow`: plain passes bring evidence (see the module docstring); without it K = 0 is final
  and needs MIN_EVIDENCE tried drafts over the active rows and plain decoding faster than every
  K (by STOP_MARGIN) at the Wilson bound STOP_CONFIDENCE standard errors above each row's
  estimate and above the active rows' pooled estimate (a batch's first pass gives a row one or
  two drafts: one rejected draft puts that row's bound near 0.8, low enough alone to stop
  drafting that pays; the pooled counts are the batch's evidence). `current_k`: the K of the
  last segment; once the estimate is settled, another K must be predicted to finish sooner by
  more than SWITCH_COST_PASSES plain passes. `depth_evidence_BJ2`: each row's decayed
  (accepted, reached) counts per draft depth; the tokens a pass commits then follow each depth's
  own acceptance (`depth_acceptance`, depth 0 shrunk towards the optimistic pooled rate, each
  deeper one towards the one before it) instead of a geometric run at the pooled rate: a
  prompt-lookup draft is often wrong at its first token and then right for a long run
  (docs/findings/2026-12-02-auto-k-depth-acceptance.md), where the geometric model overrates
  short drafts against long ones."""
  evidence_B2 = jnp.atleast_2d(jnp.asarray(evidence_B2, jnp.float32))
  remaining_B = (
    jnp.ones(evidence_B2.shape[0], jnp.float32) if remaining_B is None else jnp.asarray(remaining_B, jnp.float32)
  )
  a_B = optimistic_acceptance(evidence_B2)
  tokens_BK = None
  if depth_evidence_BJ2 is not None:
    depth_BJ2 = jnp.asarray(depth_evidence_BJ2, jnp.float32).reshape(evidence_B2.shape[0], -1, 2)
    tokens_BK = tokens_per_pass_depths(depth_acceptance(depth_BJ2, a_B), step_ms_K.shape[0])
  time_K = finish_ms(a_B, remaining_B, step_ms_K, tokens_BK)
  time_K = time_K.at[1:].multiply(1.0 + DRAFT_MARGIN)
  settled = jnp.min(jnp.where(remaining_B > 0, evidence_B2[:, 1], jnp.inf)) >= SETTLED_EVIDENCE
  if current_k is not None:  # while the estimate is young, K follows it freely
    switch_ms = jnp.where(settled, SWITCH_COST_PASSES * step_ms_K[0], 0.0)
    time_K = jnp.where(jnp.arange(time_K.shape[0]) == current_k, time_K, time_K + switch_ms)
  if not shadow:
    active_B1 = (remaining_B > 0)[:, None]
    pooled_2 = jnp.sum(jnp.where(active_B1, evidence_B2, 0.0), axis=0)
    stop = pooled_2[1] >= MIN_EVIDENCE
    for bound_B in (
      acceptance_upper_bound(evidence_B2, STOP_CONFIDENCE),
      jnp.broadcast_to(acceptance_upper_bound(pooled_2, STOP_CONFIDENCE), remaining_B.shape),
    ):
      high_K = finish_ms(bound_B, remaining_B, step_ms_K)
      stop &= high_K[0] <= jnp.min(high_K[1:] * (1.0 + STOP_MARGIN))
    time_K = time_K.at[0].set(jnp.where(stop, time_K[0], jnp.inf))
  k = jnp.argmin(time_K).astype(jnp.int32)
  drafting = jnp.where(settled, jnp.int32(SEGMENT_PASSES), jnp.int32(1))
  return k, jnp.where(k == 0, jnp.int32(PLAIN_SEGMENT_PASSES), drafting)


def record_pass_time(
  timing_K2: jax.Array, k: jax.Array, passes: jax.Array, elapsed_ms: jax.Array, step_ms_K: jax.Array
) -> jax.Array:
  """`timing_K2` (decayed [sum of passes * log(measured / calibrated ms per pass), passes] per K)
  after a segment of `passes` passes at K = k that took `elapsed_ms`; unchanged if passes == 0."""
  passes = jnp.asarray(passes, jnp.float32)
  per_pass_ms = elapsed_ms / jnp.maximum(passes, 1.0)
  limit = math.log(MAX_TIMING_RATIO)
  log_ratio = jnp.clip(jnp.log(jnp.maximum(per_pass_ms, 1e-6) / step_ms_K[k]), -limit, limit)
  updated = timing_K2.at[k].set(TIMING_DECAY * timing_K2[k] + jnp.stack([passes * log_ratio, passes]))
  return jnp.where(passes > 0, updated, timing_K2)


def corrected_step_ms(step_ms_K: jax.Array, timing_K2: jax.Array) -> jax.Array:
  """Calibrated pass times scaled by what the loop measured (`record_pass_time`): each K by its
  own evidence, shrunk towards the level pooled over all K's (K's not yet run: that level),
  then made non-decreasing in K (a longer pass never costs less)."""
  sums_K, weights_K = timing_K2[:, 0], timing_K2[:, 1]
  pooled = jnp.sum(sums_K) / jnp.maximum(jnp.sum(weights_K), 1e-6)
  log_ratio_K = (sums_K + TIMING_PRIOR_PASSES * pooled) / (weights_K + TIMING_PRIOR_PASSES)
  return jax.lax.cummax(step_ms_K * jnp.exp(log_ratio_K), axis=0)


def monotone_step_times(step_ms_K: ArrayLike) -> np.ndarray:
  """The non-decreasing sequence closest to the measured step times (pool adjacent violators).

  A longer pass never costs less; measurement noise can say otherwise.
  """
  blocks = []  # [mean, weight]
  for t in np.asarray(step_ms_K, float):
    blocks.append([t, 1.0])
    while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
      (m1, w1), (m2, w2) = blocks[-2], blocks.pop()
      blocks[-1] = [(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2]
  return np.concatenate([np.full(int(w), m) for m, w in blocks])


def smooth_step_times(step_ms_K: ArrayLike, routing: tuple[int, int] = (0, 0)) -> np.ndarray:
  """Measured per-K pass times, denoised: one noisy measurement must not flip the choice of K.

  Where there are enough points, a least-squares fit of the pass's parts,
    t(K) = c0 + c1 [K >= 1] + c2 K + c3 (U(K + 1) - U(1)),  c2, c3 >= 0,
  then made non-decreasing: plain passes are fitted exactly (drafting starts at K = 1),
  per-token work grows linearly, and the experts read grow as U(n), the distinct experts among
  n uniformly routed tokens (`routing` = (routed experts, top-k); no such term for a dense
  model, (0, 0)). A free quadratic fitted to 9 noisy points could bend down at the top and make
  the longest drafts look nearly free; here the cost of one more drafted token can only shrink
  as far as the expert term saturates.

  The fit cannot follow a step: on CPU the pass times rise more from K = 5 to K = 6 than per K
  below, outside the routed experts, for a cause not established. Judged across runs (choices on
  one run's pass times, paid at another's), a step term gained next to nothing: two runs' pass
  times differ by more than the fit's bias, so it is kept without the step
  (docs/findings/2026-12-05-pass-time-step-and-fit.md).
  """
  t = np.asarray(step_ms_K, float)
  k = np.arange(t.size, dtype=float)
  if t.size >= 6:
    columns = [np.ones_like(k), (k >= 1).astype(float), k]
    n_experts, top_k = routing
    if n_experts:
      unique = np.array([routing_lib.uniform_unique(n_experts, top_k, int(n)) for n in k + 1])
      columns.append(unique - unique[0])
    features = np.stack(columns, axis=1)
    t = np.maximum(features @ nonnegative_lstsq(features, t, free=(0, 1)), 1e-3)
  return monotone_step_times(t)


def nonnegative_lstsq(features_NP: np.ndarray, target_N: np.ndarray, free: Sequence[int] = ()) -> np.ndarray:
  """Least squares with every coefficient but those in `free` non-negative (exact: the best of
  the unconstrained fits over each support that keeps its coefficients non-negative; for the
  handful of columns here)."""
  n_cols = features_NP.shape[1]
  constrained = [c for c in range(n_cols) if c not in free]
  best, best_residual = None, np.inf
  for mask in range(1 << len(constrained)):
    support = sorted(list(free) + [c for i, c in enumerate(constrained) if mask >> i & 1])
    coef = np.zeros(n_cols)
    if support:
      coef[support] = np.linalg.lstsq(features_NP[:, support], target_N, rcond=None)[0]
    if np.all(coef[constrained] >= 0):
      residual = float(np.sum((features_NP @ coef - target_N) ** 2))
      if residual < best_residual:
        best, best_residual = coef, residual
  return best
