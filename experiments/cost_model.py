"""The bytes/bandwidth cost model against measurements on the trained model: best draft length
per acceptance rate (controlled drafter, K = 0..8), verification time per pass size, the
dedup/per-slot crossover, and num_draft='auto' against plain decoding and the best fixed K.

  python -m experiments.cost_model --workdir=runs/cost_model [--quick] [--model=PATH] \
      [--n_alphas=21] [--max_k=8] [--repeats=7] [--max_repeats=3 x repeats] [--auto_repeats=31] [--drafter_prompts=8] \
      [--auto_timing] [--max_new_tokens=128]

Writes `workdir/metrics.json` (key `cost_model`), `staircase.png`, `verify_time.png` and
`unique_experts.png`. Batch 1, greedy (the controlled drafter's acceptance is geometric only
against greedy verification). Resumable: each acceptance rate of the sweep and each auto row is
kept in `workdir/progress.json` as it finishes; rerun the same command (same settings, same
model) after an interruption and only the rest is measured (the file is removed when the run
completes).
"""

import dataclasses

import numpy as np
from absl import flags

from moespec_jax import cli
from moespec_jax.research import cost_validation

_WORKDIR = flags.DEFINE_string("workdir", "runs/cost_model", "Where metrics.json and the plots go.")
_MODEL = cli.define_model_flag()
_QUICK = flags.DEFINE_bool("quick", False, "A small run (5 acceptance rates, K <= 2, short outputs).")
_N_ALPHAS = flags.DEFINE_integer("n_alphas", 21, "Acceptance rates, evenly spaced in [0, 1].", lower_bound=2)
_MAX_K = flags.DEFINE_integer("max_k", 8, "Largest draft length K.", lower_bound=1, upper_bound=16)
_REPEATS = flags.DEFINE_integer(
    "repeats", 7, "Rounds per acceptance rate, each running plain decoding and every K once (median of ratios).",
    lower_bound=1)
_MAX_REPEATS = flags.DEFINE_integer(
    "max_repeats", None, "Most rounds per acceptance rate (>= --repeats; default 3 x --repeats): where the "
    "measured best K is unsettled (within 1 of itself in under 90% of resamples of the rounds), --repeats more "
    "rounds at a time up to this many.")
_AUTO_REPEATS = flags.DEFINE_integer(
    "auto_repeats", 31, "Rounds of plain, auto and the best fixed K side by side, per num_draft='auto' row.",
    lower_bound=1)
_DRAFTER_PROMPTS = flags.DEFINE_integer(
    "drafter_prompts", 8, "Held-out prompts the model drafters' rows (mtp, ngram) take in turn, one a round.",
    lower_bound=1)
_AUTO_TIMING = flags.DEFINE_bool(
    "auto_timing", False, "Run the num_draft='auto' rows with SpecParams(auto_timing=True) (experimental, CPU): "
    "the calibrated pass times corrected by the loop's own clock as it decodes.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Tokens generated per run (a decode phase: >= 2).",
                                lower_bound=2)


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  if _QUICK.value:
    cfg = dataclasses.replace(cost_validation.QUICK_CONFIG, auto_timing=_AUTO_TIMING.value)
  else:
    alphas = tuple(float(a) for a in np.round(np.linspace(0.0, 1.0, _N_ALPHAS.value), 3))
    cfg = cost_validation.CostValidationConfig(alphas=alphas, max_k=_MAX_K.value, repeats=_REPEATS.value,
                                               max_repeats=(3 * _REPEATS.value if _MAX_REPEATS.value is None else
                                                            _MAX_REPEATS.value),
                                               auto_repeats=_AUTO_REPEATS.value, max_new_tokens=_MAX_NEW.value,
                                               drafter_prompts=_DRAFTER_PROMPTS.value,
                                               auto_timing=_AUTO_TIMING.value)
  cost_validation.run_cost_model(cli.load_model(_MODEL.value), _WORKDIR.value, cfg)


if __name__ == "__main__":
  cli.run(main)
