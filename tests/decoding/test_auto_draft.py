"""num_draft='auto' and the controlled-acceptance drafter: the choice rule, exactness (greedy
auto output == plain output for every drafter), geometric acceptance, step-time calibration."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moespec_jax as msj
from moespec_jax.analysis import cost_model
from moespec_jax.analysis import routing as routing_lib
from moespec_jax.decoding import auto_draft, calibration, loop, passes, programs

RAGGED = [[5, 9, 30, 41], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [10, 20, 30, 10, 20, 30, 10]]


@pytest.fixture(scope="session")
def auto_model(tiny_config):
  return msj.Model.init(tiny_config.replace(num_mtp_modules=1), seed=2)


@pytest.fixture(scope="session")
def auto_plain(auto_model):
  return msj.generate(auto_model, RAGGED, max_new_tokens=20).tokens


def _controlled(acceptance: float, **options) -> msj.ResearchOptions:
  """The research options of the controlled drafter at one acceptance rate."""
  return msj.ResearchOptions(controlled_acceptance=acceptance, **options)


def _pinned(step_ms_K):
  """A stand-in for `calibrate_step_ms` that returns these pass times (no timing)."""
  return lambda ls, args, run, progress: calibration.Calibration(np.asarray(step_ms_K, np.float32), "held_runs")


def _choice(accepted, tried, step_ms, shadow=False):
  k, passes = auto_draft.choose_k(
    jnp.asarray([accepted, tried], jnp.float32), jnp.asarray(step_ms, jnp.float32), shadow=shadow
  )
  return int(k), int(passes)


def _k(*args, **kwargs):
  return _choice(*args, **kwargs)[0]


def test_choice_follows_the_cost_model():
  steps = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]
  # Acceptance near 1 with cheap extra tokens: the longest K; near 0 with evidence: plain.
  assert _k(999, 1000, steps) == 5
  assert _k(0, 100, steps) == 0
  # The same as the analysis cost model's best K for the (optimistic) estimated acceptance,
  # with drafting passes DRAFT_MARGIN dearer.
  margin = 1.0 + auto_draft.DRAFT_MARGIN
  for accepted, tried in [(30, 100), (60, 100), (80, 100), (95, 100)]:
    a = float(auto_draft.optimistic_acceptance(jnp.asarray([accepted, tried], jnp.float32)))
    assert a > accepted / tried
    best, _ = cost_model.best_k(a, 5, steps[0], lambda k: 0.0, lambda n: steps[n - 1] * (margin if n > 1 else 1.0))
    assert _k(accepted, tried, steps) == best
  # Drafting predicted to gain less than the margin stays plain.
  tpp = 1.0 + 0.25  # a = 0.25 (estimate settled), K = 1
  assert _k(2500, 10000, [1.0, tpp / 1.05]) == 0 and _k(2500, 10000, [1.0, tpp / 1.2]) == 1
  # Without shadow drafts and without enough evidence, never plain: a few early rejections do not
  # stop speculation (plain passes would bring no evidence). With shadow drafts, plain passes
  # keep measuring, so K = 0 may be chosen from the first pass on.
  dear = [1.0, 1.8, 2.4, 3.0, 3.6, 4.2]  # drafting costs much more than a plain pass
  assert _k(0, 2, dear) >= 1
  assert _choice(0, 2, dear, shadow=True) == (0, auto_draft.PLAIN_SEGMENT_PASSES)
  assert _choice(999, 1000, steps)[1] == auto_draft.SEGMENT_PASSES
  assert _choice(3, 4, steps)[1] == 1  # one pass per choice while the estimate is young
  # Settled at K = 0: long plain segments (with or without shadow drafts); without shadow
  # drafts K = 0 segments are long from the start (their estimate cannot change).
  assert _choice(0, 100, steps) == (0, auto_draft.PLAIN_SEGMENT_PASSES)
  assert _choice(0, 100, steps, shadow=True) == (0, auto_draft.PLAIN_SEGMENT_PASSES)
  assert _choice(0, 7, dear) == (0, auto_draft.PLAIN_SEGMENT_PASSES)


def test_tokens_per_pass_from_depths():
  """A constant rate gives the geometric formula; a profile, 1 + sum_j prod_{i<=j} a_i."""
  a = 0.7
  np.testing.assert_allclose(
    np.asarray(auto_draft.tokens_per_pass_depths(jnp.full((1, 5), a), 6)),
    np.asarray(auto_draft.tokens_per_pass_K(jnp.float32([a]), 6)),
    rtol=1e-6,
  )
  profile = [0.5, 0.8, 1.0, 0.9]
  expected = [1.0, 1.5, 1.5 + 0.4, 1.5 + 0.4 + 0.4, 1.5 + 0.4 + 0.4 + 0.36]
  np.testing.assert_allclose(
    np.asarray(auto_draft.tokens_per_pass_depths(jnp.float32(profile), 5)), expected, rtol=1e-6
  )


def test_depth_acceptance_continues_the_depth_before_and_follows_its_own_evidence():
  w, z = auto_draft.DEPTH_PRIOR_WEIGHT, auto_draft.DEPTH_OPTIMISM
  lift = lambda p, n: p + z * w / (n + w) * np.sqrt(p * (1 - p) / (n + w))  # noqa: E731
  # No evidence: every depth at the pooled rate, read optimistically.
  none = np.asarray(auto_draft.depth_acceptance(jnp.zeros((1, 3, 2)), jnp.float32([0.6])))[0]
  np.testing.assert_allclose(none, [lift(0.6, 0)] * 3, rtol=1e-6)
  # Depth 0 right 45 of 100 times, depth 1 right 85 of 100, deeper never reached: depths 0 and 1
  # near their own rates, depth 2 continues depth 1 (not the pooled rate).
  evidence = jnp.float32([[[45, 100], [85, 100], [0, 0]]])
  a0, a1, a2 = np.asarray(auto_draft.depth_acceptance(evidence, jnp.float32([0.6])))[0]
  p0 = (45 + w * 0.6) / (100 + w)
  p1 = (85 + w * p0) / (100 + w)
  assert a0 == pytest.approx(lift(p0, 100), rel=1e-5) and a1 == pytest.approx(lift(p1, 100), rel=1e-5)
  assert a2 == pytest.approx(lift(p1, 0), rel=1e-5) and a2 > a1 > 0.8 > 0.5 > a0


def test_choice_follows_the_depth_profile():
  """Prompt lookup: often wrong at the first draft, then right for a long run (and plain passes'
  shadow drafts add depth-0 evidence). At the same pooled counts the geometric model prefers
  medium drafts; the depth counts make the longest pay."""
  steps = jnp.float32([1.0, 1.45, 1.7, 1.9, 2.1, 2.3, 2.45, 2.6, 2.7])
  reached = np.array([200.0, 47, 39, 38, 37, 36, 35, 34])
  accepted = np.array([95.0, 39, 38, 37, 36, 35, 34, 33])
  pooled = jnp.float32([accepted.sum(), reached.sum()])
  depth = jnp.asarray(np.stack([accepted, reached], axis=-1))
  geometric, _ = auto_draft.choose_k(pooled, steps, shadow=True)
  by_depth, _ = auto_draft.choose_k(pooled, steps, shadow=True, depth_evidence_BJ2=depth[None])
  assert 2 <= int(geometric) <= 5 and int(by_depth) == 8
  # Geometric acceptance in the depth counts: the same choice as the pooled model.
  a = 0.7
  reach = 100.0 * a ** np.arange(8)
  geo_depth = jnp.asarray(np.stack([a * reach, reach], axis=-1))[None]
  geo_pooled = jnp.float32([(a * reach).sum(), reach.sum()])
  assert int(auto_draft.choose_k(geo_pooled, steps, shadow=True)[0]) == int(
    auto_draft.choose_k(geo_pooled, steps, shadow=True, depth_evidence_BJ2=geo_depth)[0]
  )


def test_batch_choice_follows_its_slowest_row():
  """A batch finishes with its slowest row: a row that accepts less pulls K down while it has
  tokens left, and stops mattering once it is done."""
  steps = jnp.asarray([1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0], jnp.float32)
  good, poor = [1900.0, 2000.0], [300.0, 1000.0]  # a ~ 0.95 and ~ 0.3
  alone, _ = auto_draft.choose_k(jnp.asarray(good), steps, shadow=True)
  both, _ = auto_draft.choose_k(jnp.asarray([good, poor]), steps, shadow=True, remaining_B=jnp.asarray([100.0, 100.0]))
  poor_done, _ = auto_draft.choose_k(
    jnp.asarray([good, poor]), steps, shadow=True, remaining_B=jnp.asarray([100.0, 0.0])
  )
  assert int(alone) == 8 and int(both) < int(alone) and int(poor_done) == int(alone)
  # The rule is the predicted finishing time: check it against a direct evaluation.
  a_B = auto_draft.optimistic_acceptance(jnp.asarray([good, poor]))
  margin = lambda k: 1.0 + (auto_draft.DRAFT_MARGIN if k else 0.0)
  want = min(
    range(9),
    key=lambda k: max(100.0 / sum(float(a) ** j for j in range(k + 1)) for a in a_B) * float(steps[k]) * margin(k),
  )
  assert int(both) == want


def test_monotone_step_times_pools_violations():
  out = auto_draft.monotone_step_times([1.0, 2.0, 1.6, 3.0, 2.9, 2.9, 5.0])
  assert np.all(np.diff(out) >= 0)
  np.testing.assert_allclose(out, [1.0, 1.8, 1.8, 2.9333333, 2.9333333, 2.9333333, 5.0], rtol=1e-6)
  np.testing.assert_array_equal(auto_draft.monotone_step_times([1, 2, 3]), [1, 2, 3])


def _pass_times(k, routing=(32, 4)):
  unique = np.array([routing_lib.uniform_unique(*routing, int(n)) for n in k + 1])
  return 0.8 + 0.25 * (k >= 1) + 0.1 * k + 0.05 * (unique - unique[0])


def test_smooth_step_times_absorbs_one_outlier():
  k = np.arange(9)
  clean = _pass_times(k)
  np.testing.assert_allclose(auto_draft.smooth_step_times(clean, (32, 4)), clean, rtol=1e-9)
  noisy = clean.copy()
  noisy[3] *= 0.6  # one fast outlier
  out = auto_draft.smooth_step_times(noisy, (32, 4))
  assert np.all(np.diff(out) >= 0)
  assert np.max(np.abs(out - clean) / clean) < 0.12
  np.testing.assert_array_equal(auto_draft.smooth_step_times([1.0, 0.5, 2.0]), [0.75, 0.75, 2.0])


@pytest.mark.parametrize("routing", [(32, 4), (0, 0)])
def test_smooth_step_times_never_makes_long_passes_free(routing):
  """A measurement that levels off at the top (noise) must not make the longest drafts look free:
  each extra drafted token keeps a positive cost, and plain passes are fitted exactly."""
  k = np.arange(9)
  measured = _pass_times(k)
  measured[6:] = measured[5]
  out = auto_draft.smooth_step_times(measured, routing)
  assert np.all(np.diff(out[1:]) > 0.01)
  assert out[0] == pytest.approx(measured[0], rel=1e-9)


def test_nonnegative_lstsq_meets_the_optimality_conditions():
  rng = np.random.default_rng(0)
  for _ in range(20):
    x_NP, y_N = rng.normal(size=(12, 4)), rng.normal(size=12)
    coef = auto_draft.nonnegative_lstsq(x_NP, y_N, free=(0,))
    gradient = x_NP.T @ (x_NP @ coef - y_N)
    assert np.all(coef[1:] >= 0)
    assert abs(gradient[0]) < 1e-8
    for c in range(1, 4):  # on the boundary the objective must not decrease into the feasible side
      assert (abs(gradient[c]) < 1e-8) if coef[c] > 0 else (gradient[c] > -1e-8)


@pytest.mark.parametrize("drafter", ["ngram", "mtp", "controlled"])
def test_auto_greedy_tokens_equal_plain_greedy(auto_model, auto_plain, drafter):
  spec = msj.SpecParams(drafter=drafter, num_draft="auto", max_draft=3, research=_controlled(0.8))
  out = msj.generate(
    auto_model, RAGGED, max_new_tokens=20, spec=spec, reference_tokens=auto_plain if drafter == "controlled" else None
  )
  np.testing.assert_array_equal(out.tokens, auto_plain)
  s = out.stats
  assert s["num_draft"] == "auto" and s["max_draft"] == 3
  assert len(s["passes_by_num_draft"]) == 4 and sum(s["passes_by_num_draft"]) == s["verify_passes"]
  assert 0 <= s["chosen_num_draft"] <= 3 and len(s["calibrated_step_ms"]) == 4
  assert np.all(np.diff(s["calibrated_step_ms"]) >= 0) and min(s["calibrated_step_ms"]) > 0


@pytest.mark.parametrize("acceptance", [0.0, 0.8])
def test_auto_drafts_where_it_pays(auto_model, auto_plain, acceptance, monkeypatch):
  """With pass times where a K = 3 pass costs 1.6 plain passes: at acceptance 0.8 auto drafts
  (mean accepted length well above 1); at 0 it stays plain after its first evidence. (Fixed
  pass times: what auto chooses must not depend on the timings of a loaded test machine.)"""
  monkeypatch.setattr(loop, "calibrate_step_ms", _pinned([1.0, 1.2, 1.4, 1.6]))
  spec = msj.SpecParams(drafter="controlled", num_draft="auto", max_draft=3, research=_controlled(acceptance))
  out = msj.generate(auto_model, RAGGED, max_new_tokens=20, spec=spec, reference_tokens=auto_plain)
  np.testing.assert_array_equal(out.tokens, auto_plain)
  passes_K = out.stats["passes_by_num_draft"]
  if acceptance:
    assert out.stats["mean_accepted_length"] > 1.5 and passes_K[3] > passes_K[0]
  else:
    assert out.stats["mean_accepted_length"] == 1.0 and passes_K[0] > 2 * sum(passes_K[1:])


def test_auto_drafts_only_as_far_as_the_cache_has_room(auto_model, monkeypatch):
  """Auto K keeps no lookahead room in the cache (18 + 46 positions: a cache of exactly 64),
  drafts until near the end, and the output is still plain greedy. (Whether K is actually cut
  by the cache's room here depends on the rows' progress: `test_cache_room` checks the room.)
  Pass times are pinned (drafting pays at a = 0.9): a calibration taken while the other test
  worker loads the machine could make it choose K = 0 throughout."""
  monkeypatch.setattr(loop, "calibrate_step_ms", _pinned([1.0, 1.2, 1.4, 1.6]))
  prompts = [[(7 * i) % 50 + 1 for i in range(18)], [3, 4, 5, 6, 7]]
  plain = msj.generate(auto_model, prompts, max_new_tokens=46).tokens
  spec = msj.SpecParams(drafter="controlled", num_draft="auto", max_draft=3, research=_controlled(0.9))
  # Private on purpose: the LoopSpec and program arguments of a generate() call have no public name.
  _, ls, _ = loop._prepare(auto_model, prompts, 46, None, spec, 0, plain)
  assert ls.cache_len == 64
  out = msj.generate(auto_model, prompts, max_new_tokens=46, spec=spec, reference_tokens=plain)
  np.testing.assert_array_equal(out.tokens, plain)
  assert sum(out.stats["passes_by_num_draft"][1:]) >= 1


def test_cache_room():
  """Room for drafts after the furthest active row's pending token; done rows do not count."""
  pos = jnp.asarray([60, 62, 63])
  assert int(passes.cache_room(pos, jnp.asarray([False, False, True]), 64)) == 1
  assert int(passes.cache_room(pos, jnp.asarray([False, True, True]), 64)) == 3


