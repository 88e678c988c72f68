"""Verification of drafts (moespec_jax/decoding/rejection.py) on cases whose outcome is certain; the
acceptance law itself is tested statistically in test_acceptance_law.py."""

import jax
import jax.numpy as jnp
import numpy as np

from moespec_jax.decoding import rejection


def test_uniforms_are_strictly_inside_the_unit_interval():
  u = np.asarray(rejection.uniform_open(jax.random.key(0), (4096,)))
  assert u.dtype == np.float32 and u.min() > 0.0 and u.max() < 1.0
  assert 0.45 < u.mean() < 0.55


def test_residual_is_the_positive_part_of_p_minus_q():
  p = jnp.asarray([[0.5, 0.3, 0.2]])
  q = jnp.asarray([[0.2, 0.6, 0.2]])
  np.testing.assert_allclose(rejection.residual_probs(p, q), [[0.3, 0.0, 0.0]], atol=1e-7)


def test_accepted_count_is_the_leading_run():
  accept_BK = jnp.asarray([[True, True, False, True], [False, True, True, True], [True, True, True, True]])
  np.testing.assert_array_equal(rejection.accepted_count(accept_BK), [2, 0, 4])


def test_greedy_accepts_while_drafts_are_the_argmax_then_takes_it():
  # argmax per verified position: row 0 -> 1, 2, 3; row 1 -> 0, 0, 0.
  logits_BSV = jax.nn.one_hot(jnp.asarray([[1, 2, 3], [0, 0, 0]]), 4) * 5.0
  drafts_BK = jnp.asarray([[1, 2], [0, 3]])
  valid_BK = jnp.asarray([[True, True], [True, True]])
  accept_BK, n_B, next_B = rejection.verify_greedy(logits_BSV, drafts_BK, valid_BK)
  np.testing.assert_array_equal(accept_BK, [[True, True], [True, False]])
  np.testing.assert_array_equal(n_B, [2, 1])
  np.testing.assert_array_equal(next_B, [3, 0])  # row 0: the bonus token; row 1: the argmax at the mismatch
  _, n_B, next_B = rejection.verify_greedy(logits_BSV, drafts_BK, jnp.asarray([[False, True], [True, True]]))
  np.testing.assert_array_equal(n_B, [0, 1])  # an invalid slot is rejected whatever its token
  np.testing.assert_array_equal(next_B, [1, 0])


def test_sampled_verification_of_certain_outcomes():
  # Row 0: the drafts' q equals p and the bonus distribution is one token: all accepted, bonus 2.
  # Row 1: the first draft has p = 0 (q > 0): rejected at once, the residual is p's only token, 1.
  logp_BSV = jnp.log(jnp.asarray([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]], [[0.0, 1.0, 0.0], [0.3, 0.3, 0.4]]]))
  q_BKV = jnp.asarray([[[0.5, 0.5, 0.0]], [[1.0, 0.0, 0.0]]])
  drafts_BK = jnp.asarray([[1], [0]])
  valid_BK = jnp.ones((2, 1), bool)
  for seed in range(4):
    keys_B = jax.random.split(jax.random.key(seed), 2)
    accept_BK, n_B, next_B = rejection.verify_sampled(keys_B, logp_BSV, drafts_BK, q_BKV, valid_BK)
    np.testing.assert_array_equal(accept_BK, [[True], [False]])
    np.testing.assert_array_equal(n_B, [1, 0])
    np.testing.assert_array_equal(next_B, [2, 1])


# Trees: node j's parent (-1: the root, the pending token); S = N + 1 positions, node j at j + 1.
TREE_PARENTS = [-1, -1, 0, 0, 1, 2]  # two children of the root; 0 has two, 1 one; 2 has one


def test_node_depths_and_the_ancestor_mask():
  parent_BN = jnp.asarray([TREE_PARENTS, [-1, 0, 1, 2, 3, 4]])  # a tree and a chain
  np.testing.assert_array_equal(rejection.node_depths(parent_BN), [[1, 1, 2, 2, 2, 3], [1, 2, 3, 4, 5, 6]])
  mask_BSS = np.asarray(rejection.ancestor_mask(parent_BN))
  for b, parents in enumerate(np.asarray(parent_BN)):
    for i in range(len(parents) + 1):
      path, node = {0, i}, i - 1
      while node >= 0:  # the index's ancestors, by following parents
        path.add(node + 1)
        node = parents[node]
      np.testing.assert_array_equal(np.flatnonzero(mask_BSS[b, i]), sorted(path), err_msg=f"row {b}, index {i}")
  np.testing.assert_array_equal(mask_BSS[1], np.tril(np.ones((7, 7), bool)))  # a chain: causal


