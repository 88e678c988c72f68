"""What `make demo` runs, on a tiny random model: the documented rows and their checks."""

import json

import pytest

import moespec_jax as msj
from moespec_jax.research import demo


@pytest.mark.slow
def test_demo_rows(tiny_config, tmp_path, capsys):
  model = msj.Model.init(tiny_config.replace(num_mtp_modules=1, max_seq_len=512), seed=0)
  lines = []
  demo.run_demo(
    model,
    tmp_path,
    max_new_tokens=8,
    batch_sizes=(1, 2),
    repeats=1,
    max_draft=2,
    sampled=False,
    memory_bound=(),
    log=lines.append,
  )
  rows = json.loads((tmp_path / "metrics.json").read_text())["demo"]["rows"]
  greedy = [("none", "exact"), ("mtp", "exact"), ("ngram", "exact"), ("mtp", "budgeted")]
  assert [(r["sampling"], r["drafter"], r["batch_size"], r["mode"]) for r in rows] == [
    ("greedy", d, b, m) for b in (1, 2) for d, m in greedy
  ]
  for r in rows:
    for key in (
      "mode",
      "drafter",
      "num_draft",
      "expert_budget",
      "tokens_per_second",
      "speedup_vs_plain",
      "mean_accepted_length",
      "top1_agreement_vs_exact",
    ):
      assert key in r
    if r["mode"] == "exact":
      # Sampled rows keep the target's distribution, not plain decoding's tokens.
      assert r["tokens_equal_plain"] is (True if r["temperature"] == 0 else None)
      assert r["top1_agreement_vs_exact"] == 1.0 and r["auto_num_draft"] == (r["drafter"] != "none")
    else:
      assert r["approximate"] and r["expert_budget"] == 2 * tiny_config.top_k and r["num_draft"] >= 1
      assert 0.0 <= r["top1_agreement_vs_exact"] <= 1.0
    # The pairs' interval brackets the median speedup (the plain rows have none).
    if r["drafter"] == "none":
      assert r["speedup_interval_90"] is None
    else:
      low, high = r["speedup_interval_90"]
      assert low <= r["speedup_vs_plain"] <= high
  auto = [r for r in rows if r["auto_num_draft"]]
  assert all(0 <= r["num_draft"] <= 2 and sum(r["passes_by_num_draft"]) > 0 for r in auto)
  # Batch 1's drafting rows count their accepted drafts and the whitespace share among them.
  for r in auto:
    assert ("accepted_drafts" in r) == (r["batch_size"] == 1)
    if r["batch_size"] == 1 and r["accepted_drafts"]:
      assert 0.0 <= r["accepted_draft_whitespace_share"] <= 1.0
  text = "\n".join(lines)
  assert "APPROXIMATE" in text and "auto:" in text
  assert "sample (greedy, held-out prompt)" in text
  # A progress line per measured row, as it finishes (8 rows: minutes on the default model),
  # through the caller's log like the rest of the output: nothing of it on stdout.
  progress = [line for line in lines if line.startswith("demo step ")]
  assert "demo step " not in capsys.readouterr().out
  n = len(rows)
  assert [line.split(" | ")[0] for line in progress] == [
    f"demo step {i}/{n} ({100 * i / n:.1f}%)" for i in range(1, n + 1)
  ]
  assert "row greedy batch 1 plain" in progress[0] and "row greedy batch 2 budgeted mtp K=" in progress[-1]
  assert "eta" in progress[0] and "eta" not in progress[-1]
  assert (tmp_path / "speedup.png").stat().st_size > 0


