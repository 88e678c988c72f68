"""`make demo`: train (first run) or load the default model, then compare decoding modes.

  python -m experiments.demo --workdir=runs/demo
"""

from absl import flags

from moespec_jax import cli
from moespec_jax.research import demo
from moespec_jax.default_model import ensure_default_model

_WORKDIR = flags.DEFINE_string("workdir", "runs/demo", "Where metrics.json goes.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Tokens generated per prompt.", lower_bound=1)
_REPEATS = flags.DEFINE_integer(
    "repeats", 7, "Timed pairs of plain and speculative runs per row (medians reported).", lower_bound=1)


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  model = ensure_default_model()
  demo.run_demo(model, _WORKDIR.value, max_new_tokens=_MAX_NEW.value, repeats=_REPEATS.value)


if __name__ == "__main__":
  cli.run(main)
