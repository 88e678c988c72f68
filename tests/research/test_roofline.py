"""roofline: the weight bytes of a decode step, counted against the model's own parameters."""

import jax
import pytest

import moespec_jax as msj
from moespec_jax.research import roofline


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
    config = dataclasses.replace(
      config, attention_type="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8
    )
  cache = KVCache.for_config(config, batch=1, max_len=40)
  held = sum(a.nbytes for a in (*cache.keys, *cache.values))
  assert roofline.decode_cache_bytes(config, 40) == held
  assert roofline.decode_cache_bytes(config, 8 * 40) == 8 * held
  with pytest.raises(ValueError, match="context_tokens"):
    roofline.decode_cache_bytes(config, -1)


@pytest.mark.parametrize("mla, tie", [(False, False), (False, True), (True, False)])
def test_a_one_token_prefill_multiplies_each_active_weight_once(tiny_config, mla, tie):
  """One position: every active weight but the input table, norms and the score bias enters one
  multiply-add, plus one (query, key) pair per layer (MLA: its latent expanded, the cheaper form
  for one position)."""
  import dataclasses

  config = dataclasses.replace(tiny_config, tie_embeddings=tie, use_score_bias=True)
  c = config
  if mla:
    config = dataclasses.replace(
      config,
      attention_type="mla",
      q_lora_rank=24,
      kv_lora_rank=16,
      qk_nope_head_dim=8,
      qk_rope_head_dim=4,
      v_head_dim=8,
    )
    c = config
    norms = c.n_layers * (2 * c.d_model + c.kv_lora_rank + c.q_lora_rank) + c.d_model
    pair = c.n_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
  else:
    norms = c.n_layers * 2 * c.d_model + c.d_model
    pair = 2 * c.n_heads * c.head_dim
  table = 0 if tie else c.vocab_size * c.d_model
  weights = c.param_counts()["active"] - table - norms - c.n_moe_layers * c.n_routed_experts
  assert roofline.prefill_flops(config, 1) == 2 * (weights + c.n_layers * pair)
  assert roofline.prefill_flops(config, 1, batch_size=3) == 3 * roofline.prefill_flops(config, 1)


def test_a_prefill_counts_causal_pairs_and_the_last_layer_at_its_last_position():
  """Three positions through a dense layer and a last MoE layer, by hand: keys and values at every
  position in both; queries, attention pairs (6 causal, then 3 for the last position) and FFN at
  every position, then at the last one only; the head once per row."""
  from moespec_jax.config import ModelConfig

  config = ModelConfig(
    vocab_size=10,
    d_model=8,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    head_dim=4,
    n_routed_experts=4,
    top_k=2,
    n_shared_experts=1,
    expert_hidden=3,
    dense_hidden=6,
    first_k_dense=1,
    eos_id=0,
    bos_id=1,
  )
  kv, qo, pair = 8 * 2 * 4, 2 * 8 * 2 * 4, 2 * 2 * 4  # per position, per query, per pair
  dense_layer = 3 * kv + 3 * qo + 6 * pair + 3 * (3 * 8 * 6)
  moe_last = 3 * kv + qo + 3 * pair + (8 * 4 + 2 * 3 * 8 * 3 + 3 * 8 * 3)
  assert roofline.prefill_flops(config, 3, batch_size=2) == 2 * 2 * (dense_layer + moe_last + 8 * 10)
  with pytest.raises(ValueError, match="prompt_len"):
    roofline.prefill_flops(config, 0)


def test_matmul_rate_is_measured():
  assert roofline.matmul_gflops(repeats=1, size=128) > 0


def test_a_measured_plain_pass_decides_the_regime(tiny_model, monkeypatch):
  prompts = ["def f(x):\n", "import os\n"]
  # A real measurement runs end to end (on the tiny model under the other test worker's load a
  # pass may be lost in noise: None; the arithmetic is checked on a fake clock below).
  ms = roofline.plain_pass_ms(tiny_model, prompts, new_tokens=16, repeats=3)
  assert ms is None or ms > 0
  with pytest.raises(ValueError, match="new_tokens"):
    roofline.plain_pass_ms(tiny_model, prompts, new_tokens=0)
  # Each batch size's pass measured on its first `batch` prompts, with half the bench's tokens.
  calls = []

  def fake_pass_ms(model, batch_prompts, new_tokens):
    calls.append((len(batch_prompts), new_tokens))
    return 0.1 * len(batch_prompts)

  monkeypatch.setattr(roofline, "plain_pass_ms", fake_pass_ms)
  lines = []
  out = roofline.measured_regimes(tiny_model, prompts, (1, 2), context=16, max_new_tokens=32, log=lines.append)
  assert calls == [(1, 16), (2, 16)]
  assert [(r["batch_size"], r["measured_pass_ms"]) for r in out] == [(1, 0.1), (2, 0.2)]
  assert all(r["effective_gbps"] > 0 for r in out) and "measured" in lines[0]


def test_a_pass_lost_in_noise_is_no_measurement(monkeypatch, tiny_config):
  import types

  # Every run takes the same time, however many tokens: no pass time can be read from them.
  monkeypatch.setattr(msj, "generate", lambda *a, **k: types.SimpleNamespace(tokens=[0]))
  monkeypatch.setattr(roofline, "time", types.SimpleNamespace(perf_counter=iter(range(100)).__next__))
  assert roofline.plain_pass_ms(None, ["x"], new_tokens=4, repeats=3) is None
  rates = dict(cache_bytes=2**30, matmul_gflops_rate=200.0, stream_gbps_rate=25.0)
  out = roofline.regime.record(tiny_config, (1,), measured_pass_ms={1: None}, log=lambda _: None, **rates)
  assert out[0]["measured_pass_ms"] is None and out[0]["effective_gbps"] is None
