"""The cost model against measurements on the trained model (experiments/cost_model.py).

Prediction (the bytes/bandwidth model of analysis/cost_model.py, batch 1):
  T_verify(n) = fixed + sum over MoE layers of fit[method(n)].time(bytes(n)),
  with each kernel's effective bandwidth and fixed time fitted on single-layer expert runs
  (uniform random routing, this model's expert shape, one weight set per MoE layer run in turn
  as a pass reads them, so the caches hold what they hold in decoding), bytes(n) from the
  unique experts the model's own routing traces show for n consecutive tokens, and `fixed`
  (everything but the routed experts) from one measured plain pass:
  fixed = T_measured(1) - expert time(1).
  Two variants let the non-expert time grow with n: `slope` per token fitted to the measured
  passes at n = 1 and the largest n (linear non-expert), or measured apart from them (measured
  non-expert): the same passes timed with every routed expert skipped
  (`step_times_with_and_without_experts_ms`), the least-squares slope of those times in n.
Measurement:
  - T_verify(n): one loop pass with K = n - 1 (`decoding.loop.step_times_ms`) with the
    controlled drafter, whose drafting costs next to nothing;
  - speedup(a, K): decode time of plain decoding over that of the controlled drafter
    (acceptance a, greedy, so exactly geometric), every K of one a in the same rounds as plain
    (`rounds.round_robin_runs`), the median of the per-round ratios;
  - the crossover: dedup vs per-slot single-layer times on windows of the traces' real routing,
    timed in alternation; the first pass size from which dedup stays faster (at n = 1 both read
    the same experts, and which wins there is timing noise).
Then best K per a predicted vs measured (and the measured speedup at the predicted K against
the best measured one, and the agreement with the rounds resampled: where speedups are flat in
K, the measured argmax moves with timing noise), and num_draft='auto' against plain and the
best fixed K, with the controlled drafter and with the model's real drafters (over several held-out
prompts, one a round: `drafter_prompts`). Each controlled
auto row also carries two simulations (analysis/draft_policy_sim): the policy on the pass times it
chose with (its own cost), and the policy choosing on them but paying the pass times the sweep
measured in decoding at that rate (`pass_costs_from_sweep`): the gap between the two is what the
calibration's error costs, the rest of the measured gap execution and timing noise. Part of the
execution: the simulations charge every pass at K the same time, but a pass's time follows the
distinct experts it reads, and the first tokens after a prompt route to more of them; beyond that
only the first two passes cost more than the experts they read predict (research/pass_times).
Auto spends these passes at small K while its estimate grows, or at a K a lucky start overrated
(measured: docs/findings/2026-12-05-in-program-pass-times.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import moespec_jax as msj
import pallas_kernels
from moespec_jax.analysis import cost_model, regime, timing
from moespec_jax.data import corpus
from moespec_jax.decoding import loop, programs
from moespec_jax.io import atomic, plots, progress
from moespec_jax.io.progress import Progress
from moespec_jax.research import draft_policy_sim, rounds, routing_report, traces
from pallas_kernels import bytes as kbytes

FITTED_METHODS = ("dedup", "per_slot")
# The best-K predictors: their column in the best_k rows -> (suffix of their
# best_k_within_one_fraction key, what they are in the printed summary).
PREDICTORS = {
  "predicted": ("", "bytes model"),
  "predicted_linear_nonexpert": ("_linear_nonexpert", "linear non-expert"),
  "predicted_measured_nonexpert": ("_measured_nonexpert", "measured non-expert"),
  "predicted_from_step_times": ("_from_step_times", "measured pass times"),
  "predicted_from_step_times_by_acceptance": ("_from_step_times_by_acceptance", "interpolated by acceptance"),
}
# The goals of num_draft='auto': never more than 3% slower than plain decoding, within 5% of the
# best fixed K.
AUTO_FLOOR_VS_PLAIN = 0.97
AUTO_FLOOR_VS_BEST_FIXED = 0.95


@dataclasses.dataclass(frozen=True)
class CostValidationConfig:
  alphas: tuple[float, ...] = tuple(float(a) for a in np.round(np.linspace(0.0, 1.0, 21), 3))
  max_k: int = 8
  max_new_tokens: int = 128
  repeats: int = 7  # rounds of plain and every K, side by side (rounds.round_robin_runs)
  # Where the measured best K is unsettled (the rounds resampled put it within 1 of the full
  # sample's best in under `settled_share` of resamples: `rounds.share_within_one`), the sweep adds
  # `repeats` rounds at that rate, up to `max_repeats`: flat speedup curves at high acceptance
  # otherwise leave the measured best K to timing noise.
  max_repeats: int = 21
  settled_share: float = 0.9
  kernel_n: tuple[int, ...] = tuple(range(1, 17))
  kernel_repeats: int = 9
  crossover_windows: int = 8
  trace_segments: int = 32
  auto_alphas: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
  auto_repeats: int = 31  # rounds; their medians still carry a few % of timing noise
  real_drafters: tuple[str, ...] = ("mtp", "ngram")
  # Held-out prompts the model drafters' rows take in turn, round by round (rounds.PromptSets;
  # their rounds are rounded up to whole turns): under greedy decoding each prompt's rounds repeat
  # one acceptance trajectory, and auto against the best fixed K varies from prompt to prompt
  # (docs/findings/2026-12-02-cost-model-validation.md).
  drafter_prompts: int = 8
  # The auto rows with ResearchOptions(auto_timing=True) (experimental): the calibration corrected by
  # the loop's own clock as it decodes.
  auto_timing: bool = False
  prompt_bytes: int = 192
  seed: int = 0
  # What the controlled drafter's passes pay for drafting (ResearchOptions.controlled_draft_cost):
  # "none", a table lookup; "mtp", the model's MTP heads run each pass (their drafts discarded).
  # The verify times are measured without it; with "mtp" its time per K is measured apart
  # (`draft_ms`) and added to the best-K predictions, and the sweep and auto rows pay it.
  controlled_draft_cost: str = "none"
  # Pass sizes of the verify-time comparison: n = 1..verify_max_k + 1 (None: max_k).
  verify_max_k: int | None = None

  @property
  def verify_k(self) -> int:
    return self.max_k if self.verify_max_k is None else max(self.verify_max_k, self.max_k)

  def __post_init__(self):
    if not self.alphas or any(not 0.0 <= a <= 1.0 for a in self.alphas):
      raise ValueError(f"alphas must be acceptance rates in [0, 1], got {self.alphas}")
    if any(not 0.0 <= a <= 1.0 for a in self.auto_alphas):
      raise ValueError(f"auto_alphas must be in [0, 1], got {self.auto_alphas}")
    if not 1 <= self.max_k <= 16:
      raise ValueError(f"max_k must be in [1, 16], got {self.max_k}")
    if min(self.repeats, self.kernel_repeats, self.auto_repeats, self.drafter_prompts) < 1:
      raise ValueError("repeats, kernel_repeats, auto_repeats and drafter_prompts must be >= 1")
    if self.max_repeats < self.repeats:
      raise ValueError(f"max_repeats ({self.max_repeats}) must be >= repeats ({self.repeats})")
    if not 0.0 <= self.settled_share <= 1.0:
      raise ValueError(f"settled_share must be in [0, 1], got {self.settled_share}")
    if not self.kernel_n or min(self.kernel_n) < 1 or len(set(self.kernel_n)) < 2:
      raise ValueError(f"kernel_n needs at least two distinct pass sizes >= 1, got {self.kernel_n}")
    if self.controlled_draft_cost not in ("none", "mtp"):
      raise ValueError(f"controlled_draft_cost must be none or mtp, got {self.controlled_draft_cost!r}")
    if self.verify_max_k is not None and not 1 <= self.verify_max_k <= 16:
      raise ValueError(f"verify_max_k must be in [1, 16], got {self.verify_max_k}")
    bad = [d for d in self.real_drafters if d not in ("mtp", "ngram")]
    if bad:
      raise ValueError(f"real_drafters must be among mtp, ngram; got {bad}")


QUICK_CONFIG = CostValidationConfig(
  alphas=(0.0, 0.25, 0.5, 0.75, 1.0),
  max_k=2,
  max_new_tokens=16,
  repeats=1,
  max_repeats=1,
  kernel_n=(1, 2, 4),
  kernel_repeats=2,
  crossover_windows=2,
  trace_segments=4,
  auto_alphas=(0.0, 1.0),
  auto_repeats=1,
  real_drafters=("ngram",),
  drafter_prompts=2,
)


def progress_settings(model, cfg: CostValidationConfig) -> dict[str, Any]:
  """What a resumed run must share with the interrupted one: the validation's settings, the
  model's config and its weights (and the layout of the stored parts: 3 keeps each round's
  speedups in the sweep's parts, as many rounds as each rate took; 4, rounds in the balanced
  order of `timing.round_order`: parts timed in the earlier order are not mixed in; 5, the model
  drafters' rows over `drafter_prompts` prompts, the sweep's accepted lengths over all rounds)."""
  return {
    "experiment": "cost_model",
    "parts_format": 5,
    "config": dataclasses.asdict(cfg),
    "model": dataclasses.asdict(model.config),
    "weights": progress.weights_fingerprint(model.state),
  }


# Single-layer expert timings ------------------------------------------------------------------
def _layer_weights(config, seed: int):
  """One routed-expert weight set per MoE layer of the model (a pass reads every layer's
  experts once, so a layer's experts are usually not in the processor's caches when they
  are read; timing one weight set over and over would measure cache-hot reads)."""
  d, f, e = config.d_model, config.expert_hidden, config.n_routed_experts
  out = []
  for layer in range(max(1, config.n_moe_layers)):
    keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), layer), 3)
    out.append(
      (
        jax.random.normal(keys[0], (e, d, f)) / np.sqrt(d),
        jax.random.normal(keys[1], (e, d, f)) / np.sqrt(d),
        jax.random.normal(keys[2], (e, f, d)) / np.sqrt(f),
      )
    )
  return out


def _layer_fns():
  return {m: jax.jit(lambda *a, m=m: pallas_kernels.expert_ffn(*a, method=m)) for m in FITTED_METHODS}


def time_layer_pair(fns, layer_weights, ids_TK: np.ndarray, repeats: int, rng) -> dict[str, float]:
  """Median time (ms) of one layer's routed experts for this routing, per method (dedup and
  per-slot): each timed call runs a method on every weight set of `layer_weights` in turn (as a
  decoding pass does) and is divided by their number. The two methods are timed in alternation
  on the same input (`timing.median_times_alternating_ms`)."""
  n, k = ids_TK.shape
  x = jnp.asarray(rng.standard_normal((n, layer_weights[0][0].shape[1])), jnp.float32)
  gates = jnp.full((n, k), 1.0 / k, jnp.float32)
  ids = jnp.asarray(ids_TK, jnp.int32)
  calls = {m: (lambda fn=fns[m]: [fn(x, ids, gates, *w) for w in layer_weights]) for m in FITTED_METHODS}
  return {m: t / len(layer_weights) for m, t in timing.median_times_alternating_ms(calls, repeats).items()}


def fit_kernels(config, n_list: Sequence[int], repeats: int, seed: int = 0):
  """Per method, bandwidth and fixed time fitted on uniform-routing single-layer runs."""
  rng = np.random.default_rng(seed)
  weights, fns = _layer_weights(config, seed), _layer_fns()
  d, f, e, k = config.d_model, config.expert_hidden, config.n_routed_experts, config.top_k
  rows = []
  for n in n_list:
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
    times = time_layer_pair(fns, weights, ids, repeats, rng)
    for m in FITTED_METHODS:
      rows.append(
        {"method": m, "n_tokens": int(n), "bytes": int(kbytes.bytes_requested(ids, d, f, 4, m)), "time_ms": times[m]}
      )
  fits = {}
  for m in FITTED_METHODS:
    b = [r["bytes"] for r in rows if r["method"] == m]
    t = [r["time_ms"] for r in rows if r["method"] == m]
    try:
      fits[m] = cost_model.fit_kernel(b, t)
    except ValueError:
      # Overhead-bound (tiny layers): time does not grow with bytes over these pass sizes.
      fits[m] = cost_model.KernelFit(gbps=math.inf, fixed_ms=float(np.median(t)))
  return fits, rows


def layer_bytes(config, unique: float, n: int, method: str) -> float:
  """Expected bytes one MoE layer's experts request for a pass of n tokens."""
  reads = unique if method == "dedup" else n * config.top_k
  return reads * kbytes.expert_bytes(config.d_model, config.expert_hidden, 4) + kbytes.activation_bytes(
    n, config.top_k, config.d_model, 4
  )


