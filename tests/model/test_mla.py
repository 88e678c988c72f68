"""MLA's rotary frequencies and softmax scale (moespec_jax/model/mla.py), plain and under YaRN; its
attention against the cache is checked with the whole model in test_model.py."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from moespec_jax.config import ModelConfig
from moespec_jax.model import layers, mla

MLA = dict(attention_type="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
YARN = dict(rope_scaling="yarn", rope_factor=40.0, rope_original_max_len=4096, rope_beta_fast=32.0, rope_beta_slow=1.0)


def test_without_scaling_the_frequencies_are_ropes():
  inv_freq, factor = mla.rope_inv_freq(ModelConfig(rope_theta=10000.0, **MLA))
  np.testing.assert_allclose(inv_freq, 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8), rtol=1e-6)
  assert factor == 1.0
  assert mla.softmax_scale(ModelConfig(**MLA)) == pytest.approx(16**-0.5)


def test_yarn_slows_the_low_frequencies_only_and_scales_the_tables():
  plain, _ = mla.rope_inv_freq(ModelConfig(**MLA))
  inv_freq, factor = mla.rope_inv_freq(ModelConfig(**MLA, **YARN))
  assert inv_freq[0] == pytest.approx(plain[0])  # the fastest rotation is kept
  assert inv_freq[-1] == pytest.approx(plain[-1] / 40.0, rel=1e-5)  # the slowest is interpolated
  assert factor == pytest.approx(0.1 * math.log(40.0) + 1.0)
  cos, _ = mla.rope_tables(jnp.zeros((1, 2), jnp.int32), ModelConfig(**MLA, **YARN))
  np.testing.assert_allclose(cos, factor, rtol=1e-6)  # position 0: cos = 1, times the attention factor
  ref_cos, _ = layers.rope_tables(jnp.ones((1, 1), jnp.int32), 8, 10000.0, inv_freq_F=inv_freq, scale=factor)
  np.testing.assert_allclose(mla.rope_tables(jnp.ones((1, 1), jnp.int32), ModelConfig(**MLA, **YARN))[0], ref_cos)


def test_yarn_with_mscale_all_dim_scales_the_softmax_not_the_tables():
  config = ModelConfig(**MLA, **YARN, rope_mscale=1.0, rope_mscale_all_dim=1.0)
  _, factor = mla.rope_inv_freq(config)
  assert factor == pytest.approx(1.0)
  m = 0.1 * math.log(40.0) + 1.0
  assert mla.softmax_scale(config) == pytest.approx(16**-0.5 * m * m)
