"""ModelConfig (moespec_jax/config.py): the dict round trip, the shapes derived from the fields, and
refusals that name the field."""

import dataclasses

import ml_collections
import pytest

from moespec_jax.config import ModelConfig, dataclass_from_dict, model_config_from

MLA = dict(attention_type="mla", kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def test_a_config_survives_its_dict_and_replace_changes_one_field():
  config = ModelConfig(d_model=64, n_layers=3, num_mtp_modules=1, **MLA)
  assert ModelConfig.from_dict(config.to_dict()) == config
  changed = config.replace(top_k=2)
  assert (changed.top_k, config.top_k) == (2, 4)
  assert changed.replace(top_k=4) == config


def test_the_dense_layers_are_a_prefix():
  config = ModelConfig(n_layers=4, first_k_dense=1)
  assert config.n_moe_layers == 3
  assert [config.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
  assert config.moe_layers == [1, 2, 3]
  assert ModelConfig(n_layers=2, first_k_dense=2).n_moe_layers == 0


def test_shared_width_is_the_fused_shared_experts():
  assert ModelConfig(n_shared_experts=2, expert_hidden=64).shared_width == 128
  assert ModelConfig(n_shared_experts=2, shared_expert_hidden=96).shared_width == 96
  assert ModelConfig(n_shared_experts=0).shared_width == 0


def test_a_cache_entry_holds_kv_heads_or_the_mla_latent():
  assert ModelConfig(n_heads=4, n_kv_heads=2, head_dim=64).cache_dims == (2, 64, 64)
  assert ModelConfig(**MLA).cache_dims == (1, 32, 8)


@pytest.mark.parametrize(
  "fields, named",
  [
    (dict(head_dim=15), "head_dim"),
    (dict(n_layers=2, first_k_dense=3), "first_k_dense"),
    (dict(score_func="relu"), "score_func"),
    (dict(n_groups=4, topk_groups=5), "topk_groups"),
    (dict(eos_id=264), "eos_id"),
    (dict(attention_type="mha"), "attention_type"),
    (dict(MLA, qk_rope_head_dim=7), "qk_rope_head_dim"),
    (dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=64), "MLA only"),
    (dict(n_shared_experts=0, shared_expert_gate=True), "shared_expert_gate"),
  ],
)
def test_a_bad_value_is_refused_naming_its_field(fields, named):
  with pytest.raises(ValueError, match=named):
    ModelConfig(**fields)


def test_dataclass_from_dict_refuses_unknown_fields():
  @dataclasses.dataclass(frozen=True)
  class Pair:
    a: int = 0
    b: int = 1

  assert dataclass_from_dict(Pair, {"a": 3}, "unknown") == Pair(a=3)
  assert dataclass_from_dict(Pair, ml_collections.ConfigDict({"b": 5}), "unknown") == Pair(b=5)
  with pytest.raises(ValueError, match=r"unknown pair fields \['c'\]"):
    dataclass_from_dict(Pair, {"a": 1, "c": 2}, "unknown pair fields")


def test_model_config_from_a_config_file_section():
  section = ml_collections.ConfigDict({"d_model": 64, "n_layers": 2, "top_k": 2})
  assert model_config_from(section) == ModelConfig(d_model=64, n_layers=2, top_k=2)
  assert model_config_from({"vocab_size": 300}).vocab_size == 300
