"""Tokens/s of plain vs speculative decoding (mtp and ngram drafters, K = 1..6), batch 1, 2, 4
and 8, greedy and temperature 1, on held-out code prompts with the default trained model and
its MTP heads (trained when missing).

  python -m experiments.spec_bench --workdir=runs/spec_bench [--quick] [--model=PATH]
      [--batch_sizes=1,8] [--temperatures=0,1] [--drafters=mtp,ngram] [--num_draft=1,2,3,auto]
      [--max_new_tokens=64] [--repeats=3] [--num_prompts=8] [--tree_nodes=0,4,8,16]

--model: a directory written by `Model.save` or a Hugging Face model directory; one without a
tokenizer.json (a random checkpoint) is prompted with the held-out code's UTF-8 bytes as token ids
(metrics `prompt_encoding`). Every batch size decodes the same `--num_prompts` prompts (default:
the largest batch size), in consecutive batches: batch 1 decodes each of them alone. Writes
`workdir/metrics.json` (key `spec_bench`) and `workdir/speedup_vs_k.png`. `--tree_nodes`: draft
trees of N nodes (depth K) beside the chains (0), with the best tree against the best chain.
"""

from absl import flags

from moespec_jax import cli
from moespec_jax.research import models, spec_bench

_WORKDIR = flags.DEFINE_string("workdir", "runs/spec_bench", "Where metrics.json and the plot go.")
_MODEL = cli.define_model_flag()
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens generated per prompt.", lower_bound=1)
_REPEATS = flags.DEFINE_integer(
  "repeats", 3, "Timed runs per row, after one untimed run (median reported).", lower_bound=1
)
_BATCHES = flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8"], "Batch sizes.")
_TEMPS = flags.DEFINE_list("temperatures", ["0", "1"], "Temperatures (0: greedy).")
_DRAFTERS = flags.DEFINE_list("drafters", ["mtp", "ngram"], "Drafters (mtp needs MTP heads).")
_KS = flags.DEFINE_list("num_draft", ["1", "2", "3", "4", "5", "6"], "Draft lengths K (whole numbers, or auto).")
_TREES = flags.DEFINE_list(
  "tree_nodes",
  ["0"],
  "Draft tree sizes N (0: chains of K drafts); N > 0 runs trees of N nodes and depth K for every fixed K <= N.",
)
_PROMPTS = flags.DEFINE_integer(
  "num_prompts",
  None,
  "Held-out prompts every batch size decodes, in consecutive batches (default: the largest batch "
  "size; batch 1 decodes each prompt alone).",
  lower_bound=1,
)
_QUICK = cli.define_quick_flag(
  "batch 1, K = 2, greedy, short outputs",
  {"batch_sizes": ["1"], "temperatures": ["0"], "num_draft": ["2"], "max_new_tokens": 16, "repeats": 3},
)


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  cli.choice_list("drafters", _DRAFTERS.value, ("mtp", "ngram"))
  # Checked before a model is loaded (or trained).
  sweep = dict(
    batch_sizes=cli.int_list("batch_sizes", _BATCHES.value),
    temperatures=cli.float_list("temperatures", _TEMPS.value),
    num_drafts=[k if k == "auto" else cli.int_list("num_draft", [k])[0] for k in _KS.value],
    max_new_tokens=_MAX_NEW.value,
    repeats=_REPEATS.value,
    num_prompts=_PROMPTS.value,
    tree_nodes=cli.int_list("tree_nodes", _TREES.value, minimum=0),
  )
  if sweep["num_prompts"] is not None and sweep["num_prompts"] < max(sweep["batch_sizes"]):
    raise ValueError(
      f"--num_prompts ({sweep['num_prompts']}) must be at least the largest batch size ({max(sweep['batch_sizes'])})"
    )
  model = models.load_model(_MODEL.value)
  drafters = [d for d in _DRAFTERS.value if d != "mtp" or model.config.num_mtp_modules]
  spec_bench.run_spec_bench(model, _WORKDIR.value, drafters=drafters, **sweep)


if __name__ == "__main__":
  cli.run(main)
