"""What `make demo` runs, on a tiny random model: the documented rows and their checks."""

import json

import pytest

import moespec_jax as msj
from moespec_jax.research import demo


@pytest.mark.slow
def test_demo_rows(tiny_config, tmp_path, capsys):
  model = msj.Model.init(tiny_config.replace(num_mtp_modules=1, max_seq_len=512), seed=0)
  lines = []
  demo.run_demo(model, tmp_path, max_new_tokens=8, batch_sizes=(1, 2), repeats=1, max_draft=2, log=lines.append)
  rows = json.loads((tmp_path / "metrics.json").read_text())["demo"]["rows"]
  assert [(r["drafter"], r["batch_size"], r["mode"]) for r in rows] == [
    (d, b, m) for b in (1, 2) for d, m in (("none", "exact"), ("mtp", "exact"), ("ngram", "exact"), ("mtp", "budgeted"))
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
      assert r["tokens_equal_plain"] and r["top1_agreement_vs_exact"] == 1.0
      assert r["auto_num_draft"] == (r["drafter"] != "none")
    else:
      assert r["approximate"] and r["expert_budget"] == 2 * tiny_config.top_k and r["num_draft"] >= 1
      assert 0.0 <= r["top1_agreement_vs_exact"] <= 1.0
  auto = [r for r in rows if r["auto_num_draft"]]
  assert all(0 <= r["num_draft"] <= 2 and sum(r["passes_by_num_draft"]) > 0 for r in auto)
  text = "\n".join(lines)
  assert "APPROXIMATE" in text and "auto:" in text
  # A progress line per measured row, as it finishes (8 rows: minutes on the default model),
  # through the caller's log like the rest of the output: nothing of it on stdout.
  progress = [line for line in lines if line.startswith("demo step ")]
  assert "demo step " not in capsys.readouterr().out
  assert [line.split(" | ")[0] for line in progress] == [f"demo step {i}/8 ({100 * i / 8:.1f}%)" for i in range(1, 9)]
  assert "row batch 1 plain" in progress[0] and "row batch 2 budgeted mtp K=" in progress[-1]
  assert "eta" in progress[0] and "eta" not in progress[-1]
  assert (tmp_path / "speedup.png").stat().st_size > 0


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
    "--max_draft=2",
    "--repeats=2",
    timeout=900,
  )
  assert proc.returncode == 0, proc.stderr
  demo_metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())["demo"]
  assert {r["batch_size"] for r in demo_metrics["rows"]} == {1} and demo_metrics["max_new_tokens"] == 32
  assert demo_metrics["max_draft"] == 2
  assert (tmp_path / "out" / "speedup.png").stat().st_size > 0
