"""experiments/kernel_bench.py --quick as a user runs it (metrics keys, plots), and its crossover summary."""

import json
import os

from moespec_jax.research import kernel_report
from tests.cli_run import run_module


def test_kernel_bench_quick(tmp_path):
  workdir = tmp_path / "kb"
  proc = run_module("experiments.kernel_bench", f"--workdir={workdir}", "--quick", "--routings=uniform,correlated")
  assert proc.returncode == 0, proc.stderr[-3000:]
  kb = json.loads((workdir / "metrics.json").read_text())["kernel_bench"]
  assert kb["stream_read_gbps"] > 0
  keys = {"shape", "n_tokens", "method", "routing", "unique_experts", "bytes_requested", "time_ms", "effective_gbps"}
  assert kb["rows"] and all(keys <= set(r) for r in kb["rows"])
  assert {r["method"] for r in kb["rows"]} == {"dedup", "per_slot", "xla"}
  assert {r["routing"] for r in kb["rows"]} == {"uniform", "correlated"}
  assert kb["ratio"] and "crossover" in kb
  assert all(os.path.exists(p) for p in kb["plots"]) and kb["plots"]


def test_crossover_is_where_dedup_stays_faster():
  def row(n, method, ms):
    return dict(
      shape="tiny", routing="uniform", n_tokens=n, method=method, time_ms=ms, bytes_requested=n, effective_gbps=1.0 / ms
    )

  times = {1: (0.9, 1.0), 2: (1.1, 1.0), 3: (1.0, 1.2), 4: (1.0, 1.5)}  # dedup, per-slot
  rows = [row(n, m, t) for n, pair in times.items() for m, t in zip(("dedup", "per_slot"), pair)]
  _, crossover = kernel_report.summarize(rows, stream_gbps=1.0)
  assert crossover[0]["measured_n"] == 3 and crossover[0]["first_faster_n"] == 1