def test_tree_greedy_takes_the_longest_matching_path():
  # Argmax after each index: root -> 5, node 0 -> 6, node 1 -> 7, node 2 -> 8, node 3 -> 9, ...
  logits_BSV = jax.nn.one_hot(jnp.asarray([[5, 6, 7, 8, 9, 3, 4]] * 4), 10)
  parent_BN = jnp.asarray([TREE_PARENTS] * 4)
  tokens_BN = jnp.asarray(
    [
      [1, 5, 7, 8, 7, 2],  # node 1 matches the root (5), then its child 4 matches (7): path 1 -> 4
      [5, 5, 6, 8, 0, 2],  # node 0 matches, its duplicate sibling 1 is not tried; 0 -> 2 matches (6)
      [1, 2, 3, 4, 5, 6],  # nothing matches: the root's argmax follows
      [5, 5, 9, 6, 0, 8],  # node 0, then its second child 3 (6), then nothing under 3: node 3's argmax
    ]
  )
  valid_BN = jnp.ones((4, 6), bool)
  on_path_BN, n_B, last_B, next_B = rejection.verify_tree_greedy(logits_BSV, tokens_BN, parent_BN, valid_BN)
  np.testing.assert_array_equal(n_B, [2, 2, 0, 2])
  np.testing.assert_array_equal(last_B, [4, 2, -1, 3])
  np.testing.assert_array_equal(on_path_BN[0], [False, True, False, False, True, False])
  np.testing.assert_array_equal(next_B, [3, 8, 5, 9])
  # An invalid node is never accepted: without node 1, row 0 accepts nothing.
  _, n_B, _, next_B = rejection.verify_tree_greedy(logits_BSV, tokens_BN, parent_BN, valid_BN.at[0, 1].set(False))
  assert (int(n_B[0]), int(next_B[0])) == (0, 5)


def test_a_chain_tree_verifies_as_a_chain():
  keys = jax.random.split(jax.random.key(3), 3)
  logp_BSV = jax.nn.log_softmax(jax.random.normal(keys[0], (64, 4, 6)) * 2.0)
  q_BKV = jax.nn.softmax(jax.random.normal(keys[1], (64, 3, 6)) * 2.0)
  drafts_BK = jax.vmap(jax.vmap(lambda k, q: jax.random.categorical(k, jnp.log(q))))(
    jax.random.split(keys[2], (64, 3)), q_BKV
  )
  valid_BK = jnp.ones((64, 3), bool).at[:8, 2].set(False)
  chain_BN = jnp.broadcast_to(jnp.arange(-1, 2), (64, 3))
  row_keys = jax.random.split(jax.random.key(4), 64)
  accept_BK, n_B, next_B = rejection.verify_sampled(row_keys, logp_BSV, drafts_BK, q_BKV, valid_BK)
  on_path, n_tree_B, last_B, next_tree_B = rejection.verify_tree_sampled(
    row_keys, logp_BSV, drafts_BK, chain_BN, q_BKV, valid_BK
  )
  # The same uniforms decide the same drafts; the token after them is drawn from the same residual.
  np.testing.assert_array_equal(n_tree_B, n_B)
  np.testing.assert_array_equal(last_B, n_B - 1)
  np.testing.assert_array_equal(on_path, np.arange(3)[None] < np.asarray(n_B)[:, None])
  assert 0 < int(n_B.sum()) < 64 * 3
  greedy = rejection.verify_greedy(logp_BSV, drafts_BK, valid_BK)
  tree_greedy = rejection.verify_tree_greedy(logp_BSV, drafts_BK, chain_BN, valid_BK)
  np.testing.assert_array_equal(tree_greedy[1], greedy[1])
  np.testing.assert_array_equal(tree_greedy[3], greedy[2])
  np.testing.assert_array_equal(next_tree_B, next_B)
  del accept_BK