@pytest.mark.slow
def test_auto_ngram_without_a_match_runs_plain_passes(auto_model, auto_plain):
  """A pass where no row's context has an n-gram match verifies nothing extra (K = 0)."""
  rows = [i for i, p in enumerate(RAGGED) if int(auto_plain[i][0]) not in p]
  assert rows, "every first token occurs in its prompt; pick other prompts"
  prompts = [RAGGED[i] for i in rows]
  spec = msj.SpecParams(drafter="ngram", num_draft="auto", max_draft=3)
  out = msj.generate(auto_model, prompts, max_new_tokens=2, spec=spec)  # one verify pass
  np.testing.assert_array_equal(out.tokens, auto_plain[rows, :2])
  assert out.stats["passes_by_num_draft"] == [1, 0, 0, 0]


@pytest.mark.slow
def test_plain_passes_bring_shadow_evidence(auto_model, auto_plain, monkeypatch):
  """Starting from a prior that makes K = 0 the best choice, the plain passes' shadow drafts
  (always right at acceptance 1) raise the estimate until auto drafts, each accepted one ending
  its plain segment at once (20 tokens are fewer than a plain segment's passes); at acceptance 0
  they keep it at 0 and every pass stays plain. The output is plain greedy either way.

  The raw pass times are pinned (drafting pays at high acceptance): measured on the test model,
  where plain passes are fast against verification passes, they can make K = 0 the best choice
  even at acceptance 1 (it failed so once in a clean run). Each rate is still calibrated once."""
  monkeypatch.setattr(auto_draft, "PRIOR_ACCEPTANCE", 0.0)
  monkeypatch.setattr(
    calibration, "measure_held_step_ms", lambda num_draft, run, rounds: np.array([1.0, 1.2, 1.4, 1.6], np.float32)
  )
  programs.PROGRAMS.forget()  # the prior is read when the loop is traced
  calibrated = len(programs.PROGRAMS.calibration_keys())
  try:
    for a in (1.0, 0.0):
      spec = msj.SpecParams(drafter="controlled", num_draft="auto", max_draft=3, research=_controlled(a))
      out = msj.generate(auto_model, RAGGED, max_new_tokens=20, spec=spec, reference_tokens=auto_plain)
      np.testing.assert_array_equal(out.tokens, auto_plain)
      by_k = out.stats["passes_by_num_draft"]
      if a == 1.0:
        assert 1 <= by_k[0] < auto_draft.PLAIN_SEGMENT_PASSES and sum(by_k[1:]) >= 1
        assert out.stats["acceptance_estimate"] > 0.8
      else:
        assert by_k[1:] == [0, 0, 0] and out.stats["acceptance_estimate"] == 0.0
    # Pass times depend on what is verified: one calibration per controlled acceptance rate.
    assert len(programs.PROGRAMS.calibration_keys()) == calibrated + 2
  finally:
    programs.PROGRAMS.forget()


