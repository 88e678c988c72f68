"""moespec_jax/hf/peer_bench: rounds interleave every measurement; ratios are taken within rounds."""

import dataclasses
import json

import pytest

from moespec_jax.research import peer_bench


def test_summary_ratios_are_medians_of_within_round_ratios():
  def row(impl, batch, drafter, seconds, tokens=64):
    return {
      "family": "f",
      "impl": impl,
      "batch_size": batch,
      "drafter": drafter,
      "seconds": seconds,
      "tokens": tokens,
      "tokens_per_second": tokens / seconds[0],
      "params": 1e6,
      "tokens_identical_to_transformers": True,
    }

  # Round 2 is a slow spell for everything: within-round ratios ignore it; ratios of medians
  # over rounds measured at different times would not.
  rows = [
    row("moespec_jax", 1, "none", [0.1, 0.4, 0.1]),
    row("transformers", 1, "none", [0.5, 2.0, 0.5]),
    row("moespec_jax", 1, "ngram", [0.08, 0.32, 0.08]),
    row("transformers", 1, "ngram", [0.5, 2.0, 0.5]),
    row("moespec_jax", 8, "none", [0.2, 0.8, 0.2], 512),
    row("transformers", 8, "none", [0.6, 2.4, 0.6], 512),
  ]
  (s,) = peer_bench.summarize(rows)
  assert s["plain_ratio_b1"] == pytest.approx(5.0) and s["plain_ratio_b8"] == pytest.approx(3.0)
  assert s["ngram_speedup_ours"] == pytest.approx(1.25) and s["ngram_speedup_transformers"] == pytest.approx(1.0)
  assert s["ngram_speedup_ours_over_transformers"] == pytest.approx(1.25)
  assert s["ngram_speedup_ours_over_transformers_interval"] == pytest.approx((1.25, 1.25))
  assert s["tokens_identical"]
  assert "| 1.25x | 1.00x | 1.25 [1.25, 1.25] | True |" in peer_bench.table(rows, [s])


def test_summary_compares_the_two_ngram_speedups_within_rounds():
  """Transformers' prompt lookup gains 1.6x in every round; ours 1.5x in four rounds and 1.8x in
  three: the medians say 1.5 against 1.6, the within-round comparison 0.94, and its interval
  reaches above 1 (the noise allows either)."""

  def row(impl, drafter, seconds):
    return {
      "family": "f",
      "impl": impl,
      "batch_size": 1 if drafter else 8,
      "drafter": drafter or "none",
      "seconds": seconds,
      "tokens": 64,
      "tokens_identical_to_transformers": True,
    }

  ours_ngram = [0.1 / x for x in (1.5, 1.8, 1.5, 1.8, 1.5, 1.8, 1.5)]
  rows = [
    row("moespec_jax", "none", [0.1] * 7),
    row("moespec_jax", "ngram", ours_ngram),
    row("transformers", "none", [1.0] * 7),
    row("transformers", "ngram", [1.0 / 1.6] * 7),
    row("moespec_jax", None, [0.1] * 7),
    row("transformers", None, [0.1] * 7),
  ]
  (s,) = peer_bench.summarize(rows)
  assert s["ngram_speedup_ours"] == pytest.approx(1.5) and s["ngram_speedup_transformers"] == pytest.approx(1.6)
  assert s["ngram_speedup_ours_over_transformers"] == pytest.approx(1.5 / 1.6)
  lo, hi = s["ngram_speedup_ours_over_transformers_interval"]
  assert lo == pytest.approx(1.5 / 1.6) and hi == pytest.approx(1.8 / 1.6)


def test_summary_ceiling_is_the_stream_bound_over_transformers():
  """At 10 GB/s, 0.1 GB per step bounds batch 8 at 800 tokens/s: 2x transformers' 400; ours
  sustained 6 GB/s, 60% of the stream."""

  def row(impl, batch, drafter, tok_s, **extra):
    return {
      "family": "f",
      "impl": impl,
      "batch_size": batch,
      "drafter": drafter,
      "seconds": [1.0],
      "params": 1e6,
      "tokens": tok_s,
      "tokens_per_second": tok_s,
      "tokens_identical_to_transformers": True,
      **extra,
    }

  plain = lambda impl, batch, tok_s: row(
    impl,
    batch,
    "none",
    tok_s,
    weight_bytes_per_step=1e8,  # noqa: E731
    read_gbps=1e8 * tok_s / batch / 1e9,
  )
  rows = [
    plain("moespec_jax", 1, 60),
    plain("transformers", 1, 20),
    row("moespec_jax", 1, "ngram", 90),
    row("transformers", 1, "ngram", 30),
    plain("moespec_jax", 8, 480),
    plain("transformers", 8, 400),
  ]
  (s,) = peer_bench.summarize(rows, stream_gbps=10.0)
  assert s["ceiling_ratio_b8"] == pytest.approx(2.0) and s["ceiling_ratio_b1"] == pytest.approx(5.0)
  assert s["stream_fraction_b8"] == pytest.approx(0.6) and s["stream_fraction_b1"] == pytest.approx(0.6)
  assert "| 5.00 / 2.00 | 60% / 60% |" in peer_bench.table(rows, [s])
  assert "ceiling_ratio_b8" not in peer_bench.summarize(rows)[0]  # no bandwidth measured: no ceiling


