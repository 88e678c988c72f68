"""Exact vs budgeted (approximate) speculative decoding on the default trained model.

  python -m experiments.compare_modes --workdir=runs/compare_modes
      [--drafter=mtp] [--num_drafts=2,3,4] [--batch_sizes=1,4] [--temperatures=0,1]
      [--policies=truncate,substitute] [--budget_multipliers=1,1.5,2,3,4] [--scope=batch]
      [--kernel=dedup] [--repeats=3] [--quick]

Budgets: top_k x each multiplier, and none (the exact row). Every program runs once untimed before
its timed repeats. Writes DIR/metrics.json (`compare_modes`) and DIR/pareto.png; budgeted rows are
labelled approximate and carry their quality figures.
"""

from absl import flags

from moespec_jax import cli
from moespec_jax.model import budget
from moespec_jax.research import compare_modes, models

_WORKDIR = flags.DEFINE_string("workdir", "runs/compare_modes", "Output directory.")
_MODEL = cli.define_model_flag()
_DRAFTER = flags.DEFINE_enum("drafter", "mtp", ["mtp", "ngram", "none"], "Drafter.")
_NUM_DRAFTS = flags.DEFINE_list("num_drafts", ["2", "3", "4"], "Draft lengths K.")
_BATCHES = flags.DEFINE_list("batch_sizes", ["1", "4"], "Batch sizes.")
_TEMPS = flags.DEFINE_list("temperatures", ["0", "1"], "Temperatures (0 = greedy).")
_POLICIES = flags.DEFINE_list("policies", ["truncate", "substitute"], "Budget policies.")
_MULTIPLIERS = flags.DEFINE_list(
  "budget_multipliers", ["1", "1.5", "2", "3", "4"], "Expert budgets as multiples of the model's top_k (rounded up)."
)
_SCOPE = flags.DEFINE_enum("scope", "batch", ["batch", "row"], "Budget per pass of the batch or per row.")
_KERNEL = flags.DEFINE_enum("kernel", "dedup", ["auto", "dedup", "per_slot", "xla"], "Expert kernel (both modes).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens per prompt.", lower_bound=1)
_REPEATS = flags.DEFINE_integer(
  "repeats", 3, "Timed repeats per row, after one untimed run (median; 90% interval from 2 repeats).", lower_bound=1
)
_QUICK = cli.define_quick_flag(
  "one K, batch 1, greedy, two budgets",
  {
    "num_drafts": ["2"],
    "batch_sizes": ["1"],
    "temperatures": ["0"],
    "budget_multipliers": ["1", "2"],
    "max_new_tokens": 32,
    "repeats": 3,
  },
)


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  # Checked before a model is loaded (or trained). K = 0 is plain decoding in both modes.
  cli.choice_list("policies", _POLICIES.value, budget.POLICIES)
  kwargs = dict(
    drafter=_DRAFTER.value,
    num_drafts=cli.int_list("num_drafts", _NUM_DRAFTS.value, minimum=0),
    batch_sizes=cli.int_list("batch_sizes", _BATCHES.value),
    temperatures=cli.float_list("temperatures", _TEMPS.value),
    budget_multipliers=cli.float_list("budget_multipliers", _MULTIPLIERS.value, minimum=1.0) + [None],
    policies=list(_POLICIES.value),
    scope=_SCOPE.value,
    kernel=_KERNEL.value,
    max_new_tokens=_MAX_NEW.value,
    repeats=_REPEATS.value,
  )
  compare_modes.run_compare_modes(models.load_model(_MODEL.value), _WORKDIR.value, **kwargs)
  if _QUICK.value:
    print(
      f"--quick: a smoke run ({_REPEATS.value} timed repeats of {_MAX_NEW.value} tokens per row): its speedups "
      "are measured as a full run's but over few tokens; run without --quick for results."
    )


if __name__ == "__main__":
  cli.run(main)
