"""Training losses (moespec_jax/training/losses.py) against hand-computed values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moespec_jax.training import losses


def test_cross_entropy_is_each_targets_negative_log_likelihood():
  logits_BTV = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 5)), jnp.float32)
  targets_BT = jnp.asarray([[0, 4, 2], [1, 1, 3]], jnp.int32)
  nll_BT = losses.cross_entropy(logits_BTV, targets_BT)
  logp = jax.nn.log_softmax(np.asarray(logits_BTV), axis=-1)
  expected = -np.take_along_axis(np.asarray(logp), np.asarray(targets_BT)[..., None], axis=-1)[..., 0]
  assert nll_BT.shape == (2, 3)
  np.testing.assert_allclose(nll_BT, expected, rtol=1e-6)


def test_balanced_routing_has_load_balance_loss_one_and_a_collapsed_one_more():
  # 1 layer, 4 tokens, top-1 of 4 experts: each expert once, uniform probabilities.
  ids_LBTK = jnp.asarray([[[[0], [1], [2], [3]]]], jnp.int32)
  uniform_LBTE = jnp.full((1, 1, 4, 4), 0.25)
  assert float(losses.load_balance_loss(ids_LBTK, uniform_LBTE)) == pytest.approx(1.0)
  collapsed_ids = jnp.zeros_like(ids_LBTK)
  collapsed_probs = jnp.asarray([[[[0.7, 0.1, 0.1, 0.1]] * 4]])
  assert float(losses.load_balance_loss(collapsed_ids, collapsed_probs)) == pytest.approx(4 * 0.7)


def test_expert_load_is_each_layers_share_of_assignments():
  ids_LBTK = jnp.asarray([[[[0, 1], [0, 2]]], [[[3, 3], [3, 1]]]], jnp.int32)  # [2 layers, 1, 2 tokens, top-2]
  load_LE = np.asarray(losses.expert_load(ids_LBTK, 4))
  np.testing.assert_allclose(load_LE, [[0.5, 0.25, 0.25, 0.0], [0.0, 0.25, 0.0, 0.75]])
