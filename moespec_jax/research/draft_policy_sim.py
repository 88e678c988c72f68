"""Offline simulation of `num_draft="auto"` (decoding/auto_draft.py): the policy's own cost, free
of timing noise.

On the development machine the same program run twice differs by several percent, so a measured
comparison of auto against plain decoding and against the best fixed K mixes what the policy
costs (passes spent learning the acceptance rate, K chosen on a noisy estimate, changes of K)
with that noise. Here one row decodes `n_tokens` tokens under geometric acceptance with rate a
(each draft accepted independently with probability a: the controlled drafter, greedy), or
under a per-depth profile (draft j accepted with its own probability given drafts 0..j-1 were:
prompt lookup's runs), and each
pass with K drafts costs step_ms[K]; the policy runs exactly as the decoding loop runs it
(`auto_draft.choose_k` per segment, the same evidence updates, shadow drafts on plain passes),
and fixed K runs the same random acceptances. `switch_ms`: time added whenever K changes between
segments (after a change the first passes run slower: decoding/auto_draft.SWITCH_COST_PASSES).
`calibrated_ms_K`: the pass times the policy chooses with, where they differ from those it pays
(the loop chooses on a calibration measured once, and passes in decoding can cost more or less:
what such an error costs the policy).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moespec_jax.decoding import auto_draft


@dataclasses.dataclass(frozen=True)
class PolicyRun:
  """Mean over simulated runs: decode time (ms) and passes at each K."""

  mean_ms: float
  passes_by_k: list[float]


@functools.cache
def _choose(shadow: bool) -> Callable:
  return jax.jit(functools.partial(auto_draft.choose_k, shadow=shadow))


def _accepted(rng: np.random.Generator, acceptance_J: np.ndarray, k: int) -> int:
  """Drafts accepted in a pass of K (draft j with probability acceptance_J[j]): the first
  rejection ends the run."""
  n = 0
  while n < k and rng.random() < acceptance_J[n]:
    n += 1
  return n


def simulate(
  acceptance: float | Sequence[float] | Callable[[int], float],
  step_ms_K: Sequence[float],
  *,
  num_draft: int | str = "auto",
  n_tokens: int = 127,
  runs: int = 100,
  shadow: bool = True,
  switch_ms: Callable[[int, int], float] | float = 0.0,
  seed: int = 0,
  by_depth: bool = False,
  calibrated_ms_K: Sequence[float] | None = None,
  prior_2: Sequence[float] | None = None,
) -> PolicyRun:
  """Decodes `n_tokens` tokens `runs` times with num_draft="auto" (K in 0..len(step_ms_K) - 1)
  or a fixed K; `shadow`: plain passes bring evidence (n-gram and controlled drafters).
  `acceptance`: one rate for every draft (geometric), or one per depth (draft j accepted with
  probability acceptance[j] given drafts 0..j-1 were; len(step_ms_K) - 1 of them), or a function
  of the tokens generated so far returning either (text whose acceptance changes: a weak start).
  `by_depth`: the policy reads acceptance per depth, as for prompt lookup (Drafter.per_depth);
  otherwise geometrically, as for the controlled drafter. `calibrated_ms_K`: the pass times the
  policy chooses with, where they differ from the times the passes take (`step_ms_K`): a noisy or
  drifted calibration (default: step_ms_K). `prior_2`: each run's starting (accepted, tried) counts,
  as generate() starts them from its calibration (`auto_draft.calibrated_prior`; default none)."""
  step = np.asarray(step_ms_K, np.float64)
  if step.ndim != 1 or step.size < 2 or np.any(step <= 0):
    raise ValueError(f"step_ms_K must hold a positive time for each K = 0..max (at least 2), got {step_ms_K}")

  def rates_at(generated: int) -> np.ndarray:
    value = acceptance(generated) if callable(acceptance) else acceptance
    acceptance_J = np.asarray(value, np.float64)
    if acceptance_J.ndim == 0:
      acceptance_J = np.full(step.size - 1, acceptance_J)
    if acceptance_J.shape != (step.size - 1,) or np.any((acceptance_J < 0) | (acceptance_J > 1)):
      raise ValueError(f"acceptance must be a rate in [0, 1] or one per draft depth ({step.size - 1}), got {value}")
    return acceptance_J

  constant_J = None if callable(acceptance) else rates_at(0)  # bad input fails before any run
  auto = num_draft == "auto"
  if not auto and not (isinstance(num_draft, int) and 0 <= num_draft < step.size):
    raise ValueError(f"num_draft must be 'auto' or an int in [0, {step.size}), got {num_draft!r}")
  switch = switch_ms if callable(switch_ms) else (lambda old, new: float(switch_ms))
  believed = step if calibrated_ms_K is None else np.asarray(calibrated_ms_K, np.float64)
  if believed.shape != step.shape or np.any(believed <= 0):
    raise ValueError(
      f"calibrated_ms_K must hold a positive time for each K = 0..{step.size - 1}, got {calibrated_ms_K}"
    )
  choose, step_j = _choose(shadow), jnp.asarray(believed, jnp.float32)
  pays_at = float(auto_draft.drafting_pays_at(step_j))
  rng = np.random.default_rng(seed)
  total_ms, passes_K = 0.0, np.zeros(step.size)
  for _ in range(runs):
    evidence = np.zeros(2, np.float32) if prior_2 is None else np.asarray(prior_2, np.float32).copy()
    depth_evidence = np.zeros((step.size - 1, 2), np.float32)
    generated, current_k, elapsed = 0, 0, 0.0
    while generated < n_tokens:
      remaining = n_tokens - generated
      if auto:
        depth = jnp.asarray(depth_evidence)[None] if by_depth else None
        k, n_passes = (
          int(x)
          for x in choose(
            jnp.asarray(evidence),
            step_j,
            remaining_B=jnp.float32([remaining]),
            current_k=jnp.int32(current_k),
            depth_evidence_BJ2=depth,
          )
        )
      else:
        k, n_passes = num_draft, n_tokens
      k = min(k, remaining - 1)  # as the loop: never more drafts than a row can still commit
      if auto and k != current_k and generated:
        elapsed += switch(current_k, k)
      current_k = k
      for _ in range(n_passes):
        if generated >= n_tokens:
          break
        acceptance_J = rates_at(generated) if constant_J is None else constant_J
        if k:
          accepted = _accepted(rng, acceptance_J, k)
          tried = min(accepted + 1, k)
        else:
          accepted, tried = (float(rng.random() < acceptance_J[0]), 1) if shadow else (0, 0)
        if tried:
          evidence = auto_draft.EVIDENCE_DECAY * evidence + np.float32([accepted, tried])
          # As the loop: every depth's counts decay with the row's evidence.
          depth = np.zeros_like(depth_evidence)
          depth[:tried, 1] = 1.0  # reached: the accepted drafts and the first rejected one
          if k:
            depth[: int(accepted), 0] = 1.0
          else:  # a shadow draft, at depth 0
            depth[0, 0] = accepted
          depth_evidence = auto_draft.EVIDENCE_DECAY * depth_evidence + depth
        generated += min((accepted if k else 0) + 1, n_tokens - generated)
        elapsed += step[k]
        passes_K[k] += 1
        # As the loop, a segment ends early: a drafting pass that accepted no draft; a plain pass
        # after which the shadow drafts' estimate says drafting would pay (`passes._run_passes`).
        if auto and k and not accepted:
          break
        if auto and not k and shadow and float(auto_draft.optimistic_acceptance(evidence)) >= pays_at:
          break
    total_ms += elapsed
  return PolicyRun(total_ms / runs, (passes_K / runs).tolist())


def auto_regret(acceptance: float, step_ms_K: Sequence[float], **kwargs) -> dict:
  """Auto against plain decoding and against the best fixed K (the one with the least mean time
  on the same acceptances): plain_over_auto and best_fixed_over_auto (1.0: as fast)."""
  fixed = [simulate(acceptance, step_ms_K, num_draft=k, **kwargs).mean_ms for k in range(len(step_ms_K))]
  auto = simulate(acceptance, step_ms_K, **kwargs)
  best = int(np.argmin(fixed))
  return {
    "acceptance": acceptance,
    "plain_over_auto": fixed[0] / auto.mean_ms,
    "best_fixed_num_draft": best,
    "best_fixed_over_auto": fixed[best] / auto.mean_ms,
    "auto_passes_by_num_draft": auto.passes_by_k,
  }
