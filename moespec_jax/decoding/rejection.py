"""Batched verification of drafted tokens: exact rejection sampling and greedy matching.

Exact sampling (Leviathan et al. 2023; Chen et al. 2023): draft x_j, drawn from q_j, is
accepted with probability min(1, p_j(x_j) / q_j(x_j)), i.e. when u_j * q_j(x_j) < p_j(x_j)
for a uniform u_j in (0, 1); at the first rejection j the token is drawn from
norm(max(p_j - q_j, 0)); when all K drafts are accepted a bonus token is drawn from p_K.
p and q are both `sampling.filtered_logprobs` of the same SamplingParams, so p is exactly
what plain sampling draws from and q exactly what the draft was drawn from. A one-hot q
(n-gram drafts) accepts with probability p(x). An invalid draft slot (no proposal) has q = 0:
it is rejected and its token drawn from p, which is plain sampling at that position.

Greedy: accept while the draft equals argmax p; the next token is argmax p at the first
mismatch (or the bonus position).

Trees (`verify_tree_sampled`, `verify_tree_greedy`): each node is a token following its parent
(or the pending token, the root). Verification walks down from the root: at the current node c,
with r the target's distribution p_c there, c's children x_1, x_2, ... are tried in their order,
x_i accepted with probability min(1, r(x_i) / q_i(x_i)), i.e. when u_i * q_i(x_i) < r(x_i); on a
rejection r becomes norm(max(r - q_i, 0)) and the next child is tried against it. An accepted
child becomes the current node (r = its p); when every child of c is rejected, the next token is
drawn from r (from p_c itself, the bonus, where c has no children). q_i is the distribution x_i
was drawn from given the siblings before it: the drafter's q for children drawn i.i.d.
(SpecInfer), q renormalised without the earlier siblings for draws without replacement, one-hot
for deterministic children (then x_i is accepted with probability r(x_i) and a rejection zeroes
it in r).

Why this samples p_c exactly (SpecInfer, Miao et al. 2024, Theorem 4.2, by induction over the
children tried): if x ~ q is independent of the uniforms and of r, the first step emits t with
probability P(x = t, accepted) = q(t) min(1, r(t)/q(t)) = min(q(t), r(t)), and rejects with
probability sum_t max(r(t) - q(t), 0) = Z, after which (by induction) it emits from the residual
max(r - q, 0) / Z; in total min(q, r) + max(r - q, 0) = r. With no child left it emits from r by
drawing. An accepted child's own subtree is then verified against that child's p the same way,
so the committed path and the token after it follow the target's distribution token by token.
An invalid node (nothing proposed) is rejected without touching r, which is trying no child.
The planted fault that omits the residual update between siblings breaks the identity for the
second child: tests/decoding/test_rejection.py catches it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from moespec_jax.decoding import sampling as sampling_lib


def uniform_open(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Float32 uniforms strictly inside (0, 1)."""
  return jax.random.uniform(key, shape, jnp.float32, minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)


def residual_probs(p_BV: jax.Array, q_BV: jax.Array) -> jax.Array:
  """The (unnormalised) distribution to sample from after rejecting a draft: max(p - q, 0)."""
  return jnp.maximum(p_BV - q_BV, 0.0)


