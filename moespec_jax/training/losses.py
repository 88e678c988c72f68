"""Language-modelling and load-balancing losses."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
  """Per-token negative log-likelihood in nats, [B, T]."""
  logprobs_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logprobs_BTV, targets_BT[..., None], axis=-1)[..., 0]


def load_balance_loss(expert_ids_LBTK: jax.Array, probs_LBTE: jax.Array) -> jax.Array:
  """Switch-style auxiliary loss E * sum_e f_e * P_e, averaged over MoE layers (1.0 when uniform).

  f_e: the fraction of (token, slot) assignments that went to expert e (no gradient);
  P_e: the mean routing probability of e (carries the gradient to the router).
  """
  n_experts = probs_LBTE.shape[-1]
  n_layers = probs_LBTE.shape[0]
  counts_LE = (
    jnp.zeros((n_layers, n_experts), jnp.float32)
    .at[jnp.arange(n_layers)[:, None], expert_ids_LBTK.reshape(n_layers, -1)]
    .add(1.0)
  )
  frac_LE = jax.lax.stop_gradient(counts_LE / jnp.sum(counts_LE, axis=-1, keepdims=True))
  mean_prob_LE = jnp.mean(probs_LBTE.reshape(n_layers, -1, n_experts), axis=1)
  return n_experts * jnp.mean(jnp.sum(frac_LE * mean_prob_LE, axis=-1))


def expert_load(expert_ids_LBTK: jax.Array, n_experts: int) -> jax.Array:
  """Fraction of assignments per expert, [L, E]."""
  n_layers = expert_ids_LBTK.shape[0]
  counts_LE = (
    jnp.zeros((n_layers, n_experts), jnp.float32)
    .at[jnp.arange(n_layers)[:, None], expert_ids_LBTK.reshape(n_layers, -1)]
    .add(1.0)
  )
  return counts_LE / jnp.sum(counts_LE, axis=-1, keepdims=True)