def test_controlled_acceptance_is_geometric(auto_model, auto_plain):
  """Each draft equals the target's greedy token with probability a, independently, so
  P(draft j accepted | j-1 accepted) = a at every depth; the output stays plain greedy."""
  a, k = 0.6, 3
  prompts = [RAGGED[i % 4] for i in range(32)]
  plain = msj.generate(auto_model, prompts, max_new_tokens=20).tokens
  out = msj.generate(
    auto_model,
    prompts,
    max_new_tokens=20,
    reference_tokens=plain,
    spec=msj.SpecParams(drafter="controlled", num_draft=k, research=_controlled(a)),
  )
  np.testing.assert_array_equal(out.tokens, plain)
  depth = out.stats["acceptance_by_depth"]
  # ~190 first-depth trials: 4 standard deviations is about 0.14.
  assert abs(depth[0] - a) < 0.14 and abs(np.mean(depth) - a) < 0.14
  for alpha, expected in ((0.0, 1.0), (1.0, k + 1.0)):
    out = msj.generate(
      auto_model,
      prompts,
      max_new_tokens=20,
      reference_tokens=plain,
      spec=msj.SpecParams(drafter="controlled", num_draft=k, research=_controlled(alpha)),
    )
    if alpha == 0.0:
      assert out.stats["mean_accepted_length"] == expected
    else:  # every draft accepted, except where a row's remaining tokens cut the pass short
      assert out.stats["acceptance_by_depth"] == [1.0] * k


