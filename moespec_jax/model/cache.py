"""The KV cache: an explicit pytree passed into and returned from every pass.

Each layer holds keys and values for `max_len` positions per row. A pass of n tokens
at positions [p, p+n) writes its keys/values there and attends to positions <= its own,
so a rollback after rejected drafts is only a position change: stale entries beyond
the committed length are overwritten before any query can see them.

The cache does not interpret its entries: grouped-query attention stores per-head keys and
values [B, S, H_kv, D_head]; MLA (model/mla.py) stores its compressed KV latent as `keys`
[B, S, 1, kv_lora_rank] and the shared rotary key as `values` [B, S, 1, qk_rope_head_dim].
Both write with `write_rows` at positions, so the speculative loop is the same for either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
  keys: tuple  # per layer [B, S, H_kv, D_head] (MLA: latent [B, S, 1, kv_lora_rank])
  values: tuple  # per layer [B, S, H_kv, D_head] (MLA: rope key [B, S, 1, qk_rope_head_dim])

  @classmethod
  def zeros(cls, n_layers: int, batch: int, max_len: int, n_kv_heads: int, head_dim: int,
            dtype=jnp.float32) -> "KVCache":
    shape = (batch, max_len, n_kv_heads, head_dim)
    return cls(keys=tuple(jnp.zeros(shape, dtype) for _ in range(n_layers)),
               values=tuple(jnp.zeros(shape, dtype) for _ in range(n_layers)))

  @classmethod
  def for_config(cls, config, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
    """A zero cache shaped for `config`'s attention (`ModelConfig.cache_dims`)."""
    heads, key_dim, value_dim = config.cache_dims
    n = config.n_layers
    return cls(keys=tuple(jnp.zeros((batch, max_len, heads, key_dim), dtype) for _ in range(n)),
               values=tuple(jnp.zeros((batch, max_len, heads, value_dim), dtype) for _ in range(n)))

  @property
  def max_len(self) -> int:
    return self.keys[0].shape[1]


def write_rows(cache_BSHD, new_BTHD, start_B):
  """Writes each row's n new entries at its own start position (no copy under jit)."""

  def one_row(c_SHD, n_THD, s):
    return jax.lax.dynamic_update_slice_in_dim(c_SHD, n_THD.astype(c_SHD.dtype), s, axis=0)

  return jax.vmap(one_row)(cache_BSHD, new_BTHD, start_B)
