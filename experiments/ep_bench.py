"""Expert parallelism on a trained model's routing: rank load per verification pass (n = 1..16
tokens, K = n - 1 drafts) on the meshes (8,) and (2, 4) and on two nodes of four ranks, under
contiguous, popularity-balanced and pass-load-fitted expert placements (and the last with each
layer's hottest experts on every rank); bytes a pass dispatches and combines and the share crossing
nodes; the cost model's pass time on the clusters of --clusters with the combine's share (projected,
not measured); and a functional check of generation on 8 simulated CPU devices.

  python -m experiments.ep_bench --workdir=runs/ep_bench [--quick] [--model=PATH]
      [--clusters=configs/clusters/default.py] [--projected_configs=deepseek_v2_lite,mixtral_8x7b]
      [--segments=64] [--max_tokens=16] [--hot_experts=1] [--nofunctional]

Writes `workdir/metrics.json` (key `ep_bench`) and `workdir/ep_load.png`.
"""

import os

# Eight simulated CPU devices for the functional check, set before JAX starts (a count given in
# XLA_FLAGS is kept).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import configs  # noqa: E402
from moespec_jax import cli  # noqa: E402
from moespec_jax.research import ep_bench, models  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", "runs/ep_bench", "Where metrics.json and ep_load.png go.")
_MODEL = cli.define_model_flag()
_CLUSTERS = config_flags.DEFINE_config_file(
  "clusters", "configs/clusters/default.py", "Clusters of the projection (stated bandwidths)."
)
_PROJECTED = flags.DEFINE_list(
  "projected_configs",
  ["deepseek_v2_lite", "mixtral_8x7b"],
  "configs/NAME.py models also projected on the clusters (bfloat16, uniform routing).",
)
_SEGMENTS = flags.DEFINE_integer("segments", 64, "Held-out windows of the routing trace (half fit, half judge).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 16, "Largest pass size n.", lower_bound=1)
_HOT = flags.DEFINE_integer("hot_experts", 1, "Hottest experts a layer put on every rank (pass_load+hot).")
_FUNCTIONAL = flags.DEFINE_bool("functional", True, "Run the functional check on simulated devices.")
_QUICK = cli.define_quick_flag(
  "a short trace, passes up to 4 tokens", {"segments": 8, "max_tokens": 4, "projected_configs": ["mixtral_8x7b"]}
)


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  if _SEGMENTS.value < 2:
    raise ValueError(f"--segments must be at least 2 (half fit, half judge), got {_SEGMENTS.value}")
  projected = {name: configs.model_config(name).replace(dtype="bfloat16") for name in _PROJECTED.value}
  clusters = [dict(cluster) for cluster in _CLUSTERS.value.values()]
  model = models.load_model(_MODEL.value, train_heads=False)
  ep_bench.run_ep_bench(
    model,
    _WORKDIR.value,
    clusters=clusters,
    projected_configs=projected,
    n_segments=_SEGMENTS.value,
    max_tokens=_MAX_TOKENS.value,
    hot=_HOT.value,
    functional=_FUNCTIONAL.value,
  )


if __name__ == "__main__":
  cli.run(main)
