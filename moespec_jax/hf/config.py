"""Hugging Face `config.json` -> `ModelConfig` for the supported MoE families.

Supported `model_type`s: mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2, deepseek_v3.
Layouts the model cannot express (sliding windows, dense layers other than a prefix, rope scaling
other than DeepSeek's YaRN, ...) are refused with a ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, NoReturn

from moespec_jax.config import ModelConfig

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3")
DEEPSEEK = ("deepseek_v2", "deepseek_v3")


@dataclasses.dataclass(frozen=True)
class ImportSpec:
  """How a checkpoint's tensors map onto the model (beyond the ModelConfig)."""

  family: str
  moe_prefix: str  # module name of the MoE block inside a layer ("mlp" or "block_sparse_moe")
  expert_names: tuple[str, str, str]  # gate, up, down projection names of one expert
  rope_interleaved: bool  # DeepSeek rotary dims stored as interleaved pairs
  num_mtp_layers: int  # DeepSeek-V3 next-token-prediction layers after the decoder layers


def _refuse(family: str, msg: str) -> NoReturn:
  raise ValueError(f"unsupported {family} checkpoint: {msg}")


def _first_id(value: object) -> int | None:
  if isinstance(value, (list, tuple)):
    value = value[0] if value else None
  return None if value is None else int(value)


def _rope(hf: dict[str, Any], family: str) -> tuple[float, dict[str, Any] | None]:
  """(theta, yarn parameters or None) from `rope_parameters` (v5) or `rope_theta`/`rope_scaling`."""
  params = dict(hf.get("rope_parameters") or {})
  scaling = hf.get("rope_scaling") or {}
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  merged = {**scaling, **params}
  rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
  if rope_type == "default":
    return float(theta), None
  if rope_type != "yarn" or family not in DEEPSEEK:
    _refuse(family, f"rope scaling type {rope_type!r} (only 'default', and 'yarn' for DeepSeek)")
  if merged.get("attention_factor") is not None:
    _refuse(family, "yarn with an explicit attention_factor")
  if merged.get("truncate", True) is False:
    _refuse(family, "yarn with truncate=False")
  orig = merged.get("original_max_position_embeddings")
  if not orig:
    _refuse(family, "yarn without original_max_position_embeddings")
  factor = merged.get("factor") or hf["max_position_embeddings"] / orig
  return float(theta), dict(
    rope_scaling="yarn",
    rope_factor=float(factor),
    rope_original_max_len=int(orig),
    rope_beta_fast=float(merged.get("beta_fast") or 32),
    rope_beta_slow=float(merged.get("beta_slow") or 1),
    rope_mscale=float(merged.get("mscale") or 0.0),
    rope_mscale_all_dim=float(merged.get("mscale_all_dim") or 0.0),
  )


def _dense_prefix(hf: dict[str, Any], family: str) -> int:
  """The number of leading dense layers (`mlp_only_layers` = [0, ..., k - 1]); other sparse
  layouts are refused."""
  if int(hf.get("decoder_sparse_step", 1)) != 1:
    _refuse(family, f"decoder_sparse_step={hf['decoder_sparse_step']} (only 1: every layer MoE)")
  dense = sorted(int(i) for i in hf.get("mlp_only_layers") or [])
  if dense != list(range(len(dense))):
    _refuse(family, f"mlp_only_layers={hf['mlp_only_layers']} (dense layers only as a prefix)")
  if hf.get("use_sliding_window"):
    _refuse(family, "use_sliding_window=true")
  return len(dense)


def to_model_config(hf: dict[str, Any], dtype: str = "float32") -> tuple[ModelConfig, ImportSpec]:
  """Maps a Hugging Face config dict to (ModelConfig, ImportSpec); ValueError when unsupported."""
  try:
    return _to_model_config(hf, dtype)
  except KeyError as e:
    raise ValueError(f"Hugging Face config ({hf.get('model_type')}) lacks the field {e}") from None


