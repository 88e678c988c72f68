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
