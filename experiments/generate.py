"""Generate text from a model.

  python -m experiments.generate --prompt="def fib(n):" --max_new_tokens=64
      [--checkpoint=DIR] [--temperature=0.8 --top_k=0 --top_p=0.95] [--batch=1] [--seed=0]

Without --checkpoint it uses the default trained model (`make demo` creates it).
"""

from absl import flags

import moespec_jax as msj
from moespec_jax import cli
from moespec_jax.io import paths

_PROMPT = flags.DEFINE_multi_string("prompt", ["def fib(n):"], "Prompt(s); repeat the flag for a batch.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Model directory (default: the cached default model).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k filter (0 = off).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Top-p filter (1 = off).")
_DRAFTER = flags.DEFINE_string("drafter", "none", "Drafter: none | mtp | ngram.")
_NUM_DRAFT = flags.DEFINE_integer("num_draft", 3, "Drafted tokens per pass.")
_KERNEL = flags.DEFINE_string("kernel", "auto", "Expert kernel: auto | dedup | per_slot | xla.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  path = _CHECKPOINT.value or paths.default_model_dir()
  if _CHECKPOINT.value is None and not (paths.default_model_dir() / "config.json").exists():
    raise FileNotFoundError(f"no default model at {path}: run `make demo` first or pass --checkpoint")
  model = msj.Model.load(path)
  out = msj.generate(
      model, list(_PROMPT.value), max_new_tokens=_MAX_NEW.value,
      sampling=msj.SamplingParams(temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value),
      spec=msj.SpecParams(drafter=_DRAFTER.value, num_draft=_NUM_DRAFT.value, kernel=_KERNEL.value),
      seed=_SEED.value)
  for prompt, row in zip(_PROMPT.value, out.tokens):
    print(prompt + model.tokenizer.decode([int(t) for t in row if t >= 0]))
    print("-" * 40)
  s = out.stats
  print(f"{s['generated_tokens']} tokens in {s['seconds']:.3f} s ({s['tokens_per_second']:.1f} tokens/s), "
        f"{s['passes']} passes, mean accepted length {s['mean_accepted_length']:.2f}")


if __name__ == "__main__":
  cli.run(main)
