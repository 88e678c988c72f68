"""The column-block layout of the C++ products (pallas_kernels/cpu/packing.py)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cpu import PACK_COLUMNS, pack_columns


def test_blocks_hold_the_columns_in_order_zero_padded():
  w_DV = jnp.arange(3 * 10, dtype=jnp.float32).reshape(3, 10)
  packed_NDC = pack_columns(w_DV, block=4)
  assert packed_NDC.shape == (3, 3, 4) and packed_NDC.dtype == jnp.float32
  np.testing.assert_array_equal(packed_NDC[1], w_DV[:, 4:8])
  np.testing.assert_array_equal(packed_NDC[2, :, :2], w_DV[:, 8:])
  np.testing.assert_array_equal(packed_NDC[2, :, 2:], 0.0)
  # Unpacked: the blocks side by side are the weight and its padding.
  side_by_side = np.concatenate(list(np.asarray(packed_NDC)), axis=1)
  np.testing.assert_array_equal(side_by_side[:, :10], w_DV)


def test_the_default_block_and_refusals():
  assert pack_columns(jnp.ones((2, PACK_COLUMNS + 1))).shape == (2, 2, PACK_COLUMNS)
  with pytest.raises(ValueError, match=r"\[D, V\]"):
    pack_columns(jnp.ones((2, 3, 4)))
  with pytest.raises(ValueError, match="block >= 1"):
    pack_columns(jnp.ones((2, 3)), block=0)
