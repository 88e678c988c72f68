"""roofline: the weight bytes of a decode step, counted against the model's own parameters."""

import jax
import pytest

import moespec_jax as msj
from moespec_jax.analysis import roofline


def _target_param_bytes(model):
  """Bytes of every target parameter (MTP heads left out), from the arrays themselves."""
  leaves = jax.tree_util.tree_flatten_with_path(model.state)[0]
  return sum(v.nbytes for path, v in leaves if "mtp" not in jax.tree_util.keystr(path))


@pytest.mark.parametrize("tie", [False, True])
def test_every_expert_read_is_every_weight_but_the_input_table(tiny_config, tie):
  config = tiny_config.replace(tie_embeddings=tie, num_mtp_modules=1)
  model = msj.Model.init(config, seed=0)
  all_experts = roofline.decode_weight_bytes(config, [config.n_routed_experts] * config.n_moe_layers)
  table = 0 if tie else config.vocab_size * config.d_model * 4
  assert all_experts == _target_param_bytes(model) - table
  # Each distinct expert adds its three matrices, in every MoE layer alike.
  none = roofline.decode_weight_bytes(config, [0] * config.n_moe_layers)
  one = roofline.decode_weight_bytes(config, [1] + [0] * (config.n_moe_layers - 1))
  assert one - none == 3 * config.d_model * config.expert_hidden * 4
  assert all_experts - none == config.n_moe_layers * config.n_routed_experts * (one - none)


def test_bad_unique_counts_are_refused(tiny_config):
  with pytest.raises(ValueError, match="one entry per MoE layer"):
    roofline.decode_weight_bytes(tiny_config, [1.0] * (tiny_config.n_moe_layers + 1))
  with pytest.raises(ValueError, match="must lie in"):
    roofline.decode_weight_bytes(tiny_config, [tiny_config.n_routed_experts + 1] * tiny_config.n_moe_layers)


def test_bound_scales_with_bandwidth_and_batch():
  assert roofline.bound_tokens_per_second(1e9, 10.0, 1) == pytest.approx(10.0)
  assert roofline.bound_tokens_per_second(1e8, 10.0, 8) == pytest.approx(800.0)
  assert roofline.stream_read_gbps(repeats=1) > 0


def test_flush_caches_reads_a_buffer_of_the_requested_size():
  roofline.flush_caches(1 << 20)
  first = roofline._FLUSH[0]
  assert first.nbytes == 1 << 20
  roofline.flush_caches(1 << 20)
  assert roofline._FLUSH[0] is first  # reused, not reallocated
  roofline.flush_caches(1 << 21)
  assert roofline._FLUSH[0].nbytes == 1 << 21


def test_last_level_cache_is_the_largest_cache_sysfs_lists(tmp_path):
  for name, size in (("index0", "48K"), ("index2", "1024K"), ("index3", "32768K")):
    (tmp_path / name).mkdir()
    (tmp_path / name / "size").write_text(size + "\n")
  assert roofline.last_level_cache_bytes(tmp_path) == 32 * 1024 * 1024
  assert roofline.last_level_cache_bytes(tmp_path / "missing") is None


@pytest.mark.parametrize("mla", [False, True])
def test_cache_bytes_are_the_cache_arrays_per_position(tiny_config, mla):
  """One row of 40 positions reads what a 40-position cache holds, every layer (MLA: latent and
  rotary key); 8 rows of 40 read 8 times as much."""
  import dataclasses
  from moespec_jax.model.cache import KVCache
  config = tiny_config
  if mla:
    config = dataclasses.replace(config, attention_type="mla", kv_lora_rank=16, qk_nope_head_dim=8,
                                 qk_rope_head_dim=4, v_head_dim=8)
  cache = KVCache.for_config(config, batch=1, max_len=40)
  held = sum(a.nbytes for a in (*cache.keys, *cache.values))
  assert roofline.decode_cache_bytes(config, 40) == held
  assert roofline.decode_cache_bytes(config, 8 * 40) == 8 * held
  with pytest.raises(ValueError, match="context_tokens"):
    roofline.decode_cache_bytes(config, -1)
