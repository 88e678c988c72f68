"""Side by side with transformers: plain greedy and prompt-lookup decoding on imported checkpoints
(experiments/peer_bench: `run_peer_bench`; needs the dev extra, torch and transformers, imported
only when a family is measured).

For one random checkpoint per family (built offline with transformers, ~20-50M parameters;
`quick`: tiny ones) and for the default trained model exported as a Qwen2-MoE checkpoint
(`trained_qwen2_moe`: random weights never repeat their context, so on them prompt lookup finds
no draft to accept and both n-gram columns measure only its overhead), each loaded by
`moespec_jax.Model.load`:
- plain greedy tokens/s of moespec-jax vs transformers `generate` at batch 1 and 8;
- n-gram prompt lookup (`SpecParams(drafter="ngram", num_draft="auto")`, up to `num_draft`
  tokens; `auto_draft=False`: fixed K) vs transformers' `prompt_lookup_num_tokens` at batch 1
  (transformers' assisted generation is batch 1 only);
on code prompts (UTF-8 bytes of standard-library sources as token ids). Measurements run in
rounds: at batch 1 both implementations' plain and prompt-lookup decoding once each per round,
at batch 8 both plain decoders, in a balanced order (`timing.round_order`); tokens/s are medians
over rounds and the summary's ratios medians of within-round ratios (this machine's speed drifts
by tens of percent over minutes). The two n-gram speedups are also compared within each round
(ours over transformers'), each figure with a 90% bootstrap interval over the rounds
(`analysis/timing`): whether one side's speedup is larger than the other's or within the noise.
Compilation and a warm-up call are excluded; every timed call starts with the processor's caches
emptied (a call that followed one of its own kind found its weights cached, one that followed
the other implementation did not).

The memory-bound ceiling beside the plain rows (`analysis/roofline`): the bytes one decode step
reads (the weights, routed experts as our decoding routed them: both sides emit the same tokens;
and the KV cache, the positions a step attends to, on average) and the streaming read bandwidth,
measured before the first family and after each; `ceiling_ratio_b*` is the largest speed ratio
over transformers that any decoder reading those bytes at that bandwidth could reach, and
`read_gbps` what each side sustained (prefill included: a lower bound).

The decode phase apart: each round also times both sides' plain decoding of the first token alone
(prefill and one step); the rest of a plain run is its decode phase (`decode_ms_per_step`,
`decode_read_gbps`), compared within rounds (`decode_ratio_b*`, `first_token_ratio_b*`) and
against the same bound (`decode_ceiling_ratio_b*`). `decode_ratio_b8_over_b1_at_equal_read_rate`
is how much transformers' decode step grows from batch 1 to 8 over how much the bytes a step
reads grow: what a decoder reading at one rate at both sizes gets at batch 8 relative to its
batch-1 ratio. Below 1, a larger ratio at batch 8 than at batch 1 needs a faster read at batch 8,
while a batch-1 step whose weights fit in the last-level cache (`last_level_cache_bytes`) may read
part of them from there and a batch-8 step that does not fit reads them all from memory. The
n-gram speedups of the decode phase alone (`ngram_decode_speedup_*`: each side's plain and
prompt-lookup runs less the plain first token of the same round): our prefill is a larger share of
our whole run than of transformers', which dilutes our whole-run speedup more.

The prefill's floor: the operations of the products a prefill must compute
(`roofline.prefill_flops`) over the machine's matmul rate (`roofline.matmul_gflops`, sampled with
the bandwidth), `prefill_floor_ms_b*` and its share of our first token; and
`ngram_speedup_ours_at_prefill_floor`: our whole-run n-gram speedup had both runs' first token
cost only that floor and one decode step, within rounds, and over transformers' speedup. Where it
stays below transformers', no faster prefill on this machine closes the whole-run gap (to within
the matmul rate's drift: the floor is approximate). Writes
DIR/metrics.json, DIR/table.md and DIR/peer_bench.png, after each family (an interrupted run resumes with the families
it finished, where its settings are the same).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import pathlib
import statistics
from collections.abc import Callable, Sequence

import numpy as np

from moespec_jax.analysis import timing
from moespec_jax.io import atomic, plots
from moespec_jax.research import roofline

# How the rows were measured (a resumed run keeps only rows measured the same way): every
# measurement of one batch size in the same rounds, ratios taken within a round.
PROTOCOL = "interleaved-rounds-first-token"
# The label of the first-token-only plain runs (prefill and one step) in a round.
FIRST = "first_token"
# The default trained model (configs/tiny.py) exported as a Qwen2-MoE checkpoint, its BPE with it.
TRAINED = "trained_qwen2_moe"
# ~20-50M parameters per family (embeddings included).
BENCH_SIZE = dict(vocab=8192, hidden=256, layers=4, heads=8, experts=16, top_k=2, moe_hidden=320, max_len=1024)
QUICK_SIZE = dict(vocab=512, hidden=64, layers=2, heads=4, experts=8, top_k=2, moe_hidden=64, max_len=512)


def code_prompts(n: int, length: int) -> list[list[int]]:
  """`n` prompts of `length` token ids: UTF-8 bytes of standard-library code."""
  import argparse
  import json.encoder
  import textwrap  # pylint: disable=g-import-not-at-top,multiple-import

  text = "".join(inspect.getsource(m) for m in (json.encoder, textwrap, argparse))
  data = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
  starts = np.linspace(0, len(data) - length - 1, n).astype(int)
  return [data[s : s + length].tolist() for s in starts]


def bench_family(
  family: str,
  ckpt: pathlib.Path,
  size: dict,
  *,
  max_new: int,
  repeats: int,
  num_draft: int,
  prompt_len: int,
  auto_draft: bool = True,
) -> list[dict]:
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  import moespec_jax as msj  # pylint: disable=g-import-not-at-top
  from moespec_jax.research import tiny_families  # pylint: disable=g-import-not-at-top

  if not (ckpt / "config.json").is_file():
    tiny_families.build(family, ckpt, **size)
  ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
  model = msj.Model.load(ckpt)
  n_params = sum(p.numel() for p in ref.parameters())
  rows = []

  def hf_generate(prompts, max_new_tokens_override=None, **kw):
    ids = torch.tensor(prompts, dtype=torch.long)
    with torch.no_grad():
      out = ref.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens_override or max_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        **kw,
      )
    return out[:, ids.shape[1] :].numpy()

  # Batch 1: plain and prompt lookup of both implementations in the same rounds (the n-gram
  # speedups are ratios within a round); batch 8: plain decoding of both.
  for batch, drafters in ((1, ("none", "ngram")), (8, ("none",))):
    prompts = code_prompts(batch, prompt_len)
    fns = {}
    for drafter in drafters:
      if drafter == "ngram":
        spec = msj.SpecParams(drafter="ngram", num_draft="auto" if auto_draft else num_draft, max_draft=num_draft)
      else:
        spec = msj.SpecParams(drafter="none")
      hf_kw = {"prompt_lookup_num_tokens": num_draft} if drafter == "ngram" else {}
      fns[("moespec_jax", drafter)] = lambda spec=spec: msj.generate(model, prompts, max_new_tokens=max_new, spec=spec)
      fns[("transformers", drafter)] = lambda hf_kw=hf_kw: hf_generate(prompts, **hf_kw)
    # The first token alone (prefill and one step), in the same rounds: the rest of a plain run is
    # its decode phase, max_new - 1 steps.
    fns[("moespec_jax", FIRST)] = lambda: msj.generate(model, prompts, max_new_tokens=1)
    fns[("transformers", FIRST)] = lambda: hf_generate(prompts, max_new_tokens_override=1)
    for fn in fns.values():  # compile / warm up
      fn()
    seconds, last = timing.interleaved_seconds(fns, repeats, before=roofline.flush_caches)
    for drafter in drafters:
      ours_out, hf_out = last[("moespec_jax", drafter)], last[("transformers", drafter)]
      ours_tokens = ours_out.tokens
      ours_n = int(np.sum(ours_tokens >= 0))
      match = [
        bool(np.array_equal(ours_tokens[b][ours_tokens[b] >= 0], hf_out[b][: int(np.sum(ours_tokens[b] >= 0))]))
        for b in range(batch)
      ]
      common = dict(
        family=family,
        params=n_params,
        batch_size=batch,
        drafter=drafter,
        num_draft=num_draft if drafter == "ngram" else 0,
        max_new_tokens=max_new,
        prompt_len=prompt_len,
        auto_draft=bool(auto_draft and drafter == "ngram"),
      )
      if drafter == "none":  # the same tokens, so the same experts, on both sides
        weight_bytes = roofline.decode_weight_bytes(model.config, ours_out.stats["unique_experts_per_pass"])
        # Decode step j (1..max_new - 1) of a row reads prompt_len + j cached positions.
        cache_bytes = roofline.decode_cache_bytes(model.config, batch * (prompt_len + max_new / 2))
        common.update(
          weight_bytes_per_step=weight_bytes,
          cache_bytes_per_step=cache_bytes,
          prefill_flops=roofline.prefill_flops(model.config, prompt_len, batch),
        )
        bytes_per_step = weight_bytes + cache_bytes
      ours_t, hf_t = seconds[("moespec_jax", drafter)], seconds[("transformers", drafter)]
      for impl, n_tokens, times, extra in (
        (
          "moespec_jax",
          ours_n,
          ours_t,
          {
            "mean_accepted_length": ours_out.stats.get("mean_accepted_length"),
            "passes_by_num_draft": ours_out.stats.get("passes_by_num_draft"),
            "tokens_identical_to_transformers": all(match),
          },
        ),
        (
          "transformers",
          int(hf_out.size),
          hf_t,
          {"mean_accepted_length": None, "tokens_identical_to_transformers": True},
        ),
      ):
        row = {
          **common,
          "impl": impl,
          "tokens_per_second": n_tokens / statistics.median(times),
          "tokens": n_tokens,
          "seconds": times,
          **extra,
        }
        if drafter == "none":  # one step per generated token and row
          row["read_gbps"] = bytes_per_step * row["tokens_per_second"] / batch / 1e9
          row["first_token_seconds"] = seconds[(impl, FIRST)]
          step_ms = statistics.median(timing.decode_ms_per_step(times, row["first_token_seconds"], max_new))
          # A decode phase too short to time (quick runs) can come out at or below zero: no figure.
          row["decode_ms_per_step"] = step_ms if step_ms > 0 else None
          row["decode_read_gbps"] = bytes_per_step / (step_ms / 1e3) / 1e9 if step_ms > 0 else None
        rows.append(row)
  return rows


def _decode_ratios(ours: dict, theirs: dict) -> list[float]:
  """Per round, transformers' decode time per step over ours (rounds where both were timed above
  zero); [] where either side has no decode phase figure."""
  if not (ours.get("decode_ms_per_step") and theirs.get("decode_ms_per_step")):
    return []
  o, t = (
    timing.decode_ms_per_step(r["seconds"], r["first_token_seconds"], r["max_new_tokens"]) for r in (ours, theirs)
  )
  return [ti / oi for oi, ti in zip(o, t) if oi > 0 and ti > 0]


def _ngram_decode_speedups(plain: dict, ngram: dict) -> list[float | None]:
  """Per round, the plain run's decode phase over the n-gram run's, both less the plain run's first
  token timed alone in that round (prompt lookup's first token is the same prefill and step): what
  drafting buys where it acts, apart from the prefill both runs share. None for a round where a
  phase came out at or below zero; [] without first-token times."""
  if not plain.get("decode_ms_per_step"):
    return []
  first, max_new = plain["first_token_seconds"], plain["max_new_tokens"]
  plain_ms = timing.decode_ms_per_step(plain["seconds"], first, max_new)
  ngram_ms = timing.decode_ms_per_step(ngram["seconds"], first, max_new)
  return [p / n if p > 0 and n > 0 else None for p, n in zip(plain_ms, ngram_ms)]


def step_bytes(row: dict) -> float:
  """The bytes one decode step reads: weights and, where counted, the KV cache."""
  return row["weight_bytes_per_step"] + row.get("cache_bytes_per_step", 0.0)


def _ngram_speedups_at_prefill_floor(plain: dict, ngram: dict, floor_ms: float) -> list[float | None]:
  """Per round, our n-gram speedup over plain decoding had both runs' first token cost only the
  prefill's floor and one plain decode step (`roofline.prefill_flops` at the matmul rate; the
  host's work and every other operation of the first token free): the whole-run speedup that a
  prefill as fast as the machine allows would leave. None for a round whose decode phase came out
  at or below zero; [] without first-token times."""
  if not plain.get("decode_ms_per_step"):
    return []
  first, max_new = plain["first_token_seconds"], plain["max_new_tokens"]
  out = []
  for tp, tn, t1, step_ms in zip(
    plain["seconds"], ngram["seconds"], first, timing.decode_ms_per_step(plain["seconds"], first, max_new)
  ):
    at_floor = (floor_ms + step_ms) / 1e3
    tp_floor, tn_floor = tp - t1 + at_floor, tn - t1 + at_floor
    out.append((ngram["tokens"] / tn_floor) / (plain["tokens"] / tp_floor) if step_ms > 0 and tn_floor > 0 else None)
  return out


def summarize(rows: list[dict], stream_gbps: float | None = None, matmul_gflops: float | None = None) -> list[dict]:
  """Per family: speed ratios (ours / transformers) and each side's n-gram speedup over its own
  plain decoding, each the median over rounds of the ratio of tokens/s within a round; with
  `stream_gbps`, the memory-bound ceiling on the plain ratios (`roofline`) and the share of
  the streaming bandwidth our plain decoding sustained; with `matmul_gflops`, the compute floor of
  each prefill, its share of our first token, and our n-gram speedup had our first token cost
  only that floor and one step, against transformers' (`ngram_speedup_ours_at_prefill_floor*`):
  below 1, no faster prefill closes the whole-run gap (to within the rate's drift), only a faster
  decode phase can."""
  out = []
  for family in dict.fromkeys(r["family"] for r in rows):
    by = {(r["impl"], r["batch_size"], r["drafter"]): r for r in rows if r["family"] == family}

    def per_round(num, den):
      a, b = by[num], by[den]
      return [(a["tokens"] / ta) / (b["tokens"] / tb) for ta, tb in zip(a["seconds"], b["seconds"])]

    ngram_ours = per_round(("moespec_jax", 1, "ngram"), ("moespec_jax", 1, "none"))
    ngram_theirs = per_round(("transformers", 1, "ngram"), ("transformers", 1, "none"))
    # All four batch-1 runs share each round: the two speedups' ratio is taken within a round too.
    relative = [o / t for o, t in zip(ngram_ours, ngram_theirs)]
    s = dict(
      family=family,
      plain_ratio_b1=statistics.median(per_round(("moespec_jax", 1, "none"), ("transformers", 1, "none"))),
      plain_ratio_b8=statistics.median(per_round(("moespec_jax", 8, "none"), ("transformers", 8, "none"))),
      ngram_speedup_ours=statistics.median(ngram_ours),
      ngram_speedup_transformers=statistics.median(ngram_theirs),
      ngram_speedup_ours_over_transformers=statistics.median(relative),
      # 90% bootstrap intervals (rounds resampled): what timing noise leaves of each figure.
      ngram_speedup_ours_interval=timing.median_interval(ngram_ours),
      ngram_speedup_transformers_interval=timing.median_interval(ngram_theirs),
      ngram_speedup_ours_over_transformers_interval=timing.median_interval(relative),
      tokens_identical=all(r["tokens_identical_to_transformers"] for r in by.values()),
    )
    # The same, decode phase only: our prefill is a larger share of our whole run than of
    # transformers' (first-token ratios ~2-3 against decode ratios ~5-12), which dilutes our
    # whole-run n-gram speedup more.
    # Rounds where both sides' decode phases were timed, paired.
    paired = [
      (o, t)
      for o, t in zip(
        _ngram_decode_speedups(by[("moespec_jax", 1, "none")], by[("moespec_jax", 1, "ngram")]),
        _ngram_decode_speedups(by[("transformers", 1, "none")], by[("transformers", 1, "ngram")]),
      )
      if o is not None and t is not None
    ]
    if paired:
      decode_relative = [o / t for o, t in paired]
      s.update(
        ngram_decode_speedup_ours=statistics.median(o for o, _ in paired),
        ngram_decode_speedup_transformers=statistics.median(t for _, t in paired),
        ngram_decode_speedup_ours_over_transformers=statistics.median(decode_relative),
        ngram_decode_speedup_ours_over_transformers_interval=timing.median_interval(decode_relative),
      )
    for batch in (1, 8):
      ours, theirs = by[("moespec_jax", batch, "none")], by[("transformers", batch, "none")]
      if stream_gbps and "weight_bytes_per_step" in ours:
        bound = roofline.bound_tokens_per_second(step_bytes(ours), stream_gbps, batch)
        s[f"ceiling_ratio_b{batch}"] = bound / theirs["tokens_per_second"]
        s[f"stream_fraction_b{batch}"] = ours["read_gbps"] / stream_gbps
      decode = _decode_ratios(ours, theirs)
      if decode:
        s[f"decode_ratio_b{batch}"] = statistics.median(decode)
        s[f"decode_ratio_b{batch}_interval"] = timing.median_interval(decode)
        s[f"first_token_ratio_b{batch}"] = statistics.median(
          [t / o for o, t in zip(ours["first_token_seconds"], theirs["first_token_seconds"])]
        )
        if stream_gbps and "weight_bytes_per_step" in ours:
          bound_ms = step_bytes(ours) / (stream_gbps * 1e9) * 1e3
          s[f"decode_ceiling_ratio_b{batch}"] = theirs["decode_ms_per_step"] / bound_ms
          s[f"decode_stream_fraction_b{batch}"] = ours["decode_read_gbps"] / stream_gbps
    if matmul_gflops and all("prefill_flops" in by[("moespec_jax", b, "none")] for b in (1, 8)):
      for batch in (1, 8):
        ours = by[("moespec_jax", batch, "none")]
        floor_ms = ours["prefill_flops"] / (matmul_gflops * 1e9) * 1e3
        s[f"prefill_floor_ms_b{batch}"] = floor_ms
        if ours.get("first_token_seconds"):
          s[f"prefill_floor_share_b{batch}"] = floor_ms / (statistics.median(ours["first_token_seconds"]) * 1e3)
      paired = [
        (o, t)
        for o, t in zip(
          _ngram_speedups_at_prefill_floor(
            by[("moespec_jax", 1, "none")], by[("moespec_jax", 1, "ngram")], s["prefill_floor_ms_b1"]
          ),
          ngram_theirs,
        )
        if o is not None
      ]
      if paired:
        relative = [o / t for o, t in paired]
        s.update(
          ngram_speedup_ours_at_prefill_floor=statistics.median(o for o, _ in paired),
          ngram_speedup_ours_at_prefill_floor_over_transformers=statistics.median(relative),
          ngram_speedup_ours_at_prefill_floor_over_transformers_interval=timing.median_interval(relative),
        )
    plain = {b: (by[("moespec_jax", b, "none")], by[("transformers", b, "none")]) for b in (1, 8)}
    if all(r.get("decode_ms_per_step") and "weight_bytes_per_step" in r for pair in plain.values() for r in pair):
      # How much transformers' decode step grows from batch 1 to 8, over how much the bytes a step
      # reads grow: a decoder that reads at one rate at both sizes (its step time in proportion
      # to the bytes) sees its batch-8 decode ratio over transformers this factor times its
      # batch-1 one. Below 1, a larger ratio at batch 8 needs a faster read at batch 8.
      step_growth = plain[8][1]["decode_ms_per_step"] / plain[1][1]["decode_ms_per_step"]
      bytes_growth = step_bytes(plain[8][0]) / step_bytes(plain[1][0])
      s["decode_ratio_b8_over_b1_at_equal_read_rate"] = step_growth / bytes_growth
    out.append(s)
  return out


def table(rows: list[dict], summary: list[dict]) -> str:
  lines = [
    "| family | params | batch | drafter | moespec-jax tok/s | transformers tok/s | ratio | identical tokens |",
    "|---|---|---|---|---|---|---|---|",
  ]
  by = {(r["family"], r["batch_size"], r["drafter"], r["impl"]): r for r in rows}
  for (family, batch, drafter, impl), r in by.items():
    if impl != "moespec_jax":
      continue
    h = by[(family, batch, drafter, "transformers")]
    lines.append(
      f"| {family} | {r['params'] / 1e6:.1f}M | {batch} | {drafter} | "
      f"{r['tokens_per_second']:.1f} | {h['tokens_per_second']:.1f} | "
      f"{r['tokens_per_second'] / h['tokens_per_second']:.2f}x | "
      f"{r['tokens_identical_to_transformers']} |"
    )
  lines += [
    "",
    "| family | plain b1 ratio | plain b8 ratio | n-gram speedup (ours) | "
    "prompt-lookup speedup (transformers) | ours / transformers [90% interval] | identical | "
    "b1 / b8 ceiling ratio | b1 / b8 share of stream bandwidth (ours) |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  pair = lambda s, key, fmt: (
    " / ".join(format(s[f"{key}_b{b}"], fmt) for b in (1, 8))  # noqa: E731
    if f"{key}_b8" in s
    else "-"
  )
  for s in summary:
    lo, hi = s["ngram_speedup_ours_over_transformers_interval"]
    lines.append(
      f"| {s['family']} | {s['plain_ratio_b1']:.2f}x | {s['plain_ratio_b8']:.2f}x | "
      f"{s['ngram_speedup_ours']:.2f}x | {s['ngram_speedup_transformers']:.2f}x | "
      f"{s['ngram_speedup_ours_over_transformers']:.2f} [{lo:.2f}, {hi:.2f}] | "
      f"{s['tokens_identical']} | {pair(s, 'ceiling_ratio', '.2f')} | {pair(s, 'stream_fraction', '.0%')} |"
    )
  has_decode = lambda s: "decode_ratio_b1" in s and "decode_ratio_b8" in s  # noqa: E731
  if any(has_decode(s) for s in summary):
    lines += [
      "",
      "Decode phase (a plain run less its first token, timed alone in the same rounds):",
      "",
      "| family | decode ratio b1 [90% interval] | decode ratio b8 [90% interval] | "
      "first-token ratio b1 / b8 | "
      "decode ceiling ratio b1 / b8 | our decode read GB/s b1 / b8 (share of stream) | "
      "b8 / b1 ratio at an equal read rate | n-gram decode speedup ours / transformers "
      "(ours over transformers [90% interval]) |",
      "|---|---|---|---|---|---|---|---|",
    ]
    plain_rows = {(r["family"], r["batch_size"], r["impl"]): r for r in rows if r["drafter"] == "none"}
    ngram_decode = lambda s: (
      "{:.2f}x / {:.2f}x ({:.2f} [{:.2f}, {:.2f}])".format(  # noqa: E731
        s["ngram_decode_speedup_ours"],
        s["ngram_decode_speedup_transformers"],
        s["ngram_decode_speedup_ours_over_transformers"],
        *s["ngram_decode_speedup_ours_over_transformers_interval"],
      )
      if "ngram_decode_speedup_ours" in s
      else "-"
    )
    for s in summary:
      if not has_decode(s):
        continue
      ratio = lambda b, s=s: "{:.2f}x [{:.2f}, {:.2f}]".format(  # noqa: E731
        s[f"decode_ratio_b{b}"], *s[f"decode_ratio_b{b}_interval"]
      )
      gbps = " / ".join(f"{plain_rows[(s['family'], b, 'moespec_jax')]['decode_read_gbps']:.1f}" for b in (1, 8))
      lines.append(
        f"| {s['family']} | {ratio(1)} | {ratio(8)} | {pair(s, 'first_token_ratio', '.2f')} | "
        f"{pair(s, 'decode_ceiling_ratio', '.2f')} | {gbps} ({pair(s, 'decode_stream_fraction', '.0%')}) | "
        f"{s.get('decode_ratio_b8_over_b1_at_equal_read_rate', float('nan')):.2f} | {ngram_decode(s)} |"
      )
  if any("prefill_floor_ms_b1" in s for s in summary):
    lines += [
      "",
      "Prefill at the machine's matmul rate (its products' operations over the rate: an approximate floor on "
      "its time; the n-gram speedup had our first token cost only that floor and one decode step):",
      "",
      "| family | prefill GFLOP b1 / b8 | floor ms b1 / b8 | floor's share of our first token b1 / b8 | "
      "n-gram speedup ours at the floor | over transformers' [90% interval] |",
      "|---|---|---|---|---|---|",
    ]
    flops = {
      (r["family"], r["batch_size"]): r["prefill_flops"]
      for r in rows
      if r["impl"] == "moespec_jax" and r["drafter"] == "none" and "prefill_flops" in r
    }
    for s in summary:
      if "prefill_floor_ms_b1" not in s:
        continue
      gflop = " / ".join(f"{flops[(s['family'], b)] / 1e9:.2f}" for b in (1, 8))
      share = pair(s, "prefill_floor_share", ".0%") if "prefill_floor_share_b1" in s else "-"
      at_floor = (
        "{:.2f}x | {:.2f} [{:.2f}, {:.2f}]".format(
          s["ngram_speedup_ours_at_prefill_floor"],
          s["ngram_speedup_ours_at_prefill_floor_over_transformers"],
          *s["ngram_speedup_ours_at_prefill_floor_over_transformers_interval"],
        )
        if "ngram_speedup_ours_at_prefill_floor" in s
        else "- | -"
      )
      lines.append(f"| {s['family']} | {gflop} | {pair(s, 'prefill_floor_ms', '.2f')} | {share} | {at_floor} |")
  return "\n".join(lines) + "\n"


def finished_rows(path: pathlib.Path, cfg: PeerBenchConfig) -> list[dict]:
  """Rows of an earlier, interrupted run with the same settings (resume), else []."""
  if not path.exists():
    return []
  old = json.loads(path.read_text())
  same = (
    old.get("protocol") == PROTOCOL
    and old.get("quick") == cfg.quick
    and old.get("size") == cfg.size
    and old.get("repeats") == cfg.repeats
    and all(
      r["max_new_tokens"] == cfg.max_new_tokens
      and r["prompt_len"] == cfg.prompt_len
      and r["num_draft"] in (0, cfg.num_draft)
      and r.get("auto_draft", False) == (cfg.auto_draft and r["drafter"] == "ngram")
      and (r["drafter"] != "none" or "prefill_flops" in r)
      for r in old.get("rows", [])
    )
  )
  return list(old.get("rows", [])) if same else []


def earlier_samples(path: pathlib.Path, key: str = "stream_read_gbps_samples") -> list[float]:
  """The machine samples (`key`: streaming bandwidth, or matmul rate `matmul_gflops_samples`) an
  interrupted run took beside its finished families (a resumed run adds its own to them: the
  ceilings and floors of all families rest on every sample)."""
  if not path.exists():
    return []
  return [float(x) for x in json.loads(path.read_text()).get(key, [])]


# Rounds per family. The n-gram comparison's ratios sit near 1 on the random-weight families
# (prompt lookup rarely pays there), where a few rounds left them to timing noise
# (docs/findings/2026-12-05-peer-bench.md). 12 is a whole number of timing.round_order's balanced
# cycles for both batch sizes' calls (6 at batch 1, 4 at batch 8): every call follows every other
# equally often.
DEFAULT_REPEATS = 12
# What --quick runs on its tiny checkpoints, where a setting is not given: a smoke run, timed as a
# full run is (warm-up excluded, a few rounds).
QUICK_DEFAULTS = {"max_new_tokens": 16, "repeats": 3, "prompt_len": 64}
FULL_DEFAULTS = {"max_new_tokens": 64, "repeats": DEFAULT_REPEATS, "prompt_len": 192}


@dataclasses.dataclass(frozen=True)
class PeerBenchConfig:
  """What one run measures: `families` (of `moespec_jax.hf`, and/or TRAINED), `max_new_tokens` per
  prompt, `repeats` rounds, prompt lookup up to `num_draft` tokens (ours with num_draft='auto' when
  `auto_draft`, else fixed), `prompt_len` tokens per prompt; `quick`: tiny checkpoints."""

  families: tuple[str, ...]
  quick: bool = False
  max_new_tokens: int = 64
  repeats: int = DEFAULT_REPEATS
  num_draft: int = 4
  prompt_len: int = 192
  auto_draft: bool = True

  @property
  def size(self) -> dict:
    return QUICK_SIZE if self.quick else BENCH_SIZE


def make_config(
  families: Sequence[str] = (),
  *,
  trained: bool = True,
  quick: bool = False,
  max_new_tokens: int | None = None,
  repeats: int | None = None,
  num_draft: int = 4,
  prompt_len: int | None = None,
  auto_draft: bool = True,
) -> PeerBenchConfig:
  """The run the command line asks for: every family (and the trained model unless `trained` is
  False or `quick`) where `families` is empty; tokens, rounds and prompt length as given, else
  `QUICK_DEFAULTS` with `quick` (tiny checkpoints) and `FULL_DEFAULTS` without.
  ValueError (naming the flag) for an unknown family, the trained model with `quick`, or prompts
  and outputs beyond the checkpoints' positions."""
  from moespec_jax.hf.config import FAMILIES  # pylint: disable=g-import-not-at-top

  chosen = list(families) or list(FAMILIES) + ([TRAINED] if trained and not quick else [])
  unknown = sorted(set(chosen) - set(FAMILIES) - {TRAINED})
  if unknown:
    raise ValueError(f"--families: unknown {unknown}; choose from {list(FAMILIES) + [TRAINED]}")
  if TRAINED in chosen and quick:
    raise ValueError(f"--families: {TRAINED} does not run with --quick (it needs the default trained model)")
  given = {"max_new_tokens": max_new_tokens, "repeats": repeats, "prompt_len": prompt_len}
  defaults = QUICK_DEFAULTS if quick else FULL_DEFAULTS
  cfg = PeerBenchConfig(
    families=tuple(chosen),
    quick=quick,
    num_draft=num_draft,
    auto_draft=auto_draft,
    **{name: defaults[name] if value is None else value for name, value in given.items()},
  )
  positions = cfg.size["max_len"]
  if TRAINED in chosen:
    from moespec_jax.default_model import default_config  # pylint: disable=g-import-not-at-top

    positions = min(positions, default_config().model.max_seq_len)
  lookahead = 0 if auto_draft else num_draft  # a fixed K's drafts need room in the cache
  if cfg.prompt_len + cfg.max_new_tokens + lookahead > positions:
    raise ValueError(
      f"--prompt_len ({cfg.prompt_len}) + --max_new_tokens ({cfg.max_new_tokens})"
      + (f" + --num_draft ({lookahead})" if lookahead else "")
      + f" exceeds the {positions} positions of the checkpoints"
    )
  return cfg


def run_peer_bench(workdir: atomic.PathLike, cfg: PeerBenchConfig, log: Callable[[str], None] = print) -> dict:
  """Measures every family of `cfg` not already in `workdir/metrics.json` from an interrupted run
  with the same settings; writes metrics.json, table.md and peer_bench.png after each family; returns the metrics
  (a finished run's as written, where nothing is left to measure)."""
  try:
    import torch  # noqa: F401 - only to fail early without the dev extra
    import transformers  # noqa: F401
  except ImportError as e:
    raise ValueError(f"peer_bench needs the dev extra (torch, transformers): {e}") from None
  workdir = pathlib.Path(workdir)
  rows = finished_rows(workdir / "metrics.json", cfg)
  done = {r["family"] for r in rows}
  todo = [f for f in cfg.families if f not in done]
  if not todo:  # a finished run: its figures as written, not rewritten with a new bandwidth sample
    metrics = json.loads((workdir / "metrics.json").read_text())
    log(f"every family already measured in {workdir / 'metrics.json'}")
    log(table(metrics["rows"], metrics["summary"]))
    return metrics
  streams = (earlier_samples(workdir / "metrics.json") if rows else []) + [roofline.stream_read_gbps()]
  rates = (earlier_samples(workdir / "metrics.json", "matmul_gflops_samples") if rows else []) + [
    roofline.matmul_gflops()
  ]
  log(f"stream read bandwidth: {streams[-1]:.1f} GB/s; matmul rate: {rates[-1]:.0f} GFLOP/s")
  if done:
    log(
      f"resuming: {sorted(done)} already measured in {workdir / 'metrics.json'} "
      f"(with {len(streams) - 1} bandwidth samples)"
    )
  for family in todo:
    ckpt = workdir / "checkpoints" / (f"{family}-quick" if cfg.quick else family)
    if family == TRAINED:  # exported afresh (seconds): a retrained default model never meets a stale copy
      from moespec_jax.default_model import ensure_default_model  # pylint: disable=g-import-not-at-top
      from moespec_jax.hf import export  # pylint: disable=g-import-not-at-top

      export.export_qwen2_moe(ensure_default_model(train_heads=False), ckpt)
    rows += bench_family(
      family,
      ckpt,
      cfg.size,
      max_new=cfg.max_new_tokens,
      repeats=cfg.repeats,
      num_draft=cfg.num_draft,
      prompt_len=cfg.prompt_len,
      auto_draft=cfg.auto_draft,
    )
    streams.append(roofline.stream_read_gbps())
    rates.append(roofline.matmul_gflops())
    metrics = _write(workdir, cfg, rows, streams, rates)
    log(f"{family}: done")
  log(table(metrics["rows"], metrics["summary"]))
  return metrics


def _write(
  workdir: pathlib.Path, cfg: PeerBenchConfig, rows: list[dict], streams: list[float], rates: list[float]
) -> dict:
  """metrics.json, table.md and peer_bench.png for the rows so far (a long run leaves its finished part)."""
  summary = summarize(rows, statistics.median(streams), statistics.median(rates))
  metrics = {
    "experiment": "peer_bench",
    "protocol": PROTOCOL,
    "quick": cfg.quick,
    "size": cfg.size,
    "repeats": cfg.repeats,
    "stream_read_gbps": statistics.median(streams),
    "stream_read_gbps_samples": streams,
    "matmul_gflops": statistics.median(rates),
    "matmul_gflops_samples": rates,
    "last_level_cache_bytes": roofline.last_level_cache_bytes(),
    "families_done": sorted({r["family"] for r in rows}),
    "rows": rows,
    "summary": summary,
  }
  atomic.write_json_atomic(workdir / "metrics.json", metrics)
  atomic.write_text_atomic(workdir / "table.md", table(rows, summary))
  plot(summary, workdir / "peer_bench.png")
  return metrics


def plot(summary: list[dict], path) -> pathlib.Path:
  """Per family: our plain decoding's speed over transformers' (batch 1 and 8), and each side's
  n-gram speedup over its own plain decoding (batch 1, 90% intervals)."""
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(summary)), 4))
  bars = (
    ("plain_ratio_b1", "plain, ours / transformers, batch 1"),
    ("plain_ratio_b8", "plain, ours / transformers, batch 8"),
    ("ngram_speedup_ours", "n-gram over plain, ours"),
    ("ngram_speedup_transformers", "n-gram over plain, transformers"),
  )
  width = 0.8 / len(bars)
  for i, (key, label) in enumerate(bars):
    ys = [s[key] for s in summary]
    spans = [s.get(f"{key}_interval") or (y, y) for s, y in zip(summary, ys)]
    ax.bar(
      [j + i * width for j in range(len(summary))],
      ys,
      width,
      label=label,
      capsize=3,
      yerr=[[y - lo for y, (lo, _) in zip(ys, spans)], [hi - y for y, (_, hi) in zip(ys, spans)]],
    )
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(summary))], [s["family"] for s in summary])
  ax.axhline(1.0, color="k", lw=0.8, ls="--")
  plots.finish_axes(ax, "checkpoint", "ratio (medians over rounds)", "moespec-jax and transformers", legend_fontsize=7)
  return plots.save(fig, path)
