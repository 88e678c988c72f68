"""The bytes/bandwidth cost model against measurements on the trained model: best draft length
per acceptance rate (controlled drafter, K = 0..8), verification time per pass size, the
dedup/per-slot crossover, and num_draft='auto' against plain decoding and the best fixed K.

  python -m experiments.cost_model --workdir=runs/cost_model [--quick] [--model=PATH]
      [--n_alphas=21] [--max_k=8] [--repeats=7] [--max_repeats=3 x repeats] [--auto_repeats=31]
      [--drafter_prompts=8] [--auto_timing] [--max_new_tokens=128] [--verify_max_k=15]
      [--controlled_draft_cost=auto|none|mtp] [--real_drafters=mtp,ngram]

Writes `workdir/metrics.json` (key `cost_model`), `staircase.png`, `verify_time.png` and
`unique_experts.png`. Batch 1, greedy (the controlled drafter's acceptance is geometric only
against greedy verification). Every program runs once, untimed, before its timed rounds.
Resumable: each acceptance rate of the sweep and each auto row is kept in `workdir/progress.json`
as it finishes; rerun the same command (same settings, same model) after an interruption and only
the rest is measured (the file is removed when the run completes).
"""

import dataclasses

import numpy as np
from absl import flags

from moespec_jax import cli
from moespec_jax.research import cost_validation, models

_QUICK_CONFIG = cost_validation.QUICK_CONFIG
_WORKDIR = flags.DEFINE_string("workdir", "runs/cost_model", "Where metrics.json and the plots go.")
_MODEL = cli.define_model_flag()
_N_ALPHAS = flags.DEFINE_integer("n_alphas", 21, "Acceptance rates, evenly spaced in [0, 1].", lower_bound=2)
_MAX_K = flags.DEFINE_integer("max_k", 8, "Largest draft length K.", lower_bound=1, upper_bound=16)
_REPEATS = flags.DEFINE_integer(
  "repeats",
  7,
  "Rounds per acceptance rate, each running plain decoding and every K once (median of ratios).",
  lower_bound=1,
)
_MAX_REPEATS = flags.DEFINE_integer(
  "max_repeats",
  None,
  "Most rounds per acceptance rate (>= --repeats; default 3 x --repeats, with --quick "
  "--repeats): where the measured best K is unsettled (within 1 of itself in under 90% of resamples of the "
  "rounds), --repeats more rounds at a time up to this many.",
)
_AUTO_REPEATS = flags.DEFINE_integer(
  "auto_repeats",
  31,
  "Rounds of plain, auto and the best fixed K side by side, per num_draft='auto' row.",
  lower_bound=1,
)
_DRAFTER_PROMPTS = flags.DEFINE_integer(
  "drafter_prompts",
  8,
  "Held-out prompts the model drafters' rows (mtp, ngram) take in turn, one a round.",
  lower_bound=1,
)
_AUTO_TIMING = flags.DEFINE_bool(
  "auto_timing",
  False,
  "Run the num_draft='auto' rows with SpecParams(auto_timing=True) (experimental, CPU): "
  "the calibrated pass times corrected by the loop's own clock as it decodes.",
)
_MAX_NEW = flags.DEFINE_integer(
  "max_new_tokens", 128, "Tokens generated per run (a decode phase: >= 2).", lower_bound=2
)
_DRAFT_COST = flags.DEFINE_enum(
  "controlled_draft_cost",
  "auto",
  ["auto", "none", "mtp"],
  "What the controlled drafter's passes pay for drafting: none (a table lookup), mtp (the model's MTP heads "
  "run every pass, their drafts discarded; the verify times are measured without them and their time per K "
  "apart), auto: mtp where the model has MTP heads.",
)
_VERIFY_MAX_K = flags.DEFINE_integer(
  "verify_max_k",
  None,
  "Verify time (T(n)/T(1) against the bytes and Amdahl predictions) for n = 1..this + 1 (default --max_k).",
  lower_bound=1,
  upper_bound=16,
)
_REAL_DRAFTERS = flags.DEFINE_list(
  "real_drafters",
  ["mtp", "ngram"],
  "The model's drafters of the num_draft='auto' rows (mtp where the model has heads; empty: none, e.g. on a "
  "random model, whose heads and prompt lookup accept next to nothing; --quick: ngram).",
)
_QUICK = cli.define_quick_flag(
  "one round per comparison, fewer rates and pass sizes, the n-gram drafter only: a check of the pipeline, "
  "whose speedups and best K are not results",
  {
    "n_alphas": len(_QUICK_CONFIG.alphas),
    "max_k": _QUICK_CONFIG.max_k,
    "repeats": _QUICK_CONFIG.repeats,
    "auto_repeats": _QUICK_CONFIG.auto_repeats,
    "drafter_prompts": _QUICK_CONFIG.drafter_prompts,
    "max_new_tokens": _QUICK_CONFIG.max_new_tokens,
  },
)


def _real_drafters(base) -> tuple[str, ...]:
  """--real_drafters as given (empty: none), else the base config's (--quick: ngram only)."""
  if not flags.FLAGS["real_drafters"].present:
    return base.real_drafters
  return (
    tuple(cli.check_choices("--real_drafters", _REAL_DRAFTERS.value, ("mtp", "ngram"))) if _REAL_DRAFTERS.value else ()
  )


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  alphas = tuple(float(a) for a in np.round(np.linspace(0.0, 1.0, _N_ALPHAS.value), 3))
  max_repeats = _MAX_REPEATS.value
  if max_repeats is None:
    max_repeats = _REPEATS.value if _QUICK.value else 3 * _REPEATS.value
  # --quick: the smaller kernel, trace and auto settings of QUICK_CONFIG, beside the flags' values.
  base = _QUICK_CONFIG if _QUICK.value else cost_validation.CostValidationConfig()
  cfg = dataclasses.replace(
    base,
    alphas=alphas,
    max_k=_MAX_K.value,
    repeats=_REPEATS.value,
    max_repeats=max_repeats,
    auto_repeats=_AUTO_REPEATS.value,
    max_new_tokens=_MAX_NEW.value,
    drafter_prompts=_DRAFTER_PROMPTS.value,
    auto_timing=_AUTO_TIMING.value,
    verify_max_k=_VERIFY_MAX_K.value,
    real_drafters=_real_drafters(base),
  )
  if _QUICK.value:
    print(
      f"--quick: a check of the pipeline ({cfg.repeats} round(s) per comparison): its speedups and best K are "
      "not results; run without --quick, or give --repeats and --auto_repeats, for them.",
      flush=True,
    )
  model = models.load_model(_MODEL.value)
  draft_cost = _DRAFT_COST.value
  if draft_cost == "auto":
    draft_cost = "mtp" if model.config.num_mtp_modules else "none"
  cost_validation.run_cost_model(model, _WORKDIR.value, dataclasses.replace(cfg, controlled_draft_cost=draft_cost))


if __name__ == "__main__":
  cli.run(main, resumable=True)
