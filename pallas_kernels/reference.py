"""Pure-XLA reference of the routed SwiGLU expert FFN."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def expert_ffn_reference(
  x_TD: jax.Array,
  expert_ids_TK: jax.Array,
  gates_TK: jax.Array,
  w_gate_EDF: jax.Array,
  w_up_EDF: jax.Array,
  w_down_EFD: jax.Array,
) -> jax.Array:
  """y_t = sum_k g_tk * FFN_{e_tk}(x_t), one gathered weight set per (token, slot).

  Simple and exact; gathers copies of the weights, so it is for tests and small shapes.
  """
  wg_TKDF = w_gate_EDF[expert_ids_TK]
  wu_TKDF = w_up_EDF[expert_ids_TK]
  wd_TKFD = w_down_EFD[expert_ids_TK]
  x = x_TD.astype(jnp.float32)
  h_TKF = jax.nn.silu(jnp.einsum("td,tkdf->tkf", x, wg_TKDF)) * jnp.einsum("td,tkdf->tkf", x, wu_TKDF)
  y_TKD = jnp.einsum("tkf,tkfd->tkd", h_TKF, wd_TKFD)
  return jnp.einsum("tk,tkd->td", gates_TK.astype(jnp.float32), y_TKD).astype(x_TD.dtype)


def expert_ffn_dense(
  x_TD: jax.Array,
  expert_ids_TK: jax.Array,
  gates_TK: jax.Array,
  w_gate_EDF: jax.Array,
  w_up_EDF: jax.Array,
  w_down_EFD: jax.Array,
) -> jax.Array:
  """Every expert on every token, weighted by a dense [T, E] gate matrix (zero where unchosen)."""
  n_experts = w_gate_EDF.shape[0]
  gates_TE = jnp.zeros((x_TD.shape[0], n_experts), jnp.float32)
  gates_TE = gates_TE.at[jnp.arange(x_TD.shape[0])[:, None], expert_ids_TK].add(gates_TK.astype(jnp.float32))
  x = x_TD.astype(jnp.float32)
  h_TEF = jax.nn.silu(jnp.einsum("td,edf->tef", x, w_gate_EDF)) * jnp.einsum("td,edf->tef", x, w_up_EDF)
  y_TED = jnp.einsum("tef,efd->ted", h_TEF, w_down_EFD)
  return jnp.einsum("te,ted->td", gates_TE, y_TED).astype(x_TD.dtype)
