"""The experiments' command lines run as a user runs them (`python -m experiments.NAME` from the
repository root), for the CLI tests. The subprocesses inherit the environment conftest.py sets."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_module(module: str, *args, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
  """`python -m module args...` in the repository root; `env`: variables added to the environment."""
  return subprocess.run(
    [sys.executable, "-m", module, *map(str, args)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
    env={**os.environ, **(env or {})},
  )


def assert_one_line_error(proc: subprocess.CompletedProcess, fragment: str) -> None:
  """A refused command: exit status 2 and one line on stderr, naming `fragment`, no traceback."""
  assert proc.returncode == 2, proc.stderr
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert len(lines) == 1, proc.stderr
  assert "Traceback" not in proc.stderr and fragment in lines[0], proc.stderr