def expert_time_ms(config, fits, unique_L: Sequence[float], n: int, method: str | None = None) -> float:
  """Predicted routed-expert time of one pass of n tokens, summed over MoE layers."""
  method = method or pallas_kernels.choose_method(n, config.top_k)
  if method not in fits:
    raise ValueError(f"no kernel fit for method {method!r} (fitted: {sorted(fits)})")
  return float(sum(fits[method].time_ms(layer_bytes(config, u, n, method)) for u in unique_L))


def measured_crossover(config, trace, n_list, windows: int, repeats: int, seed: int = 0):
  """Dedup vs per-slot single-layer times on windows of real routing, the two timed in
  alternation (`time_layer_pair`). Returns (the first n from which dedup stays faster, the
  first n at which it is faster, rows)."""
  rng = np.random.default_rng(seed)
  weights, fns = _layer_weights(config, seed), _layer_fns()
  rows = []
  for n in n_list:
    t = {m: [] for m in FITTED_METHODS}
    for w in range(windows):
      seg = trace.segments[w % len(trace.segments)]
      layer = w % trace.n_layers
      start = int(rng.integers(0, max(1, seg.shape[1] - n)))
      pair = time_layer_pair(fns, weights, seg[layer, start : start + n], repeats, rng)
      for m in FITTED_METHODS:
        t[m].append(pair[m])
    rows.append(
      {"n_tokens": int(n), "dedup_ms": float(np.median(t["dedup"])), "per_slot_ms": float(np.median(t["per_slot"]))}
    )
  curves = ([r["n_tokens"] for r in rows], [r["dedup_ms"] for r in rows], [r["per_slot_ms"] for r in rows])
  return cost_model.crossover(*curves, for_good=True), cost_model.crossover(*curves), rows


# The run -------------------------------------------------------------------------------------
def run_cost_model(
  model: msj.Model,
  workdir: atomic.PathLike,
  cfg: CostValidationConfig = CostValidationConfig(),
  log: Callable[[str], None] = print,
) -> dict[str, Any]:
  """Runs the validation; writes `workdir/metrics.json` (key `cost_model`) and three plots."""
  if model.config.n_moe_layers == 0:
    raise ValueError("the cost model needs a model with MoE layers")
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  began = time.perf_counter()
  prompts = corpus.held_out_prompts(1, prompt_bytes=cfg.prompt_bytes, seed=cfg.seed)
  if cfg.controlled_draft_cost == "mtp" and not model.config.num_mtp_modules:
    raise ValueError("controlled_draft_cost 'mtp' needs a model with MTP heads")
  regime.record(model, (1,), context=cfg.prompt_bytes + cfg.max_new_tokens, log=log)
  # The sweep's acceptance rates and the auto rows are kept as they finish (workdir/progress.json):
  # an interrupted run, rerun with the same settings on the same model, measures only the rest.
  parts = progress.RunProgress(workdir / "progress.json", progress_settings(model, cfg), log=log)

  routing = _routing_stage(model, cfg, log)
  kernels = _kernel_stage(model.config, cfg, routing, log)
  passes = _pass_time_stage(model, prompts, cfg, kernels.fits, routing.unique_by_n, log)
  # What is compiled by now (plain decoding, the pass-time programs) stays compiled; everything else
  # is dropped (`programs.PROGRAMS.forget(keep)`) after the sweep and after each model drafter's runs.
  keep = programs.PROGRAMS.signatures()
  sweep = _speedup_sweep(model, prompts, passes.reference, cfg, parts, keep, log)
  add_loop_efficiency(sweep.rows, passes, log)
  best_k = best_k_comparison(cfg.alphas, cfg.max_k, sweep, passes)
  _log_best_k(best_k, log)
  controlled_rows = _auto_controlled_rows(model, prompts, cfg, passes, sweep, parts, log)
  real_rows, real_prefills = _auto_real_rows(model, cfg, keep, parts, log)

  result = {
    "cost_model": cost_model_metrics(
      cfg,
      routing.stats,
      kernels,
      passes,
      sweep,
      best_k,
      controlled_rows + real_rows,
      sweep.prefills + real_prefills,
      model.expert_method("auto"),
      time.perf_counter() - began,
    )
  }
  bandwidth = plain_bandwidth(model, passes, cfg, log)
  # The regime again, the measured plain pass deciding where its bytes come from.
  regimes = regime.record(
    model, (1,), context=bandwidth["context"], measured_pass_ms={1: bandwidth["plain_pass_ms"]}, log=log
  )
  result["cost_model"].update(
    regime=regimes,
    plain_bandwidth=bandwidth,
    controlled_draft_cost=cfg.controlled_draft_cost,
    draft_ms=None if passes.draft_ms_K is None else passes.draft_ms_K.tolist(),
  )
  _write_outputs(result, routing.stats, workdir, parts, log)
  return result


