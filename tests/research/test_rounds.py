"""analysis/rounds: generations timed side by side in rounds, speedups as per-round medians, the
best K with the rounds resampled, and rounds until it settles."""

import itertools
import types

import numpy as np
import pytest

import moespec_jax as msj
from moespec_jax.research import rounds


def test_median_ratio_interval_brackets_the_median_and_narrows_with_rounds():
  rng = np.random.default_rng(1)
  few, many = (rng.lognormal(0.0, 0.1, (2, n)) for n in (9, 201))
  intervals = []
  for num, den in (few, many):
    lo, hi = rounds.median_ratio_interval(num, den)
    assert lo <= rounds.median_ratio(num, den) <= hi
    intervals.append(hi - lo)
  assert intervals[1] < intervals[0] / 2
  assert rounds.median_ratio_interval([2.0, 4.0, 6.0], [1.0, 2.0, 3.0]) == (2.0, 2.0)
  with pytest.raises(ValueError, match="non-empty 1-D"):
    rounds.median_ratio_interval([], [])


def test_best_k_bootstrap_shares_follow_the_timing_noise():
  rng = np.random.default_rng(0)
  plain = np.ones(9)
  clear = [plain, 1.3 + 0.01 * rng.standard_normal(9), 1.6 + 0.01 * rng.standard_normal(9)]
  shares = rounds.best_k_bootstrap(clear, resamples=500)
  assert shares.tolist() == [0.0, 0.0, 1.0]
  # K = 1 and 3 equal within noise, K = 2 clearly worse: the best K splits between 1 and 3.
  tied = [plain, 1.5 + 0.05 * rng.standard_normal(9), np.full(9, 1.2), 1.5 + 0.05 * rng.standard_normal(9)]
  shares = rounds.best_k_bootstrap(tied, resamples=500)
  assert shares.sum() == pytest.approx(1.0) and shares[0] == shares[2] == 0.0
  assert 0.1 < shares[1] < 0.9 and 0.1 < shares[3] < 0.9
  assert rounds.share_within_one(shares, 2) == pytest.approx(1.0)
  assert rounds.share_within_one(shares, 0) == pytest.approx(shares[1])
  assert rounds.plausible_best_k(shares) == (1, 3)
  assert rounds.plausible_best_k([0.0, 0.05, 0.9, 0.05]) == (2, 2)
  assert rounds.plausible_best_k([0.0, 0.05, 0.9, 0.05], floor=0.01) == (1, 3)
  # Every K of a resample draws the same rounds: K = 2 beats K = 1 in every round, by less than
  # the spread between rounds, and is the best in every resample.
  k1 = np.array([1.1, 1.5, 1.9, 1.3, 1.7])
  assert rounds.best_k_bootstrap([np.ones(5), k1, k1 + 0.05], resamples=500).tolist() == [0.0, 0.0, 1.0]


