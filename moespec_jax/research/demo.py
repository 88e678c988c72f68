"""What `make demo` runs: the default model, plain decoding on held-out code, a table and metrics."""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import moespec_jax as msj
from moespec_jax.analysis import timing
from moespec_jax.data import corpus
from moespec_jax.decoding import loop, report
from moespec_jax.io import atomic, plots
from moespec_jax.io.progress import Progress
from moespec_jax.research import models, roofline, rounds, spec_bench

# The sampled rows' sampling: temperature 1 with nucleus (top-p) filtering.
SAMPLED = msj.SamplingParams(temperature=1.0, top_p=0.95)
# The validation figure the demo prints: this many batches spread over the split (the whole split,
# the figure `experiments.pretrain` reports, takes half a minute).
VALIDATION_BATCHES = 16
# Random models whose passes are bound by reading their weights (`--model=config:...` values of
# configs/), where a verification pass of several tokens costs little more than one: where
# speculation can pay on this machine.
MEMORY_BOUND_CONFIGS = ("membound_coarse", "membound_fine")
# Their rows: (K, what a pass pays for drafting): a fixed K with the config's own MTP heads' draft
# cost, and with drafts that cost nothing (a lookup, as prompt lookup's). No auto K row: its
# calibration would take a minute of the demo's budget per config.
MEMORY_BOUND_ROWS = ((2, "mtp"), (2, "none"))
# Their runs, shorter than the default model's: their passes are 20-40 times slower, and a fresh
# `make demo` has to fit its quarter of an hour (docs/findings/2026-12-04-make-demo.md).
MEMORY_BOUND_LIMITS = {"max_new_tokens": 64, "repeats": 3}


def _timed_generate(model, prompts, max_new_tokens, sampling, spec, repeats: int):
  """Median tokens/s over `repeats` runs after an untimed one (compilation and a program's slower
  first run excluded); returns (median, last output)."""
  spec_bench.warm_up(model, [prompts], max_new_tokens, sampling, spec)
  rates, out = [], None
  for r in range(repeats):
    out = msj.generate(model, prompts, max_new_tokens=max_new_tokens, sampling=sampling, spec=spec, seed=r)
    rates.append(out.stats["tokens_per_second"])
  return statistics.median(rates), out


def sampling_label(sampling: msj.SamplingParams) -> str:
  """ "greedy", or the temperature and top-p."""
  return "greedy" if sampling.greedy else f"T={sampling.temperature:g} top-p {sampling.top_p:g}"


def whitespace_share(tokens: Sequence[int], tokenizer) -> float:
  """The share of `tokens` that decode to whitespace only (NaN for none)."""
  if not len(tokens):
    return float("nan")
  return sum(1 for t in tokens if (text := tokenizer.decode([int(t)])) and not text.strip()) / len(tokens)


def _drafts_row(out, tokenizer) -> dict[str, Any]:
  """Batch 1 with a pass trace: how many accepted drafts, and the share of them that is
  whitespace (a run of indentation is accepted at every depth and says little about code)."""
  if "pass_trace" not in out.stats:
    return {}
  tokens = out.tokens[0]
  drafted = report.accepted_drafts(out.stats["pass_trace"], tokens)
  accepted = tokens[: drafted.size][drafted]
  return {
    "accepted_drafts": int(accepted.size),
    "accepted_draft_whitespace_share": whitespace_share(accepted, tokenizer),
    "output_whitespace_share": whitespace_share(tokens[tokens >= 0], tokenizer),
  }


