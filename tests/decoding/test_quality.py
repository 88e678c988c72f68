"""Quality of an approximate generation against the exact one (moespec_jax/decoding/quality.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moespec_jax.decoding import quality


def test_agreement_and_kl_count_the_valid_rows_only():
  exact_NV = jnp.asarray([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0], [1.0, 0.0, 2.0]])
  approx_NV = jnp.asarray([[2.0, 0.0, 0.0], [3.0, 0.0, 0.0], [9.0, 0.0, 0.0]])
  valid_N = jnp.asarray([True, True, False])
  agree, kl, count = quality.logit_agreement(exact_NV, approx_NV, valid_N)
  p = jax.nn.softmax(exact_NV[1])
  expected_kl = float(jnp.sum(p * (jax.nn.log_softmax(exact_NV[1]) - jax.nn.log_softmax(approx_NV[1]))))
  assert float(agree) == 1.0  # row 0 agrees, row 1 does not, row 2 is not counted
  assert float(kl) == pytest.approx(expected_kl, rel=1e-5)  # row 0's KL is 0
  assert float(count) == 2.0


def test_first_divergence_per_row():
  exact = np.array([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]])
  approx = np.array([[1, 2, 3, 4], [1, 2, 9, 4], [0, 6, 7, 8]])
  assert quality.first_divergence(exact, approx) == [None, 2, 0]
