"""model/expert_table.py: each token's most frequent experts, counted from the target's routing."""

import numpy as np
import pytest

import moespec_jax as msj
from moespec_jax.model import expert_table


def test_counted_tokens_predict_their_most_frequent_experts(tiny_model):
  """Against the routing of the same text read back from `forward_full`: a token's predicted
  experts are its K most frequent ones there (ties: the lower id), an unseen token's those of the
  router on its embedding; `predict` and `expert_sets` agree."""
  config = tiny_model.config
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, 40, size=(3, 24)).astype(np.int32)  # tokens >= 40 never occur
  table = expert_table.build(tiny_model.module(), tokens, batch=2)
  assert table.ids_LVK.shape == (config.n_moe_layers, config.vocab_size, config.top_k)
  routing = np.asarray(tiny_model.forward_full(tokens).routing.expert_ids)  # [L, B, T, K]
  for layer in range(config.n_moe_layers):
    for token in (3, 17, 39):
      hits = routing[layer][tokens == token].reshape(-1)
      if not hits.size:
        continue
      counts = np.bincount(hits, minlength=config.n_routed_experts)
      expected = np.argsort(-counts, kind="stable")[: config.top_k]
      np.testing.assert_array_equal(np.asarray(table.ids_LVK[layer, token]), expected)
  module = tiny_model.module()
  fallback = np.asarray(expert_table.router_prediction(module, module.embed_VD[...][np.array([200])]))
  np.testing.assert_array_equal(np.asarray(table.ids_LVK[:, 200]), fallback[:, 0])
  sets = np.asarray(table.expert_sets(np.array([[3, 200]]), config.n_routed_experts))
  predicted = np.asarray(table.predict(np.array([[3, 200]])))
  assert sets.shape == (1, 2, config.n_moe_layers, config.n_routed_experts)
  for j in range(2):
    for layer in range(config.n_moe_layers):
      assert set(np.flatnonzero(sets[0, j, layer])) == set(predicted[0, j, layer].tolist())


def test_the_model_keeps_its_default_table(tiny_model):
  first = tiny_model.expert_table()
  assert tiny_model.expert_table() is first  # counted once per parameter set
  assert first.ids_LVK.shape[0] == tiny_model.config.n_moe_layers


def test_recall_counts_the_share_of_actual_experts_named():
  actual = np.array([[[0, 1], [2, 3]]])  # one layer, two tokens, K = 2
  predicted = np.array([[[1, 5], [2, 3]]])
  np.testing.assert_allclose(expert_table.recall(predicted, actual), [0.75])
  with pytest.raises(ValueError, match="differ"):
    expert_table.recall(predicted[:, :1], actual)


def test_bad_text_is_refused(tiny_model, tiny_config):
  with pytest.raises(ValueError, match="outside|lie in"):
    expert_table.build(tiny_model.module(), np.array([[1, tiny_config.vocab_size]]))
  with pytest.raises(ValueError, match="non-empty"):
    expert_table.build(tiny_model.module(), np.zeros((0,), np.int32))
  dense = msj.Model.init(tiny_config.replace(n_routed_experts=0, first_k_dense=tiny_config.n_layers), seed=0)
  with pytest.raises(ValueError, match="no MoE layer"):
    expert_table.build(dense.module(), np.array([[1, 2]]))
