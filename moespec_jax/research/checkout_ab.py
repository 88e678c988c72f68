"""Two checkouts of the framework timed side by side: the same generate() calls, each checkout in a
worker process of its own, the calls taken in interleaved rounds (a balanced order per round), so
that a refactor or an upgrade is compared with the code before it under the same machine load.

The workers use only the public API (`Model.load`, `generate`, `SpecParams`, `SamplingParams`), so
any two versions that keep it can be compared. A worker compiles each call's program (and
calibrates auto K) before the first round; a round then times one call of each (checkout, call)
pair. Reported per call: each side's median time over rounds, and the median over rounds of the
B/A time ratio with its bootstrap interval; for generate's own time (its program: prefill and decode)
and for the whole call's wall time (the host's work before and after the program included).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from moespec_jax.analysis import timing
from moespec_jax.io.atomic import PathLike

# Each call: (label, SpecParams fields, SamplingParams fields). Public fields only.
CALLS: dict[str, tuple[dict, dict]] = {
  "plain": ({"drafter": "none"}, {}),
  "mtp_k3": ({"drafter": "mtp", "num_draft": 3}, {}),
  "ngram_k4": ({"drafter": "ngram", "num_draft": 4}, {}),
  "mtp_auto": ({"drafter": "mtp", "num_draft": "auto"}, {}),
  "mtp_k3_t1": ({"drafter": "mtp", "num_draft": 3}, {"temperature": 1.0, "top_p": 0.95}),
  "budgeted": ({"drafter": "mtp", "num_draft": 3, "mode": "budgeted", "expert_budget": 6}, {}),
}
PROMPTS = ["def fib(n):\n", "import os\nimport sys\n\n", "class Node:\n    def __init__(self", "for i in range"]

# The worker: reads a JSON setup line, compiles every call, then answers each call index on stdin
# with one JSON line {"wall_s", "generate_s", "tokens"}.
_WORKER = r"""
import json, sys, time
sys.path.insert(0, ".")
import moespec_jax as msj
setup = json.loads(sys.stdin.readline())
model = msj.Model.load(setup["model"])
calls = []
for spec_fields, sampling_fields in setup["calls"]:
  calls.append((msj.SpecParams(**spec_fields), msj.SamplingParams(**sampling_fields)))
def run(i):
  spec, sampling = calls[i]
  start = time.perf_counter()
  out = msj.generate(model, setup["prompts"], max_new_tokens=setup["max_new_tokens"], sampling=sampling,
                     spec=spec, seed=setup["seed"])
  wall = time.perf_counter() - start
  return {"wall_s": wall, "generate_s": float(out.stats["seconds"]), "tokens": out.tokens.tolist()}
for i in range(len(calls)):
  run(i)
  run(i)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
  print(json.dumps(run(int(line))), flush=True)
"""


class Worker:
  """One checkout's worker process."""

  def __init__(self, checkout: pathlib.Path, setup: dict[str, Any], python: str = sys.executable):
    self.checkout = checkout
    self.proc = subprocess.Popen(
      [python, "-c", _WORKER], cwd=checkout, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
    )
    self.proc.stdin.write(json.dumps(setup) + "\n")
    self.proc.stdin.flush()

  def wait_ready(self) -> None:
    line = self.proc.stdout.readline()
    if not line or not json.loads(line).get("ready"):
      raise RuntimeError(f"the worker in {self.checkout} failed to start (exit {self.proc.poll()})")

  def run(self, index: int) -> dict:
    self.proc.stdin.write(f"{index}\n")
    self.proc.stdin.flush()
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"the worker in {self.checkout} stopped (exit {self.proc.poll()})")
    return json.loads(line)

  def close(self) -> None:
    if self.proc.poll() is None:
      self.proc.stdin.close()
      self.proc.wait(timeout=60)


