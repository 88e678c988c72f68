"""What the README says of the experiments' command lines holds: each experiment's `--help` lists the
flags its README row and WORKSPACE.md's launch lines name, the shared ones (--workdir, --quick,
--model) where the README says so, and names the files the row says it writes."""

import re
import subprocess
import sys

import pytest

from tests.cli_run import ROOT

README = (ROOT / "README.md").read_text()
WORKSPACE = (ROOT / "WORKSPACE.md").read_text()
SECTION = README[README.index("## Experiments") :]
ROWS = dict(re.findall(r"^\| `(\w+)` \| (.*) \|$", SECTION, re.M))  # gpu_check.sh is a shell script


def _named(text: str) -> list[str]:
  """The backquoted experiment names in `text`."""
  return re.findall(r"`(\w+)`", text)


def _after(text: str, lead: str) -> list[str]:
  """The experiment names in the parentheses that follow `lead` in the README."""
  start = SECTION.index(lead) + len(lead)
  return _named(SECTION[start : SECTION.index(")", start)])


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
  """Every experiment's --help output (run side by side)."""
  procs = {
    name: subprocess.Popen(
      [sys.executable, "-m", f"experiments.{name}", "--help"],
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for name in ROWS
  }
  return {name: proc.communicate(timeout=300)[0] for name, proc in procs.items()}


def _flags(help_text: str) -> set[str]:
  return set(re.findall(r"^\s+--(?:\[no\])?([\w.]+):", help_text, re.M))


def _has(flags: set[str], name: str) -> bool:
  """`--name` (or `--noname`, a boolean's negation; `--config.a.b`, a field of --config) is a flag."""
  name = name.split(".")[0]
  return name in flags or (name.startswith("no") and name[2:] in flags)


def test_every_row_names_an_experiment_that_lists_its_flags(helps):
  assert set(ROWS) >= {
    "pretrain",
    "train_mtp",
    "generate",
    "kernel_bench",
    "spec_bench",
    "decode_kernels",
    "compare_modes",
    "cost_model",
    "project",
    "routing_stats",
    "peer_bench",
    "demo",
  }
  for name, row in ROWS.items():
    flags = _flags(helps[name])
    assert flags, helps[name]
    missing = [f for f in re.findall(r"--([a-z][\w.]*)", row) if not _has(flags, f)]
    assert not missing, f"{name}: the README names {missing}, --help lists {sorted(flags)}"


def test_workspace_launch_lines_use_flags_that_exist(helps):
  for name, args in re.findall(r"-m experiments\.(\w+)(.*)", WORKSPACE):
    missing = [f for f in re.findall(r"--([a-z][\w.]*)", args) if not _has(_flags(helps[name]), f)]
    assert not missing, f"WORKSPACE.md: {name} {missing}"


def test_shared_flags_are_where_the_readme_says(helps):
  without_quick = _after(SECTION, "`--quick` is a smoke run (")
  on_a_model = _after(SECTION, "those that run on a model\n(")
  assert set(without_quick) == {"generate", "project"}
  for name in ROWS:
    flags = _flags(helps[name])
    assert "workdir" in flags, name  # every experiment is python -m experiments.NAME --workdir=DIR
    assert ("quick" in flags) == (name not in without_quick), name
    assert ({"model", "checkpoint"} <= flags) == (name in on_a_model), f"{name}: --model and --checkpoint"


def test_rows_name_the_files_the_experiment_says_it_writes(helps):
  """Each PNG (or other file) a README row says the experiment writes is named in its --help; every
  experiment but generate writes a plot."""
  for name, row in ROWS.items():
    files = re.findall(r"`([\w<>]+\.(?:png|md|npz))`", row)
    assert files or name == "generate", f"{name}: the README row names no plot"
    for f in files:
      assert f in helps[name], f"{name}: --help does not name {f}"


def test_help_keeps_the_usage_lines_apart(helps):
  """A usage line of a docstring is not run into the next (a trailing backslash once joined them)."""
  for name, text in helps.items():
    usage = text[: text.index("flags:")]
    assert not re.search(r"\S {3,}\[--", usage), f"{name}: {usage}"


def test_resumable_experiments_say_so_when_interrupted():
  resumable = _after(SECTION, "the resumable\nones (")
  assert set(resumable) == {"pretrain", "train_mtp", "cost_model", "peer_bench"}
  for name in ROWS:
    source = (ROOT / "experiments" / f"{name}.py").read_text()
    assert ("cli.run(main, resumable=True)" in source) == (name in resumable), name
