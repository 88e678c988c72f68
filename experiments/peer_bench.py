"""Side by side with transformers: plain greedy and prompt-lookup decoding on imported checkpoints.

  python -m experiments.peer_bench --workdir=runs/peer_bench [--quick] [--families=mixtral,trained_qwen2_moe]

One random checkpoint per family (built offline with transformers) and the default trained model
exported as a Qwen2-MoE checkpoint, each loaded by `moespec_jax.Model.load`: plain greedy tokens/s
against transformers `generate` at batch 1 and 8, and prompt lookup against its
`prompt_lookup_num_tokens`, measured in interleaved rounds (what is measured and how:
moespec_jax/research/peer_bench.py). Writes DIR/metrics.json, DIR/table.md and DIR/peer_bench.png
after each family; rerun the same command after an interruption and only the families left are
measured. Needs the dev extra.
"""

from absl import flags

from moespec_jax import cli
from moespec_jax.research import peer_bench

_WORKDIR = flags.DEFINE_string("workdir", "runs/peer_bench", "Where metrics.json, table.md and the plot go.")
_FAMILIES = flags.DEFINE_list(
  "families",
  [],
  "Checkpoints to run: families of moespec_jax.hf and/or "
  f"{peer_bench.TRAINED} (default: every family, and the trained model unless "
  "--notrained).",
)
_MAX_NEW = flags.DEFINE_integer(
  "max_new_tokens",
  peer_bench.FULL_DEFAULTS["max_new_tokens"],
  "Tokens generated per prompt (a decode phase: >= 2).",
  lower_bound=2,
)
_REPEATS = flags.DEFINE_integer(
  "repeats", peer_bench.FULL_DEFAULTS["repeats"], "Rounds per family (medians over rounds).", lower_bound=1
)
_NUM_DRAFT = flags.DEFINE_integer(
  "num_draft", 4, "Draft length of both prompt-lookup decoders.", lower_bound=1, upper_bound=16
)
_PROMPT_LEN = flags.DEFINE_integer(
  "prompt_len", peer_bench.FULL_DEFAULTS["prompt_len"], "Prompt tokens per row.", lower_bound=1
)
_TRAINED = flags.DEFINE_bool(
  "trained",
  True,
  "Also the default trained model, exported as a Qwen2-MoE checkpoint (trained first when "
  "missing; not with --quick): a model whose output repeats its context, so prompt lookup has drafts to accept.",
)
_AUTO = flags.DEFINE_bool(
  "auto_draft",
  True,
  "Our n-gram decoder with num_draft='auto' (K <= --num_draft, "
  "K = 0 where lookup does not pay); else a fixed K = --num_draft.",
)
_QUICK = cli.define_quick_flag(
  "the tiny checkpoints of each family, fewer tokens and rounds", peer_bench.QUICK_DEFAULTS
)


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  cfg = peer_bench.make_config(
    _FAMILIES.value,
    trained=_TRAINED.value,
    quick=_QUICK.value,
    max_new_tokens=_MAX_NEW.value,
    repeats=_REPEATS.value,
    num_draft=_NUM_DRAFT.value,
    prompt_len=_PROMPT_LEN.value,
    auto_draft=_AUTO.value,
  )
  peer_bench.run_peer_bench(_WORKDIR.value, cfg, log=lambda line: print(line, flush=True))


if __name__ == "__main__":
  cli.run(main, resumable=True)
