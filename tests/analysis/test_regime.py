"""The regime verdict: bytes per pass and the working set against the last-level cache, a measured
pass's effective bandwidth, arithmetic intensity against the balance point (cache size, rates and
pass times injected: nothing is timed here)."""

import pytest

import configs
from moespec_jax.analysis import regime

MIB = 2**20


def _regime(name, **kwargs):
  args = dict(cache_bytes=32 * MIB, matmul_gflops_rate=200.0, stream_gbps_rate=25.0)
  return regime.regime_of(configs.model_config(name), **{**args, **kwargs})


def test_the_membound_configs_read_each_pass_from_memory():
  for name in ("membound_coarse", "membound_fine"):
    r = _regime(name)
    assert r.verdict == "memory-bound", r.reason
    assert r.pass_bytes > 4 * 32 * MIB
    assert r.arithmetic_intensity < r.balance_flops_per_byte
    assert "last-level cache" in r.line() and "balance point" in r.line()


def test_weight_bytes_count_the_top_k_experts_and_their_union():
  config = configs.model_config("membound_coarse")
  expert = 3 * config.d_model * config.expert_hidden * 4
  one, two = regime.weight_bytes(config, 1), regime.weight_bytes(config, 2)
  # One token reads top_k experts per MoE layer; two tokens the uniform union, 8 [1 - (6/8)^2].
  assert two - one == pytest.approx(config.n_moe_layers * (8 * (1 - 0.75**2) - 2) * expert + config.d_model * 4)
  assert regime.weight_bytes(config, 1, unique_experts=8) - one == pytest.approx(config.n_moe_layers * 6 * expert)


def test_compute_bound_where_the_intensity_passes_the_balance_point():
  # A large batch: bytes far above the cache, but operations per byte above a low balance point.
  r = _regime("membound_coarse", matmul_gflops_rate=100.0)
  big = regime.regime_of(
    configs.model_config("membound_coarse"), 64, cache_bytes=32 * MIB, matmul_gflops_rate=100.0, stream_gbps_rate=25.0
  )
  assert r.verdict == "memory-bound" and big.verdict == "compute-bound"
  assert big.arithmetic_intensity > big.balance_flops_per_byte


def test_unknown_cache_or_rates_are_said():
  r = _regime("membound_fine", cache_bytes=None)
  assert r.verdict == "memory-bound" and "cache size unknown" in r.reason
  r = _regime("membound_fine", cache_bytes=None, matmul_gflops_rate=None)
  assert r.verdict == "unknown" and "balance point unknown" in r.reason
  assert regime.classify(1e6, 0.5, 32 * MIB, None)[0] == "compute-bound"


def test_last_level_cache_reads_the_level_3_entry(tmp_path):
  for i, (level, size) in enumerate([(1, "32K"), (2, "2048K"), (3, "32768K")]):
    (tmp_path / f"index{i}").mkdir()
    (tmp_path / f"index{i}" / "level").write_text(f"{level}\n")
    (tmp_path / f"index{i}" / "size").write_text(f"{size}\n")
  assert regime.last_level_cache(tmp_path) == (32 * MIB, "sysfs L3")
  size, source = regime.last_level_cache(tmp_path / "missing")
  assert source in ("sysconf L3", "unknown") and (size is None) == (source == "unknown")


def test_record_prints_one_line_and_returns_each_batch():
  lines = []
  rates = dict(cache_bytes=32 * MIB, matmul_gflops_rate=200.0, stream_gbps_rate=25.0)
  out = regime.record(configs.model_config("tiny"), (1, 4), log=lines.append, measured_pass_ms={1: 0.1}, **rates)
  assert len(lines) == 1 and lines[0].startswith("regime: ") and "batch 4" in lines[0]
  assert out[0]["measured_pass_ms"] == 0.1 and out[1]["measured_pass_ms"] is None
  assert [r["batch_size"] for r in out] == [1, 4] and {"verdict", "reason", "pass_bytes"} <= set(out[0])


def test_a_working_set_beyond_the_cache_needs_a_measured_pass():
  # The default model: a pass's bytes fit a 32 MiB cache, its working set (every expert) does not.
  r = _regime("tiny")
  assert r.pass_bytes < 32 * MIB < r.working_set_bytes
  assert r.verdict == "borderline" and "working set" in r.reason and "measured plain pass decides" in r.reason
  # Measured: bytes at streaming speed come from memory; at 4x it the cache served them.
  at_stream = _regime("tiny", measured_pass_ms=r.pass_bytes / 25e9 * 1e3)
  assert at_stream.verdict == "memory-bound" and at_stream.effective_gbps == pytest.approx(25.0)
  from_cache = _regime("tiny", measured_pass_ms=r.pass_bytes / 100e9 * 1e3)
  assert from_cache.verdict == "compute-bound" and "4.00x streaming" in from_cache.reason
  # A cache holding the whole working set: resident, no measurement needed.
  assert _regime("tiny", cache_bytes=4 * r.working_set_bytes).verdict == "compute-bound"


def test_a_measurement_overrules_the_bytes_count():
  fast = _regime("membound_fine", measured_pass_ms=1e-3)
  assert fast.verdict == "compute-bound" and fast.to_dict()["effective_gbps"] == pytest.approx(fast.effective_gbps)
  with pytest.raises(ValueError, match="measured_pass_ms"):
    _regime("tiny", measured_pass_ms=0.0)


def test_the_working_set_is_every_weight_but_the_input_table():
  config = configs.model_config("tiny")
  counts = config.param_counts()
  assert regime.working_set_bytes(config) == (counts["total"] - config.vocab_size * config.d_model) * 4
  assert regime.working_set_bytes(config) > regime.weight_bytes(config, 1)
