"""Draft trees by policy on the default trained model and its MTP heads: chains (K = 1..4), trees
of N nodes chosen by the drafter's probability or by their predicted experts (EcoSpec-style, at
each --penalties value), each also truncated to the prefix that pays (EVICT-style); and first, how
well each light predictor names the target's experts for a token before it is routed.

  python -m experiments.tree_bench --workdir=runs/tree_bench [--quick] [--model=PATH]
      [--tree_nodes=4,8,16] [--depth=3] [--chain_ks=1,2,3,4] [--penalties=0.25,1]
      [--batch_sizes=1,4] [--temperatures=0,1] [--max_new_tokens=128] [--repeats=3] [--num_prompts=4]

Expert-aware choice and truncation run at temperature 0 only (they choose nodes by their tokens,
which sampled verification does not allow); sampled rows are the chains and probability trees.
Writes `workdir/metrics.json` (key `tree_bench`, rewritten after every row) and `workdir/trees.png`.
"""

from absl import flags

from moespec_jax import cli
from moespec_jax.research import models, tree_bench

_WORKDIR = flags.DEFINE_string("workdir", "runs/tree_bench", "Where metrics.json and trees.png go.")
_MODEL = cli.define_model_flag()
_NODES = flags.DEFINE_list("tree_nodes", ["4", "8", "16"], "Tree sizes N (draft nodes a pass verifies).")
_DEPTH = flags.DEFINE_integer("depth", 3, "The trees' depth D (a tree of N < D nodes is N deep).", lower_bound=1)
_CHAIN_KS = flags.DEFINE_list("chain_ks", ["1", "2", "3", "4"], "Chains' draft lengths K.")
_PENALTIES = flags.DEFINE_list(
  "penalties", ["0.25", "1"], "Expert-aware trees' penalties (nats a predicted new expert); the first also truncated."
)
_BATCHES = flags.DEFINE_list("batch_sizes", ["1", "4"], "Batch sizes.")
_TEMPS = flags.DEFINE_list("temperatures", ["0", "1"], "Temperatures (0: greedy).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Tokens generated per prompt.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed pairs (plain, tree) per row (medians).", lower_bound=1)
_PROMPTS = flags.DEFINE_integer(
  "num_prompts",
  None,
  "Held-out prompts each batch size decodes (default: 4, or the largest batch size if more).",
  lower_bound=1,
)
_QUICK = cli.define_quick_flag(
  "N = 4, batch 1, greedy, short outputs",
  {
    "tree_nodes": ["4"],
    "chain_ks": ["2"],
    "penalties": ["1"],
    "batch_sizes": ["1"],
    "temperatures": ["0"],
    "max_new_tokens": 16,
    "repeats": 1,
  },
)


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  sweep = dict(
    tree_nodes=cli.int_list("tree_nodes", _NODES.value),
    depth=_DEPTH.value,
    chain_ks=cli.int_list("chain_ks", _CHAIN_KS.value),
    penalties=cli.float_list("penalties", _PENALTIES.value),
    batch_sizes=cli.int_list("batch_sizes", _BATCHES.value),
    temperatures=cli.float_list("temperatures", _TEMPS.value),
    max_new_tokens=_MAX_NEW.value,
    repeats=_REPEATS.value,
    num_prompts=_PROMPTS.value,
  )
  if sweep["num_prompts"] is not None and sweep["num_prompts"] < max(sweep["batch_sizes"]):
    raise ValueError(
      f"--num_prompts ({sweep['num_prompts']}) must be at least the largest batch size ({max(sweep['batch_sizes'])})"
    )
  model = models.load_model(_MODEL.value)
  tree_bench.run_tree_bench(model, _WORKDIR.value, **sweep)


if __name__ == "__main__":
  cli.run(main)
