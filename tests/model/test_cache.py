"""The KV cache (moespec_jax/model/cache.py): its shapes per attention type, and writes at each row's
own position, checked against writes by hand."""

import jax.numpy as jnp
import numpy as np
import pytest

from moespec_jax.config import ModelConfig
from moespec_jax.model import cache as cache_lib
from moespec_jax.model.cache import KVCache


def test_a_zero_cache_shaped_for_the_attention():
  gqa = KVCache.for_config(ModelConfig(n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8), batch=2, max_len=16)
  assert len(gqa.keys) == len(gqa.values) == 3 and gqa.max_len == 16
  assert gqa.keys[0].shape == (4, 8, 16) and gqa.values[0].shape == (4, 16, 8)  # keys key-major
  assert not np.any(np.asarray(gqa.keys[2]))
  mla_config = ModelConfig(attention_type="mla", kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
  mla = KVCache.for_config(mla_config, batch=2, max_len=16, n_layers=1)
  assert len(mla.keys) == 1 and mla.keys[0].shape == (2, 16, 12) and mla.values[0].shape == (2, 16, 4)


def test_write_rows_puts_each_rows_entries_at_its_start():
  buffer_BS = jnp.full((3, 6), -1, jnp.int32)
  new_BT = jnp.asarray([[1, 2], [3, 4], [5, 6]], jnp.int32)
  out = np.asarray(cache_lib.write_rows(buffer_BS, new_BT, jnp.asarray([0, 2, 4])))
  np.testing.assert_array_equal(out, [[1, 2, -1, -1, -1, -1], [-1, -1, 3, 4, -1, -1], [-1, -1, -1, -1, 5, 6]])


@pytest.mark.parametrize("batch, tokens", [(1, 1), (1, 3), (2, 1), (2, 3)])
@pytest.mark.parametrize("key_major", [False, True])
def test_write_positions_matches_a_write_by_hand(batch, tokens, key_major):
  heads, dim, length = 2, 3, 8
  rng = np.random.default_rng(batch * 10 + tokens)
  new_BTHD = rng.normal(size=(batch, tokens, heads, dim)).astype(np.float32)
  shape = (batch * heads, dim, length) if key_major else (batch * heads, length, dim)
  cache = rng.normal(size=shape).astype(np.float32)
  start_B = np.array([2, 5][:batch])
  expected = cache.copy()
  for b in range(batch):
    for h in range(heads):
      for t in range(tokens):
        if key_major:
          expected[b * heads + h, :, start_B[b] + t] = new_BTHD[b, t, h]
        else:
          expected[b * heads + h, start_B[b] + t] = new_BTHD[b, t, h]
  got = cache_lib.write_positions(jnp.asarray(cache), jnp.asarray(new_BTHD), jnp.asarray(start_B), key_major=key_major)
  np.testing.assert_array_equal(np.asarray(got), expected)
