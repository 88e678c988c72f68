"""The KV cache: an explicit pytree passed into and returned from every pass.

Each layer holds keys and values for `max_len` positions per (row, head) pair, the pairs
flattened row-major into one leading axis: values [N = B * H, S, D], keys key-major
[N, D, S]. Attention's per-head products are then batched matmuls over N that read the cache
as it lies: scores = q [Q, D] @ keys [D, S], out = probs [Q, S] @ values [S, D]. (Keys
position-major, [N, S, D], made the score product several times slower on XLA:CPU; with
positions before heads XLA:CPU copied the whole cache on every pass to reorder it; with a
separate unit batch axis, [1, H, S, D], it duplicated the in-place update and copied every
cache several times per pass inside the decoding loop: docs/findings/2026-11-29-kv-cache-layout.md.)
A pass of n tokens at positions [p, p+n) writes its
keys/values there and attends to positions <= its own, so a rollback after rejected drafts
is only a position change: stale entries beyond the committed length are overwritten
before any query can see them.

The cache does not interpret its entries: grouped-query attention stores per-head keys
[B * H_kv, D_head, S] and values [B * H_kv, S, D_head]; MLA (model/mla.py) stores its
compressed KV latent as `keys` [B, S, kv_lora_rank] and the shared rotary key as `values`
[B, S, qk_rope_head_dim] (one "head"). Both write with `write_positions`, so the speculative
loop is the same for either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from moespec_jax.config import ModelConfig

# One layer's (keys, values) as `KVCache` holds them.
LayerCache = tuple[jax.Array, jax.Array]


@struct.dataclass
class KVCache:
  keys: tuple  # per layer [B * H_kv, D_head, S] (MLA: latent [B, S, kv_lora_rank])
  values: tuple  # per layer [B * H_kv, S, D_head] (MLA: rope key [B, S, qk_rope_head_dim])

  @classmethod
  def for_config(cls, config: ModelConfig, batch: int, max_len: int, n_layers: int | None = None) -> KVCache:
    """A zero cache shaped for `config`'s attention (`ModelConfig.cache_dims`) and dtype, one
    layer per decoder layer (or `n_layers`, e.g. one per MTP module)."""
    heads, key_dim, value_dim = config.cache_dims
    n = config.n_layers if n_layers is None else n_layers
    dtype = jnp.dtype(config.dtype)
    key_shape = (
      (batch * heads, max_len, key_dim) if config.attention_type == "mla" else (batch * heads, key_dim, max_len)
    )
    return cls(
      keys=tuple(jnp.zeros(key_shape, dtype) for _ in range(n)),
      values=tuple(jnp.zeros((batch * heads, max_len, value_dim), dtype) for _ in range(n)),
    )

  @property
  def max_len(self) -> int:
    return self.values[0].shape[1]

  def move_path(self, start_B: jax.Array, source_BW: jax.Array, *, key_major: bool) -> KVCache:
    """Every layer's entries at slots start + i take those at start + source[i] (`move_window`):
    after a tree pass, the accepted path's nodes moved to the consecutive slots a chain would
    have written. `key_major`: keys [N, D, S] (grouped-query attention; MLA's latent is [B, S, C])."""
    batch = start_B.shape[0]

    def moved(c: jax.Array, is_key: bool) -> jax.Array:
      return move_window(c, start_B, source_BW, c.shape[0] // batch, key_major=is_key and key_major)

    return KVCache(keys=tuple(moved(c, True) for c in self.keys), values=tuple(moved(c, False) for c in self.values))


def write_rows(buffer_BS: jax.Array, new_BT: jax.Array, start_B: jax.Array) -> jax.Array:
  """Writes each row's n new entries (axis 1) at its own start position (no copy under jit)."""

  def one_row(b_S: jax.Array, n_T: jax.Array, s: jax.Array):
    return jax.lax.dynamic_update_slice_in_dim(b_S, n_T.astype(b_S.dtype), s, axis=0)

  return jax.vmap(one_row)(buffer_BS, new_BT, start_B)


def write_positions(cache: jax.Array, new_BTHD: jax.Array, start_B: jax.Array, *, key_major: bool = False) -> jax.Array:
  """Writes a pass's T new entries per row (as the projections give them, [B, T, H, D]) into
  the cache, [N = B * H, S, D] (`key_major`: [N, D, S]), at each row's start position (in
  place under jit)."""
  b, t, h, d = new_BTHD.shape
  new_NTD = jnp.swapaxes(new_BTHD, 1, 2).reshape(b * h, t, d).astype(cache.dtype)
  new = jnp.swapaxes(new_NTD, 1, 2) if key_major else new_NTD
  axis = 2 if key_major else 1
  # One start for every head: a plain update, not a scatter. (Not for several key-major positions:
  # XLA:CPU then copied the whole cache into the update instead of writing in place.)
  if b == 1 and not (key_major and t > 1):
    return jax.lax.dynamic_update_slice_in_dim(cache, new, start_B[0], axis=axis)
  start_N = jnp.repeat(start_B, h)
  return jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n, s, axis=axis - 1))(cache, new, start_N)


