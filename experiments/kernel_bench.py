"""Kernel benchmark: one MoE layer's routed experts, dedup vs per_slot vs xla, n_tokens 1..16.

  python -m experiments.kernel_bench --workdir=DIR [--quick] [--shapes=...] [--n_list=...]

Writes DIR/metrics.json (key `kernel_bench`) atomically and PNG plots of time and effective
bandwidth (requested bytes / time, pallas_kernels.bytes) vs n per method, crossover marked
(DIR/kernel_bench_<shape>_<routing>.png). The
methods are timed in alternation on the same input; the crossover is the first n from which
dedup stays faster (analysis/kernel_report).
The streaming read bandwidth (jnp.sum over 256 MB, f32) is measured in the same run, around
every shape. Layers whose f32 weights exceed --max_weight_gb are benchmarked on a subset of
their experts (top_k unchanged); rows and stdout say so.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

import configs
import pallas_kernels
from moespec_jax import cli
from moespec_jax.analysis import timing
from moespec_jax.io import atomic, plots
from moespec_jax.research import kernel_report
from moespec_jax.research.roofline import stream_read_gbps
from pallas_kernels import bytes as kbytes


def expert_layer_shape(config_name: str) -> tuple[int, int, int, int]:
  """(d_model, n_routed_experts, top_k, expert_hidden) of the model in configs/<config_name>.py."""
  config = configs.model_config(config_name)
  return config.d_model, config.n_routed_experts, config.top_k, config.expert_hidden


# One routed-expert layer of each model config (the published dimensions: configs/*.py).
SHAPES = {
  name: expert_layer_shape(name)
  for name in ("tiny", "deepseek_v2_lite", "qwen3_30b_a3b", "mixtral_8x7b", "olmoe_1b_7b", "deepseek_v3", "gpt_oss_20b")
}
DEFAULT_SHAPES = ("tiny", "deepseek_v2_lite", "qwen3_30b_a3b", "mixtral_8x7b")
METHODS = ("dedup", "per_slot", "xla")
ROUTINGS = ("uniform", "correlated")

_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.", required=True)
_SHAPES = flags.DEFINE_list("shapes", list(DEFAULT_SHAPES), f"Layer shapes among {list(SHAPES)}.")
_N_LIST = flags.DEFINE_list("n_list", [str(n) for n in range(1, 17)], "Tokens per pass.")
_ROUTINGS = flags.DEFINE_list("routings", list(ROUTINGS), "uniform and/or correlated.")
_METHODS = flags.DEFINE_list("methods", list(METHODS), "Methods to time.")
_REPEATS = flags.DEFINE_integer("repeats", 7, "Timed repeats (median reported).", lower_bound=1)
_OVERLAP = flags.DEFINE_float(
  "overlap",
  0.38,
  "Correlated routing: share of a token's experts taken from the previous token.",
  lower_bound=0.0,
  upper_bound=1.0,
)
_MAX_WEIGHT_GB = flags.DEFINE_float("max_weight_gb", 3.0, "Benchmark a subset of experts above this.")
_BACKEND = flags.DEFINE_string("backend", "auto", "Kernel backend for dedup/per_slot.")
_QUICK = cli.define_quick_flag(
  "the tiny shape, three pass sizes", {"shapes": ["tiny"], "n_list": ["1", "2", "4"], "repeats": 3}
)
_SEED = flags.DEFINE_integer("seed", 0, "Routing and weight seed.")


def make_routing(rng, n_tokens, n_experts, top_k, kind, overlap=0.38):
  """Expert ids [n, K]: uniform (independent tokens) or correlated (share with the previous token)."""
  ids = np.zeros((n_tokens, top_k), np.int32)
  for t in range(n_tokens):
    chosen = []
    if kind == "correlated" and t > 0:
      prev = list(ids[t - 1])
      n_keep = rng.binomial(top_k, overlap)
      chosen = list(rng.choice(prev, n_keep, replace=False))
    rest = [e for e in range(n_experts) if e not in chosen]
    chosen += list(rng.choice(rest, top_k - len(chosen), replace=False))
    ids[t] = rng.permutation(chosen)
  return ids


def _layer(shape, max_weight_gb, seed):
  d, e, k, f = SHAPES[shape]
  per_expert = kbytes.expert_bytes(d, f, 4)
  e_bench = int(min(e, max(k, max_weight_gb * 1e9 // per_expert)))
  keys = jax.random.split(jax.random.key(seed), 3)
  w = (
    jax.random.normal(keys[0], (e_bench, d, f)) / np.sqrt(d),
    jax.random.normal(keys[1], (e_bench, d, f)) / np.sqrt(d),
    jax.random.normal(keys[2], (e_bench, f, d)) / np.sqrt(f),
  )
  return (d, e, e_bench, k, f), jax.block_until_ready(w)


def bench_shape(shape, n_list, routings, methods, repeats, overlap, max_weight_gb, backend, seed, log):
  (d, e, e_bench, k, f), w = _layer(shape, max_weight_gb, seed)
  note = "" if e_bench == e else f" (benchmarking {e_bench} of {e} experts to fit memory)"
  log(f"[{shape}] d_model {d}, {e} experts top-{k}, hidden {f}{note}")
  fns = {m: jax.jit(lambda *a, m=m: pallas_kernels.expert_ffn(*a, method=m, backend=backend)) for m in methods}
  rng = np.random.default_rng(seed)
  rows = []
  for routing in routings:
    for n in n_list:
      ids = make_routing(rng, n, e_bench, k, routing, overlap)
      x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
      g = jnp.full((n, k), 1.0 / k, jnp.float32)
      u = kbytes.unique_experts(ids)
      parts = []
      ids_j = jnp.asarray(ids)
      times_ms = timing.median_times_alternating_ms(
        {m: (lambda fn=fns[m]: fn(x, ids_j, g, *w)) for m in methods}, repeats
      )
      for m in methods:
        t_ms = times_ms[m]
        b = kbytes.bytes_requested(ids, d, f, 4, m)
        gbps = b / t_ms / 1e6
        rows.append(
          dict(
            shape=shape,
            n_tokens=n,
            method=m,
            routing=routing,
            unique_experts=u,
            bytes_requested=int(b),
            time_ms=t_ms,
            effective_gbps=gbps,
            experts_benchmarked=e_bench,
            n_experts=e,
          )
        )
        parts.append(f"{m} {t_ms:8.3f} ms {gbps:6.1f} GB/s")
      log(f"  {routing:10s} n={n:2d} unique={u:3d}  " + "  ".join(parts))
  del w
  return rows


def plot(rows, crossover, workdir):
  plt = plots.pyplot()
  paths = []
  for shape in sorted({r["shape"] for r in rows}):
    for routing in sorted({r["routing"] for r in rows if r["shape"] == shape}):
      fig, axes = plt.subplots(1, 2, figsize=(11, 4))
      for m in METHODS:
        sel = sorted(
          (r for r in rows if r["shape"] == shape and r["routing"] == routing and r["method"] == m),
          key=lambda r: r["n_tokens"],
        )
        if not sel:
          continue
        ns = [r["n_tokens"] for r in sel]
        axes[0].plot(ns, [r["time_ms"] for r in sel], "o-", label=m)
        axes[1].plot(ns, [r["effective_gbps"] for r in sel], "o-", label=m)
      cross = next((c["measured_n"] for c in crossover if c["shape"] == shape and c["routing"] == routing), None)
      for ax, yl in zip(axes, ("time per layer (ms)", "effective bandwidth (GB/s)")):
        if cross is not None:
          ax.axvline(cross, color="gray", ls="--", label=f"crossover n={cross}")
        ax.set_xlabel("tokens per pass n")
        ax.set_ylabel(yl)
        ax.legend()
      fig.suptitle(f"{shape}, {routing} routing")
      p = os.path.join(workdir, f"kernel_bench_{shape}_{routing}.png")
      plots.save(fig, p, dpi=90)
      paths.append(p)
  return paths


def run(workdir, shapes, n_list, routings, methods, repeats, overlap, max_weight_gb, backend, seed):
  for s in shapes:
    if s not in SHAPES:
      raise ValueError(f"unknown shape {s!r}; known: {list(SHAPES)}")
  cli.choice_list("routings", routings, ROUTINGS)
  cli.choice_list("methods", methods, METHODS)
  kernels = pallas_kernels.resolve_backend(backend)  # refuses an unknown backend
  os.makedirs(workdir, exist_ok=True)
  log = lambda s: print(s, flush=True)
  log(f"backend {jax.default_backend()}; kernels: {kernels}")
  streams = [stream_read_gbps()]
  log(f"stream read: {streams[-1]:.1f} GB/s")
  rows = []
  for shape in shapes:
    rows += bench_shape(shape, n_list, routings, methods, repeats, overlap, max_weight_gb, backend, seed, log)
    streams.append(stream_read_gbps())
    log(f"stream read: {streams[-1]:.1f} GB/s")
  stream = float(np.median(streams))
  ratio, crossover = kernel_report.summarize(rows, stream)
  for c in crossover:
    fr = c["best_fraction_of_stream"]
    log(
      f"[{c['shape']}/{c['routing']}] crossover n={c['measured_n']} (dedup faster from there on; first "
      f"faster at n={c['first_faster_n']}); best/stream: " + " ".join(f"{n}:{v:.2f}" for n, v in fr.items())
    )
  metrics = {
    "kernel_bench": dict(
      stream_read_gbps=stream,
      stream_read_gbps_samples=streams,
      platform=jax.default_backend(),
      kernel_backend=pallas_kernels.resolve_backend(backend),
      repeats=repeats,
      dtype="float32",
      rows=rows,
      ratio=ratio,
      crossover=crossover,
      note="effective_gbps = bytes_requested / time; bytes per pallas_kernels.bytes; "
      "experts_benchmarked < n_experts means a subset of the layer's experts (memory)",
    )
  }
  metrics["kernel_bench"]["plots"] = plot(rows, crossover, workdir)
  atomic.write_json_atomic(os.path.join(workdir, "metrics.json"), metrics)
  log(f"wrote {os.path.join(workdir, 'metrics.json')}")
  return metrics


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  run(
    _WORKDIR.value,
    _SHAPES.value,
    cli.int_list("n_list", _N_LIST.value),
    _ROUTINGS.value,
    _METHODS.value,
    _REPEATS.value,
    _OVERLAP.value,
    _MAX_WEIGHT_GB.value,
    _BACKEND.value,
    _SEED.value,
  )


if __name__ == "__main__":
  cli.run(main)