def test_step_times_grow_with_pass_size(auto_model):
  times = loop.step_times_ms(auto_model, RAGGED, 8, spec=msj.SpecParams(drafter="ngram", num_draft=2), repeats=2)
  assert times.shape == (3,) and np.all(times > 0)
  with_K, without_K = loop.step_times_with_and_without_experts_ms(
    auto_model, RAGGED, 8, spec=msj.SpecParams(drafter="ngram", num_draft=2), repeats=2
  )
  assert with_K.shape == without_K.shape == (3,) and np.all(with_K > 0) and np.all(without_K > 0)


def test_passes_without_routed_experts_read_none(auto_model):
  """A kernel policy with routed_experts=False, what the cost model times as a pass's non-expert part: the
  verification pass skips every routed expert (none counted, and the tokens change)."""
  # Private on purpose: the LoopSpec and program arguments of a generate() call have no public name.
  _, ls, args = loop._prepare(
    auto_model, RAGGED, 8, msj.SamplingParams(), msj.SpecParams(drafter="ngram", num_draft=2), 0, None
  )
  state0 = programs.PROGRAMS.compiled(calibration.init_program, ls, *args)(*args[1:])
  out = {}
  for experts in (True, False):
    run_ls = dataclasses.replace(ls, kernels=dataclasses.replace(ls.kernels, routed_experts=experts))
    run = programs.PROGRAMS.compiled(
      calibration.passes_program, run_ls, args[0], args[1], state0, jnp.int32(0), jnp.int32(0)
    )
    # (The program may be step_times_ms's own, compiled to take over its state: pass a copy.)
    out[experts] = run(args[1], jax.tree.map(jnp.copy, state0), jnp.int32(2), jnp.int32(3))
  assert float(jnp.sum(out[True].stats.unique_L)) > 0
  assert float(jnp.sum(out[False].stats.unique_L)) == 0
  assert not np.array_equal(out[True].out_BN, out[False].out_BN)


