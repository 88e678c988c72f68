"""analysis/projection: the bytes model on published configs (no weights, nothing measured)."""

import json

import numpy as np
import pytest

import configs
from moespec_jax.analysis import cost_model
from moespec_jax.analysis import routing as routing_lib
from moespec_jax.research import projection, roofline, routing_report
from pallas_kernels import bytes as kbytes
from tests.cli_run import run_module


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
    result = projection.project(
      config, projection.Machine(read_gbps=3000.0, dedup_bandwidth_ratio=r), context=0, max_tokens=16
    )
    expected = next((row["n_tokens"] for row in result["passes"] if row["dedup_ms"] < row["per_slot_ms"]), None)
    assert result["crossover_n"] == expected
    u = [
      (
        projection.pass_bytes(config, n, method="dedup")["experts"]
        / projection.pass_bytes(config, n, method="per_slot")["experts"]
      )
      for n in range(1, 17)
    ]
    assert expected == next((n for n, share in enumerate(u, 1) if share < r), None)
  # r = 1: any overlap helps, from two tokens on.
  assert projection.project(config, projection.Machine(3000.0), max_tokens=16)["crossover_n"] == 2


def test_staircase_is_monotone_with_the_limits():
  config = _config("mixtral_8x7b")
  result = projection.project(
    config,
    projection.Machine(read_gbps=2000.0, fixed_ms=0.5),
    context=512,
    draft_cost=0.03,
    alphas=np.linspace(0, 1, 41),
  )
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


def _sticky_routing_stats(path, n_experts=64, top_k=8, n_tokens=2000, seed=0):
  """routing_stats metrics of a router that keeps each expert of the previous token with
  probability 0.5 (overlapping like a trained model's), written to `path`."""
  rng = np.random.default_rng(seed)
  ids = [rng.choice(n_experts, top_k, replace=False)]
  for _ in range(n_tokens - 1):
    keep = [x for x in ids[-1] if rng.random() < 0.5]
    rest = np.setdiff1d(np.arange(n_experts), keep)
    ids.append(np.array(keep + list(rng.choice(rest, top_k - len(keep), replace=False))))
  ids = np.stack(ids)
  trace = routing_lib.RoutingTrace([ids[None, i : i + 250] for i in range(0, n_tokens, 250)], n_experts, {})
  stats = routing_report.routing_stats(trace, max_tokens=16, ipf_max_tokens=3, max_distance=2)
  path.write_text(json.dumps({"routing_stats": stats}))
  return stats


def test_measured_routing_replaces_the_uniform_bound(tmp_path):
  stats = _sticky_routing_stats(tmp_path / "routing.json")
  curve = projection.load_routing_curve(tmp_path / "routing.json")
  assert curve.unique_by_n == tuple(r["empirical"] for r in stats["unique_experts"])
  config = _config("olmoe_1b_7b")
  layers, expert = config.n_moe_layers, kbytes.expert_bytes(config.d_model, config.expert_hidden, 2)
  for n in (1, 4, 16):
    act = layers * kbytes.activation_bytes(n, config.top_k, config.d_model, 2)
    measured = projection.pass_bytes(config, n, method="dedup", routing=curve)["experts"]
    assert measured == pytest.approx(layers * curve.unique_by_n[n - 1] * expert + act)
    if n > 1:  # overlapping routing reads fewer distinct experts than the uniform bound
      assert measured < projection.pass_bytes(config, n, method="dedup")["experts"]
  # Rows are independent sequences: B rows of u distinct experts each touch N (1 - (1 - u/N)^B).
  u4 = curve.unique_by_n[3]
  assert curve.unique(4, batch=3) == pytest.approx(64 * (1 - (1 - u4 / 64) ** 3))
  assert projection.pass_bytes(config, 4, method="per_slot", routing=curve) == projection.pass_bytes(
    config, 4, method="per_slot"
  )
  result = projection.project(config, projection.Machine(3000.0), routing=curve)
  assert result["routing"].startswith("measured") and "measured" in projection.describe(result)
  with pytest.raises(ValueError, match="covers passes up to 16 tokens, not 17"):
    curve.unique(17)
  with pytest.raises(ValueError, match="top-8; the config routes to 6 of 64"):
    projection.pass_bytes(_config("deepseek_v2_lite"), 2, routing=curve)
  (tmp_path / "other.json").write_text(json.dumps({"cost_model": {}}))
  with pytest.raises(ValueError, match="no routing_stats"):
    projection.load_routing_curve(tmp_path / "other.json")


def test_cli_writes_the_projection(tmp_path):
  workdir = tmp_path / "proj"
  _sticky_routing_stats(tmp_path / "routing.json")
  proc = run_module(
    "experiments.project",
    "--config=configs/olmoe_1b_7b.py",
    "--read_gbps=3350",
    "--fixed_ms=0.2",
    f"--workdir={workdir}",
    f"--routing_stats={tmp_path / 'routing.json'}",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "PROJECTED" in proc.stdout and "best K by acceptance" in proc.stdout
  assert "distinct experts per pass: measured" in proc.stdout
  metrics = json.loads((workdir / "metrics.json").read_text())["projection"]
  assert metrics["config_name"] == "olmoe_1b_7b" and len(metrics["passes"]) == 16
  assert metrics["routing"].startswith("measured")
  assert (workdir / "projection.png").stat().st_size > 0
  mismatch = run_module(
    "experiments.project",
    "--config=configs/deepseek_v2_lite.py",
    "--read_gbps=3350",
    f"--workdir={workdir}3",
    f"--routing_stats={tmp_path / 'routing.json'}",
  )
  assert mismatch.returncode == 2 and len(mismatch.stderr.strip().splitlines()) == 1
  assert "top-8" in mismatch.stderr and not (workdir.parent / "proj3" / "metrics.json").exists()
  bad = run_module("experiments.project", "--read_gbps=-1", f"--workdir={workdir}2")
  assert bad.returncode == 2 and "read_gbps" in bad.stderr and "Traceback" not in bad.stderr
