"""research/tree_bench.py: the predictors' recall and one small sweep of tree policies."""

import json

import numpy as np
import pytest

import moespec_jax as msj
from moespec_jax.analysis import regime
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


def _fake_generate(model, prompts, *, max_new_tokens, sampling, spec, seed=0):
  """Statistics shaped as generate's, from the spec alone: a chain of K commits K tokens a pass
  and reads 10 K experts; a tree of N nodes commits 2 and reads 5 N (3 N where expert-aware),
  verifying 1 node when truncated. Plain decoding: 100 tokens/s."""
  del model, prompts, max_new_tokens, sampling, seed
  truncated = spec.tree_truncate
  if spec.drafter == "none":
    tokens, nodes, experts, rate = 1.0, 0, 8.0, 100.0
  elif spec.tree_nodes:
    nodes = 1.0 if truncated else float(spec.tree_nodes)
    tokens, experts, rate = 2.0, (3.0 if spec.tree_policy == "expert_aware" else 5.0) * nodes, 80.0
  else:
    tokens, nodes, experts, rate = float(spec.num_draft), spec.num_draft, 10.0 * spec.num_draft, 90.0
  stats = {
    "tokens_per_second": rate,
    "generated_tokens": 8,
    "seconds": 8 / rate,
    "verify_passes": 4,
    "mean_accepted_length": tokens,
    "acceptance_by_depth": [0.5],
    "unique_experts_per_pass": [experts / 2, experts / 2],
  }
  if spec.tree_nodes:
    stats["verified_nodes_per_pass"] = nodes
  if spec.tree_policy == "expert_aware" or truncated:
    stats["predicted_unique_experts_per_pass"] = [experts, experts]
  if spec.research.pass_trace:
    stats["pass_trace"] = {"ms": [1.0 * tokens, 2.0 * tokens, 4.0 * tokens], "tokens": [tokens, tokens, 0]}
  return msj.GenerateOutput(tokens=None, stats=stats)


def test_a_small_sweep_writes_every_policy_row(monkeypatch, heads_model, tmp_path):
  """Every policy's row, its derived columns (tokens per expert read, per verified node, the
  bytes-bound speedup, the latency percentiles over the traced passes that committed tokens),
  the metrics, the plot and the lines against the best chain."""
  monkeypatch.setattr(msj, "generate", _fake_generate)
  monkeypatch.setattr(tree_bench, "predictor_recall", lambda model: {"predictors": {}})
  lines = []
  result = tree_bench.run_tree_bench(
    heads_model,
    tmp_path,
    tree_nodes=(2,),
    depth=2,
    chain_ks=(1, 2),
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
  rows = {(r["policy"], r.get("num_draft")): r for r in result["rows"]}
  assert [r["policy"] for r in result["rows"]] == [
    "chain",
    "chain",
    "probability",
    "expert_aware",
    "probability+truncate",
    "expert_aware+truncate",
  ]
  chain2, aware = rows[("chain", 2)], rows[("expert_aware", 2)]
  assert chain2["speedup"] == pytest.approx(0.9) and aware["speedup"] == pytest.approx(0.8)
  assert aware["experts_per_pass"] == 6.0 and aware["predicted_experts_per_pass"] == 12.0
  assert rows[("probability", 2)]["predicted_experts_per_pass"] is None
  assert aware["tokens_per_expert_read"] == pytest.approx(2.0 / 6.0)
  assert aware["tokens_per_verified_node"] == pytest.approx(2.0 / 3.0)
  assert rows[("expert_aware+truncate", 2)]["verified_nodes_per_pass"] == 1.0
  config = heads_model.config
  plain_bytes = regime.weight_bytes(config, 1, unique_experts=float(config.top_k))
  assert aware["bytes_bound_speedup"] == pytest.approx(2.0 * plain_bytes / regime.weight_bytes(config, 3, 3.0))
  # Traced passes of each of the 2 prompts: 2 and 4 ms for 2 tokens (the pass with none left
  # out): 1 and 2 ms a token; plain passes of 1, 2 and 4 ms, median 2 ms.
  assert aware["ms_per_token_p50"] == pytest.approx(1.5) and aware["ms_per_token_p99"] == pytest.approx(2.0)
  assert aware["utility_mean"] == pytest.approx(np.mean([2.0 * 2.0 / 2.0, 2.0 * 2.0 / 4.0]))
  assert aware["utility_p5"] == pytest.approx(1.0)
  assert json.loads((tmp_path / "metrics.json").read_text())["tree_bench"]["rows"] == result["rows"]
  assert (tmp_path / "trees.png").exists()
  assert any(line.startswith("T=0 batch 1, expert_aware:") and "(K=2)" in line for line in lines)


def test_sampled_rows_run_chains_and_probability_trees_only():
  specs = tree_bench.row_specs((4,), 3, (1, 2), (0.5,), greedy=False)
  assert [label["policy"] for label, _ in specs] == ["chain", "chain", "probability"]
  greedy = tree_bench.row_specs((4,), 3, (1,), (0.5, 2.0), greedy=True)
  assert [label.get("expert_penalty") for label, _ in greedy if label["policy"] == "expert_aware"] == [0.5, 2.0]