@dataclasses.dataclass(frozen=True)
class RoutingStage:
  """The model's routing on held-out text (`traces.heldout_trace`), its statistics
  (`routing_report.routing_stats`) and the empirical unique experts per MoE layer read by n
  consecutive tokens ({n: [per layer]})."""

  trace: Any
  stats: dict
  unique_by_n: dict


def _routing_stage(model, cfg: CostValidationConfig, log) -> RoutingStage:
  """[1/6] The routing traces: what a pass of n tokens reads, for the bytes model."""
  log(f"[1/6] routing traces ({cfg.trace_segments} held-out windows) and unique experts under four models")
  trace = traces.heldout_trace(model, n_segments=cfg.trace_segments)
  rstats = routing_report.routing_stats(trace, max_tokens=max(max(cfg.kernel_n), cfg.verify_k + 1))
  return RoutingStage(trace, rstats, {r["n_tokens"]: r["empirical_per_layer"] for r in rstats["unique_experts"]})


@dataclasses.dataclass(frozen=True)
class KernelStage:
  """Each method's kernel fit, the single-layer timings it was fitted on, and the dedup/per-slot
  crossover predicted from the fits against the measured one (metrics.json's `crossover`)."""

  fits: dict
  rows: list
  crossover: dict


def predicted_crossover(config, fits, unique_by_n, n_list: Sequence[int]) -> int | None:
  """The first pass size of `n_list` from which the fitted dedup kernel is predicted faster than
  per-slot at every larger size, with the traces' unique experts per layer."""
  return cost_model.crossover(
    n_list,
    [expert_time_ms(config, fits, unique_by_n[n], n, "dedup") for n in n_list],
    [expert_time_ms(config, fits, unique_by_n[n], n, "per_slot") for n in n_list],
    for_good=True,
  )


def _kernel_stage(config, cfg: CostValidationConfig, routing: RoutingStage, log) -> KernelStage:
  """[2/6] Each kernel's effective bandwidth and fixed time on single-layer runs, and where dedup
  starts to beat per-slot: predicted from the fits, measured on windows of the traces' routing."""
  log(f"[2/6] single-layer kernel fits ({', '.join(FITTED_METHODS)}, n = {min(cfg.kernel_n)}..{max(cfg.kernel_n)})")
  fits, kernel_rows = fit_kernels(config, cfg.kernel_n, cfg.kernel_repeats, cfg.seed)
  for m, fit in fits.items():
    if math.isinf(fit.gbps):
      log(f"  {m}: time does not grow with bytes here (overhead-bound): {fit.fixed_ms * 1e3:.0f} us per layer")
    else:
      log(f"  {m}: {fit.gbps:.1f} GB/s effective, fixed {fit.fixed_ms * 1e3:.0f} us per layer")
  n_list = sorted(cfg.kernel_n)
  predicted_cross = predicted_crossover(config, fits, routing.unique_by_n, n_list)
  measured_cross, measured_first_win, cross_rows = measured_crossover(
    config, routing.trace, n_list, cfg.crossover_windows, cfg.kernel_repeats, cfg.seed
  )
  log(
    f"  dedup/per-slot crossover (dedup faster from there on): predicted n = {predicted_cross}, measured "
    f"n = {measured_cross} (dedup first faster at n = {measured_first_win})"
  )
  return KernelStage(
    fits,
    kernel_rows,
    {
      "predicted_n": predicted_cross,
      "measured_n": measured_cross,
      "measured_first_faster_n": measured_first_win,
      "definition": "the first pass size from which dedup is faster at every larger size measured",
      "rows": cross_rows,
    },
  )


@dataclasses.dataclass(frozen=True)
class VerifyTimes:
  """Verify time per pass size n = 1..max_k + 1 ({n: ms}), predicted: `fixed_ms` (everything but
  the routed experts, from the measured plain pass) plus the predicted expert time; with a
  non-expert term linear in n instead (`slope_ms` per token, fitted to the pass times at both
  ends); and with that term measured (`measured_slope_ms` per token: the pass without its routed
  experts, timed at every n, `nonexpert_ms_K`). `rows`: metrics.json's `verify_time`; the
  relative errors against the measured pass times, n = 2..max_k + 1 (linear: n = 2..max_k, its
  two ends are fitted). `nonexpert_growth_share`: `nonexpert_share_of_growth`."""

  fixed_ms: float
  slope_ms: float
  predicted_ms: dict
  predicted_linear_ms: dict
  rows: list
  rel_err: list
  rel_err_linear: list
  measured_slope_ms: float
  predicted_measured_nonexpert_ms: dict
  rel_err_measured_nonexpert: list
  nonexpert_growth_share: float | None


def nonexpert_share_of_growth(step_ms_K, nonexpert_ms_K) -> float | None:
  """The share of the pass time's growth from n = 1 to the largest n by which the same passes
  without their routed experts grow: growth that no model of expert reads accounts for (near 1,
  the best K follows the rest of the pass, not the experts). None where the pass time does not
  grow."""
  growth = float(step_ms_K[-1] - step_ms_K[0])
  return float(nonexpert_ms_K[-1] - nonexpert_ms_K[0]) / growth if growth > 0 else None


def nonexpert_slope_ms(nonexpert_ms_K) -> float:
  """The per-token growth of the pass without its routed experts: the least-squares line through
  its times at n = 1..len (one noisy pass must not set it), floored at 0."""
  t = np.asarray(nonexpert_ms_K, float)
  if t.ndim != 1 or t.size < 2:
    raise ValueError(f"need the non-expert pass time at two pass sizes at least, got {nonexpert_ms_K}")
  return max(float(np.polyfit(np.arange(1, t.size + 1), t, 1)[0]), 0.0)


