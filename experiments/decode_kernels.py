"""What the CPU decoding kernels buy on a model: plain greedy decoding with the C++ output head,
dense projections and attention (GQA, or MLA's passes against its compressed cache), with each
in turn replaced by XLA's ops, and with none, side by side in interleaved rounds (decode phase
timed apart from the first token; ratios within rounds with 90% intervals; tokens must agree).

  python -m experiments.decode_kernels --workdir=runs/decode_kernels [--model=PATH]
      [--batch_sizes=1,8] [--max_new_tokens=64] [--rounds=11] [--prompt_bytes=192] [--quick]

--model: a directory written by `Model.save` or a Hugging Face model directory (default: the
default trained model); one without a tokenizer.json is prompted with held-out code's UTF-8 bytes
as token ids. Writes `workdir/metrics.json` (key `decode_kernels`), `workdir/table.md` and
`workdir/decode_kernels.png`. CPU only.
"""

import pathlib

import jax
from absl import flags

from moespec_jax import cli
from moespec_jax.io import atomic
from moespec_jax.research import decode_kernels, models, roofline, spec_bench

_WORKDIR = flags.DEFINE_string("workdir", "runs/decode_kernels", "Where metrics.json, table.md and the plot go.")
_MODEL = cli.define_model_flag()
_BATCHES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens generated per prompt (>= 2).", lower_bound=2)
_ROUNDS = flags.DEFINE_integer("rounds", 11, "Interleaved rounds (every variant once per round).", lower_bound=1)
_PROMPT_BYTES = flags.DEFINE_integer("prompt_bytes", 192, "Bytes of held-out code per prompt.", lower_bound=16)
_QUICK = cli.define_quick_flag(
  "batch 1, short outputs, few rounds", {"batch_sizes": ["1"], "max_new_tokens": 8, "rounds": 3}
)


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  if jax.default_backend() != "cpu":
    raise ValueError(f"decode_kernels compares the CPU kernels; this backend is {jax.default_backend()}")
  batch_sizes = cli.int_list("batch_sizes", _BATCHES.value)
  model = models.load_model(_MODEL.value)
  max_new, rounds = _MAX_NEW.value, _ROUNDS.value
  prompts, encoding = spec_bench.bench_prompts(model, max(batch_sizes), _PROMPT_BYTES.value)
  regimes = roofline.measured_regimes(
    model, prompts, batch_sizes, context=_PROMPT_BYTES.value + max_new, max_new_tokens=max_new
  )
  rows = decode_kernels.decode_kernels_ab(
    model, prompts, batch_sizes=batch_sizes, max_new_tokens=max_new, rounds=rounds
  )
  workdir = pathlib.Path(_WORKDIR.value)
  atomic.write_json_atomic(
    workdir / "metrics.json",
    {
      "decode_kernels": {
        "model": _MODEL.value or "default",
        "prompt_encoding": encoding,
        "prompt_bytes": _PROMPT_BYTES.value,
        "max_new_tokens": max_new,
        "rounds": rounds,
        "batch_sizes": batch_sizes,
        "rows": rows,
        "regime": regimes,
      }
    },
  )
  table = decode_kernels.format_table(rows)
  atomic.write_text_atomic(workdir / "table.md", table)
  decode_kernels.plot(rows, workdir / "decode_kernels.png")
  print(table)
  print(f"wrote {workdir / 'metrics.json'}, {workdir / 'table.md'} and {workdir / 'decode_kernels.png'}")


if __name__ == "__main__":
  cli.run(main)
