"""Exact tree verification (`rejection.verify_tree_sampled`), checked statistically: the first three
tokens a pass commits (continued by plain sampling where it commits fewer) follow the target.

A target and a drafter over V = 8 tokens, each a table of logits by context (the root, one token,
two tokens; the drafter's the target's plus noise), both through `sampling.filtered_logprobs` as the
loop builds them. Each row's tree: three children of the root and two children of each, drawn by the
drafter i.i.d. from its q (SpecInfer), as its top tokens with one-hot q (a deterministic tree), or
without replacement (each child's q: the drafter's without the siblings before it, renormalised); N
= 2^16 rows verified in one call. Exactness means that the joint law of the first three committed
tokens is the target's p(t1) p(t2 | t1) p(t3 | t1, t2) (a chi-square over the 512 cells, pooled
where their expected counts are small; a token of probability 0 makes the p-value 0). The planted
fault keeps the target's distribution instead of the residual between siblings: the same check must
reject it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moespec_jax.decoding import rejection
from moespec_jax.decoding.params import SamplingParams
from moespec_jax.decoding.sampling import filtered_logprobs
from tests.decoding import exactness

V, N_ROWS = 8, 1 << 16
PARENTS = (-1, -1, -1, 0, 0, 1, 1, 2, 2)  # three children of the root, two under each
CASES = {
  "t1": SamplingParams(temperature=1.0),
  "top_k3": SamplingParams(temperature=1.0, top_k=3),
  "t0.7_top_p0.8": SamplingParams(temperature=0.7, top_p=0.8),
}


def _tables(seed: int, scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Logits after the root [V], after one token [V, V] and after two [V, V, V]."""
  rng = np.random.default_rng(seed)
  return tuple(scale * rng.standard_normal((V,) * n).astype(np.float32) for n in (1, 2, 3))


def _filtered(tables, sampling: SamplingParams) -> tuple[np.ndarray, ...]:
  return tuple(np.asarray(filtered_logprobs(jnp.asarray(t.reshape(-1, V)), sampling)).reshape(t.shape) for t in tables)


@functools.partial(jax.jit, static_argnames=("deterministic", "update_residual", "renormalise"))
def _verify(key, logp_target, logq_draft, *, deterministic, update_residual: bool, renormalise: bool = True):
  """One pass per row over a drafted tree: (on_path_BN, n_B, next_B, tokens_BN)."""
  p0, p1, p2 = logp_target
  q0, q1, _ = logq_draft
  k_draft, k_verify = jax.random.split(key)
  parent_N = jnp.asarray(PARENTS)
  depth1 = [j for j, par in enumerate(PARENTS) if par < 0]

  def children(k, logq_V, n):
    if deterministic == "top":  # the drafter's top n tokens, each a one-hot proposal
      toks = jax.lax.top_k(logq_V, n)[1]
      return toks, jax.nn.one_hot(toks, V)
    if deterministic == "distinct":  # n draws without replacement (Gumbel top-n), as the MTP trees
      toks = jax.lax.top_k(logq_V + jax.random.gumbel(k, (V,)), n)[1]
      q_V = jnp.exp(logq_V)
      earlier_NV = jnp.cumsum(jax.nn.one_hot(toks, V), axis=0) - jax.nn.one_hot(toks, V)
      q_NV = jnp.where(earlier_NV > 0, 0.0, q_V) if renormalise else jnp.broadcast_to(q_V, (n, V))
      return toks, q_NV / jnp.sum(q_NV, axis=1, keepdims=True)
    toks = jax.random.categorical(k, logq_V, shape=(n,))
    return toks, jnp.broadcast_to(jnp.exp(logq_V), (n, V))

  def one_row(k):
    k0, *k1 = jax.random.split(k, 1 + len(depth1))
    toks, qs = children(k0, q0, len(depth1))
    tokens, q_rows, logp_rows = list(toks), list(qs), [p0] + [p1[t] for t in toks]
    for i, j in enumerate(depth1):
      sub_toks, sub_qs = children(k1[i], q1[toks[i]], PARENTS.count(j))
      tokens += list(sub_toks)
      q_rows += list(sub_qs)
      logp_rows += [p2[toks[i], t] for t in sub_toks]
    return jnp.stack(tokens), jnp.stack(q_rows), jnp.stack(logp_rows)

  tokens_BN, q_BNV, logp_BSV = jax.vmap(one_row)(jax.random.split(k_draft, N_ROWS))
  parent_BN = jnp.broadcast_to(parent_N, tokens_BN.shape)
  valid_BN = jnp.ones(tokens_BN.shape, bool)
  on_path_BN, n_B, _, next_B = rejection.verify_tree_sampled(
    jax.random.split(k_verify, N_ROWS),
    logp_BSV,
    tokens_BN,
    parent_BN,
    q_BNV,
    valid_BN,
    update_residual=update_residual,
  )
  return on_path_BN, n_B, next_B, tokens_BN


