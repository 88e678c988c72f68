"""analysis/projection: the bytes model on published configs (no weights, nothing measured)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import configs
from moespec_jax.analysis import cost_model, projection, roofline
from moespec_jax.analysis import routing as routing_lib
from pallas_kernels import bytes as kbytes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(name, dtype="bfloat16"):
  return configs.model_config(name).replace(dtype=dtype)


def test_pass_bytes_count_weights_experts_and_cache():
  config = _config("deepseek_v2_lite")
  layers, expert = config.n_moe_layers, kbytes.expert_bytes(config.d_model, config.expert_hidden, 2)
  one = projection.pass_bytes(config, 1, method="per_slot")
  # One token: top_k experts per MoE layer either way, the rest as roofline counts it.
  assert one == projection.pass_bytes(config, 1, method="dedup")
  activations = layers * kbytes.activation_bytes(1, config.top_k, config.d_model, 2)
  assert one["total"] == pytest.approx(roofline.decode_weight_bytes(config, [config.top_k] * layers) + activations)
  # Per-slot reads grow by top_k experts a token; dedup by the distinct ones (uniform routing).
  for n in (2, 5, 16):
    per_slot = projection.pass_bytes(config, n, method="per_slot")["experts"]
    dedup = projection.pass_bytes(config, n, method="dedup")["experts"]
    act = layers * kbytes.activation_bytes(n, config.top_k, config.d_model, 2)
    assert per_slot == pytest.approx(layers * n * config.top_k * expert + act)
    assert dedup == pytest.approx(layers * routing_lib.uniform_unique(64, 6, n) * expert + act)
    assert dedup < per_slot
  # MLA caches 576 values per token and layer: 27 layers, 2 bytes, 2 rows of 100 tokens.
  assert projection.pass_bytes(config, 1, batch=2, context=100)["kv_cache"] == 2 * 100 * 27 * 576 * 2
  with pytest.raises(ValueError, match="method"):
    projection.pass_bytes(config, 1, method="grouped")


def test_crossover_follows_the_bandwidth_ratio():
  """Dedup is faster exactly where its share u(n) of per-slot expert bytes is below r."""
  config = _config("qwen3_30b_a3b")
  for r in (1.0, 0.6, 0.3):
    result = projection.project(config, projection.Machine(read_gbps=3000.0, dedup_bandwidth_ratio=r),
                                context=0, max_tokens=16)
    expected = next((row["n_tokens"] for row in result["passes"]
                     if row["dedup_ms"] < row["per_slot_ms"]), None)
    assert result["crossover_n"] == expected
    u = [(projection.pass_bytes(config, n, method="dedup")["experts"]
          / projection.pass_bytes(config, n, method="per_slot")["experts"]) for n in range(1, 17)]
    assert expected == next((n for n, share in enumerate(u, 1) if share < r), None)
  # r = 1: any overlap helps, from two tokens on.
  assert projection.project(config, projection.Machine(3000.0), max_tokens=16)["crossover_n"] == 2


def test_staircase_is_monotone_with_the_limits():
  config = _config("mixtral_8x7b")
  result = projection.project(config, projection.Machine(read_gbps=2000.0, fixed_ms=0.5), context=512,
                              draft_cost=0.03, alphas=np.linspace(0, 1, 41))
  ks = [b["best_k"] for b in result["best_k"]]
  assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == 8
  assert result["best_k"][0]["speedup"] == 1.0 and result["best_k"][-1]["speedup"] > 1.0
  # Each K pays exactly above its break-even acceptance.
  verify = {r["n_tokens"]: min(r["dedup_ms"], r["per_slot_ms"]) for r in result["passes"]}
  draft = lambda k: k * 0.03 * verify[1]
  for k, a in result["break_even_acceptance"].items():
    assert a is not None and 0 < a < 1
    assert cost_model.speedup(a + 1e-3, k, verify[1], draft, verify.get) > 1.0
    assert cost_model.speedup(a - 1e-3, k, verify[1], draft, verify.get) < 1.0
  assert 0 < result["amdahl_expert_fraction"] < 1 and result["projection"] is True


def test_bad_machine_is_refused():
  with pytest.raises(ValueError, match="read_gbps"):
    projection.Machine(read_gbps=0.0)
  with pytest.raises(ValueError, match="dedup_bandwidth_ratio"):
    projection.Machine(read_gbps=1.0, dedup_bandwidth_ratio=0.0)


def test_cli_writes_the_projection(tmp_path):
  workdir = tmp_path / "proj"
  proc = subprocess.run([sys.executable, "-m", "experiments.project", "--config=configs/olmoe_1b_7b.py",
                         "--read_gbps=3350", "--fixed_ms=0.2", f"--workdir={workdir}"],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "PROJECTED" in proc.stdout and "best K by acceptance" in proc.stdout
  metrics = json.loads((workdir / "metrics.json").read_text())["projection"]
  assert metrics["config_name"] == "olmoe_1b_7b" and len(metrics["passes"]) == 16
  assert (workdir / "projection.png").stat().st_size > 0
  bad = subprocess.run([sys.executable, "-m", "experiments.project", "--read_gbps=-1", f"--workdir={workdir}2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert bad.returncode == 2 and "read_gbps" in bad.stderr and "Traceback" not in bad.stderr
