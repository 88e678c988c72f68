"""Draft trees by policy (experiments/tree_bench.py): chains, probability trees, expert-aware trees,
each with and without EVICT-style truncation, and how well the experts they weigh are predicted.

Two parts. `predictor_recall`: per MoE layer, the share of the target's chosen experts that each
light predictor names for a token before the target routes it, on held-out text, with its cost.
`run_tree_bench`: per batch size and temperature, plain decoding beside each tree and chain row
(paired runs, `spec_bench.paired`), and per row the metrics of seed 004's list: tokens a pass,
verified nodes, distinct experts a pass (read and predicted), committed tokens per expert read and
per verified node, P50/P95/P99 milliseconds per output token and batch 1's per-request utility over
the passes of one traced run of each prompt group, and a projection where a pass is bound by the
weight bytes it reads (the bytes model's ratio against a plain pass: a bandwidth cancels out of it).
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

import moespec_jax as msj
from moespec_jax.analysis import regime
from moespec_jax.data import batches
from moespec_jax.decoding import programs
from moespec_jax.io import atomic, plots
from moespec_jax.io.progress import Progress
from moespec_jax.model import expert_table as expert_table_lib
from moespec_jax.model import mtp as mtp_lib
from moespec_jax.research import spec_bench

# The tree rows' policies (a row's "policy"; chains are "chain"), in the order the summary gives them.
POLICIES = ("probability", "expert_aware", "probability+truncate", "expert_aware+truncate")


def predictor_recall(model: msj.Model, *, windows: int = 16, length: int = 256, seed: int = 0) -> dict[str, Any]:
  """Each predictor's recall of the target's chosen experts per MoE layer on `windows` validation
  windows (the table counted on the train split, `Model.expert_table`), and its cost a node:

  - parent: the experts the target chose for the token before (the temporal overlap);
  - table: the token's most frequent experts (`model.expert_table`), the expert-aware trees' choice;
  - router_embedding: each layer's router on the token's normed embedding;
  - router_mtp_hidden: each layer's router on the MTP module's hidden state at the token (what the
    module computes for a node it expands: the tree's last level and unexpanded nodes have none);
  and the uniform chance K / E."""
  config = model.config
  if not config.n_moe_layers:
    raise ValueError("predictor_recall needs a model with MoE layers")
  val = batches.corpus_tokens(model.tokenizer, "validation")
  length = min(length, config.max_seq_len, val.size - 1)
  starts = np.random.default_rng(seed).integers(0, val.size - length, windows)
  tokens_BT = np.stack([val[s : s + length] for s in starts]).astype(np.int32)
  out = model.forward_full(tokens_BT)
  actual_LBTK = np.asarray(out.routing.expert_ids)
  module = model.module()
  k, n_layers = config.top_k, config.n_moe_layers

  def flat(ids_LBTK: np.ndarray) -> np.ndarray:
    return ids_LBTK.reshape(n_layers, -1, k)

  target_LNK = flat(actual_LBTK[:, :, 2:])
  table = model.expert_table()
  embed_BTD = module.embed_VD[...][jnp.asarray(tokens_BT)]
  router_flops = 2 * n_layers * config.d_model * config.n_routed_experts
  result: dict[str, Any] = {
    "windows": windows,
    "length": length,
    "uniform_chance": k / config.n_routed_experts,
    "predictors": {
      "parent": {"recall_by_layer": expert_table_lib.recall(flat(actual_LBTK[:, :, 1:-1]), target_LNK), "cost": "none"},
      "table": {
        "recall_by_layer": expert_table_lib.recall(
          flat(np.asarray(table.predict(tokens_BT[:, 2:]), np.int32).transpose(2, 0, 1, 3)), target_LNK
        ),
        "cost": f"a gather of {n_layers} x {k} ids; a [L, V, K] table of {table.ids_LVK.size * 4 / 1e6:.2f} MB",
      },
      "router_embedding": {
        "recall_by_layer": expert_table_lib.recall(
          flat(
            np.asarray(
              expert_table_lib.router_prediction(module, embed_BTD[:, 2:].reshape(-1, config.d_model))
            ).reshape(n_layers, windows, length - 2, k)
          ),
          target_LNK,
        ),
        "cost": f"{n_layers} norms and routers: {router_flops / 1e6:.3f} MFLOP",
      },
    },
  }
  if config.num_mtp_modules:
    batch, t = tokens_BT.shape
    positions = jnp.broadcast_to(jnp.arange(t - 1, dtype=jnp.int32), (batch, t - 1))
    h_BTD, _, _ = mtp_lib.run_module(module, 0, out.hidden[:, : t - 1], jnp.asarray(tokens_BT[:, 1:]), positions, None)
    # h_BTD[:, i]: the module's state at token i + 1, which the target routes at position i + 1.
    pred = expert_table_lib.router_prediction(module, h_BTD[:, 1:].reshape(-1, config.d_model))
    result["predictors"]["router_mtp_hidden"] = {
      "recall_by_layer": expert_table_lib.recall(flat(np.asarray(pred).reshape(n_layers, batch, t - 2, k)), target_LNK),
      "cost": "the routers on an expanded node's MTP state (an MTP module step the tree runs anyway); leaves have none",
    }
  for entry in result["predictors"].values():
    entry["recall_by_layer"] = [float(r) for r in entry["recall_by_layer"]]
    entry["recall"] = float(np.mean(entry["recall_by_layer"]))
  return result


def row_specs(
  tree_nodes: Sequence[int], depth: int, chain_ks: Sequence[int], penalties: Sequence[float], greedy: bool
) -> list[tuple[dict[str, Any], msj.SpecParams]]:
  """(the row's label fields, its SpecParams): chains of each K, then per N the probability tree,
  (greedy) the expert-aware tree at each penalty, and both truncated (expert-aware: the first
  penalty). Sampled decoding runs the chains and probability trees only (expert-aware choice and
  truncation are greedy only)."""
  specs = [
    ({"policy": "chain", "num_draft": k, "tree_nodes": 0}, msj.SpecParams(drafter="mtp", num_draft=k)) for k in chain_ks
  ]
  for n in tree_nodes:
    d = min(depth, n)

    def tree(
      policy: str, penalty: float | None = None, truncate: bool = False
    ) -> tuple[dict[str, Any], msj.SpecParams]:
      label = {"policy": policy + ("+truncate" if truncate else ""), "num_draft": d, "tree_nodes": n}
      if penalty is not None:
        label["expert_penalty"] = penalty
      spec = msj.SpecParams(
        drafter="mtp",
        num_draft=d,
        tree_nodes=n,
        tree_policy=policy,
        expert_penalty=0.5 if penalty is None else penalty,
        tree_truncate=truncate,
      )
      return label, spec

    specs.append(tree("probability"))
    if greedy:
      specs.extend(tree("expert_aware", p) for p in penalties)
      specs.append(tree("probability", truncate=True))
      if penalties:
        specs.append(tree("expert_aware", penalties[0], truncate=True))
  return specs


def traced_passes(model: msj.Model, groups: Sequence[list], max_new_tokens: int, sampling, spec) -> dict[str, list]:
  """Every pass of one run over each group of prompts, timed inside the program (`pass_trace`),
  the groups' traces concatenated."""
  traced = dataclasses.replace(spec, research=msj.ResearchOptions(pass_trace=True))
  merged: dict[str, list] = {}
  for group in groups:
    trace = msj.generate(model, group, max_new_tokens=max_new_tokens, sampling=sampling, spec=traced).stats
    for key, values in trace["pass_trace"].items():
      merged.setdefault(key, []).extend(values)
  return merged


def latency_percentiles(trace: dict[str, list], plain_ms: float | None, batch: int) -> dict[str, Any]:
  """P50/P95/P99 of milliseconds per output token over a traced run's passes (each pass's time over
  the tokens it committed, over the batch's rows), and at batch 1 each request's utility a pass:
  its committed tokens times the plain pass time over its pass time."""
  ms, tokens = np.asarray(trace["ms"]), np.asarray(trace["tokens"], np.float64)
  keep = tokens > 0
  per_token = ms[keep] / tokens[keep]
  out = {f"ms_per_token_p{q}": float(np.percentile(per_token, q)) for q in (50, 95, 99)} if per_token.size else {}
  if batch == 1 and plain_ms and keep.any():
    utility = tokens[keep] * plain_ms / ms[keep]
    out["utility_mean"], out["utility_p5"] = float(utility.mean()), float(np.percentile(utility, 5))
  return out


def bytes_bound_speedup(
  config: msj.ModelConfig, tokens_per_pass: float, verified_tokens: float, experts_L: Sequence[float]
) -> float:
  """The pass's speedup over plain decoding where every pass is bound by the weight bytes it reads
  (`regime.weight_bytes` at the measured distinct experts per layer)."""
  plain = regime.weight_bytes(config, 1, unique_experts=float(config.top_k))
  mean_unique = float(np.mean(experts_L)) if len(experts_L) else 0.0
  spec = regime.weight_bytes(config, max(1, round(verified_tokens)), unique_experts=mean_unique)
  return tokens_per_pass * plain / spec


def run_tree_bench(
  model: msj.Model,
  workdir: atomic.PathLike,
  *,
  tree_nodes: Sequence[int] = (4, 8, 16),
  depth: int = 3,
  chain_ks: Sequence[int] = (1, 2, 3, 4),
  penalties: Sequence[float] = (0.25, 1.0),
  batch_sizes: Sequence[int] = (1, 4),
  temperatures: Sequence[float] = (0.0, 1.0),
  max_new_tokens: int = 128,
  repeats: int = 3,
  num_prompts: int | None = None,
  prompt_bytes: int = 192,
  log: Callable[[str], None] = print,
) -> dict[str, Any]:
  """Runs the predictors' recall and the rows; writes `workdir/metrics.json` (key `tree_bench`,
  rewritten after every row) and the plots; returns the metrics."""
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  config = model.config
  if not config.num_mtp_modules:
    raise ValueError("tree_bench drafts with the MTP heads: the model has none (train them with experiments.train_mtp)")
  if config.num_mtp_modules != 1:
    raise ValueError(f"MTP draft trees run one MTP module; the model has {config.num_mtp_modules}")
  num_prompts = max(4, *batch_sizes) if num_prompts is None else num_prompts
  if num_prompts < max(batch_sizes):
    raise ValueError(f"num_prompts ({num_prompts}) must be at least the largest batch size ({max(batch_sizes)})")
  began = time.perf_counter()
  log("predictors' recall of the target's experts ...")
  recall = predictor_recall(model)
  for name, entry in recall["predictors"].items():
    log(f"  {name:<18} recall {entry['recall']:.3f} by layer {np.round(entry['recall_by_layer'], 3).tolist()}")
  prompts, encoding = spec_bench.bench_prompts(model, num_prompts, prompt_bytes, log=log)
  plans = [(t, b, row_specs(tree_nodes, depth, chain_ks, penalties, t == 0)) for t in temperatures for b in batch_sizes]
  progress = Progress(sum(len(p[2]) for p in plans), desc="tree_bench", unit="rows", every_s=15.0, emit=log)
  rows: list[dict[str, Any]] = []
  result: dict[str, Any] = {}
  for temperature, batch, specs in plans:
    sampling = msj.SamplingParams(temperature=float(temperature))
    groups = spec_bench.prompt_groups(prompts, batch)
    plain_trace = traced_passes(model, groups, max_new_tokens, sampling, msj.SpecParams(drafter="none"))
    plain_ms = float(np.median(plain_trace["ms"])) if plain_trace["ms"] else None
    plain_programs = programs.PROGRAMS.signatures()
    for label, spec in specs:
      spec_bench.warm_up(model, groups, max_new_tokens, sampling, spec)
      runs = spec_bench.paired(model, groups, max_new_tokens, sampling, spec, repeats)
      tps, plain_tps, speedup = runs.tokens_per_second, runs.plain_tokens_per_second, runs.speedup
      acc_len, stats = runs.mean_accepted_length, runs.stats
      traced = traced_passes(model, groups, max_new_tokens, sampling, spec)
      experts_L = stats["unique_experts_per_pass"]
      # A chain verifies its K drafts; a tree reports its valid nodes.
      nodes = stats["verified_nodes_per_pass"] if label["tree_nodes"] else float(label["num_draft"])
      row = {
        **label,
        "batch_size": batch,
        "temperature": float(temperature),
        "tokens_per_second": tps,
        "plain_tokens_per_second": plain_tps,
        "speedup": speedup,
        "mean_accepted_length": acc_len,
        "verified_nodes_per_pass": nodes,
        "unique_experts_per_pass": experts_L,
        "experts_per_pass": float(np.sum(experts_L)),
        "predicted_experts_per_pass": (
          float(np.sum(stats["predicted_unique_experts_per_pass"]))
          if "predicted_unique_experts_per_pass" in stats
          else None
        ),
        # Committed tokens per (layer, expert) read and per verified node, over the batch's rows.
        "tokens_per_expert_read": acc_len * batch / max(float(np.sum(experts_L)), 1e-9),
        "tokens_per_verified_node": acc_len / max(1.0 + nodes, 1e-9),
        "bytes_bound_speedup": bytes_bound_speedup(config, acc_len, batch * (1.0 + nodes), experts_L),
        **latency_percentiles(traced, plain_ms, batch),
      }
      rows.append(row)
      progress.update(len(rows), speedup=speedup)
      result = _write(
        workdir, rows, recall, began, complete=False, encoding=encoding, max_new_tokens=max_new_tokens, repeats=repeats
      )
      programs.PROGRAMS.forget(plain_programs)
    programs.PROGRAMS.forget()
  result = _write(
    workdir, rows, recall, began, complete=True, encoding=encoding, max_new_tokens=max_new_tokens, repeats=repeats
  )
  plot_trees(rows, workdir / "trees.png")
  log(format_rows(rows))
  for line in summary_lines(rows):
    log(line)
  return result


def _write(
  workdir: pathlib.Path, rows, recall, began: float, *, complete: bool, encoding: str, max_new_tokens: int, repeats: int
) -> dict[str, Any]:
  result = {
    "tree_bench": {
      "rows": rows,
      "predictor_recall": recall,
      "complete": complete,
      "prompt_encoding": encoding,
      "max_new_tokens": max_new_tokens,
      "repeats": repeats,
      "seconds": time.perf_counter() - began,
    }
  }
  atomic.write_json_atomic(workdir / "metrics.json", result)
  return result


def format_rows(rows: Sequence[dict]) -> str:
  head = (
    f"{'T':>4}{'batch':>6}{'policy':>24}{'lam':>6}{'N':>4}{'D':>3}{'nodes':>7}{'speedup':>9}{'tok/pass':>9}"
    f"{'experts':>9}{'pred.':>7}{'tok/exp':>8}{'bytes-b.':>9}{'p50ms':>7}{'p99ms':>7}"
  )
  lines = [head]
  for r in rows:
    pred = r["predicted_experts_per_pass"]
    lines.append(
      f"{r['temperature']:>4.1f}{r['batch_size']:>6}{r['policy']:>24}{r.get('expert_penalty', ''):>6}"
      f"{r['tree_nodes'] or '-':>4}{r['num_draft']:>3}{r['verified_nodes_per_pass']:>7.2f}{r['speedup']:>9.2f}"
      f"{r['mean_accepted_length']:>9.2f}{r['experts_per_pass']:>9.1f}{'-' if pred is None else f'{pred:.1f}':>7}"
      f"{r['tokens_per_expert_read']:>8.3f}{r['bytes_bound_speedup']:>9.2f}"
      f"{r.get('ms_per_token_p50', float('nan')):>7.2f}{r.get('ms_per_token_p99', float('nan')):>7.2f}"
    )
  return "\n".join(lines)


def summary_lines(rows: Sequence[dict]) -> list[str]:
  """Per temperature and batch: the best row of each policy against the best chain, measured and
  bytes-bound."""
  lines = []
  for key in sorted({(r["temperature"], r["batch_size"]) for r in rows}):
    mine = [r for r in rows if (r["temperature"], r["batch_size"]) == key]
    chains = [r for r in mine if r["policy"] == "chain"]
    if not chains:
      continue
    chain = max(chains, key=lambda r: r["speedup"])
    chain_b = max(chains, key=lambda r: r["bytes_bound_speedup"])
    for policy in POLICIES:
      trees = [r for r in mine if r["policy"] == policy]
      if not trees:
        continue
      best = max(trees, key=lambda r: r["speedup"])
      best_b = max(trees, key=lambda r: r["bytes_bound_speedup"])
      lines.append(
        f"T={key[0]:g} batch {key[1]}, {policy}: measured {best['speedup']:.2f}x plain = "
        f"{best['speedup'] / chain['speedup']:.2f}x the best chain (K={chain['num_draft']}); bytes-bound "
        f"{best_b['bytes_bound_speedup']:.2f}x = {best_b['bytes_bound_speedup'] / chain_b['bytes_bound_speedup']:.2f}x "
        f"the best chain's (K={chain_b['num_draft']})"
      )
  return lines


def plot_trees(rows: Sequence[dict], path: pathlib.Path) -> None:
  """Three panels at T = 0, batch 1 (else the first temperature and batch): tokens a pass against
  N per policy, experts a pass against N, and tokens a pass against experts a pass (the front)."""
  if not rows:
    return
  plt = plots.pyplot()
  key = (
    (0.0, 1)
    if any((r["temperature"], r["batch_size"]) == (0.0, 1) for r in rows)
    else (rows[0]["temperature"], rows[0]["batch_size"])
  )
  mine = [r for r in rows if (r["temperature"], r["batch_size"]) == key]
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
  groups: dict[str, list[dict]] = {}
  for r in mine:
    name = r["policy"] + (f" lam={r['expert_penalty']:g}" if "expert_penalty" in r else "")
    groups.setdefault(name, []).append(r)
  for name, sel in sorted(groups.items()):
    if name == "chain":
      sel = sorted(sel, key=lambda r: r["num_draft"])
      axes[2].plot(
        [r["experts_per_pass"] for r in sel], [r["mean_accepted_length"] for r in sel], "k.-", label="chains (K)"
      )
      continue
    sel = sorted(sel, key=lambda r: r["tree_nodes"])
    n = [r["tree_nodes"] for r in sel]
    axes[0].plot(n, [r["mean_accepted_length"] for r in sel], "o-", label=name)
    axes[1].plot(n, [r["experts_per_pass"] for r in sel], "o-", label=name)
    axes[2].plot([r["experts_per_pass"] for r in sel], [r["mean_accepted_length"] for r in sel], "o", label=name)
  where = f"{'greedy' if key[0] == 0 else f'T={key[0]:g}'}, batch {key[1]}"
  plots.finish_axes(axes[0], "tree nodes N", "tokens a pass", f"accepted length, {where}", legend_fontsize=7)
  plots.finish_axes(axes[1], "tree nodes N", "distinct experts a pass", "experts read", legend_fontsize=7)
  plots.finish_axes(axes[2], "distinct experts a pass", "tokens a pass", "tokens against experts", legend_fontsize=7)
  plots.save(fig, path)