def test_summary_decode_phase_is_a_run_less_its_first_token_within_rounds():
  """17 tokens, so 16 decode steps. Batch 1: ours 0.02 s + 16 x 1 ms, transformers 0.05 s + 16 x
  5 ms (5x per step); round 2 is slow for everything. Batch 8: ours 8 ms, theirs 20 ms a step
  (2.5x) while a step reads 4x the bytes: transformers' step grows 4x, the bytes 4x, so at one read
  rate the batch-8 ratio would equal the batch-1 one (factor 1)."""

  def row(impl, batch, drafter, first, step_ms, nbytes=None, slow=(1, 3, 1)):
    seconds = [(first + 16 * step_ms / 1e3) * f for f in slow]
    r = {
      "family": "f",
      "impl": impl,
      "batch_size": batch,
      "drafter": drafter,
      "seconds": seconds,
      "tokens": 17 * batch,
      "tokens_per_second": 17 * batch / seconds[0],
      "params": 1e6,
      "max_new_tokens": 17,
      "tokens_identical_to_transformers": True,
    }
    if drafter == "none":
      r.update(weight_bytes_per_step=nbytes, read_gbps=1.0, first_token_seconds=[first * f for f in slow])
      r["decode_ms_per_step"] = step_ms
      r["decode_read_gbps"] = nbytes / (step_ms / 1e3) / 1e9
    return r

  rows = [
    row("moespec_jax", 1, "none", 0.02, 1.0, 1e7),
    row("transformers", 1, "none", 0.05, 5.0, 1e7),
    row("moespec_jax", 1, "ngram", 0.02, 0.5),
    row("transformers", 1, "ngram", 0.05, 5.0),
    row("moespec_jax", 8, "none", 0.08, 8.0, 4e7),
    row("transformers", 8, "none", 0.2, 20.0, 4e7),
  ]
  (s,) = peer_bench.summarize(rows, stream_gbps=20.0)
  assert s["decode_ratio_b1"] == pytest.approx(5.0) and s["decode_ratio_b8"] == pytest.approx(2.5)
  assert s["decode_ratio_b1_interval"] == pytest.approx((5.0, 5.0))
  assert s["first_token_ratio_b1"] == pytest.approx(2.5) and s["first_token_ratio_b8"] == pytest.approx(2.5)
  # 1e7 bytes at 20 GB/s: 0.5 ms a step, against transformers' 5 ms: 10x; batch 8: 2 ms against 20.
  assert s["decode_ceiling_ratio_b1"] == pytest.approx(10.0) and s["decode_ceiling_ratio_b8"] == pytest.approx(10.0)
  assert s["decode_stream_fraction_b1"] == pytest.approx(0.5) and s["decode_stream_fraction_b8"] == pytest.approx(0.25)
  assert s["decode_ratio_b8_over_b1_at_equal_read_rate"] == pytest.approx(1.0)
  # Prompt lookup halves our decode steps and none of transformers': 2x against 1x in the decode
  # phase, where the whole runs say (0.02 + 0.016) / (0.02 + 0.008) = 1.29x.
  assert s["ngram_speedup_ours"] == pytest.approx(0.036 / 0.028)
  assert s["ngram_decode_speedup_ours"] == pytest.approx(2.0)
  assert s["ngram_decode_speedup_transformers"] == pytest.approx(1.0)
  assert s["ngram_decode_speedup_ours_over_transformers"] == pytest.approx(2.0)
  assert s["ngram_decode_speedup_ours_over_transformers_interval"] == pytest.approx((2.0, 2.0))
  assert (
    "| f | 5.00x [5.00, 5.00] | 2.50x [2.50, 2.50] | 2.50 / 2.50 | 10.00 / 10.00 | 10.0 / 5.0 (50% / 25%) | "
    "1.00 | 2.00x / 1.00x (2.00 [2.00, 2.00]) |"
  ) in peer_bench.table(rows, [s])


