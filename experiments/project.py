"""Projected speculative decoding for a model config on a machine you describe (no weights, no
measurement): pass bytes and time per size for the dedup and per-slot kernels, the crossover,
the routed experts' share of a pass, and the best draft length per acceptance rate.

  python -m experiments.project --config=configs/deepseek_v2_lite.py --read_gbps=4000
      [--fixed_ms=0.3] [--dedup_bandwidth_ratio=0.6] [--batch_size=1] [--context=2048]
      [--dtype=bfloat16] [--draft_cost=0.04] [--max_k=8] [--workdir=runs/project]
      [--routing_stats=runs/routing_stats/metrics.json]

Writes DIR/metrics.json (key `projection`) and DIR/projection.png. Measure read_gbps and the
dedup ratio on the target machine with experiments.kernel_bench. Distinct experts per pass assume
uniform routing (an upper bound) unless --routing_stats names the metrics.json of a routing_stats
run on a model with the config's experts and top-k (e.g. `routing_stats --model=HF_DIR`).
"""

import pathlib

from absl import flags
from ml_collections import config_flags

from moespec_jax import cli
from moespec_jax.config import model_config_from
from moespec_jax.io import atomic
from moespec_jax.research import projection

_CONFIG = config_flags.DEFINE_config_file("config", "configs/deepseek_v2_lite.py", "Model config.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/project", "Output directory.")
_GBPS = flags.DEFINE_float("read_gbps", None, "Effective read bandwidth (GB/s) of the machine.", required=True)
_FIXED = flags.DEFINE_float("fixed_ms", 0.0, "Fixed time per pass (ms): launches, synchronisation.")
_RATIO = flags.DEFINE_float("dedup_bandwidth_ratio", 1.0, "Dedup kernel's bandwidth / per-slot kernel's.")
_BATCH = flags.DEFINE_integer("batch_size", 1, "Rows decoded together.")
_CONTEXT = flags.DEFINE_integer("context", 1024, "Tokens in each row's KV cache.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Weight and cache dtype.")
_DRAFT = flags.DEFINE_float(
  "draft_cost", 0.0, "Cost of one drafted token, in plain passes (0: prompt lookup; an MTP module: about 1 / n_layers)."
)
_MAX_K = flags.DEFINE_integer("max_k", 8, "Largest draft length.")
_ROUTING = flags.DEFINE_string(
  "routing_stats",
  None,
  "metrics.json of experiments.routing_stats on a model with "
  "this config's experts and top-k: its measured distinct experts instead of uniform.",
)


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  config = model_config_from(_CONFIG.value.model).replace(dtype=_DTYPE.value)
  machine = projection.Machine(read_gbps=_GBPS.value, fixed_ms=_FIXED.value, dedup_bandwidth_ratio=_RATIO.value)
  routing = projection.load_routing_curve(_ROUTING.value) if _ROUTING.value else None
  result = projection.project(
    config,
    machine,
    batch=_BATCH.value,
    context=_CONTEXT.value,
    draft_cost=_DRAFT.value,
    max_k=_MAX_K.value,
    max_tokens=max(16, _MAX_K.value + 1),
    routing=routing,
  )
  result["config_name"] = _CONFIG.value.get("name", "")
  workdir = pathlib.Path(_WORKDIR.value)
  workdir.mkdir(parents=True, exist_ok=True)
  atomic.write_json_atomic(workdir / "metrics.json", {"projection": result})
  projection.plot(result, workdir / "projection.png")
  print(
    f"PROJECTED (bytes model, not measured): {result['config_name']}, {config.dtype}, batch "
    f"{_BATCH.value}, context {_CONTEXT.value}, {_GBPS.value:g} GB/s"
  )
  print(projection.describe(result))
  print(f"wrote {workdir / 'metrics.json'}")


if __name__ == "__main__":
  cli.run(main)
