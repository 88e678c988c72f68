"""Exact vs budgeted (MoE-Spec, APPROXIMATE) speculative decoding: speed beside quality.

For each (temperature, batch, K), the exact row is measured first; then each (policy, budget)
row gets (a) one run with `measure_quality` (the exact pass on the same cache gives top-1
agreement and KL(exact || budgeted) at the verified positions) and (b) `repeats` timed runs
alternating with exact runs on the same seeds, whose median ratio is `speedup_vs_exact` (with a
90% bootstrap interval from two repeats on). Every program runs once, untimed, before it is
timed: a program's first run after compilation is slower than the later ones, and a cold run
set against a warm one would decide the ratio. Greedy rows also report where the budgeted text
first departs from the exact text, and in how many rows.
The default kernel is `dedup`: it reads each kept expert once, so a budget lowers the bytes a
pass requests (the per-pair XLA path's cost follows (token, slot) pairs, which a budget keeps).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import moespec_jax as msj
from moespec_jax import cli
from moespec_jax.analysis import timing
from moespec_jax.data import corpus
from moespec_jax.decoding import programs, quality
from moespec_jax.io import atomic, plots
from moespec_jax.io.progress import Progress
from moespec_jax.model import budget as budget_lib
from moespec_jax.research import roofline

BUDGET_MULTIPLIERS = (1.0, 1.5, 2.0, 3.0, 4.0, None)  # x top_k; None = no budget


def budgets_for(top_k: int, multipliers: Sequence[float | None]) -> list[int | None]:
  out = []
  for m in multipliers:
    b = None if m is None else int(math.ceil(m * top_k))
    if b not in out:
      out.append(b)
  return out


def divergence(exact_tokens_BN, tokens_BN) -> dict[str, Any]:
  """Where greedy budgeted text first departs from exact: per row (None: never), the mean
  position over the rows that depart (None where none does) and how many do."""
  firsts = quality.first_divergence(exact_tokens_BN, tokens_BN)
  departed = [f for f in firsts if f is not None]
  return {
    "first_divergence_by_row": firsts,
    "diverged_rows": len(departed),
    "first_divergence": float(np.mean(departed)) if departed else None,
  }


def run_compare_modes(
  model: msj.Model,
  workdir: atomic.PathLike,
  *,
  drafter: str = "mtp",
  num_drafts: Sequence[int] = (2, 3, 4),
  budget_multipliers: Sequence[float | None] = BUDGET_MULTIPLIERS,
  policies: Sequence[str] = ("truncate", "substitute"),
  batch_sizes: Sequence[int] = (1, 4),
  temperatures: Sequence[float] = (0.0, 1.0),
  scope: str = "batch",
  kernel: str = "dedup",
  max_new_tokens: int = 64,
  repeats: int = 3,
  log: Callable[[str], None] = print,
) -> dict[str, Any]:
  """Runs the sweep; writes `workdir/metrics.json` (key `compare_modes`) and `pareto.png`."""
  cli.check_choices("policies", policies, budget_lib.POLICIES)
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  if drafter == "mtp" and model.config.num_mtp_modules == 0:
    raise ValueError("drafter 'mtp' needs a model with MTP heads (num_mtp_modules > 0)")
  budgets = budgets_for(model.config.top_k, budget_multipliers)
  prompts = corpus.held_out_prompts(max(batch_sizes), prompt_bytes=192, seed=0)
  total = len(temperatures) * len(batch_sizes) * len(num_drafts) * (1 + len(policies) * len(budgets))
  progress = Progress(total, desc="compare_modes", unit="rows", every_s=15.0, emit=log)
  rows, began = [], time.perf_counter()
  # The regime of plain decoding at each batch size (prompts of 192 bytes, the plain pass measured),
  # printed once.
  settings = {
    "max_new_tokens": max_new_tokens,
    "repeats": repeats,
    "regime": roofline.measured_regimes(
      model, prompts, batch_sizes, context=192 + max_new_tokens, max_new_tokens=max_new_tokens, log=log
    ),
  }

  def gen(batch_prompts, sampling, spec, seed):
    return msj.generate(model, batch_prompts, max_new_tokens=max_new_tokens, sampling=sampling, spec=spec, seed=seed)

  for temperature in temperatures:
    sampling = msj.SamplingParams(temperature=float(temperature))
    for batch in batch_sizes:
      batch_prompts = prompts[:batch]
      for k in num_drafts:
        exact_spec = msj.SpecParams(drafter=drafter, num_draft=k, kernel=kernel)
        gen(batch_prompts, sampling, exact_spec, 0)  # compiled and run once, untimed
        exact_runs = [gen(batch_prompts, sampling, exact_spec, r) for r in range(repeats)]
        exact_tps = statistics.median(o.stats["tokens_per_second"] for o in exact_runs)
        base = {
          "num_draft": k,
          "batch_size": batch,
          "temperature": float(temperature),
          "drafter": drafter,
          "kernel": kernel,
        }
        rows.append(
          {
            **base,
            "mode": "exact",
            "approximate": False,
            "expert_budget": None,
            "policy": None,
            "tokens_per_second": exact_tps,
            "speedup_vs_exact": 1.0,
            "speedup_interval": None,
            "top1_agreement": 1.0,
            "mean_kl": 0.0,
            "mean_accepted_length": exact_runs[0].stats["mean_accepted_length"],
            "first_divergence": None,
          }
        )
        progress.update(len(rows))
        for policy in policies:
          for budget in budgets:
            if budget is None:
              continue  # the exact row above
            spec = msj.SpecParams(
              drafter=drafter,
              num_draft=k,
              mode="budgeted",
              expert_budget=budget,
              budget_policy=policy,
              budget_scope=scope,
              kernel=kernel,
            )
            with_quality = dataclasses.replace(spec.research, measure_quality=True)
            measured = gen(batch_prompts, sampling, dataclasses.replace(spec, research=with_quality), 0)
            gen(batch_prompts, sampling, spec, 0)  # compiled and run once, untimed
            ratios, rates, lengths = [], [], []
            for r in range(repeats):
              e = gen(batch_prompts, sampling, exact_spec, r).stats["tokens_per_second"]
              out = gen(batch_prompts, sampling, spec, r)
              rates.append(out.stats["tokens_per_second"])
              ratios.append(out.stats["tokens_per_second"] / e)
              lengths.append(out.stats["mean_accepted_length"])
            row = {
              **base,
              "mode": "budgeted",
              "approximate": measured.stats["approximate"],
              "expert_budget": budget,
              "policy": policy,
              "scope": scope,
              "tokens_per_second": statistics.median(rates),
              "speedup_vs_exact": statistics.median(ratios),
              "speedup_interval": list(timing.median_interval(ratios)) if repeats >= 2 else None,
              "top1_agreement": measured.stats.get("top1_agreement", 1.0),
              "mean_kl": measured.stats.get("mean_kl", 0.0),
              "mean_accepted_length": statistics.median(lengths),
              "unique_experts_per_pass": out.stats["unique_experts_per_pass"],
              "first_divergence": None,
            }
            if sampling.greedy:
              row.update(divergence(exact_runs[0].tokens, out.tokens))
            rows.append(row)
            progress.update(len(rows), speedup=rows[-1]["speedup_vs_exact"])
            _write(workdir, rows, began, settings, complete=False)
        programs.PROGRAMS.forget()  # ~300 programs in a full sweep do not fit in memory together
  result = _write(workdir, rows, began, settings, complete=True)
  plot_pareto(rows, workdir / "pareto.png")
  log(format_table(rows))
  return result


def _write(workdir, rows, began, settings, *, complete):
  result = {
    "compare_modes": {
      "rows": rows,
      "complete": complete,
      "seconds": time.perf_counter() - began,
      **settings,
      "note": "budgeted rows are APPROXIMATE: not the target's distribution",
    }
  }
  atomic.write_json_atomic(workdir / "metrics.json", result)
  return result


def format_table(rows) -> str:
  head = (
    f"{'mode':<10}{'policy':<11}{'B':>4}{'T':>5}{'batch':>6}{'K':>3}{'tok/s':>9}{'vs exact':>9}"
    f"{'top1':>7}{'KL':>8}{'acc.len':>8}{'diverge':>11}"
  )
  lines = ["EXACT (the target's distribution)", head]
  for r in rows:
    if r["mode"] == "exact":
      lines.append(_line(r))
  lines += ["", "APPROXIMATE (budgeted: quality figures against exact)", head]
  for r in rows:
    if r["mode"] != "exact":
      lines.append(_line(r))
  lines.append(
    "diverge: where greedy budgeted text first departs from exact (token position from 0), mean over "
    "the rows that depart (d/n: d of n rows do); never: the same text in every row; -: not compared "
    "(exact, or sampled)"
  )
  return "\n".join(lines)


def divergence_text(r) -> str:
  """The `diverge` column: '-' (not compared), 'never', or the mean first position over the rows
  that departed, with their count where not all did."""
  firsts = r.get("first_divergence_by_row")
  if firsts is None:
    return "-"
  if not r["diverged_rows"]:
    return "never"
  part = "" if r["diverged_rows"] == len(firsts) else f" {r['diverged_rows']}/{len(firsts)}"
  return f"{r['first_divergence']:.1f}{part}"


def _line(r) -> str:
  budget = "-" if r["expert_budget"] is None else str(r["expert_budget"])
  return (
    f"{r['mode']:<10}{(r['policy'] or '-'):<11}{budget:>4}{r['temperature']:>5.1f}{r['batch_size']:>6}"
    f"{r['num_draft']:>3}{r['tokens_per_second']:>9.1f}{r['speedup_vs_exact']:>9.2f}"
    f"{r['top1_agreement']:>7.3f}{r['mean_kl']:>8.4f}{r['mean_accepted_length']:>8.2f}{divergence_text(r):>11}"
  )


def point_label(r, rows) -> str:
  """A Pareto point's label: its budget, and the settings that vary across the sweep."""
  label = f"B={r['expert_budget']}"
  for key, short in (("num_draft", "K"), ("batch_size", "b"), ("temperature", "T")):
    if len({x[key] for x in rows}) > 1:
      label += f" {short}={r[key]:g}"
  return label