def _to_model_config(hf: dict[str, Any], dtype: str) -> tuple[ModelConfig, ImportSpec]:
  family = hf.get("model_type")
  if family not in FAMILIES:
    raise ValueError(f"unsupported Hugging Face model_type {family!r}; supported: {', '.join(FAMILIES)}")
  if hf.get("hidden_act", "silu") != "silu":
    _refuse(family, f"hidden_act={hf['hidden_act']!r} (only silu)")
  d, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
  vocab = int(hf["vocab_size"])
  max_len = int(hf.get("max_position_embeddings", 4096))
  window = hf.get("sliding_window")
  if family == "mixtral" and window is not None and int(window) < max_len:
    _refuse(family, f"sliding_window={window} below max_position_embeddings={max_len}")
  theta, yarn = _rope(hf, family)
  eos = _first_id(hf.get("eos_token_id"))
  bos = _first_id(hf.get("bos_token_id"))
  if eos is None or not 0 <= eos < vocab:
    logging.warning(
      "%s: eos_token_id %s missing or outside the vocabulary; using %d", family, hf.get("eos_token_id"), vocab - 1
    )
    eos = vocab - 1
  if bos is None or not 0 <= bos < vocab:
    bos = eos
  kw: dict[str, Any] = dict(
    vocab_size=vocab,
    d_model=d,
    n_layers=int(hf["num_hidden_layers"]),
    n_heads=n_heads,
    n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
    head_dim=int(hf.get("head_dim") or d // n_heads),
    rope_theta=theta,
    norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    max_seq_len=max_len,
    top_k=int(hf["num_experts_per_tok"]),
    tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    eos_id=eos,
    bos_id=bos,
    tokenizer="pretrained",
    dtype=dtype,
    num_mtp_modules=0,
    first_k_dense=0,
    n_shared_experts=0,
    n_groups=1,
    topk_groups=1,
    use_score_bias=False,
    routed_scaling_factor=1.0,
    score_func="softmax",
  )
  prefix, names = "mlp", ("gate_proj", "up_proj", "down_proj")
  interleaved, mtp = False, 0

  if family in ("mixtral", "qwen3_moe", "olmoe") and hf.get("attention_bias"):
    _refuse(family, "attention_bias=true")
  if family == "mixtral":
    prefix, names = "block_sparse_moe", ("w1", "w3", "w2")
    kw.update(
      n_routed_experts=int(hf["num_local_experts"]), expert_hidden=int(hf["intermediate_size"]), norm_topk_prob=True
    )
  elif family == "qwen2_moe":
    shared = int(hf.get("shared_expert_intermediate_size") or 0)
    kw["first_k_dense"] = _dense_prefix(hf, family)
    kw.update(
      n_routed_experts=int(hf["num_experts"]),
      expert_hidden=int(hf["moe_intermediate_size"]),
      norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
      qkv_bias=bool(hf.get("qkv_bias", True)),
      n_shared_experts=1 if shared else 0,
      shared_expert_hidden=shared,
      shared_expert_gate=bool(shared),
    )
  elif family == "qwen3_moe":
    kw["first_k_dense"] = _dense_prefix(hf, family)
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    kw.update(
      n_routed_experts=int(experts),
      expert_hidden=int(hf["moe_intermediate_size"]),
      norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
      qk_norm="head",
    )
  elif family == "olmoe":
    if hf.get("clip_qkv") is not None:
      _refuse(family, f"clip_qkv={hf['clip_qkv']}")
    kw.update(
      n_routed_experts=int(hf["num_experts"]),
      expert_hidden=int(hf["intermediate_size"]),
      norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
      qk_norm="full",
    )
  else:  # DeepSeek-V2 / V3.
    if hf.get("attention_bias"):
      _refuse(family, "attention_bias=true")
    if int(hf.get("moe_layer_freq", 1)) != 1:
      _refuse(family, f"moe_layer_freq={hf['moe_layer_freq']} (only 1)")
    experts = int(hf["n_routed_experts"])
    n_group = int(hf.get("n_group") or 1)
    topk_group = int(hf.get("topk_group") or n_group)
    rope_dim = int(hf["qk_rope_head_dim"])
    kw.update(
      attention_type="mla",
      n_kv_heads=n_heads,
      head_dim=rope_dim,
      q_lora_rank=int(hf.get("q_lora_rank") or 0),
      kv_lora_rank=int(hf["kv_lora_rank"]),
      qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
      qk_rope_head_dim=rope_dim,
      v_head_dim=int(hf["v_head_dim"]),
      n_routed_experts=experts,
      expert_hidden=int(hf["moe_intermediate_size"]),
      dense_hidden=int(hf["intermediate_size"]),
      n_shared_experts=int(hf.get("n_shared_experts") or 0),
      first_k_dense=min(int(hf.get("first_k_dense_replace", 0)), int(hf["num_hidden_layers"])),
      routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
      norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )
    if family == "deepseek_v2":
      interleaved = True
      method = hf.get("topk_method", "greedy")
      if hf.get("scoring_func", "softmax") != "softmax":
        _refuse(family, f"scoring_func={hf['scoring_func']!r}")
      if method == "group_limited_greedy":
        kw.update(n_groups=n_group, topk_groups=topk_group)
      elif method != "greedy":
        _refuse(family, f"topk_method={method!r} (greedy or group_limited_greedy)")
    else:
      interleaved = bool(hf.get("rope_interleave", True))
      if hf.get("scoring_func", "sigmoid") != "sigmoid":
        _refuse(family, f"scoring_func={hf['scoring_func']!r}")
      if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        _refuse(family, f"topk_method={hf['topk_method']!r} (noaux_tc)")
      kw.update(score_func="sigmoid", use_score_bias=True, n_groups=n_group, topk_groups=topk_group)
      mtp = int(hf.get("num_nextn_predict_layers") or 0)
  if yarn:
    kw.update(yarn)
  if "dense_hidden" not in kw:  # Qwen's dense layers (and unused otherwise): intermediate_size
    kw["dense_hidden"] = int(hf.get("intermediate_size") or kw["expert_hidden"])
  spec = ImportSpec(
    family=family, moe_prefix=prefix, expert_names=names, rope_interleaved=interleaved, num_mtp_layers=mtp
  )
  return ModelConfig(**kw), spec
