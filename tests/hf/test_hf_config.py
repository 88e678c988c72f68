"""Hugging Face config.json to ModelConfig (moespec_jax/hf/config.py), without transformers: our own
export's config maps back to the model's shape, and layouts the model cannot express are refused
naming the field. Each family's import against transformers is in test_hf_parity.py."""

import pytest

from moespec_jax.config import ModelConfig
from moespec_jax.hf import config as hf_config
from moespec_jax.hf import export

MIXTRAL = {
  "model_type": "mixtral",
  "vocab_size": 300,
  "hidden_size": 32,
  "num_hidden_layers": 2,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "num_local_experts": 8,
  "num_experts_per_tok": 2,
  "intermediate_size": 24,
  "max_position_embeddings": 128,
  "rope_theta": 1e6,
  "eos_token_id": 2,
  "bos_token_id": 1,
}


def test_our_exported_config_maps_back_to_the_models_shape(tiny_config):
  config, spec = hf_config.to_model_config(export.qwen2_moe_config(tiny_config))
  assert spec.family == "qwen2_moe" and spec.num_mtp_layers == 0
  same = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "n_routed_experts", "top_k")
  assert all(getattr(config, f) == getattr(tiny_config, f) for f in same)
  assert (config.expert_hidden, config.first_k_dense, config.dense_hidden) == (16, 1, 48)
  # Qwen2-MoE's shared expert is gated: ours is written with a zero gate (export.py).
  assert config.shared_expert_gate and config.shared_width == tiny_config.shared_width
  assert (config.eos_id, config.bos_id, config.tokenizer) == (256, 257, "pretrained")


def test_a_mixtral_config():
  config, spec = hf_config.to_model_config(MIXTRAL, dtype="bfloat16")
  assert isinstance(config, ModelConfig) and spec.moe_prefix == "block_sparse_moe"
  assert (config.n_routed_experts, config.expert_hidden, config.head_dim, config.rope_theta) == (8, 24, 8, 1e6)
  assert (config.n_shared_experts, config.first_k_dense, config.dtype) == (0, 0, "bfloat16")


@pytest.mark.parametrize(
  "change, message",
  [
    ({"model_type": "llama"}, "unsupported Hugging Face model_type 'llama'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"sliding_window": 64}, "sliding_window=64"),
    ({"num_local_experts": None}, "num_local_experts"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope scaling type 'linear'"),
  ],
)
def test_what_the_model_cannot_express_is_refused_naming_it(change, message):
  hf = {k: v for k, v in {**MIXTRAL, **change}.items() if v is not None}
  with pytest.raises(ValueError, match=message):
    hf_config.to_model_config(hf)