def verify_times(config, fits, unique_by_n, step_ms_K, nonexpert_ms_K, max_k: int) -> VerifyTimes:
  """The bytes model's verify times against `step_ms_K` (one measured loop pass at K = 0..max_k),
  with the fixed time calibrated at n = 1 (and the linear non-expert term at n = 1 and max_k + 1).
  `nonexpert_ms_K`: the same passes timed without their routed experts
  (`loop.step_times_with_and_without_experts_ms`); their per-token growth (`nonexpert_slope_ms`)
  gives a third model that takes nothing from the pass times but the plain pass."""
  n_max = max_k + 1
  if len(nonexpert_ms_K) != n_max:
    raise ValueError(f"need one non-expert pass time per n = 1..{n_max}, got {len(nonexpert_ms_K)}")
  expert_ms = {n: expert_time_ms(config, fits, unique_by_n[n], n) for n in range(1, n_max + 1)}
  fixed_ms = float(step_ms_K[0] - expert_ms[1])
  predicted_verify = {n: fixed_ms + expert_ms[n] for n in expert_ms}
  # A second model: the non-expert time linear in n, calibrated at n = 1 and n = max_k + 1.
  slope_ms = float((step_ms_K[n_max - 1] - expert_ms[n_max]) - fixed_ms) / (n_max - 1)
  predicted_linear = {n: fixed_ms + slope_ms * (n - 1) + expert_ms[n] for n in expert_ms}
  verify_rows = [
    {
      "n_tokens": n,
      "predicted_ms": predicted_verify[n],
      "measured_ms": float(step_ms_K[n - 1]),
      "predicted_linear_ms": predicted_linear[n],
      "method": pallas_kernels.choose_method(n, config.top_k),
      "predicted_expert_ms": expert_ms[n],
    }
    for n in range(1, n_max + 1)
  ]
  rel_err = [abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"] for r in verify_rows[1:]]
  rel_err_linear = [abs(r["predicted_linear_ms"] - r["measured_ms"]) / r["measured_ms"] for r in verify_rows[1:-1]]
  measured_slope = nonexpert_slope_ms(nonexpert_ms_K)
  predicted_measured = {n: fixed_ms + measured_slope * (n - 1) + expert_ms[n] for n in expert_ms}
  for r in verify_rows:
    r["predicted_measured_nonexpert_ms"] = predicted_measured[r["n_tokens"]]
    r["nonexpert_measured_ms"] = float(nonexpert_ms_K[r["n_tokens"] - 1])
    # The routed experts' part as the pass pays it (caches as in decoding), beside predicted_expert_ms.
    r["expert_measured_ms"] = r["measured_ms"] - r["nonexpert_measured_ms"]
  rel_err_measured = [
    abs(r["predicted_measured_nonexpert_ms"] - r["measured_ms"]) / r["measured_ms"] for r in verify_rows[1:]
  ]
  # T(n)/T(1) measured, from the bytes model, and from the Amdahl split (the routed experts' share f
  # of a plain pass, as the pass without them measures it, scaled by the distinct experts read).
  f = cost_model.amdahl_fraction(float(step_ms_K[0]), float(step_ms_K[0] - nonexpert_ms_K[0]))
  for r in verify_rows:
    n = r["n_tokens"]
    r["measured_ratio"] = r["measured_ms"] / verify_rows[0]["measured_ms"]
    r["predicted_ratio"] = predicted_verify[n] / predicted_verify[1]
    r["amdahl_ratio"] = cost_model.amdahl_ratio(f, float(np.mean(unique_by_n[n])), config.top_k)
    r["amdahl_expert_share"] = f
  return VerifyTimes(
    fixed_ms,
    slope_ms,
    predicted_verify,
    predicted_linear,
    verify_rows,
    rel_err,
    rel_err_linear,
    measured_slope,
    predicted_measured,
    rel_err_measured,
    nonexpert_share_of_growth(step_ms_K[:n_max], nonexpert_ms_K),
  )


@dataclasses.dataclass(frozen=True)
class PassTimes:
  """Plain decoding's greedy tokens (`reference`: what every speculative run must reproduce), one
  loop pass measured at K = 0..max_k with the controlled drafter at acceptance 0.5 (`step_ms_K`)
  and with every draft wrong / right (`step_ms_by_end`, keys 0.0 and 1.0), and the bytes model's
  verify times against them."""

  reference: Any
  step_ms_K: Any
  step_ms_by_end: dict
  verify: VerifyTimes
  draft_ms_K: Any = None
  """ms [K = 0..max_k]: what drafting K tokens adds to a pass (controlled_draft_cost "mtp": the
  passes timed with the MTP heads run, less those without); zeros where drafting is a lookup."""

  def measured_ms(self, n: int) -> float:
    """The measured pass time of n tokens (K = n - 1, acceptance 0.5)."""
    return float(self.step_ms_K[n - 1])

  def draft_ms(self, k: int) -> float:
    """What drafting k tokens adds to a pass (ms)."""
    return 0.0 if self.draft_ms_K is None else float(self.draft_ms_K[k])


def _pass_time_stage(model, prompts, cfg: CostValidationConfig, fits, unique_by_n, log) -> PassTimes:
  """[3/6] Measured pass times per K (the controlled drafter, batch 1) and the verify times the
  bytes model predicts for them."""
  log(f"[3/6] measured pass times, K = 0..{cfg.verify_k} (controlled drafter, batch 1)")
  reference = msj.generate(model, prompts, max_new_tokens=cfg.max_new_tokens).tokens
  step_spec = msj.SpecParams(drafter="controlled", num_draft=cfg.verify_k, research=_controlled(0.5))
  # The same passes without their routed experts, timed side by side with them: how the rest of a
  # pass grows with n, and the experts' part as decoding pays it.
  step_ms_K, nonexpert_ms_K = loop.step_times_with_and_without_experts_ms(
    model, prompts, cfg.max_new_tokens, spec=step_spec, reference_tokens=reference, repeats=cfg.kernel_repeats
  )
  # A pass's cost depends on what it verifies: wrong drafts (random tokens here) route to more
  # distinct experts than the model's own continuation. Pass times with every draft wrong
  # (a = 0) and every draft right (a = 1); under acceptance a a fraction a of the controlled
  # drafts are right, so a pass costs about (1 - a) T0[K] + a T1[K].
  step_by_end = {
    end: loop.step_times_ms(
      model,
      prompts,
      cfg.max_new_tokens,
      reference_tokens=reference,
      repeats=cfg.kernel_repeats,
      spec=msj.SpecParams(drafter="controlled", num_draft=cfg.max_k, research=_controlled(end)),
    )
    for end in (0.0, 1.0)
  }
  log(
    f"  pass times K = 0..{cfg.max_k} (ms): every draft wrong "
    f"{np.round(step_by_end[0.0], 2).tolist()}, every draft right {np.round(step_by_end[1.0], 2).tolist()}"
  )
  draft_ms_K = None
  if cfg.controlled_draft_cost == "mtp":
    # The same passes with the MTP heads run, timed apart: what drafting adds at each K.
    with_draft_K = loop.step_times_ms(
      model,
      prompts,
      cfg.max_new_tokens,
      reference_tokens=reference,
      repeats=cfg.kernel_repeats,
      spec=msj.SpecParams(drafter="controlled", num_draft=cfg.max_k, research=_controlled(0.5, "mtp")),
    )
    draft_ms_K = np.maximum(with_draft_K - step_ms_K[: cfg.max_k + 1], 0.0)
    draft_ms_K[0] = 0.0
    log(f"  drafting with the MTP heads adds (ms) K = 0..{cfg.max_k}: {np.round(draft_ms_K, 2).tolist()}")
  v = verify_times(model.config, fits, unique_by_n, step_ms_K, nonexpert_ms_K, cfg.verify_k)
  n_max = cfg.verify_k + 1
  log(
    f"  without routed experts (ms): {np.round(nonexpert_ms_K, 2).tolist()}, "
    f"{v.measured_slope_ms * 1e3:.0f} us per token (least squares); "
    f"{_share(v.nonexpert_growth_share)} of the pass time's growth from n = 1 to {n_max}"
  )
  log(
    f"  fixed (non-expert) time {v.fixed_ms:.3f} ms; verify time median relative error "
    f"{np.median(v.rel_err):.1%} (n = 2..{n_max}); with the measured non-expert term: "
    f"{np.median(v.rel_err_measured_nonexpert):.1%}; with a linear non-expert term "
    f"({v.slope_ms * 1e3:.0f} us per token, fitted at n = 1 and {n_max}): "
    f"{np.median(v.rel_err_linear) if v.rel_err_linear else float('nan'):.1%} (n = 2..{n_max - 1})"
  )
  shown = [r for r in v.rows if r["n_tokens"] in (2, 4, 8, 16) or r["n_tokens"] == n_max]
  log(
    "  T(n)/T(1) measured / bytes model / Amdahl "
    f"(routed experts {v.rows[0]['amdahl_expert_share']:.0%} of a plain pass): "
    + ", ".join(
      f"n={r['n_tokens']} {r['measured_ratio']:.2f} / {r['predicted_ratio']:.2f} / {r['amdahl_ratio']:.2f}"
      for r in shown
    )
  )
  return PassTimes(reference, step_ms_K, step_by_end, v, draft_ms_K)


@dataclasses.dataclass(frozen=True)
class SpeedupSweep:
  """The controlled drafter's fixed-K sweep. `speedups`: {(a, K): median decode-phase speedup over
  plain} (K = 0: 1.0); `accepted_lengths`: {(a, K >= 1): tokens committed per pass}; `rows`:
  metrics.json's `speedups`; `prefills`: every round's prefill (s), subtracted from its runs;
  `best_k_shares`: {a: each K's share of bootstrap resamples where it is best}; `rounds`: {a:
  rounds run (`rounds.rounds_until_settled`)}."""

  speedups: dict
  accepted_lengths: dict
  rows: list
  prefills: list
  best_k_shares: dict
  rounds: dict


def measured_best_k(speedups, a: float, max_k: int) -> int:
  """The K in 0..max_k with the best measured speedup at acceptance a (`speedups[(a, K)]`; the
  smallest such K on ties)."""
  return max(range(max_k + 1), key=lambda k: speedups[(a, k)])


def _sweep_rate(model, prompts, reference, cfg: CostValidationConfig, a: float, warm_up: bool = False) -> dict:
  """One acceptance rate of the sweep as the run keeps it (progress): every round's prefill, each
  K's per-round speedups (K = 1..max_k) and its row; rounds added until the best K is settled.
  `warm_up`: run every program once, untimed, first (`rounds.warm_up`)."""
  drafted = list(range(1, cfg.max_k + 1))
  research = _controlled(a, cfg.controlled_draft_cost)
  specs = {k: msj.SpecParams(drafter="controlled", num_draft=k, research=research) for k in drafted}
  if warm_up:
    rounds.warm_up(model, prompts, cfg.max_new_tokens, specs, reference)
  runs = rounds.rounds_until_settled(
    lambda first, n: rounds.round_robin_runs(
      model, prompts, cfg.max_new_tokens, specs, n, reference, check_tokens=reference, first_round=first
    ),
    drafted,
    cfg.repeats,
    cfg.max_repeats,
    cfg.settled_share,
    cfg.seed,
  )
  rounds_K = {k: runs.speedups(k) for k in drafted}
  return {
    "prefills": runs.prefill_s,
    "round_speedups": [rounds_K[k] for k in drafted],
    "rows": [
      {
        "num_draft": k,
        "speedup": statistics.median(rounds_K[k]),
        "tokens_per_second": statistics.median(st["tokens_per_second"] for st in runs.stats[k]),
        "mean_accepted_length": pooled_accepted_length(runs.stats[k]),
      }
      for k in drafted
    ],
  }


def pooled_accepted_length(stats_by_round: Sequence[dict]) -> float:
  """Tokens committed per verify pass over all rounds, weighted by their passes: each round of the
  controlled drafter draws its own table, and a model drafter's rounds decode different prompts,
  so one round's figure is one draw's."""
  passes = sum(st["verify_passes"] for st in stats_by_round)
  return sum(st["mean_accepted_length"] * st["verify_passes"] for st in stats_by_round) / max(passes, 1)


def _speedup_sweep(model, prompts, reference, cfg: CostValidationConfig, parts, keep, log) -> SpeedupSweep:
  """[4/6] Decode-phase speedups of the controlled drafter at every acceptance rate and K, plain
  and every K side by side (`_sweep_rate`), each rate kept as it finishes; then only the programs
  in `keep` stay compiled."""
  log(
    f"[4/6] measured speedups: {len(cfg.alphas)} acceptance rates x K = 1..{cfg.max_k}, {cfg.repeats} rounds "
    f"of plain and every K side by side ({cfg.repeats} more at a time, up to {cfg.max_repeats}, where the "
    f"measured best K is unsettled)"
  )
  speedups = {(a, 0): 1.0 for a in cfg.alphas}
  accepted_lengths, sweep_rows, prefills, best_k_shares, sweep_rounds = {}, [], [], {}, {}
  bar = Progress(len(cfg.alphas), desc="cost_model sweep", unit="rates", every_s=20.0, emit=log)
  warmed = []  # the rates share their programs (the acceptance is an argument): warmed at the first one measured

  def measure(a: float) -> dict:
    part = _sweep_rate(model, prompts, reference, cfg, a, warm_up=not warmed)
    warmed.append(a)
    return part

  for i, a in enumerate(cfg.alphas):
    part = parts.cached(f"sweep/{a}", lambda: measure(a))
    prefills += part["prefills"]
    per_round_KR = part["round_speedups"]
    best_k_shares[a] = rounds.best_k_bootstrap([[1.0] * len(per_round_KR[0])] + per_round_KR, seed=cfg.seed).tolist()
    sweep_rounds[a] = len(per_round_KR[0])
    for r in part["rows"]:
      speedups[(a, r["num_draft"])] = r["speedup"]
      accepted_lengths[(a, r["num_draft"])] = r["mean_accepted_length"]
      sweep_rows.append(
        dict(r, alpha=a, predicted_accepted_length=float(cost_model.tokens_per_pass(a, r["num_draft"])))
      )
    bar.update(i + 1, best_k=measured_best_k(speedups, a, cfg.max_k), rounds=sweep_rounds[a])
  programs.PROGRAMS.forget(keep)
  log(
    f"  prefill, timed in every round and subtracted from its runs: median {np.median(prefills) * 1e3:.1f} ms "
    f"(range {min(prefills) * 1e3:.1f}-{max(prefills) * 1e3:.1f})"
  )
  return SpeedupSweep(speedups, accepted_lengths, sweep_rows, prefills, best_k_shares, sweep_rounds)


def plain_bandwidth(model, passes: PassTimes, cfg: CostValidationConfig, log=print) -> dict[str, float]:
  """Plain decoding's effective read bandwidth: the bytes a one-token pass reads (weights with its
  top-k experts, and the KV cache at the middle of a run: `analysis/regime`) over the measured
  plain pass time, against this machine's streaming read bandwidth."""
  context = cfg.prompt_bytes + 1 + cfg.max_new_tokens // 2
  pass_bytes = regime.regime_of(model, 1, context=context).pass_bytes
  ms = passes.measured_ms(1)
  gbps, stream = regime.effective_gbps(pass_bytes, ms), regime.stream_gbps()
  log(
    f"  plain pass {ms:.3f} ms reads {pass_bytes / 1e6:.1f} MB: {gbps:.1f} GB/s effective against "
    f"{stream:.1f} GB/s streaming ({gbps / stream:.0%})"
  )
  return {
    "plain_pass_ms": ms,
    "bytes_per_pass": pass_bytes,
    "context": context,
    "effective_gbps": gbps,
    "stream_gbps": stream,
    "share_of_stream": gbps / stream,
  }


def add_loop_efficiency(sweep_rows: list[dict], passes: PassTimes, log=print) -> None:
  """Adds to each sweep row the speedup predicted from the isolated pass times (interpolated by
  acceptance, `pass_times_at`, plus drafting) and the row's realised accepted length, and the loop
  efficiency: the measured speedup over that prediction (1: the loop costs nothing beyond its
  passes)."""
  plain_ms = passes.measured_ms(1)
  for r in sweep_rows:
    k = r["num_draft"]
    pass_rel = pass_times_at(passes.step_ms_by_end, r["alpha"])(k + 1) + passes.draft_ms(k) / plain_ms
    r["predicted_speedup_from_pass_times"] = r["mean_accepted_length"] / pass_rel
    r["loop_efficiency"] = r["speedup"] / r["predicted_speedup_from_pass_times"]
  if sweep_rows:
    eff = [r["loop_efficiency"] for r in sweep_rows]
    log(
      f"  loop efficiency (measured speedup / predicted from isolated passes): median {np.median(eff):.3f}, "
      f"range {min(eff):.3f}-{max(eff):.3f}"
    )


def pass_times_at(step_ms_by_end: dict, a: float):
  """Pass time of n tokens at acceptance a, in units of a plain pass: (1 - a) T0[K] + a T1[K] from
  the pass times with every draft wrong (T0) and right (T1)."""
  # Each end in units of its own plain pass (the two were timed apart; only ratios carry over).
  wrong, right = (step_ms_by_end[e] / step_ms_by_end[e][0] for e in (0.0, 1.0))
  return lambda n: float((1.0 - a) * wrong[n - 1] + a * right[n - 1])


def _best_k_on(a: float, max_k: int, t_verify_ms, t_draft_ms=lambda k: 0.0) -> tuple[int, float]:
  """`cost_model.best_k` for pass times t_verify_ms(n) (plain decoding: n = 1) and drafting times
  t_draft_ms(k) in the same unit (default: drafting free)."""
  return cost_model.best_k(a, max_k, t_verify_ms(1), t_draft_ms, t_verify_ms)


@dataclasses.dataclass(frozen=True)
class BestKComparison:
  """Best K per acceptance rate, each predictor of PREDICTORS against the measured one. `rows`:
  metrics.json's `best_k`; per predictor column: `within_one`, the share of rates where the
  measured best K is within 1 of it, `within_one_resampled`, that share expected with the rounds
  resampled, `cost_of_prediction`, the measured speedup at its K over the best measured;
  `self_agreement`: the resampled share for the measured best K itself."""

  rows: list
  within_one: dict
  within_one_resampled: dict
  self_agreement: float
  cost_of_prediction: dict


def best_k_comparison(alphas: Sequence[float], max_k: int, sweep: SpeedupSweep, passes: PassTimes) -> BestKComparison:
  """The best K at each rate of `alphas` predicted by the bytes model (fixed or linear non-expert
  time) and by the measured pass times (at a = 0.5, or interpolated by acceptance), against the
  sweep's measured best K."""
  best_rows = []
  for a in alphas:
    measured_k = measured_best_k(sweep.speedups, a, max_k)
    draft, plain_ms = passes.draft_ms, passes.measured_ms(1)
    pred_k, pred_s = _best_k_on(a, max_k, passes.verify.predicted_ms.__getitem__, draft)
    step_k, _ = _best_k_on(a, max_k, passes.measured_ms, draft)
    step_a_k, _ = _best_k_on(a, max_k, pass_times_at(passes.step_ms_by_end, a), lambda k: draft(k) / plain_ms)
    linear_k, _ = _best_k_on(a, max_k, passes.verify.predicted_linear_ms.__getitem__, draft)
    measured_nonexpert_k, _ = _best_k_on(a, max_k, passes.verify.predicted_measured_nonexpert_ms.__getitem__, draft)
    best_rows.append(
      {
        "alpha": a,
        "predicted": pred_k,
        "measured": measured_k,
        "predicted_from_step_times": step_k,
        "predicted_from_step_times_by_acceptance": step_a_k,
        "predicted_linear_nonexpert": linear_k,
        "predicted_measured_nonexpert": measured_nonexpert_k,
        "predicted_speedup": float(pred_s),
        "measured_speedup": sweep.speedups[(a, measured_k)],
        "measured_speedup_at_predicted": sweep.speedups[(a, pred_k)],
        "measured_best_k_bootstrap_shares": sweep.best_k_shares[a],
        "rounds": sweep.rounds[a],
      }
    )
  within = {col: float(np.mean([abs(r[col] - r["measured"]) <= 1 for r in best_rows])) for col in PREDICTORS}
  # The same question asked of the rounds resampled: how often the measured best K lands within 1
  # of each predictor's K, and of the measured best K itself (what timing noise leaves of the goal
  # figure: no predictor can expect to agree with a resampled measurement more often than that).
  within_resampled = {
    col: float(np.mean([rounds.share_within_one(r["measured_best_k_bootstrap_shares"], r[col]) for r in best_rows]))
    for col in PREDICTORS
  }
  self_agreement = float(
    np.mean([rounds.share_within_one(r["measured_best_k_bootstrap_shares"], r["measured"]) for r in best_rows])
  )
  # Where measured speedups are flat in K (within run-to-run timing noise) the measured
  # argmax is itself noisy; what choosing the predicted K costs is the measured speedup there
  # against the best measured one.
  cost_of_prediction = {}
  for col in PREDICTORS:
    frac = [sweep.speedups[(r["alpha"], r[col])] / r["measured_speedup"] for r in best_rows]
    cost_of_prediction[col] = {
      "within_5pct": float(np.mean(np.array(frac) >= 0.95)),
      "worst": float(min(frac)),
      "median": float(np.median(frac)),
    }
  return BestKComparison(best_rows, within, within_resampled, self_agreement, cost_of_prediction)


def _log_best_k(best: BestKComparison, log) -> None:
  """The best-K agreement of each predictor, as measured and with the rounds resampled."""
  log(
    "  best K within 1 of measured: "
    + ", ".join(f"{best.within_one[col]:.0%} ({name})" for col, (_, name) in PREDICTORS.items())
  )
  log(
    f"  rounds resampled: the measured best K within 1 of itself {best.self_agreement:.0%}; of the predictions "
    + ", ".join(f"{best.within_one_resampled[col]:.0%} ({name})" for col, (_, name) in PREDICTORS.items())
  )


def auto_simulations(a: float, calibrated_step_ms, n_tokens: int, paid_K=None) -> dict:
  """A controlled auto row's simulations (analysis/draft_policy_sim). `simulated`: the policy's own
  cost, free of timing noise (acceptance a and the pass times auto chose with). Given `paid_K`,
  the pass times the sweep measured in decoding at this rate (`pass_costs_from_sweep`),
  `simulated_on_measured_pass_times`: the policy choosing on its calibration but paying those,
  what the calibration's error against decoding costs it."""
  sim_keys = ("plain_over_auto", "best_fixed_num_draft", "best_fixed_over_auto")
  simulated = draft_policy_sim.auto_regret(a, calibrated_step_ms, n_tokens=n_tokens)
  out = {"simulated": {k: simulated[k] for k in sim_keys}}
  if paid_K is not None:
    on_measured = draft_policy_sim.auto_regret(
      a,
      tuple(float(c * calibrated_step_ms[0]) for c in paid_K),
      n_tokens=n_tokens,
      calibrated_ms_K=tuple(calibrated_step_ms),
    )
    out["simulated_on_measured_pass_times"] = dict(
      {k: on_measured[k] for k in sim_keys}, pass_time_ratios=[float(c) for c in paid_K]
    )
  return out


def auto_spec(cfg: CostValidationConfig, drafter: str, acceptance: float | None = None) -> msj.SpecParams:
  """num_draft='auto' up to max_k drafts, as the validation's auto rows run it."""
  draft_cost = cfg.controlled_draft_cost if drafter == "controlled" else "none"
  research = msj.ResearchOptions(
    controlled_acceptance=acceptance, auto_timing=cfg.auto_timing, controlled_draft_cost=draft_cost
  )
  return msj.SpecParams(drafter=drafter, num_draft="auto", max_draft=cfg.max_k, research=research)


def _controlled(acceptance: float, draft_cost: str = "none") -> msj.ResearchOptions:
  """The research options of the controlled drafter at one acceptance rate (`draft_cost`: what its
  passes pay for drafting, ResearchOptions.controlled_draft_cost)."""
  return msj.ResearchOptions(controlled_acceptance=acceptance, controlled_draft_cost=draft_cost)


def _auto_controlled_rows(
  model, prompts, cfg: CostValidationConfig, passes: PassTimes, sweep: SpeedupSweep, parts, log
) -> list[dict]:
  """[5/6] num_draft='auto' with the controlled drafter against plain and the best fixed K (the
  sweep's where it measured the rate, else the best on the measured pass times), each row kept as
  it finishes and shown beside its simulations (`auto_simulations`)."""
  log(
    f"[5/6] num_draft='auto' with the controlled drafter ({len(cfg.auto_alphas)} acceptance rates), "
    f"plain / auto / the best fixed K side by side"
  )
  drafted = range(1, cfg.max_k + 1)
  auto_rows = []
  for a in cfg.auto_alphas:
    best_k = (
      measured_best_k(sweep.speedups, a, cfg.max_k)
      if a in cfg.alphas
      else _best_k_on(a, cfg.max_k, passes.measured_ms, passes.draft_ms)[0]
    )
    spec = auto_spec(cfg, "controlled", a)
    fixed = msj.SpecParams(drafter="controlled", num_draft=best_k, research=_controlled(a, cfg.controlled_draft_cost))
    row = parts.cached(
      f"auto/controlled/{a}",
      lambda: auto_against_fixed(model, prompts, cfg.max_new_tokens, spec, fixed, cfg.auto_repeats, passes.reference),
    )
    paid_K = (
      pass_costs_from_sweep(
        [sweep.speedups[(a, k)] for k in drafted], [sweep.accepted_lengths[(a, k)] for k in drafted]
      )
      if a in cfg.alphas
      else None
    )
    auto_rows.append(
      dict(
        row,
        drafter="controlled",
        alpha=a,
        **auto_simulations(a, row["calibrated_step_ms"], cfg.max_new_tokens - 1, paid_K),
      )
    )
    log("  " + describe_auto(auto_rows[-1]))
  return auto_rows


def drafter_prompt_sets(model, cfg: CostValidationConfig) -> rounds.PromptSets:
  """The held-out prompts the model drafters' rows take in turn (one a round, batch 1), each with
  plain greedy decoding's tokens, which every run of its rounds must reproduce."""
  batches = tuple(
    [p] for p in corpus.held_out_prompts(cfg.drafter_prompts, prompt_bytes=cfg.prompt_bytes, seed=cfg.seed)
  )
  return rounds.PromptSets(
    batches, tuple(msj.generate(model, b, max_new_tokens=cfg.max_new_tokens).tokens for b in batches)
  )


def _real_drafter_part(model, prompt_sets: rounds.PromptSets, cfg: CostValidationConfig, drafter: str, keep) -> dict:
  """One model drafter's auto row against its best fixed K, with its fixed-K speedups (K =
  0..max_k), and the prefills of those speedups' rounds: what the run keeps of it (progress).
  Rounds take the prompts of `prompt_sets` in turn."""
  ks = list(range(cfg.max_k + 1))
  specs = {k: msj.SpecParams(drafter=drafter, num_draft=k) for k in ks[1:]}
  rounds.warm_up(model, prompt_sets, cfg.max_new_tokens, specs)
  fixed_speedups, _, _, drafter_prefills, _ = rounds.round_robin_speedups(
    model, prompt_sets, cfg.max_new_tokens, specs, prompt_sets.rounds_for(cfg.repeats)
  )
  fixed_speedups[0] = 1.0
  programs.PROGRAMS.forget(keep)
  best = max(ks, key=lambda k: fixed_speedups[k])
  spec = auto_spec(cfg, drafter)
  fixed = msj.SpecParams(drafter=drafter if best else "none", num_draft=best)
  row = auto_against_fixed(
    model, prompt_sets, cfg.max_new_tokens, spec, fixed, prompt_sets.rounds_for(cfg.auto_repeats)
  )
  programs.PROGRAMS.forget(keep)
  return {
    "row": dict(
      row, drafter=drafter, alpha=None, fixed_speedups=[fixed_speedups[k] for k in ks], prompts=len(prompt_sets)
    ),
    "prefills": drafter_prefills,
  }


def _auto_real_rows(model, cfg: CostValidationConfig, keep, parts, log) -> tuple[list[dict], list[float]]:
  """[6/6] num_draft='auto' with the model's drafters (mtp where the model has MTP modules), each
  against every fixed K (`_real_drafter_part`, kept as it finishes), over `cfg.drafter_prompts`
  held-out prompts. Returns the rows and the prefills of their fixed-K rounds."""
  log(
    f"[6/6] num_draft='auto' with the model's drafters, against every fixed K ({cfg.drafter_prompts} "
    f"held-out prompts, one a round)"
  )
  drafters = [d for d in cfg.real_drafters if d != "mtp" or model.config.num_mtp_modules]
  auto_rows, prefills = [], []
  prompt_sets = functools.cache(lambda: drafter_prompt_sets(model, cfg))  # only where a row is not kept
  for drafter in drafters:
    part = parts.cached(f"auto/{drafter}", lambda: _real_drafter_part(model, prompt_sets(), cfg, drafter, keep))
    prefills += part["prefills"]
    auto_rows.append(part["row"])
    log(
      f"  {describe_auto(auto_rows[-1])}; fixed K=1..{cfg.max_k} (sweep): "
      + " ".join(f"{s:.2f}" for s in part["row"]["fixed_speedups"][1:])
    )
  return auto_rows, prefills


def cost_model_metrics(
  cfg: CostValidationConfig,
  routing_stats: dict,
  kernels: KernelStage,
  passes: PassTimes,
  sweep: SpeedupSweep,
  best: BestKComparison,
  auto_rows: list,
  prefills: Sequence[float],
  expert_method: str,
  seconds: float,
) -> dict[str, Any]:
  """metrics.json's `cost_model` from the stages' results (`prefills`: every round's prefill of
  the fixed-K sweeps, in seconds)."""
  v = passes.verify
  return {
    # gbps None: time did not grow with bytes over the fitted pass sizes (overhead-bound).
    "fitted": [
      {"method": m, "gbps": None if math.isinf(f.gbps) else f.gbps, "fixed_ms": f.fixed_ms}
      for m, f in kernels.fits.items()
    ],
    "kernel_rows": kernels.rows,
    "fixed_ms": v.fixed_ms,
    "verify_time": v.rows,
    "verify_time_median_rel_error": float(np.median(v.rel_err)),
    "verify_time_median_rel_error_linear_nonexpert": float(np.median(v.rel_err_linear)) if v.rel_err_linear else None,
    "nonexpert_ms_per_token": v.slope_ms,
    "verify_time_median_rel_error_measured_nonexpert": float(np.median(v.rel_err_measured_nonexpert)),
    "nonexpert_ms_per_token_measured": v.measured_slope_ms,
    # The pass time's growth from n = 1 to max_k + 1 that the passes without their routed experts
    # show too (None where the pass time did not grow).
    "nonexpert_share_of_pass_growth": v.nonexpert_growth_share,
    # Timed in every round (the faster of a one-token run before and after it); median and range
    # over the rounds of the fixed-K sweeps (the auto rows subtract their own rounds' too).
    "prefill_ms": float(np.median(prefills) * 1e3),
    "prefill_ms_range": [float(min(prefills) * 1e3), float(max(prefills) * 1e3)],
    "speedup_definition": (
      "decode phase: (plain seconds - prefill) / (speculative seconds - prefill), the prefill timed in the same round"
    ),
    "best_k": best.rows,
    **{f"best_k_within_one_fraction{suffix}": best.within_one[col] for col, (suffix, _) in PREDICTORS.items()},
    # Rounds resampled (rounds.best_k_bootstrap): the expected share of acceptance rates where the
    # measured best K is within 1 of each prediction, and of the full-data measured best K.
    **{
      f"best_k_within_one_resampled{suffix}": best.within_one_resampled[col] for col, (suffix, _) in PREDICTORS.items()
    },
    "measured_best_k_self_agreement": best.self_agreement,
    "step_ms_every_draft_wrong": passes.step_ms_by_end[0.0].tolist(),
    "step_ms_every_draft_right": passes.step_ms_by_end[1.0].tolist(),
    "speedup_at_predicted_over_best": best.cost_of_prediction,
    "crossover": kernels.crossover,
    "speedups": sweep.rows,
    "auto": auto_rows,
    "auto_goals": auto_goals(auto_rows),
    "unique_experts": [
      {k: r[k] for k in ("n_tokens", "empirical", "independent", "uniform", "ipf")}
      for r in routing_stats["unique_experts"]
    ],
    "ipf_mean_abs_rel_error": routing_stats["ipf_mean_abs_rel_error"],
    "config": dataclasses.asdict(cfg),
    "batch_size": 1,
    "expert_method": expert_method,
    "seconds": seconds,
  }


def _write_outputs(result: dict, routing_stats: dict, workdir: pathlib.Path, parts, log) -> None:
  """metrics.json, the three plots and the printed summary; then the run's kept parts are no
  longer needed."""
  atomic.write_json_atomic(workdir / "metrics.json", result)
  plot_staircase(result["cost_model"], workdir / "staircase.png")
  plot_verify_time(result["cost_model"], workdir / "verify_time.png")
  routing_report.plot_routing(routing_stats, workdir / "unique_experts.png")
  log(format_summary(result["cost_model"]))
  parts.finish()
  log(f"wrote {workdir / 'metrics.json'} and plots (staircase, verify_time, unique_experts)")


def auto_against_fixed(
  model, prompts, max_new_tokens: int, auto_spec, fixed_spec, repeats: int, reference=None
) -> dict[str, Any]:
  """Plain, auto and fixed-K decoding side by side (`rounds.round_robin_runs`, same seeds); medians of
  the per-round decode-phase ratios: auto over plain, fixed over plain, and auto over fixed.

  Plain decoding also runs a second time in every round: `plain_vs_plain`, the same program
  against itself, is the timing noise these ratios carry (ideally 1.0). `prompts`: one batch (a
  controlled drafter reading `reference`), or `rounds.PromptSets` taken in turn, every run checked
  against its batch's reference."""
  runs = rounds.round_robin_runs(
    model,
    prompts,
    max_new_tokens,
    {"auto": auto_spec, "plain_again": msj.SpecParams(), "fixed": fixed_spec},
    repeats,
    reference,
  )
  seconds, stats = runs.seconds, runs.stats
  auto_stats = stats["auto"]
  passes_by_k = np.sum([s["passes_by_num_draft"] for s in auto_stats], axis=0)
  ratios = {
    "speedup_vs_plain": (None, "auto"),
    "best_fixed_speedup": (None, "fixed"),
    "vs_best_fixed": ("fixed", "auto"),
    "plain_vs_plain": (None, "plain_again"),
  }
  return {
    **{name: rounds.median_ratio(seconds[num], seconds[den]) for name, (num, den) in ratios.items()},
    # 90% bootstrap intervals of the same medians.
    **{
      f"{name}_interval": rounds.median_ratio_interval(seconds[num], seconds[den])
      for name, (num, den) in ratios.items()
    },
    "best_fixed_num_draft": fixed_spec.num_draft,
    # Over all repeats; the calibrated per-K pass times auto chose with (last run).
    "chosen_num_draft": int(np.argmax(passes_by_k)),
    "mean_num_draft": float(np.arange(passes_by_k.size) @ passes_by_k / max(passes_by_k.sum(), 1)),
    "passes_by_num_draft": passes_by_k.tolist(),
    "calibrated_step_ms": auto_stats[-1]["calibrated_step_ms"],
    "auto_timing": bool(auto_stats[-1]["auto_timing"]),
    # Over all repeats (weighted by verify passes) and their median.
    "mean_accepted_length": pooled_accepted_length(auto_stats),
    "tokens_per_second": statistics.median(s["tokens_per_second"] for s in auto_stats),
  }


def _share(x: float | None) -> str:
  """A share as a percentage, or n/a."""
  return "n/a" if x is None else f"{x:.0%}"


def format_summary(cm) -> str:
  lines = [
    "",
    "best K: predicted by the bytes model (fixed non-expert time / linear non-expert term / "
    "non-expert term measured without routed experts), by the measured pass times (at a = 0.5 / "
    "interpolated by acceptance), and measured (decode-phase speedup at the measured best K; with "
    "the rounds resampled, the K that are the best in at least 10% of resamples)",
    f"{'alpha':>6}{'bytes':>7}{'linear':>8}{'non-exp':>9}{'passes':>8}{'by a':>6}{'measured':>10}"
    f"{'speedup':>9}{'resampled':>11}",
  ]
  for r in cm["best_k"]:
    lo, hi = rounds.plausible_best_k(r["measured_best_k_bootstrap_shares"])
    lines.append(
      f"{r['alpha']:>6.2f}{r['predicted']:>7}{r['predicted_linear_nonexpert']:>8}"
      f"{r['predicted_measured_nonexpert']:>9}"
      f"{r['predicted_from_step_times']:>8}{r['predicted_from_step_times_by_acceptance']:>6}"
      f"{r['measured']:>10}{r['measured_speedup']:>9.2f}{f'{lo}-{hi}' if hi > lo else str(lo):>11}"
    )
  lines.append(
    "best K within 1: "
    + ", ".join(f"{cm['best_k_within_one_fraction' + suffix]:.0%} ({name})" for suffix, name in PREDICTORS.values())
  )
  c = cm["speedup_at_predicted_over_best"]
  lines.append(
    "rounds resampled, best K within 1: "
    + ", ".join(f"{cm['best_k_within_one_resampled' + suffix]:.0%} ({name})" for suffix, name in PREDICTORS.values())
    + f"; the measured best K of itself {cm['measured_best_k_self_agreement']:.0%}"
  )
  lines.append(
    "measured speedup at the predicted K within 5% of the best measured: "
    + ", ".join(
      f"{c[col]['within_5pct']:.0%} ({name}, worst {c[col]['worst']:.2f})" for col, (_, name) in PREDICTORS.items()
    )
  )
  lines.append(
    f"verify time median relative error: {cm['verify_time_median_rel_error']:.1%} (with the measured "
    f"non-expert term, {cm['nonexpert_ms_per_token_measured'] * 1e3:.0f} us per token: "
    f"{cm['verify_time_median_rel_error_measured_nonexpert']:.1%}; the passes without routed "
    f"experts grow by {_share(cm['nonexpert_share_of_pass_growth'])} of the pass time's growth); crossover "
    f"predicted n = {cm['crossover']['predicted_n']}, measured n = {cm['crossover']['measured_n']} "
    f"(dedup faster from there on; first faster at n = {cm['crossover']['measured_first_faster_n']})"
  )
  lines += [describe_auto(r) for r in cm["auto"]]
  g = cm["auto_goals"]
  lines.append(
    f"auto (medians [90% intervals] over rounds): within {1 - AUTO_FLOOR_VS_PLAIN:.0%} of plain in "
    f"{g['within_plain']} of {g['rows']} rows ({g['not_measurably_below_plain']} not measurably "
    f"below), within {1 - AUTO_FLOOR_VS_BEST_FIXED:.0%} of the best fixed K in {g['within_best_fixed']} "
    f"({g['not_measurably_below_best_fixed']} not measurably below)"
  )
  return "\n".join(lines)


def _ratio_text(row, name: str) -> str:
  lo, hi = row[f"{name}_interval"]
  return f"{row[name]:.3f} [{lo:.3f}, {hi:.3f}]"


def _passes_text(passes_K) -> str:
  """Where auto's passes went: the share at K = 0 and the K >= 1 it drafted with most."""
  passes_K = np.asarray(passes_K, float)
  plain = passes_K[0] / max(passes_K.sum(), 1.0)
  drafting = f"drafting mostly at K={int(np.argmax(passes_K[1:])) + 1}" if passes_K[1:].sum() else "never drafting"
  return f"{plain:.0%} of passes plain, {drafting}"


def pass_costs_from_sweep(speedup_K: Sequence[float], accepted_length_K: Sequence[float]) -> np.ndarray:
  """Each K's pass time in units of a plain pass, as decoding ran it (K = 0..len): a run at K
  commits accepted_length tokens per pass where plain decoding commits one, so its decode-phase
  speedup is accepted_length * t[0] / t[K]."""
  speedup_K, accepted_K = np.asarray(speedup_K, float), np.asarray(accepted_length_K, float)
  if speedup_K.shape != accepted_K.shape or np.any(speedup_K <= 0) or np.any(accepted_K < 1):
    raise ValueError(f"need one positive speedup and one accepted length >= 1 per K, got {speedup_K} and {accepted_K}")
  return np.concatenate([[1.0], accepted_K / speedup_K])


def describe_auto(r) -> str:
  """One line per auto row: its medians over rounds with their 90% intervals."""
  who = r["drafter"] + (f" a={r['alpha']:.2f}" if r["alpha"] is not None else "")
  who += f" ({r['prompts']} prompts)" if r.get("prompts", 1) > 1 else ""
  line = (
    f"auto {who}: {_ratio_text(r, 'speedup_vs_plain')}x plain, {_ratio_text(r, 'vs_best_fixed')} of "
    f"best fixed K={r['best_fixed_num_draft']} ({_passes_text(r['passes_by_num_draft'])}, mean K "
    f"{r['mean_num_draft']:.2f}); plain against itself {_ratio_text(r, 'plain_vs_plain')}"
  )
  if "simulated" in r:
    sim = r["simulated"]
    line += (
      f"; simulated: {sim['plain_over_auto']:.3f}x plain, {sim['best_fixed_over_auto']:.3f} of best "
      f"fixed K={sim['best_fixed_num_draft']}"
    )
  if "simulated_on_measured_pass_times" in r:
    sim = r["simulated_on_measured_pass_times"]
    line += (
      f"; choosing on its calibration, paying the sweep's pass times: {sim['plain_over_auto']:.3f}x plain, "
      f"{sim['best_fixed_over_auto']:.3f} of best fixed K={sim['best_fixed_num_draft']}"
    )
  return line


def auto_goals(rows) -> dict[str, int]:
  """How many auto rows meet each goal by their median, and how many are not measurably below
  it (the upper end of the 90% interval reaches the goal)."""

  def count(name, floor, upper=False):
    return sum((r[f"{name}_interval"][1] if upper else r[name]) >= floor for r in rows)

  return {
    "rows": len(rows),
    "within_plain": count("speedup_vs_plain", AUTO_FLOOR_VS_PLAIN),
    "not_measurably_below_plain": count("speedup_vs_plain", AUTO_FLOOR_VS_PLAIN, upper=True),
    "within_best_fixed": count("vs_best_fixed", AUTO_FLOOR_VS_BEST_FIXED),
    "not_measurably_below_best_fixed": count("vs_best_fixed", AUTO_FLOOR_VS_BEST_FIXED, upper=True),
  }


def plot_staircase(cm, path) -> None:
  plt = plots.pyplot()
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  rows = cm["best_k"]
  alphas = [r["alpha"] for r in rows]
  ax1.step(alphas, [r["predicted"] for r in rows], where="mid", label="predicted (bytes model)")
  ax1.step(
    alphas,
    [r["predicted_linear_nonexpert"] for r in rows],
    where="mid",
    ls="-.",
    label="predicted (bytes model, linear non-expert)",
  )
  ax1.step(
    alphas,
    [r["predicted_measured_nonexpert"] for r in rows],
    where="mid",
    ls=(0, (5, 1)),
    label="predicted (bytes model, measured non-expert)",
  )
  ax1.step(
    alphas,
    [r["predicted_from_step_times"] for r in rows],
    where="mid",
    ls="--",
    label="predicted (measured pass times)",
  )
  ax1.step(
    alphas,
    [r["predicted_from_step_times_by_acceptance"] for r in rows],
    where="mid",
    ls=":",
    label="predicted (pass times interpolated by acceptance)",
  )
  ranges = np.array([rounds.plausible_best_k(r["measured_best_k_bootstrap_shares"]) for r in rows], float)
  ax1.vlines(
    alphas,
    ranges[:, 0] - 0.15,
    ranges[:, 1] + 0.15,
    colors="gray",
    lw=5,
    alpha=0.35,
    label="measured, rounds resampled (K best in >= 10%)",
  )
  ax1.plot(alphas, [r["measured"] for r in rows], "o", label="measured")
  plots.finish_axes(ax1, "acceptance rate a", "best K", "best draft length", legend_fontsize=8)
  for k in sorted({r["num_draft"] for r in cm["speedups"]}):
    sel = [r for r in cm["speedups"] if r["num_draft"] == k]
    ax2.plot([r["alpha"] for r in sel], [r["speedup"] for r in sel], "-", lw=1, label=f"K={k}")
  ax2.axhline(1.0, color="gray", ls="--", lw=0.8)
  ax2.set_xlabel("acceptance rate a")
  ax2.set_ylabel("measured decode-phase speedup over plain")
  ax2.legend(fontsize=7, ncol=2)
  ax2.grid(alpha=0.3)
  plots.save(fig, path)


def plot_verify_time(cm, path) -> None:
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  rows = cm["verify_time"]
  ns = [r["n_tokens"] for r in rows]
  ax.plot(ns, [r["measured_ms"] for r in rows], "o-", label="measured (one loop pass)")
  ax.plot(ns, [r["predicted_ms"] for r in rows], "s--", label="predicted: fixed + expert bytes / bandwidth")
  ax.plot(ns, [r["predicted_linear_ms"] for r in rows], "^-.", label="predicted, linear non-expert term")
  ax.plot(ns, [r["predicted_measured_nonexpert_ms"] for r in rows], "v--", label="predicted, non-expert term measured")
  ax.plot(ns, [r["nonexpert_measured_ms"] for r in rows], "x:", label="measured without routed experts")
  ax.plot(ns, [r["predicted_expert_ms"] for r in rows], ":", label="predicted routed-expert part")
  ax.plot(ns, [r["expert_measured_ms"] for r in rows], "+:", label="routed-expert part: pass - pass without them")
  ax.set_ylim(bottom=0)
  plots.finish_axes(ax, "tokens per pass n (K + 1)", "ms per pass", legend_fontsize=8)
  plots.save(fig, path)
