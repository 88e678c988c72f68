"""The experiment CLIs as a user runs them: bad flags and bad values give one line and exit 2."""

import json

import pytest

from tests.cli_run import assert_one_line_error, run_module


@pytest.mark.parametrize(
  "module",
  [
    "experiments.generate",
    "experiments.pretrain",
    "experiments.demo",
    "experiments.routing_stats",
    "experiments.compare_modes",
    "experiments.project",
    "experiments.kernel_bench",
    "experiments.decode_kernels",
  ],
)
def test_unknown_flag_exits_2_with_one_line(module):
  assert_one_line_error(run_module(module, "--no_such_flag=1"), "no_such_flag")


def test_kernel_bench_unknown_shape_exits_2(tmp_path):
  proc = run_module("experiments.kernel_bench", f"--workdir={tmp_path / 'kb'}", "--shapes=tiny,nope")
  assert_one_line_error(proc, "unknown shape 'nope'")
  assert_one_line_error(
    run_module("experiments.kernel_bench", f"--workdir={tmp_path / 'kb'}", "--n_list=1,two"), "--n_list"
  )
  assert not (tmp_path / "kb" / "metrics.json").exists()


def test_pretrain_bad_config_file_exits_2():
  assert_one_line_error(run_module("experiments.pretrain", "--config=configs/does_not_exist.py"), "does_not_exist")


def test_generate_cli_end_to_end_and_bad_values(tiny_model, tmp_path):
  path = str(tiny_model.save(tmp_path / "model"))
  proc = run_module(
    "experiments.generate", f"--model={path}", "--prompt=def f(x):", "--max_new_tokens=5", "--pass_trace"
  )
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith("def f(x):") and "tokens/s" in proc.stdout
  assert "pass times (ms): the first 4: " in proc.stdout and "ms over 4 passes" in proc.stdout
  # --checkpoint: --model's alias (every experiment that runs on a model takes both).
  proc = run_module(
    "experiments.generate",
    f"--checkpoint={path}",
    "--prompt=def f(x): return x",
    "--max_new_tokens=6",
    "--drafter=ngram",
    "--num_draft=auto",
    "--max_draft=3",
  )
  assert proc.returncode == 0, proc.stderr
  assert "auto K: passes by K" in proc.stdout and "APPROXIMATE" not in proc.stdout
  assert "pass times calibrated on loops" in proc.stdout  # 6 tokens: too few passes per K for held runs
  assert "\nacceptance by depth: 1: " in proc.stdout  # beside the mean accepted length
  # The calibration says when it starts and ends (stderr), and its time stands beside the decode's.
  assert "calibrating num_draft='auto'" in proc.stderr and "calibrated in " in proc.stderr
  assert "calibration before it" in proc.stdout
  proc = run_module(
    "experiments.generate",
    f"--checkpoint={path}",
    "--max_new_tokens=4",
    "--drafter=ngram",
    "--mode=budgeted",
    "--expert_budget=3",
    "--measure_quality",
  )
  assert proc.returncode == 0, proc.stderr
  assert "APPROXIMATE: expert budget 3" in proc.stdout and "top-1 agreement" in proc.stdout
  assert_one_line_error(run_module("experiments.generate", f"--checkpoint={path}", "--num_draft=many"), "--num_draft")
  assert_one_line_error(run_module("experiments.generate", f"--checkpoint={path}", "--mode=budgeted"), "expert_budget")
  assert_one_line_error(run_module("experiments.generate", f"--checkpoint={path}", "--top_p=0"), "top_p")
  assert_one_line_error(
    run_module("experiments.generate", f"--checkpoint={path}", "--mtp_prompt_window=-1"), "mtp_prompt_window"
  )
  assert_one_line_error(
    run_module("experiments.generate", f"--checkpoint={path}", "--max_new_tokens=500"), "max_seq_len"
  )
  assert_one_line_error(run_module("experiments.generate", f"--model={tmp_path / 'missing'}"), "config.json")


def test_cost_model_refuses_fewer_max_repeats_than_repeats(tmp_path):
  """Refused before any model is loaded or trained, and nothing written."""
  proc = run_module(
    "experiments.cost_model",
    f"--workdir={tmp_path / 'cm'}",
    f"--model={tmp_path / 'missing'}",
    "--repeats=7",
    "--max_repeats=5",
  )
  assert_one_line_error(proc, "max_repeats (5) must be >= repeats (7)")
  assert not (tmp_path / "cm").exists()


def test_decode_kernels_cli_end_to_end(tiny_model, tmp_path):
  """Every variant decodes the C++ kernels' tokens (checked inside), one row per variant."""
  path = str(tiny_model.save(tmp_path / "model"))
  proc = run_module(
    "experiments.decode_kernels", f"--model={path}", f"--workdir={tmp_path / 'dk'}", "--quick", "--prompt_bytes=24"
  )
  assert proc.returncode == 0, proc.stderr
  metrics = json.loads((tmp_path / "dk" / "metrics.json").read_text())["decode_kernels"]
  assert [r["variant"] for r in metrics["rows"]] == ["cpp", "xla_head", "xla_dense", "xla_attention", "xla"]
  assert "| 1 | xla_attention |" in (tmp_path / "dk" / "table.md").read_text()
  assert_one_line_error(
    run_module("experiments.decode_kernels", f"--model={path}", "--batch_sizes=1,x"), "--batch_sizes"
  )


def test_generate_offers_the_drafters_it_can_run_and_names_flags_alike(tiny_model, tmp_path):
  """--help, the refusal and the run agree on the drafters (the controlled one needs a plain run's tokens,
  which no flag supplies); a library argument's error names its flag as the flag checks do; --workdir
  keeps the generation."""
  path = str(tiny_model.save(tmp_path / "model"))
  helped = run_module("experiments.generate", "--help").stdout
  assert "--drafter: <none|mtp|ngram>:" in helped and "controlled" not in helped
  refused = run_module("experiments.generate", f"--model={path}", "--drafter=controlled")
  assert_one_line_error(refused, "--drafter=controlled")
  assert "<none|mtp|ngram>" in refused.stderr and "reference_tokens" not in refused.stderr
  assert_one_line_error(run_module("experiments.generate", f"--model={path}", "--top_p=0"), "--top_p must be in (0, 1]")
  assert_one_line_error(
    run_module("experiments.generate", f"--model={path}", "--num_draft=many"),
    "--num_draft must be a whole number or 'auto'",
  )
  proc = run_module(
    "experiments.generate",
    f"--model={path}",
    "--prompt=def f(x):",
    "--prompt=import os",
    "--max_new_tokens=5",
    "--drafter=ngram",
    "--num_draft=2",
    f"--workdir={tmp_path / 'out'}",
  )
  assert proc.returncode == 0, proc.stderr
  assert "acceptance by depth: 1: " in proc.stdout and ", 2: " in proc.stdout
  saved = json.loads((tmp_path / "out" / "metrics.json").read_text())["generate"]
  assert saved["prompts"] == ["def f(x):", "import os"] and len(saved["texts"]) == len(saved["tokens"]) == 2
  assert len(saved["stats"]["acceptance_by_depth"]) == 2
  assert proc.stdout.splitlines()[0].startswith("def f(x):" + saved["texts"][0].split("\n")[0])
