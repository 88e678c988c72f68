"""Routing (moespec_jax/model/moe.py): top-k gates and probabilities, and the routing a masked token
gets so that it reads no expert of its own. The router variants against hand-written references and
the MoE layer in the model are in test_model.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moespec_jax.config import ModelConfig
from moespec_jax.model import moe

LOGITS_TE = jnp.asarray([[2.0, 1.0, 0.0, -1.0], [0.0, 0.5, 3.0, 1.0]])


@pytest.mark.parametrize("norm, scale", [(True, 1.0), (False, 2.5)])
def test_softmax_top_k_gates_and_probabilities(norm, scale):
  config = ModelConfig(n_routed_experts=4, top_k=2, norm_topk_prob=norm, routed_scaling_factor=scale)
  ids_TK, gates_TK, probs_TE = moe.route(LOGITS_TE, config)
  np.testing.assert_array_equal(ids_TK, [[0, 1], [2, 3]])
  assert ids_TK.dtype == jnp.int32
  probs = np.asarray(jax.nn.softmax(LOGITS_TE, axis=-1))
  np.testing.assert_allclose(probs_TE, probs, rtol=1e-6)
  chosen = np.take_along_axis(probs, np.asarray(ids_TK), axis=-1)
  expected = chosen / chosen.sum(-1, keepdims=True) if norm else chosen
  np.testing.assert_allclose(gates_TK, expected * scale, rtol=1e-6)


def test_a_masked_token_points_at_the_first_valid_tokens_experts_with_gate_zero():
  ids_NK = jnp.asarray([[5, 6], [1, 2], [3, 4]], jnp.int32)
  gates_NK = jnp.full((3, 2), 0.5)
  ids, gates = moe.masked_to_read_experts(ids_NK, gates_NK, jnp.asarray([False, True, False]))
  np.testing.assert_array_equal(ids, [[1, 2], [1, 2], [1, 2]])  # no expert beyond the valid token's
  np.testing.assert_array_equal(gates, [[0.0, 0.0], [0.5, 0.5], [0.0, 0.0]])


def test_a_policy_without_routed_experts_keeps_the_shared_experts_and_the_routing():
  from flax import nnx

  from moespec_jax.model.kernels import Kernels
  from pallas_kernels.policy import KernelPolicy

  config = ModelConfig(d_model=16, n_routed_experts=4, top_k=2, n_shared_experts=1, expert_hidden=8)
  layer = moe.MoE(config, out_scale=1.0, rngs=nnx.Rngs(0))
  x_BTD = jax.random.normal(jax.random.key(1), (1, 3, 16))
  full_BTD, routing = layer(x_BTD)
  skipped_BTD, skipped_routing = layer(x_BTD, kernels=Kernels(KernelPolicy(routed_experts=False), None))
  np.testing.assert_allclose(skipped_BTD, layer.shared(x_BTD), rtol=1e-6)
  assert not np.allclose(full_BTD, skipped_BTD)  # the routed experts contribute where they run
  np.testing.assert_array_equal(routing[0], skipped_routing[0])