def test_bad_auto_and_controlled_arguments(auto_model, auto_plain):
  with pytest.raises(ValueError, match="num_draft"):
    msj.SpecParams(drafter="ngram", num_draft="best")
  with pytest.raises(ValueError, match="max_draft"):
    msj.SpecParams(drafter="ngram", num_draft="auto", max_draft=0)
  with pytest.raises(ValueError, match="controlled_acceptance"):
    msj.SpecParams(drafter="controlled", research=_controlled(1.5))
  with pytest.raises(ValueError, match="controlled_acceptance"):
    msj.SpecParams(drafter="controlled")  # the research drafter needs its research option
  controlled = msj.SpecParams(drafter="controlled", research=_controlled(0.5))
  with pytest.raises(ValueError, match="reference_tokens"):
    msj.generate(auto_model, RAGGED, max_new_tokens=4, spec=controlled)
  with pytest.raises(ValueError, match="greedy"):
    msj.generate(
      auto_model,
      RAGGED,
      max_new_tokens=4,
      sampling=msj.SamplingParams(temperature=1.0),
      spec=controlled,
      reference_tokens=auto_plain,
    )
  with pytest.raises(ValueError, match=r"reference_tokens must be an int array \[4, >= 30\]"):
    msj.generate(auto_model, RAGGED, max_new_tokens=30, spec=controlled, reference_tokens=auto_plain)
  with pytest.raises(ValueError, match="drafter='controlled' only"):
    msj.generate(auto_model, RAGGED, max_new_tokens=4, reference_tokens=auto_plain)


def test_settled_choice_changes_k_only_where_the_gain_exceeds_the_switch_cost():
  """K = 1 predicted ~10% faster than plain (past DRAFT_MARGIN): chosen with no history; a
  settled estimate at K = 0 keeps it for one token left (a gain of ~0.1 pass, under the
  SWITCH_COST_PASSES charge) and moves to K = 1 for 40 left (~4 passes); a young one moves
  either way."""
  step_ms = jnp.asarray([1.0, 1.2], jnp.float32)
  settled = jnp.asarray([8.0, 20.0], jnp.float32)  # a ~ 0.41, optimistic ~ 0.46
  young = jnp.asarray([2.0, 4.0], jnp.float32)
  choose = lambda ev, cur, left=1.0: int(
    auto_draft.choose_k(ev, step_ms, shadow=True, current_k=jnp.int32(cur), remaining_B=jnp.asarray([left]))[0]
  )
  assert int(auto_draft.choose_k(settled, step_ms, shadow=True)[0]) == 1
  assert choose(settled, 0) == 0 and choose(settled, 1) == 1
  assert choose(settled, 0, left=40.0) == 1 and choose(settled, 1, left=40.0) == 1
  assert choose(young, 0) == 1
  time_K = auto_draft.finish_ms(auto_draft.optimistic_acceptance(settled[None]), jnp.asarray([1.0]), step_ms)
  gain_passes = float(time_K[0] - time_K[1] * (1.0 + auto_draft.DRAFT_MARGIN)) / float(step_ms[0])
  assert 0.0 < gain_passes < auto_draft.SWITCH_COST_PASSES < 40.0 * gain_passes


