"""Correlated routing by weight surgery on a random model: the recency head and its strength."""

import numpy as np
import pytest

from moespec_jax import cli
from moespec_jax.research import correlated_routing, models


@pytest.fixture(scope="module")
def model():
  return cli.model_from_config("membound_coarse", size="tiny")


def test_surgery_keeps_the_shapes_and_raises_the_overlap(model):
  strong = correlated_routing.correlate(model, 8.0)
  assert strong.config.qkv_bias and not model.config.qkv_bias
  assert strong.param_counts()["active"] - model.param_counts()["active"] == strong.config.n_layers * (
    (model.config.n_heads + 2 * model.config.n_kv_heads) * model.config.head_dim
  )
  layer = strong.module().layers[0]
  np.testing.assert_array_equal(np.asarray(layer.attn.w_q_DHK[...])[:, 0], 0.0)
  assert np.all(np.asarray(layer.attn.b_q_HK[...])[0, : model.config.head_dim // 2] > 0)
  base = correlated_routing.adjacent_overlap(model, n_segments=4, seq_len=64)
  assert correlated_routing.adjacent_overlap(strong, n_segments=4, seq_len=64) > base + 0.05


def test_the_variant_of_the_model_flag(model):
  fitted = models.load_model("config:membound_coarse,size=tiny,routing=correlated:2")
  assert fitted.config.qkv_bias
  with pytest.raises(ValueError, match="no fitted strength"):
    correlated_routing.correlated_variant(model, "correlated")
  with pytest.raises(ValueError, match="routing must be correlated"):
    correlated_routing.correlated_variant(model, "popular")