def compare(
  checkout_a: PathLike,
  checkout_b: PathLike,
  model_dir: PathLike,
  *,
  calls: Sequence[str] = tuple(CALLS),
  rounds: int = 15,
  batch_size: int = 1,
  max_new_tokens: int = 128,
  seed: int = 0,
  log: Callable[[str], None] = print,
) -> dict[str, Any]:
  """Times `calls` in both checkouts in `rounds` interleaved rounds; returns the metrics."""
  unknown = sorted(set(calls) - set(CALLS))
  if unknown:
    raise ValueError(f"calls must be among {', '.join(CALLS)}; got {unknown}")
  if rounds < 3:
    raise ValueError(f"rounds must be >= 3 for an interval, got {rounds}")
  prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch_size)]
  setup = {
    "model": str(model_dir),
    "prompts": prompts,
    "max_new_tokens": max_new_tokens,
    "seed": seed,
    "calls": [CALLS[c] for c in calls],
  }
  checkouts = {"a": pathlib.Path(checkout_a).resolve(), "b": pathlib.Path(checkout_b).resolve()}
  workers = {side: Worker(path, setup) for side, path in checkouts.items()}
  try:
    for worker in workers.values():
      worker.wait_ready()
    log(f"checkout_ab: both workers compiled {len(calls)} calls; {rounds} rounds")
    times = {(c, side): [] for c in calls for side in workers}
    walls = {(c, side): [] for c in calls for side in workers}
    tokens_equal = {c: True for c in calls}
    labels = [(i, side) for i in range(len(calls)) for side in workers]
    for r in range(rounds):
      outs = {}
      for i, side in timing.round_order(labels, r):
        outs[(i, side)] = workers[side].run(i)
        times[(calls[i], side)].append(outs[(i, side)]["generate_s"])
        walls[(calls[i], side)].append(outs[(i, side)]["wall_s"])
      for i, c in enumerate(calls):
        tokens_equal[c] &= outs[(i, "a")]["tokens"] == outs[(i, "b")]["tokens"]
      log(f"checkout_ab: round {r + 1}/{rounds} done")
  finally:
    for worker in workers.values():
      worker.close()
  rows = []
  for c in calls:
    a, b = np.asarray(times[(c, "a")]), np.asarray(times[(c, "b")])
    wall_ratios = np.asarray(walls[(c, "b")]) / np.asarray(walls[(c, "a")])
    rows.append(
      {
        "call": c,
        "a_ms": float(np.median(a)) * 1e3,
        "b_ms": float(np.median(b)) * 1e3,
        "b_over_a": float(np.median(b / a)),
        "b_over_a_interval": list(timing.median_interval(b / a)),
        "wall_b_over_a": float(np.median(wall_ratios)),
        "wall_b_over_a_interval": list(timing.median_interval(wall_ratios)),
        "tokens_equal": bool(tokens_equal[c]),
      }
    )
  return {
    "checkout_a": str(checkouts["a"]),
    "checkout_b": str(checkouts["b"]),
    "model": str(model_dir),
    "rounds": rounds,
    "batch_size": batch_size,
    "max_new_tokens": max_new_tokens,
    "rows": rows,
  }


def format_table(result: dict[str, Any]) -> str:
  lines = [
    f"A = {result['checkout_a']}",
    f"B = {result['checkout_b']}",
    f"batch {result['batch_size']}, {result['max_new_tokens']} new tokens, {result['rounds']} rounds "
    "(generate's own seconds: prefill and decode, no compilation or calibration)",
    "| call | A ms | B ms | B / A (90% interval) | B / A whole call | same tokens |",
    "|---|---|---|---|---|---|",
  ]
  for r in result["rows"]:
    low, high = r["b_over_a_interval"]
    wall_low, wall_high = r["wall_b_over_a_interval"]
    same = "yes" if r["tokens_equal"] else "NO"
    lines.append(
      f"| {r['call']} | {r['a_ms']:.2f} | {r['b_ms']:.2f} | {r['b_over_a']:.3f} [{low:.3f}, {high:.3f}] "
      f"| {r['wall_b_over_a']:.3f} [{wall_low:.3f}, {wall_high:.3f}] | {same} |"
    )
  return "\n".join(lines)
