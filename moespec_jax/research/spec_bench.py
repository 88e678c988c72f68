"""Speculative vs plain decoding throughput on held-out code prompts (experiments/spec_bench.py).

For each batch size and temperature, plain decoding and every (drafter, K) run on the same
prompts, in consecutive batches of that size (`prompt_groups`: batch 1 decodes each prompt alone;
a run's tokens/s is over all its batches, `decode_groups`); K is an integer or "auto"
(`auto_lines` compares auto with the best fixed K). Each row alternates `repeats` plain and
speculative runs with the same seeds (compilation excluded: `generate` compiles ahead of time;
and each program runs once, untimed, before it is timed: its first run is slower than the later
ones), so that both see the same load on a shared machine, and reports the medians of tokens/s
and of the per-pair speedups.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import moespec_jax as msj
from moespec_jax.analysis import timing
from moespec_jax.data import corpus
from moespec_jax.data import tokenizer as tokenizer_lib
from moespec_jax.decoding import programs
from moespec_jax.io import atomic, plots
from moespec_jax.io.progress import Progress
from moespec_jax.research import roofline


def bench_prompts(model: msj.Model, n: int, prompt_bytes: int, log: Callable[[str], None] = print) -> tuple[list, str]:
  """`n` held-out code prompts and how they are encoded: text, for the model's tokenizer; for a
  checkpoint without one (a random Hugging Face import), the same text's UTF-8 bytes as token
  ids (`utf8_bytes`), as peer_bench prompts, which needs a vocabulary of at least 256."""
  prompts = corpus.held_out_prompts(n, prompt_bytes=prompt_bytes, seed=0)
  if not isinstance(model.tokenizer, tokenizer_lib.MissingTokenizer):
    return prompts, "tokenizer"
  if model.config.vocab_size < 256:
    raise ValueError(
      f"the model at {model.tokenizer.source} has no tokenizer.json and a vocabulary of "
      f"{model.config.vocab_size} < 256: no prompts to give it (add its tokenizer.json)"
    )
  log("the model has no tokenizer.json: prompts are the held-out code's UTF-8 bytes as token ids")
  return [list(p.encode("utf-8")) for p in prompts], "utf8_bytes"


def warm_up(model, groups: Sequence[list], max_new_tokens: int, sampling, *specs) -> None:
  """Runs each spec on every group of prompts once, untimed: every program the timed runs use
  (groups whose prompts pad to another length have programs of their own) is compiled (and
  auto K's calibrated) then, and its first run, slower than the later ones, kept out of them."""
  for spec in specs:
    for group in groups:
      msj.generate(model, group, max_new_tokens=max_new_tokens, sampling=sampling, spec=spec, seed=0)


def prompt_groups(prompts: Sequence, batch: int) -> list[list]:
  """The prompts in consecutive batches of `batch` (a remainder that fills no batch is left out):
  every batch size decodes the same prompts, batch 1 each of them alone."""
  if batch < 1 or batch > len(prompts):
    raise ValueError(f"batch size {batch} needs 1..{len(prompts)} prompts")
  return [list(prompts[i : i + batch]) for i in range(0, len(prompts) - batch + 1, batch)]


def _weighted(values: Sequence[float], weights: Sequence[float]) -> float:
  """The mean of `values` (NaN ones left out) weighted by `weights`; NaN where none is left."""
  pairs = [(v, w) for v, w in zip(values, weights) if not math.isnan(v) and w > 0]
  total = sum(w for _, w in pairs)
  return sum(v * w for v, w in pairs) / total if total else float("nan")


def decode_groups(model, groups: Sequence[list], max_new_tokens: int, sampling, spec, seed: int) -> dict[str, Any]:
  """One `generate` per group of prompts, in sequence, and their statistics merged: tokens/s is
  all generated tokens over all the calls' seconds; accepted length, K, acceptance by depth and
  unique experts are means over the calls weighted by their verify passes (acceptance by depth:
  by passes, not by the drafts each depth reached); every other field is the last call's."""
  all_stats = [
    msj.generate(model, g, max_new_tokens=max_new_tokens, sampling=sampling, spec=spec, seed=seed).stats for g in groups
  ]
  passes = [st["verify_passes"] for st in all_stats]
  merged = dict(all_stats[-1])
  merged["generated_tokens"] = sum(st["generated_tokens"] for st in all_stats)
  merged["seconds"] = sum(st["seconds"] for st in all_stats)
  merged["tokens_per_second"] = merged["generated_tokens"] / merged["seconds"]
  merged["verify_passes"] = sum(passes)
  merged["mean_accepted_length"] = _weighted([st["mean_accepted_length"] for st in all_stats], passes)
  for key in ("acceptance_by_depth", "unique_experts_per_pass"):
    merged[key] = [_weighted(column, passes) for column in zip(*(st[key] for st in all_stats))]
  if "passes_by_num_draft" in merged:
    by_k = [sum(column) for column in zip(*(st["passes_by_num_draft"] for st in all_stats))]
    merged["passes_by_num_draft"] = by_k
    merged["chosen_num_draft"] = max(range(len(by_k)), key=by_k.__getitem__)
    merged["mean_num_draft"] = sum(k * c for k, c in enumerate(by_k)) / max(sum(by_k), 1)
  return merged


def timed(model, groups: Sequence[list], max_new_tokens: int, sampling, spec, repeats: int):
  """(median tokens/s, median mean accepted length, last stats) over `repeats` seeded runs, each
  over every group of prompts (`decode_groups`)."""
  rates, lengths, stats = [], [], {}
  for r in range(repeats):
    stats = decode_groups(model, groups, max_new_tokens, sampling, spec, seed=r)
    rates.append(stats["tokens_per_second"])
    lengths.append(stats["mean_accepted_length"])
  return statistics.median(rates), statistics.median(lengths), stats


@dataclasses.dataclass(frozen=True)
class PairedRuns:
  """Plain and speculative runs alternated (`paired`): medians over the pairs.

  `speedup` is the median of the per-pair ratios and `speedup_interval` its 90% percentile-bootstrap
  interval (pairs resampled): how far this machine's noise leaves the speedup uncertain.
  """

  tokens_per_second: float
  plain_tokens_per_second: float
  speedup: float
  speedup_interval: tuple[float, float]
  mean_accepted_length: float
  stats: dict[str, Any]


def format_interval(interval: Sequence[float] | None) -> str:
  """A speedup's interval as printed beside it ("-" where a row has none: plain decoding's)."""
  return "-" if interval is None else "[{:.2f}, {:.2f}]".format(*interval)


def paired(model, groups: Sequence[list], max_new_tokens: int, sampling, spec, repeats: int) -> PairedRuns:
  """Alternates plain and speculative runs (same seeds, each over every group of prompts) so that
  both see the same machine load; the order within a pair reverses from one pair to the next, so
  that neither side is always the one that runs second (after the other has warmed the caches,
  or in its wake). `stats` are the last speculative run's."""
  plain_spec = msj.SpecParams(drafter="none", kernel=spec.kernel)
  order = (("plain", plain_spec), ("spec", spec))
  spec_rates, plain_rates, ratios, lengths, stats = [], [], [], [], {}
  for r in range(repeats):
    runs = {}
    for name, run_spec in timing.round_order(order, r):
      runs[name] = decode_groups(model, groups, max_new_tokens, sampling, run_spec, seed=r)
    plain, stats = runs["plain"], runs["spec"]
    spec_rates.append(stats["tokens_per_second"])
    plain_rates.append(plain["tokens_per_second"])
    ratios.append(stats["tokens_per_second"] / plain["tokens_per_second"])
    lengths.append(stats["mean_accepted_length"])
  return PairedRuns(
    tokens_per_second=statistics.median(spec_rates),
    plain_tokens_per_second=statistics.median(plain_rates),
    speedup=statistics.median(ratios),
    speedup_interval=timing.median_interval(ratios),
    mean_accepted_length=statistics.median(lengths),
    stats=stats,
  )


def run_spec_bench(
  model: msj.Model,
  workdir: atomic.PathLike,
  *,
  batch_sizes: Sequence[int] = (1, 2, 4, 8),
  temperatures: Sequence[float] = (0.0, 1.0),
  drafters: Sequence[str] = ("mtp", "ngram"),
  num_drafts: Sequence[int | str] = (1, 2, 3, 4, 5, 6),
  max_new_tokens: int = 64,
  repeats: int = 3,
  prompt_bytes: int = 192,
  num_prompts: int | None = None,
  tree_nodes: Sequence[int] = (0,),
  log: Callable[[str], None] = print,
) -> dict[str, Any]:
  """Runs the sweep and writes `workdir/metrics.json` (key `spec_bench`) and `speedup_vs_k.png`.
  `tree_nodes`: 0 runs chains of K drafts; N > 0 draft trees of N nodes and depth K (for every
  fixed K <= N: `SpecParams.tree_nodes`), each row with its `tree_nodes`."""
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  if "mtp" in drafters and model.config.num_mtp_modules == 0:
    raise ValueError("drafter 'mtp' needs a model with MTP heads (num_mtp_modules > 0)")
  num_prompts = max(batch_sizes) if num_prompts is None else num_prompts
  if num_prompts < max(batch_sizes):
    raise ValueError(f"num_prompts ({num_prompts}) must be at least the largest batch size ({max(batch_sizes)})")
  prompts, encoding = bench_prompts(model, num_prompts, prompt_bytes, log=log)
  # The regime of plain decoding at each batch size, its plain pass measured.
  regimes = roofline.measured_regimes(
    model, prompts, batch_sizes, context=prompt_bytes + max_new_tokens, max_new_tokens=max_new_tokens, log=log
  )
  shapes = [(k, n) for k in num_drafts for n in tree_nodes if n == 0 or (k != "auto" and k <= n)]
  total = len(batch_sizes) * len(temperatures) * (1 + len(drafters) * len(shapes))
  progress = Progress(total, desc="spec_bench", unit="rows", every_s=15.0, emit=log)
  rows, plain_rows, done = [], [], 0
  began = time.perf_counter()
  for temperature in temperatures:
    sampling = msj.SamplingParams(temperature=float(temperature))
    for batch in batch_sizes:
      groups = prompt_groups(prompts, batch)
      warm_up(model, groups, max_new_tokens, sampling, msj.SpecParams(drafter="none"))
      plain_tps, _, _ = timed(model, groups, max_new_tokens, sampling, msj.SpecParams(drafter="none"), repeats)
      plain_rows.append({"batch_size": batch, "temperature": float(temperature), "tokens_per_second": plain_tps})
      done += 1
      progress.update(done)
      plain_programs = programs.PROGRAMS.signatures()
      for drafter in drafters:
        for k, n in shapes:
          spec = msj.SpecParams(drafter=drafter, num_draft=k, tree_nodes=n or None)
          warm_up(model, groups, max_new_tokens, sampling, spec)
          runs = paired(model, groups, max_new_tokens, sampling, spec, repeats)
          stats = runs.stats
          rows.append(
            {
              "drafter": drafter,
              "num_draft": k,
              "tree_nodes": n,
              "batch_size": batch,
              "temperature": float(temperature),
              "tokens_per_second": runs.tokens_per_second,
              "plain_tokens_per_second": runs.plain_tokens_per_second,
              "speedup": runs.speedup,
              "speedup_interval_90": list(runs.speedup_interval),
              "mean_accepted_length": runs.mean_accepted_length,
              "acceptance_by_depth": stats["acceptance_by_depth"],
              "unique_experts_per_pass": stats["unique_experts_per_pass"],
              **(
                {"mean_num_draft": stats["mean_num_draft"], "chosen_num_draft": stats["chosen_num_draft"]}
                if k == "auto"
                else {}
              ),
            }
          )
          done += 1
          progress.update(done, speedup=runs.speedup)
          _write(
            workdir,
            rows,
            plain_rows,
            max_new_tokens,
            repeats,
            batch_sizes,
            prompt_bytes,
            model,
            began,
            num_prompts=num_prompts,
            complete=False,
            encoding=encoding,
            regimes=regimes,
          )
          # ~100 compiled loops do not fit in memory together: keep only the plain program.
          programs.PROGRAMS.forget(plain_programs)
      programs.PROGRAMS.forget()
  result = _write(
    workdir,
    rows,
    plain_rows,
    max_new_tokens,
    repeats,
    batch_sizes,
    prompt_bytes,
    model,
    began,
    num_prompts=num_prompts,
    complete=True,
    encoding=encoding,
    regimes=regimes,
  )
  plot_speedup(rows, workdir / "speedup_vs_k.png")
  log(format_table(rows))
  for line in auto_lines(rows) + tree_lines(rows):
    log(line)
  return result


def _write(
  workdir,
  rows,
  plain_rows,
  max_new_tokens,
  repeats,
  batch_sizes,
  prompt_bytes,
  model,
  began,
  *,
  num_prompts: int,
  complete: bool,
  encoding: str,
  regimes: list[dict],
):
  """Writes the metrics so far (a long sweep leaves usable partial results)."""
  result = {
    "spec_bench": {
      "rows": rows,
      "plain": plain_rows,
      "complete": complete,
      "max_new_tokens": max_new_tokens,
      "repeats": repeats,
      "n_prompts": num_prompts,
      "prompt_bytes": prompt_bytes,
      "prompt_encoding": encoding,
      "num_mtp_modules": model.config.num_mtp_modules,
      "regime": regimes,
      "seconds": time.perf_counter() - began,
    }
  }
  atomic.write_json_atomic(workdir / "metrics.json", result)
  return result


def auto_lines(rows: Sequence[dict]) -> list[str]:
  """One line per `num_draft="auto"` row: its speedup over plain and over the best fixed K of the
  same drafter, temperature and batch (where fixed Ks ran), and the mean K it chose."""
  lines = []
  for r in rows:
    if r["num_draft"] != "auto":
      continue
    fixed = [
      f["speedup"]
      for f in rows
      if f["num_draft"] != "auto"
      and (f["drafter"], f["temperature"], f["batch_size"]) == (r["drafter"], r["temperature"], r["batch_size"])
    ]
    versus = f", {r['speedup'] / max(fixed):.2f}x the best fixed K" if fixed else ""
    lines.append(
      f"auto K, {r['drafter']} T={r['temperature']:g} batch {r['batch_size']}: {r['speedup']:.2f}x plain "
      f"{format_interval(r['speedup_interval_90'])}{versus} "
      f"(mean K {r['mean_num_draft']:.2f})"
    )
  return lines


def tree_lines(rows: Sequence[dict]) -> list[str]:
  """Per drafter, temperature and batch that ran trees: the best tree row against the best chain
  (fixed K), in speedup, tokens committed per pass and distinct experts read per pass."""
  lines = []
  for key in sorted({(r["drafter"], r["temperature"], r["batch_size"]) for r in rows}):
    mine = [r for r in rows if (r["drafter"], r["temperature"], r["batch_size"]) == key and r["num_draft"] != "auto"]
    trees, chains = [r for r in mine if r.get("tree_nodes")], [r for r in mine if not r.get("tree_nodes")]
    if not trees or not chains:
      continue
    tree, chain = max(trees, key=lambda r: r["speedup"]), max(chains, key=lambda r: r["speedup"])
    experts = [sum(r["unique_experts_per_pass"]) for r in (tree, chain)]
    lines.append(
      f"trees, {key[0]} T={key[1]:g} batch {key[2]}: best tree (N={tree['tree_nodes']}, depth {tree['num_draft']}) "
      f"{tree['speedup']:.2f}x plain, {tree['speedup'] / chain['speedup']:.2f}x the best chain "
      f"(K={chain['num_draft']}); "
      f"tokens a pass {tree['mean_accepted_length']:.2f} vs {chain['mean_accepted_length']:.2f}; "
      f"experts a pass {experts[0]:.1f} vs {experts[1]:.1f}"
    )
  return lines


def format_table(rows) -> str:
  lines = [
    f"{'drafter':<8}{'T':>5}{'batch':>7}{'K':>5}{'nodes':>6}{'tok/s':>10}{'plain':>10}{'speedup':>9}"
    f"{'90% interval':>15}{'acc.len':>9}{'experts':>9}"
  ]
  for r in rows:
    lines.append(
      f"{r['drafter']:<8}{r['temperature']:>5.1f}{r['batch_size']:>7}{r['num_draft']!s:>5}"
      f"{r.get('tree_nodes') or '-':>6}{r['tokens_per_second']:>10.1f}{r['plain_tokens_per_second']:>10.1f}"
      f"{r['speedup']:>9.2f}{format_interval(r['speedup_interval_90']):>15}{r['mean_accepted_length']:>9.2f}"
      f"{sum(r['unique_experts_per_pass']):>9.1f}"
    )
  return "\n".join(lines)


def plot_speedup(rows, path: pathlib.Path) -> None:
  """Speedup vs K, one line per batch size; one panel per (drafter, temperature); auto K's rows as
  crosses at the mean K they chose; tree rows as triangles at their depth, labelled N."""
  plt = plots.pyplot()
  panels = sorted({(r["drafter"], r["temperature"]) for r in rows})
  if not panels:
    return
  fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
  for ax, (drafter, temperature) in zip(axes[0], panels):
    for batch in sorted({r["batch_size"] for r in rows}):
      mine = [r for r in rows if (r["drafter"], r["temperature"], r["batch_size"]) == (drafter, temperature, batch)]
      chains = (r for r in mine if r["num_draft"] != "auto" and not r.get("tree_nodes"))
      sel = sorted(chains, key=lambda r: r["num_draft"])
      (line,) = ax.plot([r["num_draft"] for r in sel], [r["speedup"] for r in sel], "o-", label=f"batch {batch}")
      auto = [r for r in mine if r["num_draft"] == "auto"]
      ax.plot([r["mean_num_draft"] for r in auto], [r["speedup"] for r in auto], "x", ms=9, color=line.get_color())
      trees = [r for r in mine if r.get("tree_nodes")]  # at their depth, labelled with their nodes
      ax.plot([r["num_draft"] for r in trees], [r["speedup"] for r in trees], "^", ms=7, color=line.get_color())
      for r in trees:
        label = f"N={r['tree_nodes']}"
        ax.annotate(label, (r["num_draft"], r["speedup"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    plots.finish_axes(
      ax,
      "K (drafted tokens)",
      "speedup over plain",
      f"{drafter}, {'greedy' if temperature == 0 else f'T={temperature:g}'}",
      legend_fontsize=8,
    )
  plots.save(fig, path)
