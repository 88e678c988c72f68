"""research/ep_bench.py on a tiny random model's trace: the rows per layout, placement and pass size,
what they must satisfy, the projection's parts, and the files written."""

import json

import pytest

from moespec_jax.research import ep_bench

CLUSTER = dict(
  name="test", ranks=8, ranks_per_node=8, hbm_gbps=1000.0, link_gbps=100.0, cross_node_gbps=100.0,
  collective_latency_us=5.0, fixed_ms=0.0,
)  # fmt: skip


@pytest.fixture(scope="module")
def bench(tiny_model, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("ep_bench")
  projected = {"tiny": tiny_model.config.replace(dtype="bfloat16")}
  lines = []
  result = ep_bench.run_ep_bench(
    tiny_model,
    workdir,
    clusters=[CLUSTER],
    projected_configs=projected,
    n_segments=4,
    max_tokens=3,
    functional=False,
    log=lines.append,
  )
  return workdir, result["ep_bench"], lines


def test_rows_per_layout_placement_and_pass_size(bench):
  _, result, _ = bench
  assert [e["layout"] for e in result["layouts"]] == [name for name, _, _ in ep_bench.LAYOUTS]
  for entry in result["layouts"]:
    rows = entry["rows"]
    assert {(r["placement"], r["n_tokens"]) for r in rows} == {(p, n) for p in ep_bench.PLACEMENTS for n in (1, 2, 3)}
    for r in rows:
      assert 1.0 <= r["max_over_mean_load"] <= entry["ranks"]
      assert r["mean_rank_experts"] <= r["slowest_rank_experts"] <= r["n_tokens"] * 2  # top-2 a token
      assert 0.0 <= r["cross_node_share"] <= 1.0
      assert (r["cross_node_share"] > 0) == (entry["ranks_per_node"] < entry["ranks"])
      assert r["num_draft"] == r["n_tokens"] - 1
      assert 1.0 <= r["uniform_routing_max_over_mean_load"] <= entry["ranks"]


def test_projection_parts_add_up(bench, tiny_model):
  _, result, _ = bench
  rows = result["projections"]
  assert {r["model"] for r in rows} == {"this model (its traces)", "tiny (uniform routing)"}
  for r in rows:
    parts = r["other_ms"] + r["experts_ms"] + r["combine_ms"] + r["fixed_ms"]
    assert r["total_ms"] == pytest.approx(parts)
    assert 0.0 < r["dispatch_share"] < 1.0
    assert 1.0 <= r["slowest_rank_experts"] <= tiny_model.config.n_routed_experts // CLUSTER["ranks"]


def test_files_and_summary(bench):
  workdir, result, lines = bench
  assert json.loads((workdir / "metrics.json").read_text())["ep_bench"]["fit_tokens"] == ep_bench.FIT_TOKENS
  assert (workdir / "ep_load.png").stat().st_size > 0
  assert any("PROJECTED" in line for line in lines)
  assert any(line.startswith("mesh (8,)       contiguous") for line in lines)
  assert result["functional_check"] == []
  assert len(result["popularity_max_over_mean_by_layer"]) == 2 and min(result["popularity_max_over_mean_by_layer"]) >= 1


def test_uniform_imbalance():
  # One token, top-1 of 8 experts on 8 ranks: one rank holds the pair, the mean is 1/8.
  assert ep_bench.uniform_imbalance(8, 1, 8, 1, samples=20) == pytest.approx(8.0)
  # Every expert chosen by every pass: balanced.
  assert ep_bench.uniform_imbalance(8, 8, 4, 2, samples=20) == pytest.approx(1.0)


def test_uniform_slowest_rank_experts_bounds(tiny_config):
  one = ep_bench.uniform_slowest_rank_experts(tiny_config, 4, 1, samples=50)
  many = ep_bench.uniform_slowest_rank_experts(tiny_config, 4, 16, samples=50)
  assert 1.0 <= one <= tiny_config.top_k and one <= many <= tiny_config.n_routed_experts // 4