@pytest.mark.slow
def test_demo_sampled_rows(tiny_config, tmp_path):
  """With `sampled`, the plain and exact rows again at temperature 1 with top-p 0.95 (no budgeted
  row), their tokens not compared with plain decoding's (the same distribution, not the same
  draws), and a sample of each."""
  model = msj.Model.init(tiny_config.replace(num_mtp_modules=1, max_seq_len=512), seed=0)
  lines = []
  demo.run_demo(
    model, tmp_path, max_new_tokens=8, batch_sizes=(1,), repeats=1, max_draft=2, memory_bound=(), log=lines.append
  )
  result = json.loads((tmp_path / "metrics.json").read_text())["demo"]
  sampled = [r for r in result["rows"] if r["sampling"] != "greedy"]
  assert [(r["sampling"], r["drafter"], r["mode"]) for r in sampled] == [
    ("T=1 top-p 0.95", d, "exact") for d in ("none", "mtp", "ngram")
  ]
  assert all(r["temperature"] == 1.0 and r["top_p"] == 0.95 and r["tokens_equal_plain"] is None for r in sampled)
  assert set(result["samples"]) == {"greedy", "T=1 top-p 0.95"}
  assert "sample (T=1 top-p 0.95, held-out prompt)" in "\n".join(lines)


@pytest.mark.slow
def test_memory_bound_rows_at_the_heads_acceptance(tiny_config, tmp_path):
  """The memory-bound rows: each config (here at test size) with its regime, the controlled drafter
  at the heads' mean acceptance by depth measured on the model, with their draft cost and free, labelled."""
  model = msj.Model.init(tiny_config.replace(num_mtp_modules=1, max_seq_len=512), seed=0)
  lines = []
  configs = ("membound_fine,size=tiny",)
  demo.run_demo(
    model,
    tmp_path,
    max_new_tokens=8,
    batch_sizes=(1,),
    repeats=1,
    max_draft=2,
    sampled=False,
    memory_bound=configs,
    log=lines.append,
  )
  result = json.loads((tmp_path / "metrics.json").read_text())["demo"]
  by_depth = [a for a in result["heads_acceptance_by_depth"] if a is not None]  # NaN: a depth never reached
  assert len(result["heads_acceptance_by_depth"]) == 4 and by_depth
  assert result["memory_bound_acceptance"] == pytest.approx(sum(by_depth) / len(by_depth))
  rows = result["memory_bound_rows"]
  assert [(r["config"], r["num_draft"], r["draft_cost"]) for r in rows] == [
    (configs[0], k, cost) for k, cost in demo.MEMORY_BOUND_ROWS
  ]
  for r in rows:
    assert r["controlled_acceptance"] == result["memory_bound_acceptance"] and r["speedup_vs_plain"] > 0
    assert r["regime"]["verdict"] in ("memory-bound", "compute-bound") and r["mean_accepted_length"] >= 1.0
    low, high = r["speedup_interval_90"]  # the row's own rounds, printed beside its speedup
    assert low <= r["speedup_vs_plain"] <= high
    assert any(line.startswith(r["config"]) and f"[{low:.2f}, {high:.2f}]" in line for line in lines)
  assert [r["num_draft"] for r in rows] == [k for k, _ in demo.MEMORY_BOUND_ROWS]
  text = "\n".join(lines)
  assert "MEMORY-BOUND CONFIGURATIONS" in text and "CONTROLLED" in text and f"{configs[0]}: regime:" in text
  assert f"row {configs[0]} controlled K=2 (MTP draft cost)" in text and "drafts free" in text


@pytest.mark.slow
def test_quick_demo_on_a_model_given(tiny_config, tmp_path):
  """`experiments.demo --quick --model=DIR`: batch 1 only (--quick), the flags given kept, a plot."""
  from tests.cli_run import run_module  # pylint: disable=g-import-not-at-top

  msj.Model.init(tiny_config.replace(max_seq_len=512), seed=0).save(tmp_path / "m")
  proc = run_module(
    "experiments.demo",
    f"--workdir={tmp_path / 'out'}",
    f"--model={tmp_path / 'm'}",
    "--quick",
    "--nosampled",
    "--max_draft=2",
    "--repeats=2",
    timeout=900,
  )
  assert proc.returncode == 0, proc.stderr
  demo_metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())["demo"]
  assert {r["batch_size"] for r in demo_metrics["rows"]} == {1} and demo_metrics["max_new_tokens"] == 32
  assert {r["sampling"] for r in demo_metrics["rows"]} == {"greedy"}  # --nosampled
  assert demo_metrics["max_draft"] == 2
  assert (tmp_path / "out" / "speedup.png").stat().st_size > 0
