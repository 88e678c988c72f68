"""The sort-based grouped XLA path (training): exactness and gradients against the reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import grouped, metadata
from pallas_kernels.reference import expert_ffn_reference


def _problem(seed, n_tokens, n_experts, top_k, d_model=16, hidden=8, routing="random"):
  k = jax.random.split(jax.random.key(seed), 6)
  x_TD = jax.random.normal(k[0], (n_tokens, d_model))
  if routing == "one":
    ids_TK = jnp.zeros((n_tokens, top_k), jnp.int32)
  else:
    ids_TK = jax.vmap(lambda kk: jax.random.choice(kk, n_experts - 1, (top_k,), replace=False))(
      jax.random.split(k[1], n_tokens)
    ).astype(jnp.int32)  # expert E-1 is never chosen
  gates_TK = jax.nn.softmax(jax.random.normal(k[2], (n_tokens, top_k)), axis=-1)
  s = 1.0 / np.sqrt(d_model)
  w = (
    jax.random.normal(k[3], (n_experts, d_model, hidden)) * s,
    jax.random.normal(k[4], (n_experts, d_model, hidden)) * s,
    jax.random.normal(k[5], (n_experts, hidden, d_model)) / np.sqrt(hidden),
  )
  return x_TD, ids_TK, gates_TK, w


def _loss(fn, ids_TK):
  def loss(x_TD, gates_TK, wg, wu, wd):
    y_TD = fn(x_TD, ids_TK, gates_TK, wg, wu, wd)
    return jnp.sum(y_TD * jnp.cos(jnp.arange(y_TD.size, dtype=jnp.float32).reshape(y_TD.shape)))

  return jax.grad(loss, argnums=(0, 1, 2, 3, 4))


@pytest.mark.parametrize(
  "n_tokens,n_experts,top_k,block_rows,routing",
  [
    (37, 8, 2, 8, "random"),  # n not a multiple of the block, expert 7 unused
    (40, 8, 1, 16, "random"),  # top_k = 1
    (24, 16, 8, 8, "random"),  # top_k = 8
    (33, 8, 4, 8, "one"),  # all tokens on one expert
    (1, 8, 2, 8, "random"),  # n = 1
  ],
)
def test_grouped_matches_reference_value_and_grad(n_tokens, n_experts, top_k, block_rows, routing):
  x_TD, ids_TK, gates_TK, w = _problem(n_tokens, n_tokens, n_experts, top_k, routing=routing)
  fn = functools.partial(grouped.expert_ffn_grouped, block_rows=block_rows)
  y = fn(x_TD, ids_TK, gates_TK, *w)
  y_ref = expert_ffn_reference(x_TD, ids_TK, gates_TK, *w)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  g = jax.jit(_loss(fn, ids_TK))(x_TD, gates_TK, *w)
  g_ref = jax.jit(_loss(expert_ffn_reference, ids_TK))(x_TD, gates_TK, *w)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_block_groups_static_bound_and_layout():
  ids_TK = jnp.array([[0, 3], [3, 1], [3, 0], [2, 3]], jnp.int32)
  meta = metadata.block_groups(ids_TK, 5, 2)
  rows = np.asarray(meta.row_of_slot_M)
  assert rows.shape[0] == metadata.num_padded_blocks(8, 5, 2) * 2
  slot = np.asarray(meta.slot_of_row_R)
  assert sorted(slot.tolist()) == sorted(set(slot.tolist()))
  np.testing.assert_array_equal(rows[slot], np.arange(8))
  # Each used block holds rows of one expert only.
  flat = np.asarray(ids_TK).reshape(-1)
  for b, e in enumerate(np.asarray(meta.block_expert_N)[: int(meta.num_used_blocks)]):
    rs = rows[2 * b : 2 * b + 2]
    assert all(flat[r] == e for r in rs if r < 8)


def test_entry_point_xla_uses_grouped_for_large_t():
  x_TD, ids_TK, gates_TK, w = _problem(0, 160, 8, 2)
  y = pallas_kernels.expert_ffn(x_TD, ids_TK, gates_TK, *w, method="xla")
  np.testing.assert_allclose(y, expert_ffn_reference(x_TD, ids_TK, gates_TK, *w), rtol=1e-5, atol=1e-5)
  g = jax.jit(_loss(functools.partial(pallas_kernels.expert_ffn, method="xla"), ids_TK))(x_TD, gates_TK, *w)
  g_ref = jax.jit(_loss(expert_ffn_reference, ids_TK))(x_TD, gates_TK, *w)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
