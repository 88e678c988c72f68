"""Routing traces of a model: held-out text (teacher-forced) and its own greedy continuations."""

from __future__ import annotations

import numpy as np

import moespec_jax as msj
from moespec_jax.analysis.routing import RoutingTrace
from moespec_jax.data import batches as batches_lib
from moespec_jax.data import corpus


def moe_layers(model) -> list[int]:
  """The model layers (from 0) whose routing a trace holds, in its order: the MoE layers."""
  return model.config.moe_layers


def heldout_trace(model: msj.Model, *, n_segments: int = 64, seq_len: int = 256, batch_size: int = 8) -> RoutingTrace:
  """Routing of `n_segments` contiguous validation windows (the routing decoding would see)."""
  if model.config.n_moe_layers == 0:
    raise ValueError("the model has no MoE layers: nothing to trace")
  seq_len = min(seq_len, model.config.max_seq_len)
  tokens = batches_lib.corpus_tokens(model.tokenizer, "validation")
  segments = []
  for vb in batches_lib.validation_batches(tokens, batch_size, seq_len, max_batches=-(-n_segments // batch_size)):
    ids_LBTK = np.asarray(model.forward_full(vb.tokens[:, :-1]).routing.expert_ids)
    segments.extend(ids_LBTK[:, b] for b in range(ids_LBTK.shape[1]))
  segments = segments[:n_segments]
  if not segments:
    raise ValueError("the validation split is too small for one window")
  return RoutingTrace(
    segments,
    model.config.n_routed_experts,
    {"source": "heldout", "seq_len": seq_len, "n_segments": len(segments), "model_layers": moe_layers(model)},
  )


def generated_trace(model: msj.Model, *, n_prompts: int = 16, max_new_tokens: int = 128, seed: int = 0) -> RoutingTrace:
  """Routing of the model's own greedy continuations of held-out prompts (prompt excluded)."""
  prompts = corpus.held_out_prompts(n_prompts, prompt_bytes=128, seed=seed)
  out = msj.generate(model, prompts, max_new_tokens=max_new_tokens)
  segments = []
  for prompt, row in zip(prompts, out.tokens):
    ids = list(model.tokenizer.prompt_ids(prompt))
    new = [int(t) for t in row if t >= 0]
    full = np.asarray([ids + new], np.int32)
    routing = np.asarray(model.forward_full(full).routing.expert_ids)[:, 0]
    segments.append(routing[:, len(ids) :])
  return RoutingTrace(
    segments,
    model.config.n_routed_experts,
    {
      "source": "generated",
      "max_new_tokens": max_new_tokens,
      "n_segments": len(segments),
      "model_layers": moe_layers(model),
    },
  )
