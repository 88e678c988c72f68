"""The cost model's mathematics."""

import numpy as np
import pytest

from moespec_jax.analysis import cost_model as cm


def _times(fixed=1.0, per_token=0.3, draft=0.1):
  return (lambda k: draft * k), (lambda n: fixed + per_token * n)


def test_fit_kernel_recovers_bandwidth_and_fixed_time():
  b = np.array([1e6, 2e6, 4e6, 8e6])
  t = b / (20e9) * 1e3 + 0.05
  fit = cm.fit_kernel(b, t)
  assert fit.gbps == pytest.approx(20.0, rel=1e-6)
  assert fit.fixed_ms == pytest.approx(0.05, rel=1e-6)
  with pytest.raises(ValueError, match="two distinct"):
    cm.fit_kernel([1e6, 1e6], [1.0, 1.0])


def test_tokens_per_pass_limits():
  assert cm.tokens_per_pass(0.0, 4) == pytest.approx(1.0)
  assert cm.tokens_per_pass(1.0, 4) == pytest.approx(5.0)
  assert cm.tokens_per_pass(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
  assert cm.tokens_per_pass(0.9, 0) == pytest.approx(1.0)


def test_best_k_limits_and_monotone_staircase():
  draft, verify = _times()
  t_plain = verify(1)
  assert cm.best_k(0.0, 8, t_plain, draft, verify)[0] == 0  # nothing accepted: don't speculate
  assert cm.best_k(1.0 - 1e-9, 8, t_plain, draft, verify)[0] == 8  # everything accepted: draft the most
  alphas = np.linspace(0, 0.999, 200)
  ks = cm.staircase(alphas, 8, t_plain, draft, verify)
  assert all(b >= a for a, b in zip(ks, ks[1:])), "the best K must not decrease with acceptance"
  assert len(set(ks)) > 3


def test_speculation_pays_only_above_break_even():
  draft, verify = _times()
  t_plain = verify(1)
  a0 = cm.break_even_acceptance(3, t_plain, draft, verify)
  assert 0 < a0 < 1
  assert cm.speedup(a0 - 1e-3, 3, t_plain, draft, verify) < 1 < cm.speedup(a0 + 1e-3, 3, t_plain, draft, verify)
  # An expensive verify never pays.
  assert cm.break_even_acceptance(3, 1.0, lambda k: 0.0, lambda n: 10.0 * n) is None


def test_crossover_and_amdahl():
  assert cm.crossover([1, 2, 4, 8], [5, 4, 3, 2], [1, 2, 3.5, 6]) == 4
  assert cm.crossover([1, 2], [5, 5], [1, 1]) is None
  # Measured curves that cross back and forth: the first win against the first for good.
  sizes, dedup, per_slot = [1, 2, 3, 4, 5], [1.0, 2.1, 2.9, 4.1, 4.8], [1.1, 2.0, 3.0, 4.0, 5.0]
  assert cm.crossover(sizes, dedup, per_slot) == 1
  assert cm.crossover(sizes, dedup, per_slot, for_good=True) == 5
  assert cm.crossover(sizes, dedup[:4], per_slot[:4], for_good=True) is None
  assert cm.crossover([1, 2, 4, 8], [5, 4, 3, 2], [1, 2, 3.5, 6], for_good=True) == 4
  assert cm.amdahl_ratio(0.3, 2.55 * 8, 8) == pytest.approx(1.465)
  assert cm.amdahl_ratio(0.0, 20, 8) == 1.0
  assert cm.amdahl_fraction(4.0, 1.0) == 0.25


def test_quality_figures():
  import jax.numpy as jnp

  from moespec_jax.decoding import quality

  exact = jnp.asarray([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
  agree, kl, n = quality.logit_agreement(exact, exact, jnp.asarray([True, True]))
  assert float(agree) == 2 and float(kl) == pytest.approx(0.0, abs=1e-6) and float(n) == 2
  other = jnp.asarray([[0.0, 1.0, 2.0], [0.0, 3.0, 1.0]])
  agree, kl, n = quality.logit_agreement(exact, other, jnp.asarray([True, False]))
  assert float(agree) == 0 and float(kl) > 0.5 and float(n) == 1
  assert quality.first_divergence(np.array([[1, 2, 3], [4, 5, 6]]), np.array([[1, 2, 3], [4, 0, 6]])) == [None, 1]


def test_expert_parallel_collectives_and_pass_time():
  link = cm.Interconnect(link_gbps=100.0, cross_node_gbps=10.0, latency_us=5.0, ranks_per_node=4)
  # A ring all-reduce: 2 (R - 1) / R of the message over the link, plus the fixed time.
  assert cm.allreduce_ms(1e6, 4, link) == pytest.approx(1.5 * 1e6 / 100e6 + 0.005)
  assert cm.allreduce_ms(1e6, 8, link) == pytest.approx(1.75 * 1e6 / 10e6 + 0.005)  # spans two nodes
  assert cm.allreduce_ms(1e6, 1, link) == 0.0
  assert cm.all_to_all_ms(1e6, 0.5, link) == pytest.approx(0.5e6 / 100e6 + 0.5e6 / 10e6 + 0.005)
  parts = cm.ep_verify_ms(
    other_bytes=2e6,
    expert_bytes=1e6,
    slowest_rank_experts_L=[2.0, 3.0],
    tokens=4,
    d_model=1000,
    activation_bytes=2,
    ranks=4,
    read_gbps=1000.0,
    link=link,
    fixed_ms=0.01,
  )
  assert parts["other"] == pytest.approx(2e6 / 1e9)
  assert parts["experts"] == pytest.approx(5e6 / 1e9)
  assert parts["combine"] == pytest.approx(2 * cm.allreduce_ms(8000, 4, link))
  assert parts["total"] == pytest.approx(parts["other"] + parts["experts"] + parts["combine"] + 0.01)
  with pytest.raises(ValueError, match="bandwidths must be > 0"):
    cm.Interconnect(link_gbps=0.0, cross_node_gbps=1.0, latency_us=1.0, ranks_per_node=1)
  with pytest.raises(ValueError, match="ranks_per_node >= 1"):
    cm.Interconnect(link_gbps=1.0, cross_node_gbps=1.0, latency_us=1.0, ranks_per_node=0)