def test_round_robin_balances_order_and_pairs_each_round(monkeypatch):
  """Plain and every spec run once per round, in the balanced order of timing.round_order,
  between two one-token runs (the round's prefill, the faster of the two, subtracted from its
  runs); a spec's speedup is the median of per-round ratios (a slow round moves plain and the spec
  together)."""
  calls = []
  slow = {1: 3.0}  # round 1 runs everything 3x slower
  base = {"none": 1.0, "a": 0.5, "b": 2.0}
  # After the warm-up: round 0 min(0.1, 0.3), round 1 min(0.6, 0.3).
  prefill = itertools.chain([0.2, 0.1, 0.3, 0.6, 0.3], itertools.repeat(0.1))

  def fake_generate(model, prompts, max_new_tokens, spec=None, seed=0, reference_tokens=None):
    if max_new_tokens == 1:
      calls.append((seed, "prefill"))
      return types.SimpleNamespace(tokens=np.zeros((1, 1), np.int32), stats={"seconds": next(prefill)})
    label = "none" if spec.drafter == "none" else ("a" if spec.num_draft == 1 else "b")
    calls.append((seed, label))
    seconds = (0.1 if seed == 0 else 0.3) + base[label] * slow.get(seed, 1.0)
    tokens = np.zeros((1, 4), np.int32) if label != "b" or seed < 2 else np.ones((1, 4), np.int32)
    return types.SimpleNamespace(tokens=tokens, stats={"seconds": seconds, "tokens_per_second": 4 / seconds})

  monkeypatch.setattr(msj, "generate", fake_generate)
  specs = {1: msj.SpecParams(drafter="ngram", num_draft=1), 2: msj.SpecParams(drafter="ngram", num_draft=2)}
  speedup, _, _, prefills, per_round = rounds.round_robin_speedups(None, [[1]], 4, specs, rounds=2)
  assert calls == [
    (0, "prefill"),
    (0, "prefill"),
    (0, "none"),
    (0, "a"),
    (0, "b"),
    (0, "prefill"),
    (1, "prefill"),
    (1, "a"),
    (1, "b"),
    (1, "none"),
    (1, "prefill"),
  ]
  assert prefills == pytest.approx([0.1, 0.3])
  # Exact only with each round's own prefill subtracted (0.1 in round 0, 0.3 in round 1).
  assert speedup[1] == pytest.approx(2.0) and speedup[2] == pytest.approx(0.5)
  assert per_round[1] == pytest.approx([2.0, 2.0]) and per_round[2] == pytest.approx([0.5, 0.5])
  with pytest.raises(AssertionError, match="differs from plain"):  # round 2: b's tokens differ
    rounds.round_robin_runs(None, [[1]], 4, specs, rounds=3, check_tokens=np.zeros((1, 4), np.int32))


def _fake_rounds(speedups_by_round):
  """`more` for rounds_until_settled: plain takes 1 s a round, K = k takes 1 / speedup; records its calls."""
  calls = []

  def more(first, n):
    calls.append((first, n))
    rows = [speedups_by_round(r) for r in range(first, first + n)]
    seconds = {None: [1.0] * n, **{k: [1.0 / row[k - 1] for row in rows] for k in range(1, len(rows[0]) + 1)}}
    return rounds.RoundRobin(seconds, {k: [{"round": r} for r in range(first, first + n)] for k in seconds}, [0.01] * n)

  return more, calls


def test_rounds_stop_once_the_measured_best_k_is_settled():
  more, calls = _fake_rounds(lambda r: [1.1, 1.3 + 0.01 * (r % 2), 1.2])  # K = 2 best in every round
  runs = rounds.rounds_until_settled(more, [1, 2, 3], repeats=3, max_repeats=9, settled_share=0.9)
  assert calls == [(0, 3)] and len(runs.prefill_s) == 3


def test_rounds_grow_where_the_best_k_moves_with_the_noise_up_to_the_cap():
  """K = 1 and K = 4 trade places from round to round (neither within 1 of the other): more rounds,
  continuing the round numbers, until max_repeats."""
  more, calls = _fake_rounds(lambda r: [1.3, 1.0, 1.0, 1.25] if r % 2 else [1.25, 1.0, 1.0, 1.3])
  runs = rounds.rounds_until_settled(more, [1, 2, 3, 4], repeats=3, max_repeats=8, settled_share=0.9)
  assert calls == [(0, 3), (3, 3), (6, 2)]
  assert len(runs.prefill_s) == 8 and all(len(v) == 8 for v in runs.seconds.values())
  assert [s["round"] for s in runs.stats[4]] == list(range(8))
  assert runs.seconds[1][:2] == pytest.approx([1 / 1.25, 1 / 1.3])


