"""Quality figures of an approximate mode against exact: top-1 agreement, KL, text divergence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moespec_jax.decoding import sampling as sampling_lib


def logit_agreement(
  exact_logits_NV: jax.Array, approx_logits_NV: jax.Array, valid_N: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(top-1 agreements, sum of KL(exact || approx) in nats, count) over the valid rows."""
  exact_lp = jax.nn.log_softmax(exact_logits_NV.astype(jnp.float32), axis=-1)
  approx_lp = jax.nn.log_softmax(approx_logits_NV.astype(jnp.float32), axis=-1)
  kl_N = jnp.sum(jnp.exp(exact_lp) * (exact_lp - approx_lp), axis=-1)
  agree_N = sampling_lib.argmax(exact_logits_NV) == sampling_lib.argmax(approx_logits_NV)
  valid = valid_N.astype(jnp.float32)
  return jnp.sum(agree_N * valid), jnp.sum(jnp.maximum(kl_N, 0.0) * valid), jnp.sum(valid)


def first_divergence(exact_tokens_BN: np.ndarray, approx_tokens_BN: np.ndarray) -> list[int | None]:
  """Per row, the first position where the two generations differ (None if they never do)."""
  out = []
  for a, b in zip(np.asarray(exact_tokens_BN), np.asarray(approx_tokens_BN)):
    diff = np.nonzero(a != b)[0]
    out.append(int(diff[0]) if diff.size else None)
  return out