def test_prefill_floor_replaces_our_first_token_within_rounds():
  """17 tokens. Ours: first token 20 ms, 1 ms plain steps, prompt lookup at 0.5 ms a token; round
  2 is three times slower for everything. A 1 GFLOP prefill at 250 GFLOP/s takes at least 4 ms: had
  our first token cost 4 ms and one step, round 1's runs would take 21 and 13 ms (1.615x), round
  2's 55 and 31 ms (1.774x); transformers' prompt lookup gains nothing."""

  def row(impl, batch, drafter, first, step_ms, flops=None):
    seconds = [(first + 16 * step_ms / 1e3) * f for f in (1, 3, 1)]
    r = {
      "family": "f",
      "impl": impl,
      "batch_size": batch,
      "drafter": drafter,
      "seconds": seconds,
      "tokens": 17 * batch,
      "tokens_per_second": 17 * batch / seconds[0],
      "params": 1e6,
      "max_new_tokens": 17,
      "tokens_identical_to_transformers": True,
    }
    if drafter == "none":
      r.update(first_token_seconds=[first * f for f in (1, 3, 1)], decode_ms_per_step=step_ms, decode_read_gbps=1.0)
      if impl == "moespec_jax":
        r["prefill_flops"] = flops
    return r

  rows = [
    row("moespec_jax", 1, "none", 0.02, 1.0, 1e9),
    row("transformers", 1, "none", 0.05, 5.0),
    row("moespec_jax", 1, "ngram", 0.02, 0.5),
    row("transformers", 1, "ngram", 0.05, 5.0),
    row("moespec_jax", 8, "none", 0.08, 8.0, 8e9),
    row("transformers", 8, "none", 0.2, 20.0),
  ]
  (s,) = peer_bench.summarize(rows, matmul_gflops=250.0)
  assert s["prefill_floor_ms_b1"] == pytest.approx(4.0) and s["prefill_floor_ms_b8"] == pytest.approx(32.0)
  assert s["prefill_floor_share_b1"] == pytest.approx(0.2) and s["prefill_floor_share_b8"] == pytest.approx(0.4)
  assert s["ngram_speedup_ours"] == pytest.approx(0.036 / 0.028)  # the whole runs as measured
  assert s["ngram_speedup_ours_at_prefill_floor"] == pytest.approx(21 / 13)
  assert s["ngram_speedup_ours_at_prefill_floor_over_transformers"] == pytest.approx(21 / 13)
  assert s["ngram_speedup_ours_at_prefill_floor_over_transformers_interval"] == pytest.approx((21 / 13, 55 / 31))
  assert "| f | 1.00 / 8.00 | 4.00 / 32.00 | 20% / 40% | 1.62x | 1.62 [1.62, 1.77] |" in peer_bench.table(rows, [s])
  # Without a matmul rate, no floor figures.
  assert not any("floor" in k for k in peer_bench.summarize(rows)[0])


def test_no_decode_figures_where_the_decode_phase_was_too_short_to_time():
  def row(impl, batch, drafter, decode_ms):
    return {
      "family": "f",
      "impl": impl,
      "batch_size": batch,
      "drafter": drafter,
      "seconds": [0.01],
      "tokens": 2,
      "params": 1e6,
      "tokens_per_second": 200.0,
      "max_new_tokens": 2,
      "tokens_identical_to_transformers": True,
      "first_token_seconds": [0.011],
      "decode_ms_per_step": decode_ms,
    }

  rows = [
    row(i, b, d, None if (i, b) == ("moespec_jax", 8) else 1.0)
    for i in ("moespec_jax", "transformers")
    for b, d in ((1, "none"), (1, "ngram"), (8, "none"))
  ]
  (s,) = peer_bench.summarize(rows, stream_gbps=20.0)
  # Batch 1: every round timed the decode phase below zero (its median figure aside); batch 8: none.
  assert not any(k.startswith("decode") or k.startswith("ngram_decode") for k in s)
  assert "Decode phase" not in peer_bench.table(rows, [s])


