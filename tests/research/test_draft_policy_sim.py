"""num_draft='auto' in simulation: the policy's own cost against plain and the best fixed K."""

import numpy as np
import pytest

from moespec_jax.analysis import cost_model
from moespec_jax.decoding import auto_draft
from moespec_jax.research import draft_policy_sim as sim

# Pass times of the default model on the development machine (ms, K = 0..8: plain, then K drafts
# verified; experiments/cost_model's measurement, every draft wrong and every draft right
# averaged, smoothed as auto K smooths its calibration).
STEP_MS = [0.77, 1.07, 1.24, 1.42, 1.6, 1.79, 1.99, 2.19, 2.4]


def test_fixed_k_commits_the_geometric_tokens_per_pass():
  """Fixed K under acceptance a: the mean passes match (1 - a^(K+1)) / (1 - a) tokens per pass."""
  for a, k in ((0.6, 3), (0.9, 5)):
    run = sim.simulate(a, STEP_MS, num_draft=k, n_tokens=4000, runs=3)
    passes = sum(run.passes_by_k)
    assert run.passes_by_k[k] == passes
    assert 4000 / passes == pytest.approx(cost_model.tokens_per_pass(a, k), rel=0.03)
    assert run.mean_ms == pytest.approx(passes * STEP_MS[k])


@pytest.mark.parametrize("acceptance", [0.0, 0.2])
def test_auto_stays_plain_where_drafts_are_rejected(acceptance):
  r = sim.auto_regret(acceptance, STEP_MS)
  assert r["best_fixed_num_draft"] == 0
  assert r["plain_over_auto"] >= 0.97  # the goal: never more than 3% slower than plain decoding
  assert r["auto_passes_by_num_draft"][0] >= 0.9 * sum(r["auto_passes_by_num_draft"])


@pytest.mark.parametrize("acceptance", [0.7, 0.9, 1.0])
def test_auto_drafts_close_to_the_best_fixed_k_where_drafts_are_accepted(acceptance):
  r = sim.auto_regret(acceptance, STEP_MS)
  assert r["best_fixed_num_draft"] >= 2 and r["plain_over_auto"] > 1.2
  assert r["best_fixed_over_auto"] >= 0.95  # the goal: within 5% of the best fixed K


def test_auto_follows_a_depth_profile_to_long_drafts(monkeypatch):
  """Prompt lookup's profile (default model on code: wrong at once in half the passes, then right
  for a long run): auto with per-depth acceptance drafts longer than with the pooled (geometric)
  rate alone, and ends at least as close to the best fixed K."""
  profile = [0.47, 0.83, 0.97, 0.98, 0.97, 0.97, 0.95, 0.96]
  mean_drafting_k = lambda passes: np.average(np.arange(1, 9), weights=passes[1:])  # noqa: E731
  by_depth = sim.auto_regret(profile, STEP_MS, by_depth=True)
  pooled = sim.auto_regret(profile, STEP_MS)
  # Without depth evidence, the same as every depth at the pooled rate.
  monkeypatch.setattr(auto_draft, "DEPTH_PRIOR_WEIGHT", 1e9)
  monkeypatch.setattr(auto_draft, "DEPTH_OPTIMISM", 0.0)
  # `sim._choose` on purpose: its cached program must be traced again with the patched constants.
  sim._choose.cache_clear()
  assert sim.auto_regret(profile, STEP_MS, by_depth=True) == pooled
  sim._choose.cache_clear()
  assert by_depth["best_fixed_num_draft"] >= 6
  assert by_depth["best_fixed_over_auto"] >= max(0.85, pooled["best_fixed_over_auto"])
  assert mean_drafting_k(by_depth["auto_passes_by_num_draft"]) > mean_drafting_k(pooled["auto_passes_by_num_draft"]) + 1
  fixed = sim.simulate(profile, STEP_MS, num_draft=3, n_tokens=4000, runs=3)
  assert 4000 / sum(fixed.passes_by_k) == pytest.approx(1 + 0.47 + 0.47 * 0.83 + 0.47 * 0.83 * 0.97, rel=0.03)


