"""Routing metadata (pallas_kernels/metadata.py): (token, slot) rows sorted by expert and padded to
whole blocks, with static shapes, and the gated combine of the rows' outputs."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import metadata

# 4 tokens x top-2 over 5 experts; row r = t * 2 + k. Expert 4 unused, expert 1 chosen 3 times.
IDS_TK = np.array([[1, 3], [0, 1], [3, 1], [2, 0]], np.int32)


def test_rows_sorted_by_expert_stably_with_counts_and_starts():
  s = metadata.sort_rows(jnp.asarray(IDS_TK), 5)
  ids_R = IDS_TK.reshape(-1)
  np.testing.assert_array_equal(s.order_R, np.argsort(ids_R, kind="stable"))
  np.testing.assert_array_equal(s.sorted_expert_R, np.sort(ids_R))
  np.testing.assert_array_equal(s.counts_E, [2, 3, 1, 2, 0])
  np.testing.assert_array_equal(s.starts_E, [0, 2, 5, 6, 8])


@pytest.mark.parametrize("block_rows", [1, 2, 4])
def test_blocks_hold_one_expert_each_and_every_row_once(block_rows):
  meta = metadata.block_groups(jnp.asarray(IDS_TK), 5, block_rows)
  n_rows = IDS_TK.size
  n_blocks = meta.block_expert_N.shape[0]
  assert n_blocks == metadata.num_padded_blocks(n_rows, 5, block_rows)
  slot_R, row_M = np.asarray(meta.slot_of_row_R), np.asarray(meta.row_of_slot_M)
  assert sorted(slot_R.tolist()) == sorted(set(slot_R.tolist()))  # distinct slots
  np.testing.assert_array_equal(row_M[slot_R], np.arange(n_rows))  # the two maps are inverse
  assert np.sum(row_M < n_rows) == n_rows  # the other slots are padding
  ids_R = IDS_TK.reshape(-1)
  for r in range(n_rows):  # a row sits in a block of its own expert
    assert meta.block_expert_N[slot_R[r] // block_rows] == ids_R[r]
  used = int(meta.num_used_blocks)
  assert used == sum(-(-c // block_rows) for c in (2, 3, 1, 2, 0))
  # Unused blocks repeat the last used block's expert (no new weights fetched for them).
  np.testing.assert_array_equal(meta.block_expert_N[used:], meta.block_expert_N[used - 1])


def test_padded_block_bound():
  assert metadata.num_padded_blocks(8, 5, 4) == 6  # 8 rows and at most 3 padding rows in each of 5 groups: 23
  assert metadata.num_padded_blocks(2, 64, 8) == 2  # no more groups than rows


def test_combine_is_the_gated_sum_over_slots():
  y_RD = jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3)
  gates_TK = jnp.asarray([[0.5, 0.5], [1.0, 0.0], [0.25, 0.75], [0.0, 2.0]])
  y_TD = metadata.combine(y_RD, gates_TK, jnp.float32)
  expected = np.einsum("tk,tkd->td", np.asarray(gates_TK), np.asarray(y_RD).reshape(4, 2, 3))
  np.testing.assert_allclose(y_TD, expected)


def test_routed_ffn_dispatches_by_method():
  calls = []

  def dedup_rows(*args, **kwargs):
    calls.append(("dedup", sorted(kwargs)))
    return jnp.ones((8, 3))

  def per_slot_rows(*args, **kwargs):
    calls.append(("per_slot", sorted(kwargs)))
    return jnp.zeros((8, 3))

  x_TD, gates_TK = jnp.ones((4, 3)), jnp.full((4, 2), 0.5)
  args = (x_TD, jnp.asarray(IDS_TK), gates_TK, None, None, None)
  kw = dict(interpret=True, block_rows=2, hidden_tile=None)
  np.testing.assert_allclose(metadata.routed_ffn(dedup_rows, per_slot_rows, *args, method="dedup", **kw), 1.0)
  np.testing.assert_allclose(metadata.routed_ffn(dedup_rows, per_slot_rows, *args, method="per_slot", **kw), 0.0)
  assert calls == [("dedup", ["block_rows", "hidden_tile", "interpret"]), ("per_slot", ["hidden_tile", "interpret"])]
  with pytest.raises(ValueError, match="method"):
    metadata.routed_ffn(dedup_rows, per_slot_rows, *args, method="xla", **kw)
