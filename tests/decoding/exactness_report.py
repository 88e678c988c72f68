"""The exactness checks' power and the planted faults they catch, as markdown tables.

    python -m tests.decoding.exactness_report

Runs what tests/decoding/test_acceptance_law.py and test_spec_exactness.py run (the same cases,
keys and seeds, so the same p-values) and prints: each check's p-value on the real code with its
sample size and detectable relative bias (ALPHA, POWER of tests/decoding/exactness.py), then every
planted fault against every check (p-values; * marks the checks its test requires to reject it).
"""

from __future__ import annotations

import math

import pytest

import moespec_jax as msj  # noqa: E402
import tests.conftest  # noqa: F401  (the suite's XLA flags, so that runs match the tests')
from moespec_jax.config import ModelConfig  # noqa: E402
from moespec_jax.decoding import rejection  # noqa: E402
from tests.decoding import exactness, faults, recorded  # noqa: E402
from tests.decoding import test_acceptance_law as law  # noqa: E402
from tests.decoding import test_spec_exactness as loop  # noqa: E402


def _p(value: float) -> str:
  return "0" if value == 0.0 else f"{value:.2g}"


def _bias(check: exactness.Check) -> str:
  if math.isinf(check.detectable):
    return "-"
  if check.df <= 1:
    return f"{check.detectable:.1%}"
  return f"{check.detectable:.1%} ({check.detectable_best:.1%})"


def power_table(results: dict[str, dict[str, exactness.Check]]) -> list[str]:
  """Rows (case or setting) x checks: p-value, n, detectable bias."""
  lines = [
    "| case | check | p-value | n | df | rate [interval at 1 - ALPHA] | detectable bias: median cell (best cell) |",
    "|---|---|---|---|---|---|---|",
  ]
  for case, checks in results.items():
    for name, check in checks.items():
      rate = "" if check.rate is None else f"{check.rate:.4f} [{check.interval[0]:.4f}, {check.interval[1]:.4f}]"
      lines.append(f"| {case} | {name} | {_p(check.pvalue)} | {check.n} | {check.df} | {rate} | {_bias(check)} |")
  return lines


def fault_table(real: dict[str, dict[str, exactness.Check]], planted: dict[str, tuple[str, dict, tuple]]) -> list[str]:
  """Faults x checks: the fault's p-values (the real code's on its case in the first rows)."""
  names = list(next(iter(real.values())))
  lines = ["| run | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
  for case, checks in real.items():
    lines.append(f"| real code ({case}) | " + " | ".join(_p(checks[n].pvalue) for n in names) + " |")
  for fault, (case, checks, required) in planted.items():
    cells = [_p(checks[n].pvalue) + ("*" if n in required else "") for n in names]
    lines.append(f"| {fault} ({case}) | " + " | ".join(cells) + " |")
  return lines


def kernel_report() -> list[str]:
  real = {case: law.evaluate(case) for case in law.CASES}
  planted = {fault: (case, law.evaluate(case, fault), names) for fault, (case, names) in law.PLANTED.items()}
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(rejection, "uniform_open", law.boundary_uniform)
    zero = {fault: law.zero_probability_run(fault) for fault in (None, "accept_le")}
  return (
    ["## Kernel level: the real rule", ""]
    + power_table(real)
    + ["", "## Kernel level: planted faults (p-values)", ""]
    + fault_table({case: real[case] for case in ("t1", "top_k6")}, planted)
    + [
      "",
      "Zero-probability emissions with u on a 1/256 grid (u = 0 reachable), top-6 target, unfiltered "
      f"drafts: real rule {zero[None]}, accept_le {zero['accept_le']} (p-value 0: impossible under exactness).",
    ]
  )


def loop_report() -> list[str]:
  config = loop.stat_model_config(ModelConfig(**tests.conftest.TINY))
  model = msj.Model.init(config, seed=2)
  probs = loop.prefix_probabilities(loop.enumerate_prefix_logits(model))
  with recorded.instrumented_verification(tuple(loop.PLANTED)) as instrumented:
    runs = {name: loop.generate_recorded(model, instrumented, name, None) for name in loop.SETTINGS}
    fault_runs = {fault: loop.generate_recorded(model, instrumented, "t1", fault) for fault in loop.PLANTED}
  real = {name: loop.loop_checks(run, probs[name]) for name, run in runs.items()}
  planted = {
    fault: ("t1", loop.loop_checks(run, probs["t1"]), loop.PLANTED[fault]) for fault, run in fault_runs.items()
  }
  joint = {
    name: min(loop.pvalues(loop.first_tokens(run), loop.exact_joint(probs.get(name, probs["t1"]))).values())
    for name, run in {**runs, **fault_runs}.items()
  }
  wiring = {name: loop.p_wiring_error(model, run) for name, run in runs.items()}
  unfiltered = {
    name: loop.p_wiring_error(model, run, msj.SamplingParams(temperature=run.sampling.temperature))[0]
    for name, run in runs.items()
    if name != "t1"
  }
  lines = ["## Loop level (generate, MTP drafter, K = 2): the real code", ""] + power_table(real)
  lines += [
    "",
    "Largest |p verified - p of plain sampling from Model.forward| (share of positions set aside at a "
    "near tie of the filter's cut): "
    + ", ".join(f"{name} {error:.1g} ({ties:.2%})" for name, (error, ties) in wiring.items())
    + " (the test requires < 1e-4 and under 1%). Against plain sampling without the filter (a filter missing "
    "on the target side): " + ", ".join(f"{name} {error:.2g}" for name, error in unfiltered.items()) + ".",
  ]
  lines += ["", "## Loop level: planted faults (p-values)", ""] + fault_table({"t1": real["t1"]}, planted)
  lines += [
    "",
    "The joint law of the first four tokens (the earlier test: the smallest of its four p-values, "
    "threshold 1e-3): " + ", ".join(f"{name} {_p(p)}" for name, p in joint.items()) + ".",
  ]
  return lines


def main() -> None:
  print(
    f"ALPHA = {exactness.ALPHA}, POWER = {exactness.POWER}; verification faults: {faults.FAULTS}; "
    f"input faults: {law.INPUT_FAULTS}\n"
  )
  print("\n".join(kernel_report() + [""] + loop_report()))


if __name__ == "__main__":
  main()