def test_a_cost_per_change_of_k_is_charged():
  free = sim.simulate(0.8, STEP_MS, runs=20)
  charged = sim.simulate(0.8, STEP_MS, runs=20, switch_ms=1.0)
  assert charged.passes_by_k == free.passes_by_k  # the same choices, the same acceptances
  assert charged.mean_ms > free.mean_ms


def test_a_calibration_that_underrates_long_passes_costs_auto_time():
  """Auto chooses with the calibration and pays the true pass times: calibrated long passes 20%
  cheaper than they run make it draft longer and finish later; a true calibration changes nothing."""
  underrated = tuple(t * (0.8 if k >= 5 else 1.0) for k, t in enumerate(STEP_MS))
  true = sim.simulate(0.7, STEP_MS, runs=40)
  assert sim.simulate(0.7, STEP_MS, runs=40, calibrated_ms_K=tuple(STEP_MS)) == true
  misled = sim.simulate(0.7, STEP_MS, runs=40, calibrated_ms_K=underrated)
  assert sum(misled.passes_by_k[5:]) > sum(true.passes_by_k[5:]) + 5
  assert misled.mean_ms > true.mean_ms
  regret = sim.auto_regret(0.7, STEP_MS, runs=40, calibrated_ms_K=underrated)
  assert regret["best_fixed_over_auto"] == pytest.approx(
    min(sim.simulate(0.7, STEP_MS, num_draft=k, runs=40).mean_ms for k in range(9)) / misled.mean_ms
  )


def test_bad_arguments_are_refused():
  with pytest.raises(ValueError, match="acceptance"):
    sim.simulate(1.5, STEP_MS)
  with pytest.raises(ValueError, match="one per draft depth"):
    sim.simulate([0.5, 0.9], STEP_MS)
  with pytest.raises(ValueError, match="step_ms_K"):
    sim.simulate(0.5, [1.0])
  with pytest.raises(ValueError, match="num_draft"):
    sim.simulate(0.5, STEP_MS, num_draft=9)
  with pytest.raises(ValueError, match="calibrated_ms_K"):
    sim.simulate(0.5, STEP_MS, calibrated_ms_K=STEP_MS[:-1])
  assert np.isfinite(sim.simulate(0.5, STEP_MS, runs=1).mean_ms)


def test_acceptance_that_changes_with_the_text():
  """Acceptance as a function of the tokens generated: every draft rejected for the first 30
  tokens, then every draft accepted. With shadow drafts auto sees the change and drafts the rest;
  without them (the MTP heads) the K = 0 chosen on the weak start is final."""
  weak_start = lambda generated: 0.0 if generated < 30 else 1.0  # noqa: E731
  shadow = sim.simulate(weak_start, STEP_MS, runs=3)
  final = sim.simulate(weak_start, STEP_MS, runs=3, shadow=False)
  assert sum(shadow.passes_by_k[1:]) >= 10 and sum(shadow.passes_by_k) < 75
  assert final.passes_by_k[0] >= 110 and sum(final.passes_by_k[1:]) <= 10
  assert shadow.mean_ms < 0.7 * final.mean_ms
  # A function returning a constant is that constant.
  assert sim.simulate(lambda _: 0.6, STEP_MS, runs=3).mean_ms == sim.simulate(0.6, STEP_MS, runs=3).mean_ms
  with pytest.raises(ValueError, match="acceptance"):
    sim.simulate(lambda generated: 1.5, STEP_MS)


def test_a_calibrated_prior_spares_the_mtp_heads_their_first_drafts():
  """Without shadow drafts, at an acceptance where drafting cannot pay: from no prior the policy
  drafts until it has MIN_EVIDENCE drafts; from the calibration's prior at that acceptance it is
  plain from its first pass, as fast as plain decoding."""
  step_ms = [1.0, 1.8, 2.6, 3.4]
  plain = sim.simulate(0.3, step_ms, num_draft=0, runs=5).mean_ms
  cold = sim.simulate(0.3, step_ms, shadow=False, runs=20)
  warm = sim.simulate(0.3, step_ms, shadow=False, runs=20, prior_2=auto_draft.calibrated_prior([30.0, 100.0]))
  assert sum(cold.passes_by_k[1:]) >= 1 and cold.mean_ms > plain
  assert sum(warm.passes_by_k[1:]) == 0 and warm.mean_ms == pytest.approx(plain)
