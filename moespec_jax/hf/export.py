"""A moespec-jax model as a Hugging Face Qwen2-MoE checkpoint (config.json, model.safetensors, its
tokenizer and generation_config.json).

Qwen2-MoE is the family that expresses the models trained here (grouped-query attention,
softmax top-k routing, one shared expert, dense layers first): transformers loads the directory
as `Qwen2MoeForCausalLM` and computes the same logits, and `Model.load` reads it back. Our
shared expert has no gate; Qwen2-MoE's always has one (sigmoid(x . w)), so it is written with
w = 0 and the shared down projection doubled: sigmoid(0) * 2 = 1, exactly. The MTP heads have
no place in the layout and are not written. The tokenizer (tokenizer.json, tokenizer_config.json,
special_tokens_map.json) encodes as the model does: transformers' `tokenizer(text)` gives the ids
of `model.tokenizer.prompt_ids(text)`, which for our models start with EOS, the document boundary
the model was trained on; so BOS in the configs is that token. Nothing here needs torch or
transformers.
"""

from __future__ import annotations

import json
import pathlib
from typing import TYPE_CHECKING, NoReturn

import numpy as np
from absl import logging
from flax import nnx
from safetensors.numpy import save_file
from tokenizers import Tokenizer as HfTokenizer

from moespec_jax.config import ModelConfig
from moespec_jax.data.tokenizer import Tokenizer
from moespec_jax.io import atomic

if TYPE_CHECKING:
  from moespec_jax.model.handle import ModelHandle


def _refuse(field: str, value: object, why: str) -> NoReturn:
  raise ValueError(f"Qwen2-MoE export: {field}={value!r} {why}")


def check_exportable(config: ModelConfig) -> None:
  """ValueError naming the first field the Qwen2-MoE layout cannot express."""
  if config.attention_type != "gqa":
    _refuse("attention_type", config.attention_type, "(Qwen2-MoE attention is grouped-query)")
  if config.qk_norm != "none":
    _refuse("qk_norm", config.qk_norm, "(Qwen2-MoE has no query/key norm)")
  if config.rope_scaling != "none":
    _refuse("rope_scaling", config.rope_scaling, "(only plain RoPE)")
  if config.n_moe_layers == 0:
    _refuse("first_k_dense", config.first_k_dense, "leaves no MoE layer")
  if config.score_func != "softmax":
    _refuse("score_func", config.score_func, "(Qwen2-MoE routes by softmax top-k)")
  if config.use_score_bias:
    _refuse("use_score_bias", True, "(Qwen2-MoE has no routing correction bias)")
  if config.n_groups != 1:
    _refuse("n_groups", config.n_groups, "(Qwen2-MoE has no group-limited routing)")
  if config.routed_scaling_factor != 1.0:
    _refuse("routed_scaling_factor", config.routed_scaling_factor, "(Qwen2-MoE does not scale gates)")
  if config.n_shared_experts == 0:
    _refuse("n_shared_experts", 0, "(Qwen2-MoE layers always have a shared expert)")


def qwen2_moe_config(config: ModelConfig, bos_id: int | None = None) -> dict:
  """The transformers config.json of `config` in the Qwen2-MoE layout; `bos_id`: the id prompts
  start with (`prompt_bos_id`; default `config.bos_id`)."""
  check_exportable(config)
  return {
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "dtype": "float32",
    "vocab_size": config.vocab_size,
    "hidden_size": config.d_model,
    "num_hidden_layers": config.n_layers,
    "num_attention_heads": config.n_heads,
    "num_key_value_heads": config.n_kv_heads,
    "head_dim": config.head_dim,
    "hidden_act": "silu",
    "rms_norm_eps": config.norm_eps,
    "max_position_embeddings": config.max_seq_len,
    "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
    "qkv_bias": config.qkv_bias,
    "tie_word_embeddings": config.tie_embeddings,
    "num_experts": config.n_routed_experts,
    "num_experts_per_tok": config.top_k,
    "moe_intermediate_size": config.expert_hidden,
    "norm_topk_prob": config.norm_topk_prob,
    "shared_expert_intermediate_size": config.shared_width,
    # Dense layers (a prefix here) are Qwen2-MoE's mlp_only_layers, of width intermediate_size.
    "mlp_only_layers": list(range(config.first_k_dense)),
    "decoder_sparse_step": 1,
    "intermediate_size": config.dense_hidden if config.first_k_dense else config.expert_hidden,
    "use_sliding_window": False,
    "sliding_window": None,
    "bos_token_id": config.bos_id if bos_id is None else bos_id,
    "eos_token_id": config.eos_id,
    "pad_token_id": None,
  }


def _out_in(w_IO: np.ndarray) -> np.ndarray:
  """[in, out] (ours) -> [out, in] (a torch Linear's weight)."""
  return np.ascontiguousarray(np.asarray(w_IO, np.float32).T)


