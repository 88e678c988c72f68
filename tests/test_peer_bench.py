"""experiments/peer_bench: rounds interleave every measurement; ratios are taken within rounds."""

import pytest

from experiments import peer_bench


def test_interleaved_seconds_runs_every_function_once_per_round_reversing_the_order():
  calls = []
  fns = {name: (lambda name=name: calls.append(name) or name) for name in ("a", "b", "c")}
  seconds, last = peer_bench.interleaved_seconds(fns, 3, before=lambda: calls.append("flush"))
  assert calls == ["flush", "a", "flush", "b", "flush", "c", "flush", "c", "flush", "b", "flush", "a",
                   "flush", "a", "flush", "b", "flush", "c"]
  assert last == {"a": "a", "b": "b", "c": "c"} and all(len(v) == 3 for v in seconds.values())


def test_summary_ratios_are_medians_of_within_round_ratios():
  def row(impl, batch, drafter, seconds, tokens=64):
    return {"family": "f", "impl": impl, "batch_size": batch, "drafter": drafter, "seconds": seconds,
            "tokens": tokens, "tokens_per_second": tokens / seconds[0], "params": 1e6,
            "tokens_identical_to_transformers": True}
  # Round 2 is a slow spell for everything: within-round ratios ignore it; ratios of medians
  # over rounds measured at different times would not.
  rows = [row("moespec_jax", 1, "none", [0.1, 0.4, 0.1]), row("transformers", 1, "none", [0.5, 2.0, 0.5]),
          row("moespec_jax", 1, "ngram", [0.08, 0.32, 0.08]), row("transformers", 1, "ngram", [0.5, 2.0, 0.5]),
          row("moespec_jax", 8, "none", [0.2, 0.8, 0.2], 512), row("transformers", 8, "none", [0.6, 2.4, 0.6], 512)]
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
    return {"family": "f", "impl": impl, "batch_size": 1 if drafter else 8, "drafter": drafter or "none",
            "seconds": seconds, "tokens": 64, "tokens_identical_to_transformers": True}
  ours_ngram = [0.1 / x for x in (1.5, 1.8, 1.5, 1.8, 1.5, 1.8, 1.5)]
  rows = [row("moespec_jax", "none", [0.1] * 7), row("moespec_jax", "ngram", ours_ngram),
          row("transformers", "none", [1.0] * 7), row("transformers", "ngram", [1.0 / 1.6] * 7),
          row("moespec_jax", None, [0.1] * 7), row("transformers", None, [0.1] * 7)]
  (s,) = peer_bench.summarize(rows)
  assert s["ngram_speedup_ours"] == pytest.approx(1.5) and s["ngram_speedup_transformers"] == pytest.approx(1.6)
  assert s["ngram_speedup_ours_over_transformers"] == pytest.approx(1.5 / 1.6)
  lo, hi = s["ngram_speedup_ours_over_transformers_interval"]
  assert lo == pytest.approx(1.5 / 1.6) and hi == pytest.approx(1.8 / 1.6)


def test_summary_ceiling_is_the_stream_bound_over_transformers():
  """At 10 GB/s, 0.1 GB per step bounds batch 8 at 800 tokens/s: 2x transformers' 400; ours
  sustained 6 GB/s, 60% of the stream."""
  def row(impl, batch, drafter, tok_s, **extra):
    return {"family": "f", "impl": impl, "batch_size": batch, "drafter": drafter, "seconds": [1.0], "params": 1e6,
            "tokens": tok_s, "tokens_per_second": tok_s, "tokens_identical_to_transformers": True, **extra}
  plain = lambda impl, batch, tok_s: row(impl, batch, "none", tok_s, weight_bytes_per_step=1e8,  # noqa: E731
                                          read_gbps=1e8 * tok_s / batch / 1e9)
  rows = [plain("moespec_jax", 1, 60), plain("transformers", 1, 20), row("moespec_jax", 1, "ngram", 90),
          row("transformers", 1, "ngram", 30), plain("moespec_jax", 8, 480), plain("transformers", 8, 400)]
  (s,) = peer_bench.summarize(rows, stream_gbps=10.0)
  assert s["ceiling_ratio_b8"] == pytest.approx(2.0) and s["ceiling_ratio_b1"] == pytest.approx(5.0)
  assert s["stream_fraction_b8"] == pytest.approx(0.6) and s["stream_fraction_b1"] == pytest.approx(0.6)
  assert "| 5.00 / 2.00 | 60% / 60% |" in peer_bench.table(rows, [s])
  assert "ceiling_ratio_b8" not in peer_bench.summarize(rows)[0]  # no bandwidth measured: no ceiling
