"""CLI test of experiments/kernel_bench.py --quick: metrics keys and plots."""

import json
import os
import subprocess
import sys


def test_kernel_bench_quick(tmp_path):
  workdir = tmp_path / "kb"
  proc = subprocess.run([sys.executable, "-m", "experiments.kernel_bench", f"--workdir={workdir}", "--quick",
                         "--routings=uniform,correlated"], capture_output=True, text=True, timeout=300,
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert proc.returncode == 0, proc.stderr[-3000:]
  kb = json.loads((workdir / "metrics.json").read_text())["kernel_bench"]
  assert kb["stream_read_gbps"] > 0
  keys = {"shape", "n_tokens", "method", "routing", "unique_experts", "bytes_requested", "time_ms", "effective_gbps"}
  assert kb["rows"] and all(keys <= set(r) for r in kb["rows"])
  assert {r["method"] for r in kb["rows"]} == {"dedup", "per_slot", "xla"}
  assert {r["routing"] for r in kb["rows"]} == {"uniform", "correlated"}
  assert kb["ratio"] and "crossover" in kb
  assert all(os.path.exists(p) for p in kb["plots"]) and kb["plots"]
