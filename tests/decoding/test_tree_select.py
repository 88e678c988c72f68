"""decoding/tree_select.py: draft tree nodes chosen by their predicted experts, and truncation."""

import jax.numpy as jnp
import numpy as np
import pytest

import moespec_jax as msj
from moespec_jax.analysis import regime
from moespec_jax.decoding import tree_select

# Five candidates of one row: 0 and 1 follow the root, 2 and 3 follow 0, 4 follows 1.
PARENT = jnp.array([[-1, -1, 0, 0, 1]])
SCORE = jnp.array([[-0.1, -0.5, -0.3, -1.2, -0.9]])


def _sets(pairs_per_candidate, n_layers=1, n_experts=8):
  """bool [1, X, L, E] from each candidate's list of (layer, expert)."""
  out = np.zeros((1, len(pairs_per_candidate), n_layers, n_experts), bool)
  for x, pairs in enumerate(pairs_per_candidate):
    for layer, e in pairs:
      out[0, x, layer, e] = True
  return jnp.asarray(out)


def test_without_a_penalty_the_likeliest_paths_are_chosen_parents_first():
  sets = _sets([[(0, 1)], [(0, 2)], [(0, 3)], [(0, 4)], [(0, 5)]])
  root = _sets([[(0, 0)]])[:, 0]
  chosen, added, union = tree_select.select_expert_aware(SCORE, PARENT, sets, root, 3, penalty=0.0)
  np.testing.assert_array_equal(chosen, [[0, 2, 1]])  # -0.1, then -0.3 (under 0), then -0.5
  np.testing.assert_array_equal(added, [[1, 1, 1]])
  np.testing.assert_array_equal(np.flatnonzero(union[0]), [0, 1, 2, 3])


def test_a_penalty_prefers_nodes_whose_experts_the_pass_reads_already():
  """Candidate 1 (-0.5) brings two new experts, candidate 2 (-0.3) three: at penalty 1, after 0,
  candidate 4 (-0.9, under 1, no new expert once 1 is in) beats candidate 2; a child is never
  chosen before its parent."""
  sets = _sets([[(0, 1)], [(0, 2), (0, 3)], [(0, 4), (0, 5), (0, 6)], [(0, 7)], [(0, 2)]])
  root = _sets([[(0, 0)]])[:, 0]
  chosen, added, _ = tree_select.select_expert_aware(SCORE, PARENT, sets, root, 3, penalty=1.0)
  # Values after 0: 1 -> -0.5 - 2 = -2.5; 2 -> -3.3; 3 -> -2.2. Then 1's child 4 is not open yet.
  np.testing.assert_array_equal(chosen, [[0, 3, 1]])
  np.testing.assert_array_equal(added, [[1, 1, 2]])
  chosen4, _, _ = tree_select.select_expert_aware(SCORE, PARENT, sets, root, 4, penalty=1.0)
  assert chosen4[0, 3] == 4  # now open, and free


def test_inactive_rows_add_nothing_to_the_shared_union():
  sets = jnp.concatenate([_sets([[(0, 1)], [(0, 2)], [(0, 3)], [(0, 4)], [(0, 5)]])] * 2)
  root = jnp.concatenate([_sets([[(0, 0)]])[:, 0], _sets([[(0, 7)]])[:, 0]])
  _, _, union = tree_select.select_expert_aware(
    jnp.concatenate([SCORE] * 2), jnp.concatenate([PARENT] * 2), sets, root, 2, 0.0, jnp.array([True, False])
  )
  np.testing.assert_array_equal(np.flatnonzero(union[0]), [0, 1, 3])


def test_truncation_keeps_the_prefix_of_most_tokens_per_time():
  """Expected tokens 1 + sum q over predicted time fixed + per_node (n + 1) + per_expert * pairs:
  with likely first nodes and a costly expert-hungry tail, the prefix stops before the tail."""
  score = jnp.log(jnp.array([[0.9, 0.8, 0.05, 0.04]]))
  added = jnp.array([[1, 0, 6, 6]])
  cost = tree_select.TreeCost(fixed=1.0, per_node=0.0, per_expert=0.1)
  keep = tree_select.truncate(score, added, jnp.array([2]), cost)
  rates = [(1 + 0.9) / 1.3, (1 + 1.7) / 1.3, (1 + 1.75) / 1.9, (1 + 1.79) / 2.5]
  assert int(np.argmax(rates)) == 1
  np.testing.assert_array_equal(keep, [[True, True, False, False]])
  free = tree_select.TreeCost(fixed=1.0, per_node=0.0, per_expert=0.0)
  assert bool(tree_select.truncate(score, added, jnp.array([2]), free).all())  # nothing costs: keep all


def test_the_bytes_model_prices_a_plain_pass_at_one(tiny_config):
  cost = tree_select.TreeCost.from_bytes(tiny_config)
  plain_pairs = tiny_config.n_moe_layers * tiny_config.top_k
  np.testing.assert_allclose(float(cost.pass_time(jnp.float32(1), jnp.float32(plain_pairs))), 1.0, rtol=1e-6)
  expert = 3 * tiny_config.d_model * tiny_config.expert_hidden * 4
  np.testing.assert_allclose(cost.per_expert, expert / regime.weight_bytes(tiny_config, 1, float(tiny_config.top_k)))


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(fixed=-1.0, per_node=0.1, per_expert=0.1), "TreeCost.fixed"),
    (dict(fixed=0.0, per_node=0.0, per_expert=0.1), "fixed \\+ per_node > 0"),
    (dict(fixed=1.0, per_node=0.1, per_expert=float("nan")), "TreeCost.per_expert"),
  ],
)
def test_bad_costs_are_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    msj.TreeCost(**kwargs)
