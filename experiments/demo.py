"""`make demo`: train (first run) or load the default model, then compare decoding modes.

  python -m experiments.demo --workdir=runs/demo [--model=DIR] [--quick] [--nosampled] [--nomemory_bound]

Writes DIR/metrics.json (key `demo`) and DIR/speedup.png.
"""

from absl import flags

from moespec_jax import cli
from moespec_jax.research import demo, models

_WORKDIR = flags.DEFINE_string("workdir", "runs/demo", "Where metrics.json and speedup.png go.")
_MODEL = cli.define_model_flag()
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Tokens generated per prompt.", lower_bound=1)
_REPEATS = flags.DEFINE_integer(
  "repeats",
  7,
  "Timed pairs of plain and speculative runs per row, after one untimed run of each (medians reported).",
  lower_bound=1,
)
_BATCHES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes.")
# 4, not SpecParams' 8: each K is a loop of auto K's program and a calibration, compiled and timed in
# the demo's time (a fresh make demo: docs/findings/2026-12-04-make-demo.md); on the default model
# auto K chooses K <= 1.
_MAX_DRAFT = flags.DEFINE_integer("max_draft", 4, "Largest K of num_draft='auto'.", lower_bound=1, upper_bound=16)
_SAMPLED = flags.DEFINE_bool(
  "sampled",
  True,
  "Also the plain and exact rows with sampling (temperature 1, top-p 0.95) at the smallest batch size, beside greedy.",
)
_MEMORY_BOUND = flags.DEFINE_bool(
  "memory_bound",
  True,
  "Also rows on the memory-bound configurations (random weights, the controlled drafter at the default heads' "
  "measured acceptance, paying their own heads' draft cost), where speculation can pay on this machine.",
)
_QUICK = cli.define_quick_flag(
  "batch 1, shorter outputs, fewer pairs, no memory-bound rows",
  {"batch_sizes": ["1"], "max_new_tokens": 32, "repeats": 3, "memory_bound": False},
)


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  batch_sizes = cli.int_list("batch_sizes", _BATCHES.value)
  model = models.load_model(_MODEL.value)
  demo.run_demo(
    model,
    _WORKDIR.value,
    max_new_tokens=_MAX_NEW.value,
    batch_sizes=tuple(batch_sizes),
    repeats=_REPEATS.value,
    max_draft=_MAX_DRAFT.value,
    sampled=_SAMPLED.value,
    memory_bound=demo.MEMORY_BOUND_CONFIGS if _MEMORY_BOUND.value else (),
  )


if __name__ == "__main__":
  cli.run(main)
