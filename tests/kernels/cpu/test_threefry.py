"""pallas_kernels/cpu/threefry.py: threefry on CPU unrolled, the same bits."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry_2x32

from pallas_kernels.cpu import threefry


def test_unrolled_threefry_gives_the_known_answers_without_a_loop():
  """Random123's known-answer vectors for threefry2x32 (20 rounds), and no while loop left in the
  compiled program: the hash is one fused kernel."""
  assert threefry.use_unrolled_threefry()
  fn = jax.jit(threefry_2x32)
  cases = [
    ((0x0, 0x0), (0x0, 0x0), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
  ]
  for key, count, expected in cases:
    out = fn(jnp.asarray(key, jnp.uint32), jnp.asarray(count, jnp.uint32))
    np.testing.assert_array_equal(np.asarray(out, np.uint64), np.asarray(expected, np.uint64))
  program = fn.lower(jnp.zeros(2, jnp.uint32), jnp.zeros(2, jnp.uint32)).compile().as_text()
  assert " while(" not in program
  # jax.random on top of it draws what JAX's rolled lowering draws (these bits were taken with it).
  bits = jax.jit(lambda k: jax.random.bits(k, (4,)))(jax.random.key(0))
  np.testing.assert_array_equal(
    np.asarray(bits, np.uint64), np.asarray([0xF29A4FA7, 0xFA843692, 0x55110E28, 0x77FAA835], np.uint64)
  )