def qwen2_moe_tensors(config: ModelConfig, pure: dict) -> dict[str, np.ndarray]:
  """Our pure parameter dict as Qwen2-MoE tensor names (the inverse of `hf.weights`' import)."""
  check_exportable(config)
  d = config.d_model
  f32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))  # noqa: E731
  out = {"model.embed_tokens.weight": f32(pure["embed_VD"]), "model.norm.weight": f32(pure["final_norm"]["weight"])}
  if not config.tie_embeddings:
    out["lm_head.weight"] = _out_in(pure["lm_head_DV"])
  for i in range(config.n_layers):
    layer, p = pure["layers"][i], f"model.layers.{i}"
    attn = layer["attn"]
    out[f"{p}.input_layernorm.weight"] = f32(layer["attn_norm"]["weight"])
    out[f"{p}.post_attention_layernorm.weight"] = f32(layer["ffn_norm"]["weight"])
    for name in ("q", "k", "v"):
      out[f"{p}.self_attn.{name}_proj.weight"] = _out_in(np.asarray(attn[f"w_{name}_DHK"]).reshape(d, -1))
    out[f"{p}.self_attn.o_proj.weight"] = _out_in(np.asarray(attn["w_o_HKD"]).reshape(-1, d))
    if config.qkv_bias:
      out.update(
        {
          f"{p}.self_attn.q_proj.bias": f32(attn["b_q_HK"]).reshape(-1),
          f"{p}.self_attn.k_proj.bias": f32(attn["b_k_GK"]).reshape(-1),
          f"{p}.self_attn.v_proj.bias": f32(attn["b_v_GK"]).reshape(-1),
        }
      )
    ffn = layer["ffn"]
    if not config.is_moe_layer(i):
      for name in ("gate", "up"):
        out[f"{p}.mlp.{name}_proj.weight"] = _out_in(ffn[f"w_{name}_DF"])
      out[f"{p}.mlp.down_proj.weight"] = _out_in(ffn["w_down_FD"])
      continue
    out[f"{p}.mlp.gate.weight"] = _out_in(ffn["w_router_DE"])
    for e in range(config.n_routed_experts):
      out[f"{p}.mlp.experts.{e}.gate_proj.weight"] = _out_in(ffn["w_gate_EDF"][e])
      out[f"{p}.mlp.experts.{e}.up_proj.weight"] = _out_in(ffn["w_up_EDF"][e])
      out[f"{p}.mlp.experts.{e}.down_proj.weight"] = _out_in(ffn["w_down_EFD"][e])
    shared = ffn["shared"]
    out[f"{p}.mlp.shared_expert.gate_proj.weight"] = _out_in(shared["w_gate_DF"])
    out[f"{p}.mlp.shared_expert.up_proj.weight"] = _out_in(shared["w_up_DF"])
    if config.shared_expert_gate:
      out[f"{p}.mlp.shared_expert.down_proj.weight"] = _out_in(shared["w_down_FD"])
      out[f"{p}.mlp.shared_expert_gate.weight"] = f32(ffn["w_shared_gate_D"]).reshape(1, d)
    else:  # an ungated shared expert: gate weight 0 (sigmoid 1/2), down projection doubled
      out[f"{p}.mlp.shared_expert.down_proj.weight"] = 2.0 * _out_in(shared["w_down_FD"])
      out[f"{p}.mlp.shared_expert_gate.weight"] = np.zeros((1, d), np.float32)
  return out


def prompt_bos_id(tokenizer: Tokenizer, default: int) -> int:
  """The special token the tokenizer's prompts start with (`prompt_ids` against `encode`: EOS for
  our tokenizers), or `default` where prompts start with the text."""
  probe = "x = 1"
  framed, plain = list(tokenizer.prompt_ids(probe)), list(tokenizer.encode(probe))
  if len(framed) > len(plain) and framed[1 : 1 + len(plain)] == plain:
    return int(framed[0])
  return default


def tokenizer_files(hf_tok: HfTokenizer, config: ModelConfig, bos_id: int) -> dict[str, str]:
  """File name -> text: the tokenizer transformers loads (`AutoTokenizer.from_pretrained`) from
  `hf_tok` (`tokenizer.hf_tokenizer()`), and the generation config; `bos_id`: `prompt_bos_id`."""
  special = {
    name: hf_tok.id_to_token(i)
    for name, i in (("bos_token", bos_id), ("eos_token", config.eos_id))
    if hf_tok.id_to_token(i) is not None
  }
  tokenizer_config = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "model_max_length": config.max_seq_len,
    "clean_up_tokenization_spaces": False,
    # Whether special tokens' text in the input is encoded as text (our byte tokenizer: yes).
    "split_special_tokens": bool(hf_tok.encode_special_tokens),
    **special,
  }
  generation = {
    "bos_token_id": bos_id,
    "eos_token_id": config.eos_id,
    "pad_token_id": config.eos_id,
    "do_sample": False,
  }
  return {
    "tokenizer.json": hf_tok.to_str(),
    "tokenizer_config.json": json.dumps(tokenizer_config, indent=2),
    "special_tokens_map.json": json.dumps(special, indent=2),
    "generation_config.json": json.dumps(generation, indent=2),
  }


def export_qwen2_moe(model: ModelHandle, path: atomic.PathLike) -> pathlib.Path:
  """Writes `model` (a `moespec_jax.Model`) to `path` as a Qwen2-MoE checkpoint, atomically
  (replacing `path`): config.json and model.safetensors (float32), the tokenizer and the
  generation config (`tokenizer_files`; BOS is the token our prompts start with). A model without
  a tokenizer (an import that had none) is written without one."""
  config = model.config
  hf_tok = model.tokenizer.hf_tokenizer()
  if hf_tok is None:
    logging.warning("the model has no tokenizer: the export holds none (prompts are token ids)")
    bos_id, files = config.bos_id, {}
  else:
    bos_id = prompt_bos_id(model.tokenizer, config.bos_id)
    files = tokenizer_files(hf_tok, config, bos_id)
  hf_config = qwen2_moe_config(config, bos_id=bos_id)
  tensors = qwen2_moe_tensors(config, nnx.to_pure_dict(model.state))
  path = pathlib.Path(path)
  with atomic.atomic_dir(path) as tmp:
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name, text in files.items():
      (tmp / name).write_text(text)
  return path
