"""Bad flag values of the experiments, as a user gives them: one line, exit 2, before anything runs.

(Apart from tests/test_experiments_cli.py so that `make test`'s two workers share these
subprocesses.)"""

import pytest

from tests.cli_run import assert_one_line_error, run_module


@pytest.mark.parametrize(
  "module,args,fragment",
  [
    ("experiments.peer_bench", ["--repeats=0"], "--repeats=0"),
    ("experiments.peer_bench", ["--prompt_len=1000", "--families=mixtral"], "exceeds the 1024 positions"),
    ("experiments.peer_bench", ["--families=mixtral,nope"], "unknown ['nope']"),
    ("experiments.peer_bench", ["--families=trained_qwen2_moe", "--quick"], "does not run with --quick"),
    ("experiments.routing_stats", ["--seq_len=12", "--max_tokens=16"], "--seq_len (12) must be >= --max_tokens (16)"),
    ("experiments.routing_stats", ["--seq_len=8"], "--seq_len=8"),  # overlap up to distance 8 needs 9
    ("experiments.routing_stats", ["--ipf_max_tokens=1"], "--ipf_max_tokens=1"),
    ("experiments.compare_modes", ["--num_drafts=0,x"], "--num_drafts must be a list of integers"),
    ("experiments.compare_modes", ["--temperatures=-1"], "--temperatures values must be finite numbers >= 0"),
    ("experiments.compare_modes", ["--policies=drop"], "--policies must be among truncate, substitute"),
    (
      "experiments.compare_modes",
      ["--budget_multipliers=2,0.5"],
      "--budget_multipliers values must be finite numbers >= 1",
    ),
    ("experiments.compare_modes", ["--quick", "--num_drafts=x"], "--num_drafts must be a list of integers"),
    ("experiments.kernel_bench", ["--quick", "--n_list=1,x"], "--n_list must be a list of integers"),
    ("experiments.spec_bench", ["--temperatures=hot"], "--temperatures must be a list of numbers"),
    ("experiments.spec_bench", ["--drafters=mtp,eagle"], "--drafters must be among mtp, ngram"),
    ("experiments.kernel_bench", ["--methods=dedup,triton"], "--methods must be among dedup, per_slot, xla"),
    ("experiments.kernel_bench", ["--repeats=0"], "--repeats=0"),
    ("experiments.kernel_bench", ["--routings=uniform,zipf"], "--routings must be among uniform, correlated"),
    ("experiments.decode_kernels", ["--max_new_tokens=1"], "--max_new_tokens=1"),
    ("experiments.cost_model", ["--n_alphas=1"], "--n_alphas=1"),
    ("experiments.demo", ["--repeats=0"], "--repeats=0"),
    ("experiments.train_mtp", ["--model=/nonexistent/model"], "/nonexistent/model"),
  ],
)
def test_bad_values_refused_before_anything_runs(module, args, fragment, tmp_path):
  """Refused in one line (exit 2) before a model is loaded, built or trained: nothing written. Where the
  experiment takes --model, a missing one is passed too, so an error about it would mean the values
  were checked too late."""
  model = (
    []
    if module in ("experiments.peer_bench", "experiments.kernel_bench", "experiments.demo", "experiments.train_mtp")
    else [f"--model={tmp_path / 'missing'}"]
  )
  proc = run_module(module, f"--workdir={tmp_path / 'out'}", *model, *args)
  assert_one_line_error(proc, fragment)
  assert not (tmp_path / "out").exists()
