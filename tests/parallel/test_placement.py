"""`moespec_jax.parallel.placement`: placements, the rank loads of a trace's passes under them, and
a model whose experts are renumbered to realise one (same logits, renamed routing)."""

import numpy as np
import pytest

import moespec_jax as msj
from moespec_jax.parallel import placement


def test_contiguous_and_popularity_placements():
  np.testing.assert_array_equal(placement.contiguous(2, 8, 4), [[0, 0, 1, 1, 2, 2, 3, 3]] * 2)
  # The four hot experts sit on rank 0 contiguously; by popularity they go one to each rank.
  popularity = np.array([[4.0, 4, 4, 4, 1, 1, 1, 1]])
  rank_E = placement.by_popularity(popularity, 4)[0]
  assert sorted(rank_E[:4]) == [0, 1, 2, 3]
  assert np.all(np.bincount(rank_E, minlength=4) == 2)
  with pytest.raises(ValueError, match="6 experts do not divide over 4 ranks"):
    placement.contiguous(1, 6, 4)


def test_pass_pair_counts_and_imbalance():
  # One layer, top-2, 5 tokens: passes of 2 tokens are tokens (0, 1) and (2, 3); token 4 is left.
  seg = np.array([[[0, 1], [0, 2], [3, 1], [3, 3], [0, 0]]])
  (counts,) = placement.pass_pair_counts([seg], 4, 2)
  np.testing.assert_array_equal(counts, [[2, 1, 1, 0], [0, 1, 0, 3]])
  loads = placement.rank_loads(counts, np.array([0, 0, 1, 1]), 2)
  np.testing.assert_array_equal(loads, [[3, 1], [1, 3]])
  np.testing.assert_allclose(placement.imbalance(loads), [1.5, 1.5])
  np.testing.assert_allclose(placement.imbalance(np.zeros((1, 2))), [1.0])
  with pytest.raises(ValueError, match="no segment of the trace holds a pass of 8 tokens"):
    placement.pass_pair_counts([seg], 4, 8)


def test_replicating_hot_experts_fills_the_least_loaded_ranks():
  counts = np.array([[3.0, 0, 1, 0]])  # expert 0 (rank 0) hot: 3 of 4 pairs
  rank_E = np.array([0, 0, 1, 1])
  assert placement.imbalance(placement.rank_loads(counts, rank_E, 2))[0] == pytest.approx(1.5)
  hot = np.array([True, False, False, False])
  assert placement.replicated_imbalance(counts, rank_E, hot, 2)[0] == pytest.approx(1.0)


def test_placement_fitted_to_passes_spreads_experts_chosen_together():
  # Experts 0 and 1 always come together, as do 2 and 3: contiguously each pair shares a rank.
  rng = np.random.default_rng(0)
  pairs = np.array([[0, 1], [2, 3]])[rng.integers(0, 2, size=400)]
  (counts,) = placement.pass_pair_counts([pairs[None]], 4, 1)
  before = placement.imbalance(placement.rank_loads(counts, placement.contiguous(1, 4, 2)[0], 2)).mean()
  rank_E = placement.by_pass_load([counts], 2)[0]
  after = placement.imbalance(placement.rank_loads(counts, rank_E, 2)).mean()
  assert before == pytest.approx(2.0) and after == pytest.approx(1.0)
  assert rank_E[0] != rank_E[1] and rank_E[2] != rank_E[3]


def test_cross_node_share():
  counts = np.array([[1.0, 1, 1, 1]])
  # Ranks 0..3 on nodes of two ranks; the pass lives on rank 0 (node 0): experts 2, 3 cross.
  assert placement.cross_node_share(counts, np.arange(4), np.array([0]), 2) == pytest.approx(0.5)
  assert placement.cross_node_share(counts, np.zeros(4, int), np.array([0]), 2) == 0.0


def test_renumbered_model_has_the_same_logits_and_renamed_routing(tiny_config):
  model = msj.Model.init(tiny_config, seed=1)
  rng = np.random.default_rng(0)
  order = np.stack([rng.permutation(tiny_config.n_routed_experts) for _ in range(tiny_config.n_moe_layers)])
  renumbered = model.renumber_experts(order)
  tokens = rng.integers(2, tiny_config.vocab_size, size=(2, 16))
  before, after = model.forward_full(tokens), renumbered.forward_full(tokens)
  np.testing.assert_allclose(np.asarray(after.logits), np.asarray(before.logits), atol=1e-5)
  # New expert j is old expert order[j]: the routing names the same experts by their new numbers.
  old_ids, new_ids = np.asarray(before.routing.expert_ids), np.asarray(after.routing.expert_ids)
  for layer in range(tiny_config.n_moe_layers):
    np.testing.assert_array_equal(np.sort(order[layer][new_ids[layer]], -1), np.sort(old_ids[layer], -1))
  with pytest.raises(ValueError, match="permutation of the experts in every layer"):
    model.renumber_experts(np.zeros_like(order))
  grouped = msj.Model.init(tiny_config.replace(n_groups=2, topk_groups=1), seed=1)
  with pytest.raises(ValueError, match="group-limited routing"):
    grouped.renumber_experts(order)


def test_expert_order_realises_a_placement():
  rank_LE = np.array([[1, 0, 1, 0]])
  order = placement.expert_order(rank_LE)
  np.testing.assert_array_equal(order, [[1, 3, 0, 2]])  # rank 0's experts first
  with pytest.raises(ValueError, match="same number of experts"):
    placement.expert_order(np.array([[0, 0, 0, 1]]))
