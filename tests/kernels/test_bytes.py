"""Byte accounting (pallas_kernels.bytes): unique experts and the bytes each method requests."""

import jax.numpy as jnp
import numpy as np

from pallas_kernels import bytes as kbytes


def test_bytes_requested():
  ids = np.array([[0, 1], [1, 2], [1, 0]])
  per_expert = 3 * 8 * 4 * 2
  act = kbytes.activation_bytes(3, 2, 8, 2)
  assert kbytes.unique_experts(ids) == 3
  assert int(kbytes.unique_experts_jnp(jnp.asarray(ids), 5)) == 3
  assert kbytes.bytes_requested(ids, 8, 4, 2, "dedup") == 3 * per_expert + act
  assert kbytes.bytes_requested(ids, 8, 4, 2, "per_slot") == 6 * per_expert + act
  assert kbytes.bytes_requested(ids, 8, 4, 2, "xla") == 6 * per_expert + act
  assert abs(kbytes.expected_unique_uniform(1, 64, 6) - 6.0) < 1e-9
