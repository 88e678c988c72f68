"""research/tree_bench.py: the predictors' recall and one small sweep of tree policies."""

import json

import numpy as np
import pytest

import moespec_jax as msj
from moespec_jax.research import tree_bench


@pytest.fixture(scope="module")
def heads_model(tiny_config):
  return msj.Model.init(tiny_config.replace(num_mtp_modules=1), seed=0)


def test_predictor_recall_names_each_predictor_per_layer(heads_model):
  result = tree_bench.predictor_recall(heads_model, windows=2, length=32)
  layers = heads_model.config.n_moe_layers
  assert set(result["predictors"]) == {"parent", "table", "router_embedding", "router_mtp_hidden"}
  for entry in result["predictors"].values():
    assert len(entry["recall_by_layer"]) == layers
    assert all(0.0 <= r <= 1.0 for r in entry["recall_by_layer"])
    assert entry["recall"] == pytest.approx(np.mean(entry["recall_by_layer"]))
  assert result["uniform_chance"] == heads_model.config.top_k / heads_model.config.n_routed_experts


def test_a_small_sweep_writes_every_policy_row(heads_model, tmp_path):
  lines = []
  result = tree_bench.run_tree_bench(
    heads_model,
    tmp_path,
    tree_nodes=(2,),
    depth=2,
    chain_ks=(1,),
    penalties=(1.0,),
    batch_sizes=(1,),
    temperatures=(0.0,),
    max_new_tokens=8,
    repeats=1,
    num_prompts=2,
    prompt_bytes=16,
    log=lines.append,
  )["tree_bench"]
  assert result["complete"]
  policies = [r["policy"] for r in result["rows"]]
  assert policies == ["chain", "probability", "expert_aware", "probability+truncate", "expert_aware+truncate"]
  for row in result["rows"]:
    assert row["speedup"] > 0 and row["bytes_bound_speedup"] > 0
    assert (row["predicted_experts_per_pass"] is None) == (row["policy"] in ("chain", "probability"))
    assert "ms_per_token_p99" in row and row["ms_per_token_p50"] <= row["ms_per_token_p99"]
  assert json.loads((tmp_path / "metrics.json").read_text())["tree_bench"]["rows"] == result["rows"]
  assert (tmp_path / "trees.png").exists()
  assert any("expert_aware+truncate" in line and "the best chain" in line for line in lines)


def test_sampled_rows_run_chains_and_probability_trees_only():
  specs = tree_bench.row_specs((4,), 3, (1, 2), (0.5,), greedy=False)
  assert [label["policy"] for label, _ in specs] == ["chain", "chain", "probability"]
  greedy = tree_bench.row_specs((4,), 3, (1,), (0.5, 2.0), greedy=True)
  assert [label.get("expert_penalty") for label, _ in greedy if label["policy"] == "expert_aware"] == [0.5, 2.0]