def _first_three_tokens(seed, sampling, *, deterministic, update_residual=True, renormalise=True):
  """[N, 3]: each row's first three committed tokens, and the target's joint law [V, V, V]."""
  # The drafter's logits: the target's plus noise (a drafter that is right often, but not always).
  target_logits = _tables(100 + seed, 1.5)
  target = _filtered(target_logits, sampling)
  draft = _filtered(tuple(t + n for t, n in zip(target_logits, _tables(200 + seed, 1.0))), sampling)
  on_path, n, nxt, tokens = (
    np.asarray(x)
    for x in _verify(
      jax.random.key(seed),
      tuple(map(jnp.asarray, target)),
      tuple(map(jnp.asarray, draft)),
      deterministic=deterministic,
      update_residual=update_residual,
      renormalise=renormalise,
    )
  )
  # The path's tokens in node order (ancestors first: depth order), then the token after them.
  order = np.argsort(~on_path, axis=1, kind="stable")
  seq = np.concatenate([np.take_along_axis(tokens, order, axis=1)[:, :2], np.zeros((N_ROWS, 1), np.int64)], axis=1)
  seq[np.arange(N_ROWS), n] = nxt
  # Plain sampling continues where the pass committed fewer than three tokens.
  rng = np.random.default_rng(seed)
  p0, p1, p2 = (np.exp(t) for t in target)
  for j in range(3):
    short = n + 1 <= j
    if j and short.any():
      probs = p1[seq[short, 0]] if j == 1 else p2[seq[short, 0], seq[short, 1]]
      u = rng.random(short.sum())[:, None]
      seq[short, j] = np.minimum((np.cumsum(probs, axis=1) < u).sum(axis=1), V - 1)
  joint = p0[:, None, None] * p1[:, :, None] * p2
  return seq, joint, n


def _joint_check(seq, joint) -> exactness.Check:
  cells = (seq[:, 0] * V + seq[:, 1]) * V + seq[:, 2]
  return exactness.chi_square_test(np.bincount(cells, minlength=V**3), joint.reshape(-1))


@pytest.mark.parametrize("deterministic", [False, "top", "distinct"], ids=["iid_children", "top_children", "distinct"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_tree_verification_commits_the_targets_joint_law(case, deterministic):
  seq, joint, n = _first_three_tokens(1, CASES[case], deterministic=deterministic)
  check = _joint_check(seq, joint)
  assert not check.rejects, check.describe()
  # The check must be powerful enough to see a bias of its likeliest cell of the size asserted here
  # (its power, computed by the check).
  assert check.detectable_best <= 0.25, check.describe()
  flat = joint.reshape(-1)
  assert flat[(seq[:, 0] * V + seq[:, 1]) * V + seq[:, 2]].min() > 0  # never a token of probability 0
  # The trees pay: most passes commit a draft, some the whole depth.
  assert (n >= 1).mean() > 0.5 and (n == 2).any()


def test_the_same_check_rejects_draws_without_replacement_verified_against_the_unrenormalised_q():
  # Siblings drawn without replacement (the MTP heads' sampled trees), each verified against q
  # itself instead of q without its earlier siblings, renormalised.
  seq, joint, _ = _first_three_tokens(1, CASES["t1"], deterministic="distinct", renormalise=False)
  check = _joint_check(seq, joint)
  assert check.rejects, check.describe()


@pytest.mark.parametrize("deterministic", [False, "top", "distinct"], ids=["iid_children", "top_children", "distinct"])
def test_the_same_check_rejects_siblings_tried_without_the_residual(deterministic):
  seq, joint, _ = _first_three_tokens(1, CASES["t1"], deterministic=deterministic, update_residual=False)
  check = _joint_check(seq, joint)
  assert check.rejects, check.describe()
