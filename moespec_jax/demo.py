"""What `make demo` runs: the default model, plain decoding on held-out code, a table and metrics."""

from __future__ import annotations

import pathlib
import statistics
from typing import Any

import moespec_jax as msj
from moespec_jax.data import corpus
from moespec_jax.io import atomic


def _timed_generate(model, prompts, max_new_tokens, spec, repeats: int):
  """Median tokens/s over `repeats` runs (compilation excluded); returns (median, last output)."""
  rates, out = [], None
  for r in range(repeats):
    out = msj.generate(model, prompts, max_new_tokens=max_new_tokens, spec=spec, seed=r)
    rates.append(out.stats["tokens_per_second"])
  return statistics.median(rates), out


def run_demo(model, workdir, *, max_new_tokens: int = 128, batch_sizes=(1, 8), repeats: int = 3,
             log=print) -> dict[str, Any]:
  """Generates from held-out prompts and writes `workdir/metrics.json` (key `demo`)."""
  from moespec_jax.training import pretrain
  workdir = pathlib.Path(workdir)
  prompts = corpus.held_out_prompts(max(batch_sizes), prompt_bytes=192, seed=0)
  bpb = pretrain.validation_bits_per_byte(model)
  rows = []
  sample_text = ""
  for batch in batch_sizes:
    spec = msj.SpecParams(drafter="none")
    tps, out = _timed_generate(model, prompts[:batch], max_new_tokens, spec, repeats)
    rows.append({
        "mode": "exact", "drafter": "none", "num_draft": 0, "expert_budget": None,
        "batch_size": batch, "tokens_per_second": tps, "speedup_vs_plain": 1.0,
        "mean_accepted_length": out.stats["mean_accepted_length"], "top1_agreement_vs_exact": 1.0,
        "approximate": False,
    })
    if batch == 1:
      sample_text = prompts[0] + model.tokenizer.decode(out.tokens[0].tolist())
  params = model.param_counts()
  result = {"demo": {"rows": rows, "validation_bits_per_byte": bpb, "params_total": params["total"],
                     "params_active": params["active"], "max_new_tokens": max_new_tokens,
                     "sample": sample_text}}
  atomic.write_json_atomic(workdir / "metrics.json", result)

  log(f"default model: {params['total'] / 1e6:.1f}M parameters, {params['active'] / 1e6:.1f}M active per token; "
      f"validation {bpb:.3f} bits/byte")
  log("\nsample (greedy, held-out prompt):\n" + "-" * 60 + f"\n{sample_text}\n" + "-" * 60)
  header = f"{'mode':<8}{'drafter':<9}{'K':>3}{'budget':>8}{'batch':>7}{'tokens/s':>11}{'speedup':>9}{'acc.len':>9}{'top1':>7}"
  log(header)
  for r in rows:
    budget = "-" if r["expert_budget"] is None else str(r["expert_budget"])
    log(f"{r['mode']:<8}{r['drafter']:<9}{r['num_draft']:>3}{budget:>8}{r['batch_size']:>7}"
        f"{r['tokens_per_second']:>11.1f}{r['speedup_vs_plain']:>9.2f}{r['mean_accepted_length']:>9.2f}"
        f"{r['top1_agreement_vs_exact']:>7.3f}")
  log(f"\nmetrics written to {workdir / 'metrics.json'}")
  return result
