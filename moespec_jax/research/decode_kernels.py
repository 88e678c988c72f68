"""The CPU decoding kernels against XLA's ops, side by side (experiments/decode_kernels.py).

On CPU, decoding runs the output head, the dense projections and the attention against the KV
cache (GQA, and MLA's passes against its compressed cache) on C++ kernels by default
(`ResearchOptions(head_kernel=, dense_kernel=, attention_kernel=)`). This measures what each one buys
on a given model: plain greedy decoding with all of them, with each one in turn replaced by
XLA's ops, and with none, every variant once per round (in a balanced order, `timing.round_order`,
the processor's caches emptied before every call), each run beside a first-token-only run of the
same variant, so that the decode phase (all but the first token) is timed apart from the
prefill. Ratios are taken within rounds, each with a 90% bootstrap interval; every variant must
emit the same tokens.
"""

from __future__ import annotations

import pathlib
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import moespec_jax as msj
from moespec_jax.analysis import timing
from moespec_jax.decoding import programs
from moespec_jax.io import plots
from moespec_jax.io.atomic import PathLike
from moespec_jax.io.progress import Progress
from moespec_jax.research import roofline

# Variant name -> the ResearchOptions kernel settings it decodes with ("cpp": the defaults).
VARIANTS: dict[str, dict[str, str]] = {
  "cpp": {},
  "xla_head": {"head_kernel": "xla"},
  "xla_dense": {"dense_kernel": "xla"},
  "xla_attention": {"attention_kernel": "xla"},
  "xla": {"head_kernel": "xla", "dense_kernel": "xla", "attention_kernel": "xla"},
}


def decode_kernels_ab(
  model: msj.Model,
  prompts: Sequence,
  *,
  batch_sizes: Sequence[int] = (1, 8),
  max_new_tokens: int = 64,
  rounds: int = 11,
  variants: Sequence[str] = tuple(VARIANTS),
  before: Callable[[], object] = roofline.flush_caches,
  log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
  """One row per (batch size, variant): decode ms per step (median over rounds) and, beside
  "cpp", the within-round ratio of the variant's decode time to the C++ kernels' (above 1: the
  kernels it replaces paid), with its interval. `prompts`: at least max(batch_sizes)."""
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown:
    raise ValueError(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
  if "cpp" not in variants:
    raise ValueError("variants must include 'cpp' (the ratios are to it)")
  if max_new_tokens < 2:
    raise ValueError(f"max_new_tokens must be >= 2 (a decode phase), got {max_new_tokens}")
  if rounds < 1:
    raise ValueError(f"rounds must be >= 1, got {rounds}")
  if len(prompts) < max(batch_sizes):
    raise ValueError(f"{len(prompts)} prompts for batch sizes up to {max(batch_sizes)}")
  rows = []
  progress = Progress(len(batch_sizes) * rounds, desc="decode_kernels", unit="rounds", every_s=15.0, emit=log)
  for bi, batch in enumerate(batch_sizes):
    batch_prompts = list(prompts[:batch])
    calls = {}
    for name in variants:
      spec = msj.SpecParams(drafter="none", research=msj.ResearchOptions(**VARIANTS[name]))
      for n in (1, max_new_tokens):
        calls[(name, n)] = lambda spec=spec, n=n: msj.generate(model, batch_prompts, max_new_tokens=n, spec=spec)
    outputs = {key: fn() for key, fn in calls.items()}  # compiles; the tokens every variant must emit
    reference = outputs[("cpp", max_new_tokens)].tokens
    for name in variants:
      if not np.array_equal(outputs[(name, max_new_tokens)].tokens, reference):
        raise AssertionError(f"variant {name!r} decoded other tokens than the C++ kernels at batch {batch}")
    seconds, _ = timing.interleaved_seconds(
      calls, rounds, before=before, on_round=lambda r, bi=bi: progress.update(bi * rounds + r + 1)
    )
    step_ms = {
      name: timing.decode_ms_per_step(seconds[(name, max_new_tokens)], seconds[(name, 1)], max_new_tokens)
      for name in variants
    }
    for name in variants:
      median_ms = statistics.median(step_ms[name])
      # A decode phase too short to time against its first token (a quick run) gives no figure.
      row = {
        "batch_size": batch,
        "variant": name,
        "settings": VARIANTS[name],
        "decode_ms_per_step": median_ms if median_ms > 0 else None,
        "first_token_ms": statistics.median(seconds[(name, 1)]) * 1e3,
        "rounds": rounds,
      }
      if name != "cpp" and row["decode_ms_per_step"] is not None:
        ratios = [v / c for v, c in zip(step_ms[name], step_ms["cpp"]) if v > 0 and c > 0]
        if ratios:
          row["decode_time_over_cpp"] = statistics.median(ratios)
          row["decode_time_over_cpp_interval"] = timing.median_interval(ratios)
      rows.append(row)
      log(format_row(row))
    programs.PROGRAMS.forget()
  return rows


def _ms(value) -> str:
  return "-" if value is None else f"{value:.3f}"


def format_row(row: dict) -> str:
  text = f"batch {row['batch_size']} {row['variant']:>13}: decode {_ms(row['decode_ms_per_step'])} ms/step"
  if "decode_time_over_cpp" in row:
    lo, hi = row["decode_time_over_cpp_interval"]
    text += f", {row['decode_time_over_cpp']:.3f}x the C++ kernels' time [{lo:.3f}, {hi:.3f}]"
  return text


def format_table(rows: Sequence[dict]) -> str:
  lines = ["| batch | variant | decode ms/step | time / C++ kernels' [90% interval] |", "|---|---|---|---|"]
  for row in rows:
    ratio = "-"
    if "decode_time_over_cpp" in row:
      lo, hi = row["decode_time_over_cpp_interval"]
      ratio = f"{row['decode_time_over_cpp']:.3f} [{lo:.3f}, {hi:.3f}]"
    lines.append(f"| {row['batch_size']} | {row['variant']} | {_ms(row['decode_ms_per_step'])} | {ratio} |")
  return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict], path: PathLike) -> pathlib.Path:
  """Each variant's decode time over the C++ kernels' (90% intervals), one group of bars per batch size."""
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(8, 4))
  batches = sorted({r["batch_size"] for r in rows})
  variants = [v for v in dict.fromkeys(r["variant"] for r in rows) if v != "cpp"]
  width = 0.8 / max(len(batches), 1)
  for i, batch in enumerate(batches):
    by = {r["variant"]: r for r in rows if r["batch_size"] == batch and "decode_time_over_cpp" in r}
    xs = [j + i * width for j, v in enumerate(variants) if v in by]
    ys = [by[v]["decode_time_over_cpp"] for v in variants if v in by]
    spans = [by[v]["decode_time_over_cpp_interval"] for v in variants if v in by]
    ax.bar(
      xs,
      ys,
      width,
      yerr=[[y - lo for y, (lo, _) in zip(ys, spans)], [hi - y for y, (_, hi) in zip(ys, spans)]],
      capsize=3,
      label=f"batch {batch}",
    )
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(variants))], variants)
  ax.axhline(1.0, color="k", lw=0.8, ls="--", label="C++ kernels")
  plots.finish_axes(
    ax,
    "kernels replaced by XLA's ops",
    "decode time / C++ kernels' (90% interval)",
    "what the CPU decoding kernels buy",
    legend_fontsize=8,
  )
  return plots.save(fig, path)
