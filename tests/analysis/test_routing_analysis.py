"""Routing statistics and the IPF max-entropy model."""

import numpy as np
import pytest

from moespec_jax.analysis import ipf, routing
from moespec_jax.analysis.routing import RoutingTrace
from moespec_jax.research import routing_report


def _trace(ids_NK, n_experts):
  return RoutingTrace([np.asarray(ids_NK)[None]], n_experts, {})


def test_counts_on_a_hand_built_trace():
  # k = 2, 4 experts; tokens: {0,1} {0,1} {0,2} {3,2}
  tr = _trace([[0, 1], [0, 1], [0, 2], [3, 2]], 4)
  np.testing.assert_allclose(routing.popularity(tr)[0], [3 / 4, 2 / 4, 2 / 4, 1 / 4])
  # windows of 2: {0,1}=2, {0,1,2}=3, {0,2,3}=3 -> mean 8/3
  assert routing.empirical_unique(tr, 2)[0] == pytest.approx(8 / 3)
  assert routing.empirical_unique(tr, 4)[0] == pytest.approx(4)
  # overlap at d=1: |{0,1}|=2, |{0}|=1, |{2}|=1 -> (2+1+1)/3/k
  assert routing.overlap_by_distance(tr, 1)[0, 0] == pytest.approx(4 / 3 / 2)
  assert routing.reuse(np.asarray([[[0, 1], [0, 1], [0, 2], [3, 2]]]))[0] == pytest.approx(1 - 4 / 8)
  # No window of 5 tokens in a 4-token trace: an error, not a count of zero experts.
  with pytest.raises(ValueError, match="no segment of the trace has 5 tokens"):
    routing.empirical_unique(tr, 5)


def test_routing_stats_refuses_what_the_trace_cannot_measure():
  trace = RoutingTrace([np.zeros((1, 12, 2), int), np.ones((1, 12, 2), int)], 4, {})
  with pytest.raises(ValueError, match="too short for passes of up to 16 tokens"):
    routing_report.routing_stats(trace, max_tokens=16, ipf_max_tokens=3, max_distance=2)
  with pytest.raises(ValueError, match="too short for passes of up to 4 tokens and overlap up to distance 12"):
    routing_report.routing_stats(trace, max_tokens=4, ipf_max_tokens=3, max_distance=12)
  with pytest.raises(ValueError, match="max_tokens and ipf_max_tokens >= 2"):
    routing_report.routing_stats(trace, max_tokens=4, ipf_max_tokens=1, max_distance=2)


def test_uniform_and_independent_formulas():
  assert routing.uniform_unique(64, 6, 1) == pytest.approx(6)
  assert routing.uniform_unique(64, 6, 4) == pytest.approx(64 * (1 - (1 - 6 / 64) ** 4))
  p = np.full((1, 64), 6 / 64)
  assert routing.independent_unique(p, 4)[0] == pytest.approx(routing.uniform_unique(64, 6, 4))


def test_ipf_meets_its_constraints():
  p = np.array([0.3, 0.05, 0.6])
  # A feasible target: a stationary Markov chain's co-activations p (p + (1 - p) rho^d).
  rho = 0.6
  co = np.stack([p * (p + (1 - p) * rho**d) for d in range(1, 6)], axis=1)  # [E, D]
  n = 5
  prob = ipf.fit_joint(p, co, n)
  # `ipf._states` on purpose: the order of fit_joint's 2^n states is that table's, with no public name.
  states = ipf._states(n)
  for x in range(3):
    for t in range(n):
      assert prob[x][states[:, t]].sum() == pytest.approx(p[x], abs=1e-7)
    for d in range(1, n):
      for t in range(n - d):
        both = states[:, t] & states[:, t + d]
        assert prob[x][both].sum() == pytest.approx(co[x, d - 1], abs=1e-7)


def test_ipf_with_independent_pairs_is_the_independence_model():
  p = np.array([0.1, 0.25, 0.4, 0.02])
  co = np.outer(p, np.ones(8)) * p[:, None]
  for n in (2, 5, 9):
    assert ipf.expected_unique(p, co, n) == pytest.approx(np.sum(1 - (1 - p) ** n), rel=1e-7)


def test_ipf_predicts_unique_experts_of_a_correlated_router():
  """Sticky routing (each token keeps each expert of the previous token with probability 0.5)."""
  rng = np.random.default_rng(0)
  e, k, n_tokens = 16, 2, 6000
  weights = rng.dirichlet(np.ones(e))
  ids = [rng.choice(e, k, replace=False, p=weights)]
  for _ in range(n_tokens - 1):
    keep = [x for x in ids[-1] if rng.random() < 0.5]
    rest = [x for x in range(e) if x not in keep]
    w = weights[rest] / weights[rest].sum()
    ids.append(np.array(keep + list(rng.choice(rest, k - len(keep), replace=False, p=w))))
  ids = np.array(ids)
  trace = RoutingTrace([ids[None, i : i + 500] for i in range(0, n_tokens, 500)], e, {})
  stats = routing_report.routing_stats(trace, max_tokens=8, ipf_max_tokens=6, max_distance=5)
  assert stats["ipf_mean_abs_rel_error"] < 0.03
  # Correlation makes the independence model overestimate clearly more than IPF's error.
  assert stats["independent_mean_abs_rel_error"] > 3 * stats["ipf_mean_abs_rel_error"]
  assert stats["overlap_by_distance"][0]["overlap"] > stats["overlap_by_distance"][0]["independent"]


def test_trace_save_load_round_trip(tmp_path):
  tr = RoutingTrace([np.arange(12).reshape(1, 6, 2) % 5, np.ones((1, 3, 2), int)], 5, {"source": "x"})
  tr.save(tmp_path / "t.npz")
  back = RoutingTrace.load(tmp_path / "t.npz")
  assert back.n_experts == 5 and back.meta == {"source": "x"}
  for a, b in zip(tr.segments, back.segments):
    np.testing.assert_array_equal(a, b)