@struct.dataclass
class TreeMask:
  """A tree pass's attention: its T entries are written at slots write_B.. (consecutive) while
  its positions (RoPE) go by depth, and each query reads every slot before `base_B` and the slots
  of the window [base, base + M) that `mask_BTM` marks (itself and its ancestors). The target's
  tree pass: base = write = the pending token's slot, the mask over the pass itself; a drafter's
  frontier pass: the window holds the tree's earlier levels too."""

  base_B: jax.Array
  """int32 [B]: the window's first slot."""
  write_B: jax.Array
  """int32 [B]: the slot of the pass's first entry (within the window)."""
  mask_BTM: jax.Array
  """bool [B, T, M]: the window slots each query reads."""

  @classmethod
  def over_pass(cls, start_B: jax.Array, mask_BTT: jax.Array) -> TreeMask:
    """A pass that is the whole tree, written from `start_B`, visible as `mask_BTT` says."""
    return cls(base_B=start_B, write_B=start_B, mask_BTM=mask_BTT)


def visible_slots(n_slots: int, query_positions_BT: jax.Array, tree: TreeMask | None = None) -> jax.Array:
  """bool [B, T, S]: the cache slots each of a pass's queries reads: a chain pass (slot = position)
  the slots up to the query's own position; a tree pass as its `TreeMask` says."""
  slot_S = jnp.arange(n_slots, dtype=jnp.int32)
  if tree is None:
    return slot_S[None, None] <= query_positions_BT[:, :, None]
  m = tree.mask_BTM.shape[2]
  rel_BS = slot_S[None] - tree.base_B[:, None]
  index_BTS = jnp.broadcast_to(jnp.clip(rel_BS, 0, m - 1)[:, None], (*tree.mask_BTM.shape[:2], n_slots))
  in_window_BTS = jnp.take_along_axis(tree.mask_BTM, index_BTS, axis=2) & ((rel_BS >= 0) & (rel_BS < m))[:, None]
  return (rel_BS < 0)[:, None] | in_window_BTS


def move_window(
  cache: jax.Array, start_B: jax.Array, source_BW: jax.Array, heads: int, *, key_major: bool = False
) -> jax.Array:
  """Each row's W entries from slot start + i take the entry at start + source[i] (a permutation
  or any map into the window): a tree pass's accepted path moved to consecutive slots. `cache`:
  [N = B * heads, S, D] (`key_major`: [N, D, S])."""
  w = source_BW.shape[1]
  axis = 2 if key_major else 1
  start_N, source_NW = jnp.repeat(start_B, heads), jnp.repeat(source_BW, heads, axis=0)

  def one(c: jax.Array, s: jax.Array, src_W: jax.Array):
    window = jax.lax.dynamic_slice_in_dim(c, s, w, axis=axis - 1)
    return jax.lax.dynamic_update_slice_in_dim(c, jnp.take(window, src_W, axis=axis - 1), s, axis=axis - 1)

  return jax.vmap(one)(cache, start_N, source_NW)