def test_final_plain_needs_confidence_without_shadow_drafts():
  """Without shadow drafts K = 0 is final, so it is chosen only where drafting would not pay
  even at a high bound on the acceptance: 7.5 of 8.5 drafts accepted (an estimate of 0.81,
  where these pass times make plain decoding the best choice at the estimate) keeps drafting;
  2 of 12 stops; with shadow drafts the same evidence may pick K = 0 (it is not final)."""
  step_ms = [1.08, 2.17, 2.84, 3.5, 4.14, 4.77, 5.38, 5.99, 6.57]  # MTP heads on the default model
  hopeful, poor = (7.46, 8.46), (2.0, 12.0)
  assert _k(*hopeful, step_ms, shadow=True) == 0
  assert _k(*hopeful, step_ms) >= 1
  assert _choice(*poor, step_ms) == (0, auto_draft.PLAIN_SEGMENT_PASSES)


def test_stop_bound_is_the_wilson_score_bound():
  """The final stop's bound on the acceptance: Wilson's, which stays below 1 where the normal
  bound a + z SE reaches it (the standard error shrinks with 1 - a)."""
  z = auto_draft.STOP_CONFIDENCE
  for accepted, tried in [(0.0, 4.0), (3.0, 10.0), (27.0, 30.0), (300.0, 300.0)]:
    evidence = jnp.asarray([accepted, tried], jnp.float32)
    a = float(auto_draft.acceptance_estimate(evidence))
    n = tried + auto_draft.PRIOR_WEIGHT
    wilson = (a + z * z / (2 * n) + z * np.sqrt(a * (1 - a) / n + z * z / (4 * n * n))) / (1 + z * z / n)
    bound = float(auto_draft.acceptance_upper_bound(evidence, z))
    assert bound == pytest.approx(min(wilson, auto_draft.MAX_ACCEPTANCE), abs=1e-6)
    assert a < bound <= auto_draft.MAX_ACCEPTANCE + 1e-6
  near_one = jnp.asarray([27.0, 30.0], jnp.float32)
  assert float(auto_draft.acceptance_upper_bound(near_one, z)) < 0.97
  assert float(auto_draft.optimistic_acceptance(near_one, z)) > 0.99


def test_final_plain_where_drafting_pays_only_near_perfect_acceptance():
  """MTP heads at batch 8 on CPU (pass times of the default model): drafting pays by the margin
  only above ~0.985 acceptance, so after one pass of 8 rows accepting their draft auto stops;
  where drafting pays at a moderate acceptance (batch 1 pass times) the same evidence keeps it."""
  batch8 = jnp.asarray([1.81, 4.21, 5.68, 7.14, 8.61, 10.08, 11.55, 13.01, 14.48], jnp.float32)
  batch1 = jnp.asarray([0.70, 1.28, 1.66, 2.00, 2.30, 2.57, 2.82, 3.04, 3.24], jnp.float32)
  one_pass = jnp.ones((8, 2), jnp.float32)
  remaining = jnp.full((8,), 100.0)
  k8, passes8 = auto_draft.choose_k(one_pass, batch8, shadow=False, remaining_B=remaining)
  assert (int(k8), int(passes8)) == (0, auto_draft.PLAIN_SEGMENT_PASSES)
  k1, _ = auto_draft.choose_k(one_pass, batch1, shadow=False, remaining_B=remaining)
  assert int(k1) >= 1


def test_one_rejected_first_draft_does_not_end_drafting_that_pays():
  """MTP heads at batch 8 where drafting pays (pass times measured on the default model, fixed
  K = 2..4 at 1.04-1.14x plain): after a first pass in which 7 of 8 rows accept their draft, the
  rejecting row's own bound (~0.8) would alone say stop, but the batch's pooled evidence does not:
  drafting goes on. With every row rejecting, the pooled bound agrees and auto stops later."""
  batch8 = jnp.asarray([1.58, 2.64, 3.57, 4.44, 5.27, 6.04, 6.78, 7.48, 8.16], jnp.float32)
  remaining = jnp.full((8,), 100.0)
  first_pass = jnp.asarray([[1.0, 1.0]] * 7 + [[0.0, 1.0]], jnp.float32)
  row_bound = auto_draft.acceptance_upper_bound(first_pass[-1], auto_draft.STOP_CONFIDENCE)
  row_alone = auto_draft.finish_ms(jnp.full((8,), row_bound), remaining, batch8)
  assert row_alone[0] <= jnp.min(row_alone[1:]) * (1.0 + auto_draft.STOP_MARGIN)  # the row alone: stop
  k, _ = auto_draft.choose_k(first_pass, batch8, shadow=False, remaining_B=remaining)
  assert int(k) >= 1
  rejected = jnp.asarray([[0.0, 2.0]] * 8, jnp.float32)
  k, passes = auto_draft.choose_k(rejected, batch8, shadow=False, remaining_B=remaining)
  assert (int(k), int(passes)) == (0, auto_draft.PLAIN_SEGMENT_PASSES)
  # Finished rows' evidence does not count towards the pooled evidence.
  done = jnp.zeros((8,)).at[0].set(100.0)
  k, _ = auto_draft.choose_k(rejected, batch8, shadow=False, remaining_B=done)
  assert int(k) >= 1