def test_ceiling_counts_the_kv_cache_a_step_reads_beside_the_weights():
  """As above, but every step also reads 1e8 bytes of KV cache: twice the bytes, half the bound."""

  def row(impl, batch, drafter, tok_s, **extra):
    return {
      "family": "f",
      "impl": impl,
      "batch_size": batch,
      "drafter": drafter,
      "seconds": [1.0],
      "params": 1e6,
      "tokens": tok_s,
      "tokens_per_second": tok_s,
      "tokens_identical_to_transformers": True,
      **extra,
    }

  plain = lambda impl, batch, tok_s: row(
    impl,
    batch,
    "none",
    tok_s,
    weight_bytes_per_step=1e8,  # noqa: E731
    cache_bytes_per_step=1e8,
    read_gbps=2e8 * tok_s / batch / 1e9,
  )
  rows = [
    plain("moespec_jax", 1, 60),
    plain("transformers", 1, 20),
    row("moespec_jax", 1, "ngram", 90),
    row("transformers", 1, "ngram", 30),
    plain("moespec_jax", 8, 480),
    plain("transformers", 8, 400),
  ]
  (s,) = peer_bench.summarize(rows, stream_gbps=10.0)
  assert s["ceiling_ratio_b8"] == pytest.approx(1.0) and s["ceiling_ratio_b1"] == pytest.approx(2.5)


def test_ngram_decode_speedups_pair_only_rounds_both_sides_timed():
  """Round 0 of our n-gram run and round 1 of transformers' plain run came out no slower than their
  first token (untimeable): only round 2 is compared, ours 2x against their 1.25x."""

  def row(impl, drafter, seconds, first=None, batch=1):
    r = {
      "family": "f",
      "impl": impl,
      "batch_size": batch,
      "drafter": drafter,
      "seconds": seconds,
      "tokens": 5,
      "max_new_tokens": 5,
      "tokens_identical_to_transformers": True,
    }
    if first is not None:
      r.update(first_token_seconds=first, decode_ms_per_step=1.0)
    return r

  rows = [
    row("moespec_jax", "none", [0.05, 0.05, 0.05], first=[0.01] * 3),
    row("moespec_jax", "ngram", [0.01, 0.03, 0.03]),
    row("transformers", "none", [0.5, 0.1, 0.5], first=[0.1] * 3),
    row("transformers", "ngram", [0.3, 0.3, 0.42]),
    row("moespec_jax", "none", [0.1], batch=8),
    row("transformers", "none", [0.1], batch=8),
  ]
  (s,) = peer_bench.summarize(rows)
  assert s["ngram_decode_speedup_ours"] == pytest.approx(2.0)
  assert s["ngram_decode_speedup_transformers"] == pytest.approx(1.25)
  assert s["ngram_decode_speedup_ours_over_transformers"] == pytest.approx(1.6)


def test_make_config_defaults_quick_defaults_and_errors():
  from moespec_jax.hf import FAMILIES

  cfg = peer_bench.make_config()
  assert cfg.families == (*FAMILIES, peer_bench.TRAINED) and cfg.size == peer_bench.BENCH_SIZE
  assert peer_bench.make_config(trained=False).families == tuple(FAMILIES)
  assert (cfg.max_new_tokens, cfg.repeats, cfg.prompt_len) == (64, peer_bench.DEFAULT_REPEATS, 192)
  quick = peer_bench.make_config(quick=True)
  assert quick.families == tuple(FAMILIES)  # the trained model needs the full run
  # A smoke run timed as a full run is: a few rounds, not one.
  assert (quick.max_new_tokens, quick.repeats, quick.prompt_len, quick.size) == (16, 3, 64, peer_bench.QUICK_SIZE)
  # Settings given explicitly win over --quick's.
  given = peer_bench.make_config(quick=True, max_new_tokens=32, repeats=5, prompt_len=48)
  assert (given.max_new_tokens, given.repeats, given.prompt_len, given.size) == (32, 5, 48, peer_bench.QUICK_SIZE)
  with pytest.raises(ValueError, match=r"unknown \['nope'\]"):
    peer_bench.make_config(["mixtral", "nope"])
  with pytest.raises(ValueError, match="does not run with --quick"):
    peer_bench.make_config([peer_bench.TRAINED], quick=True)
  # A fixed K's drafts need cache room; auto K's do not.
  with pytest.raises(ValueError, match=r"\+ --num_draft \(4\) exceeds the 1024 positions"):
    peer_bench.make_config(["mixtral"], prompt_len=1000, max_new_tokens=22, auto_draft=False)
  assert peer_bench.make_config(["mixtral"], prompt_len=1000, max_new_tokens=22).prompt_len == 1000


