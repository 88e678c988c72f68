"""The traced steps of a pass (moespec_jax/decoding/passes.py) that need no model: how many tokens
each row commits, and the cache's room for drafts. Whole passes run in test_spec_decoding.py."""

import jax.numpy as jnp
import numpy as np

from moespec_jax.decoding import passes

EOS = 9


def test_each_row_commits_its_accepted_drafts_and_one_more_cut_at_eos_and_max_new_tokens():
  cand_BS = jnp.asarray(
    [
      [5, 6, 7],  # two accepted, then the sampled token: 3
      [5, EOS, 7],  # EOS among the accepted drafts: committed, and the row ends there
      [5, 6, EOS],  # an EOS beyond the accepted ones is not a candidate
      [5, 6, 7],  # 2 tokens left of max_new_tokens
      [5, 6, 7],  # finished row: nothing
    ],
    jnp.int32,
  )
  n_acc_B = jnp.asarray([2, 2, 0, 2, 2], jnp.int32)
  active_B = jnp.asarray([True, True, True, True, False])
  gen_B = jnp.asarray([1, 1, 1, 8, 1], jnp.int32)
  n_commit_B, hit_eos_B = passes.commit_counts(cand_BS, n_acc_B, active_B, gen_B, EOS, 10)
  np.testing.assert_array_equal(n_commit_B, [3, 2, 1, 2, 0])
  np.testing.assert_array_equal(hit_eos_B, [False, True, False, False, False])


def test_cache_room_is_the_furthest_active_rows():
  pos_B = jnp.asarray([3, 10, 14], jnp.int32)
  assert int(passes.cache_room(pos_B, jnp.asarray([False, False, True]), 16)) == 5
  assert int(passes.cache_room(pos_B, jnp.asarray([False, True, True]), 16)) == 12
  assert int(passes.cache_room(pos_B, jnp.asarray([True, True, True]), 16)) == 16