def test_pass_time_correction_without_evidence_is_the_calibration():
  step_ms = jnp.asarray([1.0, 1.5, 1.8, 2.0], jnp.float32)
  timing = jnp.zeros((4, 2), jnp.float32)
  np.testing.assert_allclose(auto_draft.corrected_step_ms(step_ms, timing), step_ms)
  # A segment of no passes records nothing.
  np.testing.assert_array_equal(auto_draft.record_pass_time(timing, 2, 0, 5.0, step_ms), timing)


def test_pass_time_correction_follows_the_measured_k():
  """K = 3 measured at twice its calibration over many segments: K = 3 approaches 2x, K's never
  run take the pooled level (here all of K = 3), and the result stays non-decreasing."""
  step_ms = jnp.asarray([1.0, 1.5, 1.8, 2.0], jnp.float32)
  timing = jnp.zeros((4, 2), jnp.float32)
  for _ in range(30):
    timing = auto_draft.record_pass_time(timing, 3, 4, 4 * 2 * 2.0, step_ms)
  corrected = np.asarray(auto_draft.corrected_step_ms(step_ms, timing))
  np.testing.assert_allclose(corrected, 2.0 * np.asarray(step_ms), rtol=1e-5)
  # Now K = 0 measured at its calibration: K = 0 moves back towards 1x, K = 3 stays near 2x.
  for _ in range(30):
    timing = auto_draft.record_pass_time(timing, 0, 16, 16 * 1.0, step_ms)
  corrected = np.asarray(auto_draft.corrected_step_ms(step_ms, timing))
  assert corrected[0] < 1.15 and 3.6 < corrected[3] < 4.0
  assert np.all(np.diff(corrected) >= 0)


def test_pass_time_correction_clips_a_stall():
  step_ms = jnp.asarray([1.0, 2.0], jnp.float32)
  timing = auto_draft.record_pass_time(jnp.zeros((2, 2), jnp.float32), 0, 1, 1e4, step_ms)
  np.testing.assert_allclose(timing[0], [np.log(auto_draft.MAX_TIMING_RATIO), 1.0], rtol=1e-6)


@pytest.mark.parametrize("calibrated_ms", [1e-3, 1e3])
def test_auto_timing_measures_passes_in_the_loop(auto_model, auto_plain, calibrated_ms, monkeypatch):
  """Calibrations far too fast (1 us a pass) or far too slow (1 s) against the real passes of
  the tiny model: every K the loop ran (and, pooled, every other) is corrected by the clipped
  factor, so the clock inside the program measured something between those bounds."""
  monkeypatch.setattr(loop, "calibrate_step_ms", _pinned(np.full((4,), calibrated_ms)))
  spec = msj.SpecParams(
    drafter="controlled", num_draft="auto", max_draft=3, research=_controlled(0.8, auto_timing=True)
  )
  out = msj.generate(auto_model, RAGGED, max_new_tokens=20, spec=spec, reference_tokens=auto_plain)
  np.testing.assert_array_equal(out.tokens, auto_plain)
  assert out.stats["auto_timing"] is True
  factor = auto_draft.MAX_TIMING_RATIO if calibrated_ms < 1 else 1 / auto_draft.MAX_TIMING_RATIO
  np.testing.assert_allclose(out.stats["corrected_step_ms"], np.full(4, calibrated_ms * factor), rtol=1e-4)
  untimed = msj.generate(
    auto_model,
    RAGGED,
    max_new_tokens=20,
    reference_tokens=auto_plain,
    spec=msj.SpecParams(drafter="controlled", num_draft="auto", max_draft=3, research=_controlled(0.8)),
  )
  assert untimed.stats["auto_timing"] is False and "corrected_step_ms" not in untimed.stats


def test_pass_trace_records_the_k_auto_chose_each_pass(auto_model, auto_plain, monkeypatch):
  monkeypatch.setattr(loop, "calibrate_step_ms", _pinned([1.0, 1.2, 1.4, 1.6]))
  spec = msj.SpecParams(drafter="controlled", num_draft="auto", max_draft=3, research=_controlled(0.9, pass_trace=True))
  out = msj.generate(auto_model, RAGGED, max_new_tokens=20, spec=spec, reference_tokens=auto_plain)
  np.testing.assert_array_equal(out.tokens, auto_plain)
  ks = out.stats["pass_trace"]["num_draft"]
  assert np.bincount(ks, minlength=4).tolist() == out.stats["passes_by_num_draft"] and max(ks) > 0


def test_the_calibrated_prior_is_the_calibrations_acceptance_at_a_fixed_weight():
  w = auto_draft.CALIBRATION_PRIOR_WEIGHT
  np.testing.assert_allclose(auto_draft.calibrated_prior(np.array([30.0, 40.0])), [0.75 * w, w])
  np.testing.assert_array_equal(auto_draft.calibrated_prior(None), [0.0, 0.0])
  assert w >= auto_draft.MIN_EVIDENCE  # enough for the final K = 0 at the first choice
  for bad in ([5.0, 0.0], [5.0, 4.0], [-1.0, 4.0]):
    with pytest.raises(ValueError, match="accepted, tried"):
      auto_draft.calibrated_prior(np.array(bad))


