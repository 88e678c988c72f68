"""Building blocks (moespec_jax/model/layers.py): indexing one position per row, initialisation,
row-invariant sums and norms, rotary embeddings and the dense SwiGLU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moespec_jax.model import layers
from moespec_jax.model.kernels import Kernels
from pallas_kernels.policy import KernelPolicy


def test_at_index_takes_each_rows_own_positions():
  x_BTD = jnp.arange(2 * 4 * 3).reshape(2, 4, 3)
  one = layers.at_index(x_BTD, jnp.asarray([3, 1]))
  assert one.shape == (2, 1, 3)
  np.testing.assert_array_equal(one[:, 0], np.stack([x_BTD[0, 3], x_BTD[1, 1]]))
  window = layers.at_index(x_BTD, jnp.asarray([[0, 2], [1, 3]]))
  assert window.shape == (2, 2, 3)
  np.testing.assert_array_equal(window[1], x_BTD[1, jnp.asarray([1, 3])])


def test_fan_in_init_has_the_asked_spread():
  w = layers.fan_in_init(64, scale=0.5)(jax.random.key(0), (64, 512), jnp.float32)
  assert float(jnp.std(w)) == pytest.approx(0.5 / 8, rel=0.03)


@pytest.mark.parametrize("width", [1, 5, 8, 40])
def test_halving_sum_is_the_sum_and_each_rows_bits_its_own(width):
  x = jnp.asarray(np.random.default_rng(width).normal(size=(7, width)), jnp.float32)
  total = layers.halving_sum(x)
  assert total.shape == (7, 1)
  np.testing.assert_allclose(total[:, 0], np.sum(np.asarray(x, np.float64), axis=-1), rtol=1e-5, atol=1e-5)
  for i in range(7):
    np.testing.assert_array_equal(layers.halving_sum(x[i : i + 1]), total[i : i + 1])


@pytest.mark.parametrize("row_invariant", [False, True])
def test_rms_norm_scales_each_row_to_unit_rms_times_the_weight(row_invariant):
  norm = layers.RMSNorm(6, 1e-6)
  norm.weight[...] = jnp.arange(1.0, 7.0)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 6)), jnp.float32)
  y = norm(x, Kernels(KernelPolicy(row_invariant_norms=row_invariant)))
  expected = np.asarray(x) / np.sqrt(np.mean(np.asarray(x) ** 2, axis=-1, keepdims=True) + 1e-6) * np.arange(1, 7)
  np.testing.assert_allclose(y, expected, rtol=1e-5)


def test_rope_rotates_pairs_keeping_their_norm_and_scores_depend_on_distance_only():
  head_dim = 8
  positions_BT = jnp.asarray([[0, 1, 5, 9]])
  cos, sin = layers.rope_tables(positions_BT, head_dim, 10000.0, on_cpu=True)
  assert cos.shape == sin.shape == (1, 4, head_dim // 2)
  x_BTHD = jnp.asarray(np.random.default_rng(1).normal(size=(1, 4, 1, head_dim)), jnp.float32)
  rotated = layers.apply_rope(x_BTHD, cos, sin)
  np.testing.assert_allclose(rotated[0, 0], x_BTHD[0, 0], rtol=1e-6)  # position 0: no rotation
  np.testing.assert_allclose(jnp.linalg.norm(rotated, axis=-1), jnp.linalg.norm(x_BTHD, axis=-1), rtol=1e-5)
  # The same query and key at positions (1, 0) and (9, 8) score alike.
  q, k = x_BTHD[:, :1], x_BTHD[:, 1:2]
  at = lambda v, p: layers.apply_rope(v, *layers.rope_tables(jnp.asarray([[p]]), head_dim, 10000.0))  # noqa: E731
  assert float(jnp.sum(at(q, 1) * at(k, 0))) == pytest.approx(float(jnp.sum(at(q, 9) * at(k, 8))), rel=1e-4)
  scaled_cos, _ = layers.rope_tables(positions_BT, head_dim, 10000.0, scale=2.0)
  np.testing.assert_allclose(scaled_cos, 2.0 * cos, rtol=1e-6)


def test_swiglu_is_silu_gate_times_up_then_down():
  ffn = layers.SwiGLU(4, 6, out_scale=1.0, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(2).normal(size=(1, 2, 4)), jnp.float32)
  wg, wu, wd = (np.asarray(w[...]) for w in (ffn.w_gate_DF, ffn.w_up_DF, ffn.w_down_FD))
  g, u = np.asarray(x) @ wg, np.asarray(x) @ wu
  np.testing.assert_allclose(ffn(x), (g / (1 + np.exp(-g)) * u) @ wd, rtol=1e-5, atol=1e-6)
