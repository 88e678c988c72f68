"""A random model whose routing is correlated across neighbouring tokens, by weight surgery.

A random router routes each token nearly independently of its neighbours, where a trained model's
routing follows the context (the seeds: adjacent tokens share about 0.38 of their experts). The
construction gives each MoE layer a context signal that varies slowly along the sequence and lets
the router read it:

- a recency head: attention head 0 of the layer (and its key-value head) keep only constant
  query and key vectors (the projections' biases, `qkv_bias`; their weights zeroed), equal
  amplitude on every rotary frequency pair. With RoPE the score of a key d positions back is then
  sum_i cos(theta_i d) times a constant, which falls about as log(d) (each frequency drops out once
  theta_i d passes 1): the head's output is a power-law-weighted mean of the recent tokens' values,
  a summary of the context that moves a little with each token;
- the router gains a low-rank component reading that head's output through its output projection:
  w_router[:, e] += strength * |w_router[:, e]| * u_e, with u_e = W_o[head 0]^T r_e normalised
  (r_e random), so expert e's logit rises with the context's projection on r_e.

`strength` sets how much of a logit the context decides, hence the overlap at distance 1; it was
fitted per config with `fit_strength` (bisection on the held-out routing's overlap). Shapes and
costs are unchanged but for the attention biases; the MTP heads are left as they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx

import moespec_jax as msj
from moespec_jax.analysis import routing
from moespec_jax.model import Transformer
from moespec_jax.research import traces

TARGET_OVERLAP = 0.38  # the seeds' overlap of adjacent tokens' experts (trained model, MT-Bench)
# Attention weights fall as d^-RECENCY_POWER with the distance d (the recency head's sharpness).
RECENCY_POWER = 2.0
# Strengths fitted with `fit_strength` to TARGET_OVERLAP (seed 0), keyed by the routed layout
# (d_model, n_routed_experts, top_k); `correlate` takes another strength explicitly.
# membound_fine: the seeds' overlap. membound_coarse (8 experts top-2) overlaps more than that
# without surgery: its strength gives the seeds' excess over independent tokens instead,
# (0.381 - 0.118) / (1 - 0.118) of the way from the independent overlap to 1
# (docs/findings/2026-12-06-membound-configs.md).
FITTED_STRENGTH: dict[tuple[int, int, int], float] = {(1024, 64, 6): 5.0, (1024, 8, 2): 9.0}


def _rebuilt(config, pure: dict, tokenizer):
  """A model of `config` holding the parameters of the pure dict `pure`."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
  nnx.replace_by_pure_dict(state, pure)
  return msj.Model(config, graphdef, state, tokenizer)


def _pure_with_attention_biases(model) -> tuple[object, dict]:
  """(config with `qkv_bias` on, the model's parameters with zero biases where it had none)."""
  pure = nnx.to_pure_dict(model.state)
  config = model.config
  if not config.qkv_bias:
    config = config.replace(qkv_bias=True)
    blocks = list(pure["layers"].values()) + [m["block"] for m in (pure.get("mtp") or {}).values()]
    h, g, k = config.n_heads, config.n_kv_heads, config.head_dim
    for block in blocks:
      block["attn"].update(b_q_HK=jnp.zeros((h, k)), b_k_GK=jnp.zeros((g, k)), b_v_GK=jnp.zeros((g, k)))
  return config, pure


def recency_amplitude(config, power: float = RECENCY_POWER) -> float:
  """The amplitude a of the recency head's constant query and key (a on every rotary pair's first
  coordinate): its scores a^2 / sqrt(head_dim) * sum_i cos(theta_i d) fall by about
  a^2 / sqrt(head_dim) * half / ln(theta) per unit of ln d, set here to `power`."""
  half = config.head_dim // 2
  return math.sqrt(power * math.sqrt(config.head_dim) * math.log(config.rope_theta) / half)


def correlate(model, strength: float, *, power: float = RECENCY_POWER):
  """The model with correlated routing (the module docstring's construction) at `strength`."""
  config = model.config
  if config.attention_type != "gqa" or config.n_moe_layers == 0:
    raise ValueError("correlated routing needs a GQA model with MoE layers")
  if strength < 0:
    raise ValueError(f"strength must be >= 0, got {strength}")
  config, pure = _pure_with_attention_biases(model)
  half, a = config.head_dim // 2, recency_amplitude(config, power)
  bias_K = jnp.concatenate([jnp.full((half,), a), jnp.zeros((config.head_dim - half,))])
  for i, block in pure["layers"].items():
    if not config.is_moe_layer(int(i)):
      continue
    attn = block["attn"]
    attn["w_q_DHK"] = attn["w_q_DHK"].at[:, 0].set(0.0)
    attn["w_k_DHK"] = attn["w_k_DHK"].at[:, 0].set(0.0)
    attn["b_q_HK"] = attn["b_q_HK"].at[0].set(bias_K)
    attn["b_k_GK"] = attn["b_k_GK"].at[0].set(bias_K)
    attn["w_o_HKD"] = attn["w_o_HKD"].at[0].multiply(strength)
  return _rebuilt(config, pure, model.tokenizer)


def adjacent_overlap(model, *, n_segments: int = 8, seq_len: int = 128) -> float:
  """The mean over MoE layers of the overlap of adjacent tokens' experts on held-out text."""
  trace = traces.heldout_trace(model, n_segments=n_segments, seq_len=seq_len)
  return float(routing.overlap_by_distance(trace, 1)[:, 0].mean())


def fit_strength(
  model,
  target: float = TARGET_OVERLAP,
  *,
  low: float = 0.25,
  high: float = 64.0,
  steps: int = 8,
  measure: Callable[[object], float] = adjacent_overlap,
  log=print,
) -> tuple[float, float]:
  """(strength, overlap): bisection, on a log scale between `low` and `high`, of the strength
  whose held-out overlap at distance 1 is `target` (the overlap grows with the strength)."""
  best = (0.0, math.inf)
  for _ in range(steps):
    mid = math.sqrt(low * high)
    overlap = measure(correlate(model, mid))
    log(f"  strength {mid:.3f}: overlap at distance 1 {overlap:.3f}")
    if abs(overlap - target) < abs(best[1] - target):
      best = (mid, overlap)
    low, high = (mid, high) if overlap < target else (low, mid)
  return best


def correlated_variant(model, setting: str):
  """`--model=config:NAME,routing=correlated[:STRENGTH]`: the fitted strength of the model's
  layout (FITTED_STRENGTH), or STRENGTH given."""
  name, _, value = setting.partition(":")
  if name != "correlated":
    raise ValueError(f"--model routing must be correlated or correlated:STRENGTH, got {setting!r}")
  if value:
    try:
      strength = float(value)
    except ValueError:
      raise ValueError(f"--model routing=correlated:STRENGTH needs a number, got {value!r}") from None
  else:
    key = (model.config.d_model, model.config.n_routed_experts, model.config.top_k)
    if key not in FITTED_STRENGTH:
      raise ValueError(
        f"--model routing=correlated: no fitted strength for this layout {key}; give one "
        "(routing=correlated:STRENGTH) or fit it (research/correlated_routing.fit_strength)"
      )
    strength = FITTED_STRENGTH[key]
  return correlate(model, strength)
