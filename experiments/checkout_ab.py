"""Two checkouts of the framework timed side by side (a refactor or an upgrade against the code before it).

  python -m experiments.checkout_ab --a=../old-checkout --b=. [--model=DIR] [--rounds=15]
      [--batch_size=1] [--max_new_tokens=128] [--calls=plain,mtp_k3,...] [--workdir=runs/checkout_ab]

Each checkout runs the same generate() calls in a worker process of its own (public API only),
taken in interleaved rounds; prints each call's median time on each side and the median B/A ratio
over rounds with its 90% interval, and checks that both sides produce the same tokens. Writes
metrics.json in --workdir.
"""

import pathlib

from absl import flags

from moespec_jax import cli
from moespec_jax.io import atomic, paths
from moespec_jax.research import checkout_ab

_A = flags.DEFINE_string("a", None, "Checkout A (the reference), a directory holding moespec_jax/.", required=True)
_B = flags.DEFINE_string("b", ".", "Checkout B (the candidate).")
_MODEL = cli.define_model_flag(unset="the cached default model: `make demo` creates it")
_ROUNDS = flags.DEFINE_integer("rounds", 15, "Interleaved rounds.", lower_bound=3)
_BATCH = flags.DEFINE_integer("batch_size", 1, "Prompts per call.", lower_bound=1)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Tokens per call.", lower_bound=2)
_CALLS = flags.DEFINE_list("calls", list(checkout_ab.CALLS), f"Calls among {', '.join(checkout_ab.CALLS)}.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/checkout_ab", "Where metrics.json goes.")


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  calls = cli.choice_list("calls", _CALLS.value, list(checkout_ab.CALLS))
  for name, path in (("--a", _A.value), ("--b", _B.value)):
    if not (pathlib.Path(path) / "moespec_jax" / "__init__.py").is_file():
      raise ValueError(f"{name}={path} is not a checkout of the framework (no moespec_jax/__init__.py)")
  model_dir = pathlib.Path(_MODEL.value) if _MODEL.value else paths.default_model_dir()
  if not (model_dir / "config.json").is_file():
    raise FileNotFoundError(f"no model at {model_dir}: run `make demo` first or pass --model")
  result = checkout_ab.compare(
    _A.value,
    _B.value,
    model_dir,
    calls=calls,
    rounds=_ROUNDS.value,
    batch_size=_BATCH.value,
    max_new_tokens=_MAX_NEW.value,
  )
  print(checkout_ab.format_table(result))
  workdir = pathlib.Path(_WORKDIR.value)
  atomic.write_json_atomic(workdir / "metrics.json", {"checkout_ab": result})
  print(f"wrote {workdir / 'metrics.json'}")


if __name__ == "__main__":
  cli.run(main)