def test_prompt_sets_are_taken_in_turn_and_each_checked_against_its_own_reference(monkeypatch):
  """Round r decodes batch r % len, its runs checked against that batch's reference (and a
  controlled drafter reading it); rounds are rounded up to whole turns."""
  seen = []

  def fake_generate(model, prompts, max_new_tokens, spec=None, seed=0, reference_tokens=None):
    tokens = np.full((1, 4), len(prompts[0]), np.int32)
    if max_new_tokens > 1:
      seen.append(
        (
          seed,
          prompts[0],
          None if spec is None else spec.drafter,
          None if reference_tokens is None else int(reference_tokens[0, 0]),
        )
      )
    return types.SimpleNamespace(tokens=tokens, stats={"seconds": 1.0, "tokens_per_second": 4.0})

  monkeypatch.setattr(msj, "generate", fake_generate)
  sets = rounds.PromptSets((["a"], ["bb"], ["ccc"]), tuple(np.full((1, 4), n, np.int32) for n in (1, 2, 3)))
  assert len(sets) == 3 and sets.rounds_for(7) == 9 and sets.rounds_for(3) == 3 and sets.rounds_for(1) == 3
  # Each turn takes every batch once, shifted by one a turn.
  assert [sets.index(r) for r in range(9)] == [0, 1, 2, 1, 2, 0, 2, 0, 1]
  eight = rounds.PromptSets(tuple([str(i)] for i in range(8)), tuple(range(8)))
  for turn in range(4):
    assert sorted(eight.index(r) for r in range(8 * turn, 8 * turn + 8)) == list(range(8))
  # Against an order of runs that cycles every 4 rounds, each batch meets all four over 4 turns.
  assert all(sorted(r % 4 for r in range(32) if eight.index(r) == b) == [0, 1, 2, 3] for b in range(8))
  specs = {
    "c": msj.SpecParams(drafter="controlled", num_draft=1, research=msj.ResearchOptions(controlled_acceptance=0.5))
  }
  runs = rounds.round_robin_runs(None, sets, 4, specs, rounds=4, first_round=2)
  assert len(runs.prefill_s) == 4
  assert sorted((s, p) for s, p, d, _ in seen if d == "none") == [(2, "ccc"), (3, "bb"), (4, "ccc"), (5, "a")]
  # The controlled drafter reads its round's batch's reference.
  assert all(ref == len(p) for _, p, d, ref in seen if d == "controlled")
  wrong = rounds.PromptSets(sets.batches, (sets.references[0], np.zeros((1, 4), np.int32), sets.references[2]))
  with pytest.raises(AssertionError, match="differs from plain"):
    rounds.round_robin_runs(None, wrong, 4, specs, rounds=2)
  with pytest.raises(ValueError, match="own"):
    rounds.round_robin_runs(None, sets, 4, specs, rounds=1, check_tokens=sets.references[0])
  with pytest.raises(ValueError, match="one reference per prompt batch"):
    rounds.PromptSets((["a"],), ())


def test_warm_up_runs_plain_and_each_spec_once_on_the_first_batch(monkeypatch):
  """Before timed rounds: every program compiled and run once, untimed (a first run is slower than
  the later ones); a controlled drafter reads that batch's reference."""
  calls = []

  def fake_generate(model, prompts, max_new_tokens, spec=None, seed=0, reference_tokens=None):
    calls.append((spec.drafter, spec.num_draft, prompts, None if reference_tokens is None else reference_tokens[0]))

  monkeypatch.setattr(msj, "generate", fake_generate)
  controlled = msj.ResearchOptions(controlled_acceptance=0.5)
  specs = {
    1: msj.SpecParams(drafter="controlled", num_draft=1, research=controlled),
    2: msj.SpecParams(drafter="ngram", num_draft=2),
  }
  sets = rounds.PromptSets(([[1]], [[2]]), ([7], [8]))
  rounds.warm_up(None, sets, 4, specs)
  assert calls == [("none", 3, [[1]], None), ("controlled", 1, [[1]], 7), ("ngram", 2, [[1]], None)]