@pytest.mark.parametrize("drafts", [None, (10.0, 100.0), (100.0, 100.0)])
def test_mtp_heads_start_only_where_the_calibration_leaves_drafting_a_chance(
  auto_model, auto_plain, drafts, monkeypatch
):
  """Pass times where K = 1 pays only at an acceptance near 1: with the calibration's drafts
  mostly rejected, the heads are never started and every pass is plain; without a prior they start
  and draft until they have the evidence; with every calibrated draft accepted they draft. Greedy
  output is plain greedy's throughout."""
  step_ms_K = np.array([1.0, 1.8, 2.6, 3.4], np.float32)
  drafts_2 = None if drafts is None else np.array(drafts)
  monkeypatch.setattr(
    loop,
    "calibrate_step_ms",
    lambda ls, args, run, progress: calibration.Calibration(step_ms_K, "held_runs", 0.0, drafts_2),
  )
  spec = msj.SpecParams(drafter="mtp", num_draft="auto", max_draft=3)
  out = msj.generate(auto_model, RAGGED, max_new_tokens=20, spec=spec)
  np.testing.assert_array_equal(out.tokens, auto_plain)
  s = out.stats
  passes_K = s["passes_by_num_draft"]
  assert s["calibration_acceptance"] == (None if drafts is None else drafts[0] / drafts[1])
  if drafts == (10.0, 100.0):
    assert not s["drafter_started"] and passes_K == [s["verify_passes"], 0, 0, 0]
  else:
    assert s["drafter_started"] and sum(passes_K[1:]) >= 1


def test_auto_calibrates_on_its_own_program(auto_model, auto_plain, monkeypatch):
  """generate's calibration times the auto program itself, held at each K, where its runs pass
  often enough at every K (no loops of passes timed), and in loops where they do not."""
  programs.PROGRAMS.forget()
  loops = []
  monkeypatch.setattr(
    calibration,
    "measure_step_ms",
    lambda ls, args, rounds: loops.append(ls.max_new_tokens) or np.array([1.0, 1.2, 1.4]),
  )
  monkeypatch.setattr(calibration, "CALIBRATION_ROUNDS", 2)
  try:
    for max_new in (20, 3):
      spec = msj.SpecParams(drafter="controlled", num_draft="auto", max_draft=2, research=_controlled(0.8))
      out = msj.generate(auto_model, RAGGED, max_new_tokens=max_new, spec=spec, reference_tokens=auto_plain)
      np.testing.assert_array_equal(out.tokens, auto_plain[:, :max_new])
      assert len(out.stats["calibrated_step_ms"]) == 3 and min(out.stats["calibrated_step_ms"]) > 0
      assert out.stats["calibration"] == ("held_runs" if max_new == 20 else "loops")
      # The held runs' drafts: the controlled drafter's acceptance (auto's prior); loops count none.
      acceptance = out.stats["calibration_acceptance"]
      assert (0.6 < acceptance < 0.95) if max_new == 20 else acceptance is None
    assert loops == [3]  # 3 tokens: too few passes at every K
  finally:
    programs.PROGRAMS.forget()


def test_drafting_pays_at_the_lowest_acceptance_where_some_k_beats_plain():
  """The rate at which `choose_k` would first draft: at it some K >= 1 beats plain decoding by
  DRAFT_MARGIN, a grid step below it none does; where K = 2's pass costs little more than K = 1's
  it is K = 2 that pays first, below K = 1's own break-even; where no K pays, 1.0."""
  step = 1.0 / (auto_draft.PAYS_AT_GRID - 1)

  def beaten_by(a, step_ms):  # the K's that beat plain at geometric acceptance a
    k_K = np.arange(len(step_ms))
    rate_K = (1 - a ** (k_K + 1)) / (1 - a) / np.asarray(step_ms)
    return [k for k in k_K[1:] if rate_K[k] > (1 + auto_draft.DRAFT_MARGIN) * rate_K[0]]

  for step_ms in ([1.0, 1.5, 2.0, 2.5], [1.0, 1.5, 1.55, 3.0]):
    a = float(auto_draft.drafting_pays_at(jnp.asarray(step_ms, jnp.float32)))
    assert beaten_by(a, step_ms) and not beaten_by(a - step, step_ms)
  one_draft_even = 1.5 * (1 + auto_draft.DRAFT_MARGIN) - 1  # K = 1's break-even, 0.65
  linear = float(auto_draft.drafting_pays_at(jnp.asarray([1.0, 1.5, 2.0, 2.5], jnp.float32)))
  assert linear == pytest.approx(one_draft_even, abs=step)  # there K = 1 pays first
  concave = float(auto_draft.drafting_pays_at(jnp.asarray([1.0, 1.5, 1.55, 3.0], jnp.float32)))
  assert concave < one_draft_even - 0.05 and beaten_by(concave, [1.0, 1.5, 1.55, 3.0]) == [2]
  assert float(auto_draft.drafting_pays_at(jnp.asarray([1.0, 3.0, 5.0], jnp.float32))) == 1.0