def _row(
  drafter,
  k,
  batch,
  out,
  plain_out,
  *,
  sampling,
  runs: spec_bench.PairedRuns | None = None,
  plain_tps: float | None = None,
  budget=None,
  top1=1.0,
):
  """A table row; `runs`: the row's pairs against plain decoding (None: the plain row, timed alone
  at `plain_tps`)."""
  if (runs is None) == (plain_tps is None):
    raise ValueError("a row is either paired (runs) or the plain row (plain_tps)")
  row = {
    "mode": "exact" if budget is None else "budgeted",
    "sampling": sampling_label(sampling),
    "temperature": sampling.temperature,
    "top_p": sampling.top_p,
    "drafter": drafter,
    "num_draft": k,
    "expert_budget": budget,
    "kernel": out.stats["expert_method"],
    "batch_size": batch,
    "tokens_per_second": plain_tps if runs is None else runs.tokens_per_second,
    "plain_tokens_per_second": plain_tps if runs is None else runs.plain_tokens_per_second,
    "speedup_vs_plain": 1.0 if runs is None else runs.speedup,
    "speedup_interval_90": None if runs is None else list(runs.speedup_interval),
    "mean_accepted_length": out.stats["mean_accepted_length"],
    "top1_agreement_vs_exact": top1,
    "approximate": budget is not None,
    "acceptance_by_depth": out.stats["acceptance_by_depth"],
    # Exact greedy speculation must reproduce plain greedy decoding token for token (sampled:
    # the same distribution, not the same tokens: None).
    "tokens_equal_plain": bool(np.array_equal(out.tokens, plain_out.tokens)) if sampling.greedy else None,
    "auto_num_draft": out.stats["num_draft"] == "auto",
  }
  if row["auto_num_draft"]:
    row["mean_num_draft"] = out.stats["mean_num_draft"]
    row["passes_by_num_draft"] = out.stats["passes_by_num_draft"]
  return row


def heads_acceptance(model: msj.Model, prompts: Sequence, max_new_tokens: int, num_draft: int = 4) -> list[float]:
  """The model's MTP heads' acceptance by depth (greedy, K = `num_draft`, on `prompts`)."""
  out = msj.generate(
    model, prompts, max_new_tokens=max_new_tokens, spec=msj.SpecParams(drafter="mtp", num_draft=num_draft)
  )
  return [float(a) for a in out.stats["acceptance_by_depth"]]


def memory_bound_rows(
  acceptance: float,
  configs: Sequence[str] = MEMORY_BOUND_CONFIGS,
  *,
  max_new_tokens: int,
  repeats: int,
  log: Callable[[str], None] = print,
  row_done: Callable[..., None] = lambda what, **figures: None,
) -> list[dict[str, Any]]:
  """Rows on `configs` (random models, `config:NAME` of `models.load_model`), batch 1, greedy: plain decoding and the
  controlled drafter at `acceptance` (its drafts from the plain run's tokens, each right with
  that probability) at MEMORY_BOUND_ROWS: paying the model's own MTP heads' draft cost every pass
  (`controlled_draft_cost "mtp"`) or nothing; speedups over plain measured side by side (`rounds`). Each
  config's regime line is printed and kept."""
  rows = []
  for name in configs:
    model = models.load_model(f"config:{name}")
    prompts, _ = spec_bench.bench_prompts(model, 1, 192, log=log)
    regime_rows = roofline.measured_regimes(
      model,
      prompts,
      (1,),
      context=192 + max_new_tokens,
      max_new_tokens=max_new_tokens,
      log=lambda line: log(f"{name}: {line}"),
    )
    reference = msj.generate(model, prompts, max_new_tokens=max_new_tokens).tokens
    specs = {
      (k, cost): msj.SpecParams(
        drafter="controlled",
        num_draft=k,
        research=msj.ResearchOptions(controlled_acceptance=acceptance, controlled_draft_cost=cost),
      )
      for k, cost in MEMORY_BOUND_ROWS
    }
    rounds.warm_up(model, prompts, max_new_tokens, specs, reference)
    speedups, rates, last, _, per_round = rounds.round_robin_speedups(
      model, prompts, max_new_tokens, specs, repeats, reference, check_tokens=reference
    )
    for (k, cost), st in last.items():
      row = {
        "config": name,
        "drafter": "controlled",
        "controlled_acceptance": acceptance,
        "draft_cost": cost,
        "num_draft": k,
        "batch_size": 1,
        "max_new_tokens": max_new_tokens,
        "tokens_per_second": rates[(k, cost)],
        "speedup_vs_plain": speedups[(k, cost)],
        "round_speedups": per_round[(k, cost)],
        "speedup_interval_90": list(timing.median_interval(per_round[(k, cost)])),
        "mean_accepted_length": st["mean_accepted_length"],
        "regime": regime_rows[0],
      }
      rows.append(row)
      drafts = "drafts free" if cost == "none" else "MTP draft cost"
      row_done(f"{name} controlled K={k} ({drafts})", speedup=speedups[(k, cost)])
    del model
  return rows


