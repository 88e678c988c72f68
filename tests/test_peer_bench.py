"""experiments/peer_bench: rounds interleave every measurement; ratios are taken within rounds."""

import pytest

from experiments import peer_bench


def test_interleaved_seconds_runs_every_function_once_per_round_reversing_the_order():
  calls = []
  fns = {name: (lambda name=name: calls.append(name) or name) for name in ("a", "b", "c")}
  seconds, last = peer_bench.interleaved_seconds(fns, 3)
  assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
  assert last == {"a": "a", "b": "b", "c": "c"} and all(len(v) == 3 for v in seconds.values())


def test_summary_ratios_are_medians_of_within_round_ratios():
  def row(impl, batch, drafter, seconds, tokens=64):
    return {"family": "f", "impl": impl, "batch_size": batch, "drafter": drafter, "seconds": seconds,
            "tokens": tokens, "tokens_identical_to_transformers": True}
  # Round 2 is a slow spell for everything: within-round ratios ignore it; ratios of medians
  # over rounds measured at different times would not.
  rows = [row("moespec_jax", 1, "none", [0.1, 0.4, 0.1]), row("transformers", 1, "none", [0.5, 2.0, 0.5]),
          row("moespec_jax", 1, "ngram", [0.08, 0.32, 0.08]), row("transformers", 1, "ngram", [0.5, 2.0, 0.5]),
          row("moespec_jax", 8, "none", [0.2, 0.8, 0.2], 512), row("transformers", 8, "none", [0.6, 2.4, 0.6], 512)]
  (s,) = peer_bench.summarize(rows)
  assert s["plain_ratio_b1"] == pytest.approx(5.0) and s["plain_ratio_b8"] == pytest.approx(3.0)
  assert s["ngram_speedup_ours"] == pytest.approx(1.25) and s["ngram_speedup_transformers"] == pytest.approx(1.0)
  assert s["tokens_identical"]