def plot_pareto(rows, path) -> None:
  """Speedup over exact against top-1 agreement, one point per budgeted row labelled with its budget;
  bars: the speedup's 90% interval over repeats, where there are repeats."""
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(7, 5))
  for policy, marker in (("truncate", "o"), ("substitute", "s")):
    pts = [r for r in rows if r["policy"] == policy]
    if not pts:
      continue
    x = [r["top1_agreement"] for r in pts]
    y = [r["speedup_vs_exact"] for r in pts]
    spans = [r.get("speedup_interval") or (v, v) for r, v in zip(pts, y)]
    yerr = [[v - lo for v, (lo, _) in zip(y, spans)], [hi - v for v, (_, hi) in zip(y, spans)]]
    ax.errorbar(x, y, yerr=yerr, fmt=marker, alpha=0.7, capsize=3, label=f"budgeted, {policy} (approximate)")
    for r, xi, yi in zip(pts, x, y):
      ax.annotate(point_label(r, rows), (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
  ax.axhline(1.0, color="k", lw=0.8, ls="--", label="exact")
  ax.axvline(0.98, color="gray", lw=0.8, ls=":", label="top-1 agreement 0.98")
  plots.finish_axes(
    ax,
    "top-1 agreement with exact target logits",
    "speedup over exact mode (90% interval)",
    "MoE-Spec expert budgets: speed vs quality",
    legend_fontsize=8,
  )
  plots.save(fig, path)