def _family_rows(family, cfg):
  """The rows `bench_family` returns, with made-up times (two rounds)."""
  rows = []
  for batch, drafter in ((1, "none"), (1, "ngram"), (8, "none")):
    for impl in ("moespec_jax", "transformers"):
      rows.append(
        {
          "family": family,
          "impl": impl,
          "batch_size": batch,
          "drafter": drafter,
          "params": 1e6,
          "seconds": [0.1, 0.2] if impl == "moespec_jax" else [0.5, 0.6],
          "tokens": 64 * batch,
          "tokens_per_second": 640.0 * batch,
          "tokens_identical_to_transformers": True,
          "max_new_tokens": cfg.max_new_tokens,
          "prompt_len": cfg.prompt_len,
          "num_draft": cfg.num_draft if drafter == "ngram" else 0,
          "auto_draft": cfg.auto_draft and drafter == "ngram",
          **({"cache_bytes_per_step": 1.0, "prefill_flops": 1e9} if drafter == "none" else {}),
        }
      )
  return rows


def test_an_interrupted_run_keeps_its_finished_families_and_resumes_with_the_rest(tmp_path, monkeypatch):
  monkeypatch.setattr(peer_bench.roofline, "stream_read_gbps", lambda: 10.0)
  monkeypatch.setattr(peer_bench.roofline, "matmul_gflops", lambda: 100.0)
  cfg = peer_bench.make_config(["mixtral", "olmoe"], repeats=2)
  measured = []

  def bench(family, ckpt, size, **kw):
    assert size == cfg.size and kw["repeats"] == 2 and ckpt == tmp_path / "checkpoints" / family
    measured.append(family)
    if family == "olmoe" and measured.count("olmoe") == 1:
      raise KeyboardInterrupt  # the run stops during its second family
    return _family_rows(family, cfg)

  monkeypatch.setattr(peer_bench, "bench_family", bench)
  with pytest.raises(KeyboardInterrupt):
    peer_bench.run_peer_bench(tmp_path, cfg, log=lambda _: None)
  first = json.loads((tmp_path / "metrics.json").read_text())
  assert first["families_done"] == ["mixtral"]
  assert (tmp_path / "table.md").read_text().count("| mixtral |") == 5  # 3 rows, 1 summary, 1 prefill floor
  assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # nothing half-written

  assert first["stream_read_gbps_samples"] == [10.0, 10.0]  # before the first family and after it
  assert first["matmul_gflops_samples"] == [100.0, 100.0]

  lines = []
  monkeypatch.setattr(peer_bench.roofline, "stream_read_gbps", lambda: 16.0)
  monkeypatch.setattr(peer_bench.roofline, "matmul_gflops", lambda: 200.0)
  metrics = peer_bench.run_peer_bench(tmp_path, cfg, log=lines.append)
  assert measured == ["mixtral", "olmoe", "olmoe"] and metrics["families_done"] == ["mixtral", "olmoe"]
  assert any(line.startswith("resuming: ['mixtral']") for line in lines)
  # The resumed run's samples join the interrupted run's: mixtral's ceiling was measured beside those.
  assert metrics["stream_read_gbps_samples"] == [10.0, 10.0, 16.0, 16.0]
  assert metrics["stream_read_gbps"] == 13.0
  assert metrics["matmul_gflops_samples"] == [100.0, 100.0, 200.0, 200.0] and metrics["matmul_gflops"] == 150.0
  # The floor rests on every sample: 1 GFLOP at the median, 150 GFLOP/s.
  assert metrics["summary"][0]["prefill_floor_ms_b1"] == pytest.approx(1e3 / 150)
  # A finished run, rerun: nothing measured, its metrics returned and left as written.
  written = (tmp_path / "metrics.json").read_bytes()
  monkeypatch.setattr(peer_bench.roofline, "stream_read_gbps", lambda: pytest.fail("measured again"))
  monkeypatch.setattr(peer_bench.roofline, "matmul_gflops", lambda: pytest.fail("measured again"))
  assert peer_bench.run_peer_bench(tmp_path, cfg, log=lambda _: None) == json.loads(written)
  assert measured == ["mixtral", "olmoe", "olmoe"] and (tmp_path / "metrics.json").read_bytes() == written
  # Other settings start afresh: nothing of the old rows is kept.
  assert peer_bench.finished_rows(tmp_path / "metrics.json", dataclasses.replace(cfg, repeats=3)) == []
  assert len(peer_bench.finished_rows(tmp_path / "metrics.json", cfg)) == 12
