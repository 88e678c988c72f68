"""Routing statistics of the default trained model on held-out code.

  python -m experiments.routing_stats --workdir=runs/routing_stats [--model=DIR]
      [--source=heldout|generated] [--n_segments=64] [--seq_len=256] [--quick]

Writes DIR/metrics.json (key `routing_stats`), DIR/trace.npz and DIR/routing.png.
"""

import pathlib

from absl import flags

from moespec_jax import cli
from moespec_jax.io import atomic
from moespec_jax.research import models, routing_report, traces

_WORKDIR = flags.DEFINE_string("workdir", "runs/routing_stats", "Output directory.")
_MODEL = cli.define_model_flag()
_SOURCE = flags.DEFINE_enum("source", "heldout", ["heldout", "generated"], "Where the routing comes from.")
_SEGMENTS = flags.DEFINE_integer(
  "n_segments", 64, "Held-out windows (or prompts for 'generated'): half fit the models, half test them.", lower_bound=2
)
_SEQ_LEN = flags.DEFINE_integer(
  "seq_len",
  256,
  "Tokens per window (or generated tokens per prompt): at least --max_tokens, and "
  f"{routing_report.MAX_DISTANCE + 1} for the overlap up to distance {routing_report.MAX_DISTANCE}.",
  lower_bound=routing_report.MAX_DISTANCE + 1,
)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 16, "Largest pass size n.", lower_bound=2)
_IPF_MAX = flags.DEFINE_integer(
  "ipf_max_tokens", 9, "Largest n for the IPF model (2^n states; its error is over n = 2 and up).", lower_bound=2
)
_QUICK = cli.define_quick_flag(
  "fewer and shorter windows, smaller passes", {"n_segments": 8, "seq_len": 32, "max_tokens": 8, "ipf_max_tokens": 5}
)


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  if _SEQ_LEN.value < _MAX_TOKENS.value:
    raise ValueError(f"--seq_len ({_SEQ_LEN.value}) must be >= --max_tokens ({_MAX_TOKENS.value})")
  workdir = pathlib.Path(_WORKDIR.value)
  model = models.load_model(_MODEL.value)
  if _SOURCE.value == "heldout":
    trace = traces.heldout_trace(model, n_segments=_SEGMENTS.value, seq_len=_SEQ_LEN.value)
  else:
    trace = traces.generated_trace(model, n_prompts=_SEGMENTS.value, max_new_tokens=_SEQ_LEN.value)
  workdir.mkdir(parents=True, exist_ok=True)
  written = [workdir / "trace.npz", workdir / "metrics.json", workdir / "routing.png"]
  trace.save(written[0])
  stats = routing_report.routing_stats(trace, max_tokens=_MAX_TOKENS.value, ipf_max_tokens=_IPF_MAX.value)
  atomic.write_json_atomic(written[1], {"routing_stats": stats})
  routing_report.plot_routing(stats, written[2])
  print(f"{'n':>3}{'empirical':>11}{'IPF':>9}{'independent':>13}{'uniform':>9}")
  for r in stats["unique_experts"]:
    ipf_text = f"{r['ipf']:9.2f}" if r["ipf"] is not None else f"{'-':>9}"
    print(f"{r['n_tokens']:>3}{r['empirical']:>11.2f}{ipf_text}{r['independent']:>13.2f}{r['uniform']:>9.2f}")
  overlap = stats["overlap_by_distance"]
  print(
    "overlap by distance:",
    ", ".join(f"d={o['distance']}: {o['overlap']:.3f}" for o in overlap),
    f"(independent {overlap[0]['independent']:.3f})",
  )
  print(
    f"mean abs relative error ({stats['error_range']}): IPF {stats['ipf_mean_abs_rel_error']:.2%}, "
    f"independent {stats['independent_mean_abs_rel_error']:.2%}"
  )
  print("wrote " + ", ".join(str(p) for p in written))


if __name__ == "__main__":
  cli.run(main)