def accepted_count(accept_BK: jax.Array) -> jax.Array:
  """Number of leading accepted drafts per row."""
  return jnp.sum(jnp.cumprod(accept_BK.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def _at(x_BS: jax.Array, n_B: jax.Array) -> jax.Array:
  return jnp.take_along_axis(x_BS, n_B[:, None, None] if x_BS.ndim == 3 else n_B[:, None], axis=1)[:, 0]


def verify_greedy(
  logits_BSV: jax.Array, drafts_BK: jax.Array, valid_BK: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Greedy verification. Returns (accept_BK, n_accepted_B, next_token_B)."""
  k = drafts_BK.shape[1]
  target_BS = sampling_lib.argmax(logits_BSV)
  accept_BK = valid_BK & (drafts_BK == target_BS[:, :k])
  n_B = accepted_count(accept_BK)
  return accept_BK, n_B, _at(target_BS, n_B)


def verify_sampled(
  keys_B: jax.Array, logp_BSV: jax.Array, drafts_BK: jax.Array, q_BKV: jax.Array, valid_BK: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Exact rejection sampling over S = K + 1 target distributions per row.

  Args:
    keys_B: one PRNG key per row.
    logp_BSV: filtered target log-probabilities at the K + 1 verified positions.
    drafts_BK: drafted tokens.
    q_BKV: the draft distributions the drafts were drawn from (one-hot for n-gram).
    valid_BK: False where the drafter proposed nothing (rejected, token drawn from p).

  Returns:
    (accept_BK, n_accepted_B, next_token_B): next_token is the residual sample at the first
    rejection, or the bonus token from p_K when all K drafts are accepted.
  """
  b, s, _ = logp_BSV.shape
  k = s - 1
  p_BSV = jnp.exp(logp_BSV)
  split = jax.vmap(lambda key: jax.random.split(key, 2))(keys_B)
  u_BK = jax.vmap(lambda key: uniform_open(key, (k,)))(split[:, 0])
  p_draft_BK = jnp.take_along_axis(p_BSV[:, :k], drafts_BK[..., None], axis=-1)[..., 0]
  q_draft_BK = jnp.take_along_axis(q_BKV, drafts_BK[..., None], axis=-1)[..., 0]
  accept_BK = valid_BK & (u_BK * q_draft_BK < p_draft_BK)
  n_B = accepted_count(accept_BK)
  q_BSV = jnp.concatenate(
    [jnp.where(valid_BK[..., None], q_BKV, 0.0), jnp.zeros((b, 1, q_BKV.shape[-1]), q_BKV.dtype)], axis=1
  )
  p_n_BV, q_n_BV = _at(p_BSV, n_B), _at(q_BSV, n_B)
  r_BV = residual_probs(p_n_BV, q_n_BV)
  # p == q leaves no residual mass; rejection then has probability 0 (numerical guard only).
  r_BV = jnp.where(jnp.sum(r_BV, axis=-1, keepdims=True) > 0, r_BV, p_n_BV)
  logr_BV = jnp.where(r_BV > 0, jnp.log(jnp.where(r_BV > 0, r_BV, 1.0)), -jnp.inf)
  next_B = jax.vmap(sampling_lib.categorical)(split[:, 1], logr_BV)
  return accept_BK, n_B, next_B


def node_depths(parent_BN: jax.Array) -> jax.Array:
  """int32 [B, N]: each node's depth (1 for a child of the root). Parents come before their
  children (parent[j] < j), so one pass in node order resolves every depth."""
  n = parent_BN.shape[1]
  depth_BN = jnp.zeros(parent_BN.shape, jnp.int32)
  for j in range(n):
    par_B = parent_BN[:, j]
    parent_depth_B = jnp.take_along_axis(depth_BN, jnp.maximum(par_B, 0)[:, None], axis=1)[:, 0]
    depth_BN = depth_BN.at[:, j].set(jnp.where(par_B < 0, 1, parent_depth_B + 1))
  return depth_BN


def ancestor_mask(parent_BN: jax.Array) -> jax.Array:
  """bool [B, S, S], S = N + 1 (the root first, node j at index j + 1): [b, i, k] says whether
  index k is index i or one of its ancestors: what a tree pass's query at i attends to in the
  pass's own tokens."""
  batch, n = parent_BN.shape
  mask_BSS = jnp.zeros((batch, n + 1, n + 1), jnp.bool_).at[:, 0, 0].set(True)
  for j in range(n):
    par_B = parent_BN[:, j] + 1  # the parent's index (0: the root)
    parent_row_BS = jnp.take_along_axis(mask_BSS, par_B[:, None, None], axis=1)[:, 0]
    mask_BSS = mask_BSS.at[:, j + 1].set(parent_row_BS.at[:, j + 1].set(True))
  return mask_BSS


def _walk(
  parent_BN: jax.Array, valid_BN: jax.Array, try_child: Callable[..., tuple], state: Any
) -> tuple[jax.Array, jax.Array, tuple]:
  """Verification's walk down a tree: nodes in index order, each tried only where its parent is
  the current node. `try_child(j, state, tried_B) -> (accepted_B, state)`; returns (on_path_BN,
  the last accepted node [B] (-1: the root), the state)."""
  batch, n = parent_BN.shape
  current_B = jnp.full((batch,), -1, jnp.int32)
  on_path_BN = jnp.zeros((batch, n), jnp.bool_)
  for j in range(n):
    tried_B = valid_BN[:, j] & (parent_BN[:, j] == current_B)
    accepted_B, state = try_child(j, state, tried_B, current_B)
    accepted_B = tried_B & accepted_B
    on_path_BN = on_path_BN.at[:, j].set(accepted_B)
    current_B = jnp.where(accepted_B, j, current_B)
  return on_path_BN, current_B, state


def verify_tree_greedy(
  logits_BSV: jax.Array, tokens_BN: jax.Array, parent_BN: jax.Array, valid_BN: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Greedy tree verification: the longest path whose every token is the target's argmax after
  its parent (the first such sibling where two propose the same token). S = N + 1 positions:
  the root, then node j at j + 1. Returns (on_path_BN, n_accepted_B, last_B, next_B): the path's
  nodes, their number, the deepest (-1: none) and the argmax after it."""
  target_BS = sampling_lib.argmax(logits_BSV)

  def try_child(j: int, state: tuple, tried_B: jax.Array, current_B: jax.Array):
    want_B = jnp.take_along_axis(target_BS, (current_B + 1)[:, None], axis=1)[:, 0]
    return tokens_BN[:, j] == want_B, state

  on_path_BN, last_B, _ = _walk(parent_BN, valid_BN, try_child, ())
  n_B = jnp.sum(on_path_BN, axis=1).astype(jnp.int32)
  return on_path_BN, n_B, last_B, _at(target_BS, last_B + 1)


def verify_tree_sampled(
  keys_B: jax.Array,
  logp_BSV: jax.Array,
  tokens_BN: jax.Array,
  parent_BN: jax.Array,
  q_BNV: jax.Array,
  valid_BN: jax.Array,
  *,
  update_residual: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Exact tree verification (the module docstring): children tried in node order against the
  running residual. `logp_BSV`: filtered target log-probabilities at S = N + 1 positions (the
  root, then node j at j + 1); `q_BNV`: each node's proposal distribution given its earlier
  siblings. `update_residual=False` is the planted fault the exactness tests must catch.
  Returns (on_path_BN, n_accepted_B, last_B, next_B) as `verify_tree_greedy`."""
  batch, n = tokens_BN.shape
  p_BSV = jnp.exp(logp_BSV)
  split = jax.vmap(lambda key: jax.random.split(key, 2))(keys_B)
  u_BN = jax.vmap(lambda key: uniform_open(key, (n,)))(split[:, 0])

  def try_child(j: int, r_BV: jax.Array, tried_B: jax.Array, current_B: jax.Array):
    tok_B1 = tokens_BN[:, j : j + 1]
    q_BV = q_BNV[:, j]
    r_tok_B = jnp.take_along_axis(r_BV, tok_B1, axis=1)[:, 0]
    q_tok_B = jnp.take_along_axis(q_BV, tok_B1, axis=1)[:, 0]
    accepted_B = u_BN[:, j] * q_tok_B < r_tok_B
    # Accepted: the child's own distribution; rejected: the residual, renormalised.
    residual_BV = residual_probs(r_BV, q_BV) if update_residual else r_BV
    mass_B1 = jnp.sum(residual_BV, axis=-1, keepdims=True)
    # r == q leaves no residual mass; rejection then has probability 0 (numerical guard only).
    residual_BV = jnp.where(mass_B1 > 0, residual_BV / jnp.where(mass_B1 > 0, mass_B1, 1.0), r_BV)
    child_BV = p_BSV[:, j + 1]
    r_BV = jnp.where(tried_B[:, None], jnp.where((accepted_B & tried_B)[:, None], child_BV, residual_BV), r_BV)
    return accepted_B, r_BV

  on_path_BN, last_B, r_BV = _walk(parent_BN, valid_BN, try_child, p_BSV[:, 0])
  logr_BV = jnp.where(r_BV > 0, jnp.log(jnp.where(r_BV > 0, r_BV, 1.0)), -jnp.inf)
  next_B = jax.vmap(sampling_lib.categorical)(split[:, 1], logr_BV)
  n_B = jnp.sum(on_path_BN, axis=1).astype(jnp.int32)
  return on_path_BN, n_B, last_B, next_B
