"""Planted faults of exact verification: a copy of `rejection.verify_sampled` with one change each.

`verify_variant(..., fault=None)` is the real rule, output for output (a test holds it to
`rejection.verify_sampled`, so the copy cannot drift); each fault changes one line, in the shape
of a bug that samplers elsewhere shipped with. The copy reads `rejection.uniform_open` and
`sampling.categorical` through their modules, so a test that patches them patches both.
Faults of the inputs (q computed in another precision or without the filters, the target's
filters missing at verified positions) are built where the inputs are (test_acceptance_law.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moespec_jax.decoding import rejection
from moespec_jax.decoding import sampling as sampling_lib

# Faults of the verification itself (None: the real rule).
FAULTS = {
  "accept_inflated": "accepts with u q < 1.1 p: drafts accepted 10% too often",
  "accept_le": "accepts with u q <= p: a zero-probability draft passes when u q is 0",
  "residual_unnormalised": "draws the residual max(p - q, 0) by inverse CDF without normalising it",
  "residual_is_p": "draws the token after a rejection from p, not from max(p - q, 0)",
  "bonus_from_q": "draws the bonus token from the last draft's q, not from p",
}


def verify_variant(keys_B, logp_BSV, drafts_BK, q_BKV, valid_BK, fault: str | None = None):
  """`rejection.verify_sampled` with the planted `fault` (a key of FAULTS), or none."""
  if fault is not None and fault not in FAULTS:
    raise ValueError(f"unknown fault {fault!r}")
  b, s, vocab = logp_BSV.shape
  k = s - 1
  p_BSV = jnp.exp(logp_BSV)
  split = jax.vmap(lambda key: jax.random.split(key, 2))(keys_B)
  u_BK = jax.vmap(lambda key: rejection.uniform_open(key, (k,)))(split[:, 0])
  p_draft_BK = jnp.take_along_axis(p_BSV[:, :k], drafts_BK[..., None], axis=-1)[..., 0]
  q_draft_BK = jnp.take_along_axis(q_BKV, drafts_BK[..., None], axis=-1)[..., 0]
  if fault == "accept_inflated":
    accept_BK = valid_BK & (u_BK * q_draft_BK < 1.1 * p_draft_BK)
  elif fault == "accept_le":
    accept_BK = valid_BK & (u_BK * q_draft_BK <= p_draft_BK)
  else:
    accept_BK = valid_BK & (u_BK * q_draft_BK < p_draft_BK)
  n_B = rejection.accepted_count(accept_BK)
  q_BSV = jnp.concatenate([jnp.where(valid_BK[..., None], q_BKV, 0.0), jnp.zeros((b, 1, vocab), q_BKV.dtype)], axis=1)
  p_n_BV, q_n_BV = _at(p_BSV, n_B), _at(q_BSV, n_B)
  if fault == "bonus_from_q":
    p_n_BV = jnp.where((n_B == k)[:, None], q_BKV[:, k - 1], p_n_BV)
  r_BV = p_n_BV if fault == "residual_is_p" else rejection.residual_probs(p_n_BV, q_n_BV)
  r_BV = jnp.where(jnp.sum(r_BV, axis=-1, keepdims=True) > 0, r_BV, p_n_BV)
  if fault == "residual_unnormalised":
    # The uniform against the unnormalised CDF: whatever falls past its total mass takes the last token.
    u_B = jax.vmap(lambda key: rejection.uniform_open(key, ()))(split[:, 1])
    next_B = jnp.minimum(jnp.sum(jnp.cumsum(r_BV, axis=-1) <= u_B[:, None], axis=-1), vocab - 1).astype(jnp.int32)
    return accept_BK, n_B, next_B
  logr_BV = jnp.where(r_BV > 0, jnp.log(jnp.where(r_BV > 0, r_BV, 1.0)), -jnp.inf)
  next_B = jax.vmap(sampling_lib.categorical)(split[:, 1], logr_BV)
  return accept_BK, n_B, next_B


def _at(x_BSV, n_B):
  return jnp.take_along_axis(x_BSV, n_B[:, None, None], axis=1)[:, 0]