def run_demo(
  model: msj.Model,
  workdir: atomic.PathLike,
  *,
  max_new_tokens: int = 128,
  batch_sizes: Sequence[int] = (1, 8),
  repeats: int = 7,
  max_draft: int = 4,
  budget_multiplier: int = 2,
  sampled: bool = True,
  memory_bound: Sequence[str] = MEMORY_BOUND_CONFIGS,
  log: Callable[[str], None] = print,
) -> dict[str, Any]:
  """Generates from held-out prompts and writes `workdir/metrics.json` (key `demo`).

  Rows: plain decoding, then exact speculative decoding with the MTP drafter (when the model
  has heads) and the n-gram drafter, each with `num_draft="auto"` (K chosen every pass by the
  cost model, up to `max_draft`; `num_draft` in a row is the K chosen most often), with the
  speedup over plain decoding measured by alternating plain and speculative runs, after one
  untimed run of each (`research.spec_bench.paired`: `plain_tokens_per_second` is the plain side
  of those pairs), and one budgeted row (approximate: expert budget `budget_multiplier` x top_k,
  at the K auto chose), greedy; with `sampled`, the plain and exact rows again with sampling
  (SAMPLED: temperature 1, top-p 0.95) at the smallest batch size. Batch-1 rows say how many
  tokens were accepted drafts and the share of them that is whitespace (`report.accepted_drafts`;
  a run of indentation is accepted at every depth). Where the model has MTP heads, rows on the
  configs `memory_bound` names (`memory_bound_rows`; () for none) at the heads' mean acceptance by
  depth measured here, labelled as such. Also writes `workdir/speedup.png`.
  """
  from moespec_jax.training import pretrain

  workdir = pathlib.Path(workdir)
  prompts = corpus.held_out_prompts(max(batch_sizes), prompt_bytes=192, seed=0)
  regimes = roofline.measured_regimes(
    model, prompts, batch_sizes, context=192 + max_new_tokens, max_new_tokens=max_new_tokens, log=log
  )
  bpb = pretrain.validation_bits_per_byte(model, max_batches=VALIDATION_BATCHES)
  drafters = (["mtp"] if model.config.num_mtp_modules else []) + ["ngram"]
  budget = budget_multiplier * model.config.top_k
  budgeted = bool(model.config.n_moe_layers) and budget < model.config.n_routed_experts
  # Sampled rows at the smallest batch size only: beside greedy where a newcomer reads the table
  # first, within the demo's time on a fresh machine.
  runs = [(msj.SamplingParams(), tuple(batch_sizes))] + ([(SAMPLED, (min(batch_sizes),))] if sampled else [])
  # A line per measured row (compilation and auto K's calibration included): minutes in all.
  memory_bound = tuple(memory_bound) if model.config.num_mtp_modules else ()
  progress = Progress(
    sum(len(batches) for _, batches in runs) * (1 + len(drafters))
    + budgeted * len(batch_sizes)
    + len(memory_bound) * len(MEMORY_BOUND_ROWS),
    desc="demo",
    unit="rows",
    every_s=None,
    every_steps=1,
    emit=log,
  )
  steps = itertools.count(1)

  def row_done(what: str, **figures: float):
    progress.update(next(steps), units=1, row=what, **figures)

  rows, samples = [], {}
  for sampling, run_batches in runs:
    label = sampling_label(sampling)
    for batch in run_batches:
      plain_spec = msj.SpecParams(drafter="none")
      plain_tps, plain_out = _timed_generate(model, prompts[:batch], max_new_tokens, sampling, plain_spec, repeats)
      row_done(f"{label} batch {batch} plain", tokens_per_s=plain_tps)
      if batch == min(batch_sizes):
        samples[label] = prompts[0] + model.tokenizer.decode([t for t in plain_out.tokens[0].tolist() if t >= 0])
      rows.append(_row("none", 0, batch, plain_out, plain_out, sampling=sampling, plain_tps=plain_tps))
      chosen = {}
      for drafter in drafters:
        # Batch 1 also traces its passes where programs can read a clock (CPU): which tokens were
        # accepted drafts (a clock read per pass).
        research = msj.ResearchOptions(pass_trace=batch == 1 and loop.clock_available())
        spec = msj.SpecParams(drafter=drafter, num_draft="auto", max_draft=max_draft, research=research)
        spec_bench.warm_up(model, [prompts[:batch]], max_new_tokens, sampling, spec)
        runs = spec_bench.paired(model, [prompts[:batch]], max_new_tokens, sampling, spec, repeats)
        out = msj.generate(model, prompts[:batch], max_new_tokens=max_new_tokens, sampling=sampling, spec=spec)
        chosen[drafter] = out.stats["chosen_num_draft"]
        row = _row(drafter, chosen[drafter], batch, out, plain_out, sampling=sampling, runs=runs)
        rows.append(dict(row, **_drafts_row(out, model.tokenizer)))
        row_done(f"{label} batch {batch} exact {drafter} auto K (chose {chosen[drafter]})", speedup=runs.speedup)
      if budgeted and sampling.greedy:
        # The APPROXIMATE row: MoE-Spec budget on the first drafter at the K auto chose, read by
        # the dedup kernel (the kernel whose bytes a budget lowers), with its agreement against
        # exact logits.
        drafter = drafters[0]
        k = max(1, chosen[drafter])
        spec = msj.SpecParams(drafter=drafter, num_draft=k, mode="budgeted", expert_budget=budget, kernel="dedup")
        spec_bench.warm_up(model, [prompts[:batch]], max_new_tokens, sampling, spec)
        runs = spec_bench.paired(model, [prompts[:batch]], max_new_tokens, sampling, spec, repeats)
        quality = dataclasses.replace(spec.research, measure_quality=True)
        with_quality = msj.generate(
          model,
          prompts[:batch],
          max_new_tokens=max_new_tokens,
          sampling=sampling,
          spec=dataclasses.replace(spec, research=quality),
        )
        top1 = with_quality.stats["top1_agreement"]
        rows.append(
          _row(
            drafter,
            k,
            batch,
            with_quality,
            plain_out,
            sampling=sampling,
            runs=runs,
            budget=budget,
            top1=top1,
          )
        )
        row_done(f"{label} batch {batch} budgeted {drafter} K={k}", speedup=runs.speedup, top1=top1)
  membound_rows, by_depth, acceptance = [], [], None
  if memory_bound:
    by_depth = heads_acceptance(model, prompts, max_new_tokens)
    acceptance = float(np.mean([a for a in by_depth if a == a]))
    log(
      f"memory-bound rows: the controlled drafter at a = {acceptance:.3f}, the default MTP heads' mean "
      f"acceptance by depth ({', '.join(f'{a:.3f}' for a in by_depth)}; greedy, K = 4, {len(prompts)} prompts)"
    )
    limits = {
      "max_new_tokens": min(max_new_tokens, MEMORY_BOUND_LIMITS["max_new_tokens"]),
      "repeats": min(repeats, MEMORY_BOUND_LIMITS["repeats"]),
    }
    membound_rows = memory_bound_rows(acceptance, memory_bound, **limits, log=log, row_done=row_done)
  params = model.param_counts()
  result = {
    "demo": {
      "rows": rows,
      "regime": regimes,
      "max_draft": max_draft,
      "validation_bits_per_byte": bpb,
      "params_total": params["total"],
      "params_active": params["active"],
      "max_new_tokens": max_new_tokens,
      "sample": samples["greedy"],
      "samples": samples,
      "memory_bound_rows": membound_rows,
      "memory_bound_acceptance": acceptance,
      "heads_acceptance_by_depth": by_depth,
    }
  }
  atomic.write_json_atomic(workdir / "metrics.json", result)
  plot_speedups(rows, workdir / "speedup.png")

  log(
    f"default model: {params['total'] / 1e6:.1f}M parameters, {params['active'] / 1e6:.1f}M active per token; "
    f"validation {bpb:.3f} bits/byte ({VALIDATION_BATCHES} batches spread over the validation split)"
  )
  for label, text in samples.items():
    log(f"\nsample ({label}, held-out prompt):\n" + "-" * 60 + f"\n{text}\n" + "-" * 60)
  header = (
    f"{'mode':<10}{'sampling':<16}{'drafter':<8}{'K':>7}{'budget':>7}{'kernel':>9}{'batch':>6}{'tokens/s':>10}"
    f"{'plain':>8}{'speedup':>9}{'90% interval':>15}{'acc.len':>8}{'top1':>7}{'ws.drafts':>13}"
  )
  for approximate in (False, True):
    part = [r for r in rows if r["approximate"] == approximate]
    if not part:
      continue
    log(
      "\nAPPROXIMATE (expert budget; top1 = agreement with exact target logits)"
      if approximate
      else "EXACT (the target's distribution; greedy tokens equal plain greedy)"
    )
    log(header)
    for r in part:
      budget = "-" if r["expert_budget"] is None else str(r["expert_budget"])
      k = f"auto:{r['num_draft']}" if r["auto_num_draft"] else str(r["num_draft"])
      share = r.get("accepted_draft_whitespace_share")
      drafts = "-" if share is None or share != share else f"{share:.0%} of {r['accepted_drafts']}"
      interval = spec_bench.format_interval(r["speedup_interval_90"])
      log(
        f"{r['mode']:<10}{r['sampling']:<16}{r['drafter']:<8}{k:>7}{budget:>7}{r['kernel']:>9}{r['batch_size']:>6}"
        f"{r['tokens_per_second']:>10.1f}{r['plain_tokens_per_second']:>8.1f}{r['speedup_vs_plain']:>9.2f}{interval:>15}"
        f"{r['mean_accepted_length']:>8.2f}{r['top1_agreement_vs_exact']:>7.3f}{drafts:>13}"
      )
  if membound_rows:
    log(
      f"\nMEMORY-BOUND CONFIGURATIONS (random weights, batch 1, greedy; acceptance CONTROLLED at a = {acceptance:.3f}, "
      "the default heads' measured mean by depth)"
    )
    log(f"{'config':<18}{'K':>7}{'drafts':>16}{'tokens/s':>10}{'speedup':>9}{'90% interval':>15}{'acc.len':>8}  regime")
    for r in membound_rows:
      drafts = "free" if r["draft_cost"] == "none" else "MTP heads' cost"
      interval = spec_bench.format_interval(r["speedup_interval_90"])
      log(
        f"{r['config']:<18}{r['num_draft']:>7}{drafts:>16}{r['tokens_per_second']:>10.1f}{r['speedup_vs_plain']:>9.2f}{interval:>15}"
        f"{r['mean_accepted_length']:>8.2f}  {r['regime']['verdict']}"
      )
    log(f"({membound_rows[0]['max_new_tokens']} new tokens a run; drafts free: as a lookup's, prompt lookup's)")
  log(
    "speedup: median over runs alternating plain and speculative decoding (plain: their plain side); "
    "90% interval: the pairs' bootstrap interval of that median."
  )
  log("ws.drafts (batch 1): the share of the accepted drafts that is whitespace, of how many accepted drafts.")
  log(f"K auto:N: num_draft='auto' (cost model, K = 0..{max_draft} each pass); N is the K it chose most often.")
  log(f"\nwrote {workdir / 'metrics.json'} and {workdir / 'speedup.png'}")
  return result


def row_label(r) -> str:
  """A row's name in the plot: drafter, K (auto:K where auto chose it) and the budget if any."""
  k = f"auto:{r['num_draft']}" if r["auto_num_draft"] else str(r["num_draft"])
  name = "plain" if r["drafter"] == "none" else f"{r['drafter']} K={k}"
  name += "" if r["sampling"] == "greedy" else f" {r['sampling']}"
  return name + (f" B={r['expert_budget']} (approx.)" if r["approximate"] else "")


def plot_speedups(rows, path) -> pathlib.Path:
  """Speedup over plain decoding per row, one group of bars per batch size; approximate rows hatched."""
  plt = plots.pyplot()
  batches = sorted({r["batch_size"] for r in rows})
  fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
  for ax, batch in zip(axes[0], batches):
    part = [r for r in rows if r["batch_size"] == batch]
    bars = ax.bar(range(len(part)), [r["speedup_vs_plain"] for r in part])
    for bar, r in zip(bars, part):
      if r["approximate"]:
        bar.set_hatch("//")
    ax.set_xticks(range(len(part)), [row_label(r) for r in part], rotation=30, ha="right", fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label="plain")
    plots.finish_axes(ax, "", "speedup over plain", f"batch {batch}", legend_fontsize=8)
  return plots.save(fig, path)
