"""Generate text from a model.

  python -m experiments.generate --prompt="def fib(n):" --max_new_tokens=64
      [--model=DIR] [--temperature=0.8 --top_k=0 --top_p=0.95] [--prompt=... (a batch)]
      [--drafter=mtp|ngram --num_draft=3|auto [--max_draft=8]] [--mtp_prompt_window=16]
      [--mode=budgeted --expert_budget=N [--measure_quality]] [--seed=0] [--pass_trace]
      [--workdir=DIR]

Without --model it uses the default trained model (`make demo` creates it). Exact mode
(the default) samples the target's distribution whatever the drafter; --mode=budgeted caps the
experts of each verification pass and is APPROXIMATE (its output says so). Prints the text,
tokens/s and, with a drafter, the mean accepted length and the acceptance at each draft depth;
with --workdir also writes DIR/metrics.json (key `generate`: prompts, texts, tokens, statistics).
One generation: no --quick, and no plot. With --num_draft=auto the first call calibrates its pass
times (seconds): a line on stderr as it starts and ends, and its time printed beside the decode's
(tokens/s counts the decode alone).
"""

import pathlib
import sys

from absl import flags

import moespec_jax as msj
from moespec_jax import cli
from moespec_jax.decoding import report
from moespec_jax.io import atomic, paths
from moespec_jax.research import models

_PROMPT = flags.DEFINE_multi_string("prompt", ["def fib(n):"], "Prompt(s); repeat the flag for a batch.")
_MODEL = cli.define_model_flag(unset="the cached default model: `make demo` creates it")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per prompt.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k filter (0 = off).", lower_bound=0)
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Top-p filter (1 = off).")
# The controlled research drafter needs a plain run's tokens: it is a Python-API and cost_model tool.
_DRAFTER = flags.DEFINE_enum("drafter", "none", ["none", "mtp", "ngram"], "Drafter (none: plain decoding).")
_NUM_DRAFT = flags.DEFINE_string(
  "num_draft", "3", "Drafted tokens per pass, or 'auto' (chosen each pass by the cost model, 0..--max_draft)."
)
_MAX_DRAFT = flags.DEFINE_integer("max_draft", 8, "Largest K of --num_draft=auto.", lower_bound=1, upper_bound=16)
_MTP_WINDOW = flags.DEFINE_integer(
  "mtp_prompt_window",
  16,
  "--drafter=mtp: the heads read each prompt's last this many positions (0: every position).",
  lower_bound=0,
)
_MODE = flags.DEFINE_enum("mode", "exact", ["exact", "budgeted"], "budgeted: APPROXIMATE expert budget.")
_BUDGET = flags.DEFINE_integer("expert_budget", None, "Experts per MoE layer and pass (--mode=budgeted).")
_QUALITY = flags.DEFINE_bool(
  "measure_quality", False, "Budgeted: also run the exact pass and report top-1 agreement and KL (slower)."
)
_KERNEL = flags.DEFINE_enum("kernel", "auto", ["auto", "dedup", "per_slot", "xla"], "Expert kernel.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")
_PASS_TRACE = flags.DEFINE_bool(
  "pass_trace",
  False,
  "Time every pass inside the program (CPU) and print the first passes' times and the later ones' median at each K.",
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Also write DIR/metrics.json: prompts, texts, tokens, statistics.")


def _num_draft(text: str):
  if text == "auto":
    return "auto"
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"--num_draft must be a whole number or 'auto', got {text!r}") from None


def describe_acceptance(by_depth) -> str:
  """'1: 0.92, 2: 0.81, ...': the share of drafts accepted at each depth ('-' where none was drafted)."""
  return ", ".join(f"{d}: {'-' if a != a else f'{a:.2f}'}" for d, a in enumerate(by_depth, start=1))


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  research = msj.ResearchOptions(
    mtp_prompt_window=_MTP_WINDOW.value or None, measure_quality=_QUALITY.value, pass_trace=_PASS_TRACE.value
  )
  spec = msj.SpecParams(
    drafter=_DRAFTER.value,
    num_draft=_num_draft(_NUM_DRAFT.value),
    max_draft=_MAX_DRAFT.value,
    mode=_MODE.value,
    expert_budget=_BUDGET.value,
    kernel=_KERNEL.value,
    research=research,
  )
  sampling = msj.SamplingParams(temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value)
  if _MODEL.value is None and not (paths.default_model_dir() / "config.json").exists():
    # Generating is quick; training the default model is not: say so rather than start it.
    raise FileNotFoundError(f"no default model at {paths.default_model_dir()}: run `make demo` first or pass --model")
  model = models.load_model(_MODEL.value)
  out = msj.generate(
    model,
    list(_PROMPT.value),
    max_new_tokens=_MAX_NEW.value,
    sampling=sampling,
    spec=spec,
    seed=_SEED.value,
    progress=lambda line: print(line, file=sys.stderr, flush=True),
  )
  texts = [model.tokenizer.decode([int(t) for t in row if t >= 0]) for row in out.tokens]
  for prompt, text in zip(_PROMPT.value, texts):
    print(prompt + text)
    print("-" * 40)
  s = out.stats
  # The decode's time, and apart from it the calibration num_draft='auto' ran first (once per program).
  calibrated = f"; calibration before it {s['calibration_seconds']:.1f} s" if s.get("calibration_seconds") else ""
  print(
    f"{s['generated_tokens']} tokens in {s['seconds']:.3f} s ({s['tokens_per_second']:.1f} tokens/s{calibrated}), "
    f"{s['passes']} passes, mean accepted length {s['mean_accepted_length']:.2f}"
  )
  if _DRAFTER.value != "none":
    print("acceptance by depth: " + describe_acceptance(s["acceptance_by_depth"]))
  if s.get("passes_by_num_draft") is not None:
    print(
      "auto K: passes by K "
      + " ".join(f"{k}:{n}" for k, n in enumerate(s["passes_by_num_draft"]) if n)
      + f"; acceptance estimate {s['acceptance_estimate']:.2f}"
      + f"; pass times calibrated on {s['calibration'].replace('_', ' ')}"
      + ("" if s["calibration_seconds"] else " (kept from an earlier call)")
    )
  if "pass_trace" in s:
    print(report.describe_pass_trace(s["pass_trace"]))
  if s["approximate"]:
    quality = (
      f"; top-1 agreement with exact {s['top1_agreement']:.3f}, mean KL {s['mean_kl']:.4f}"
      if "top1_agreement" in s
      else "; --measure_quality reports its cost"
    )
    print(f"APPROXIMATE: expert budget {s['expert_budget']} per MoE layer and pass{quality}")
  if _WORKDIR.value:
    path = pathlib.Path(_WORKDIR.value) / "metrics.json"
    atomic.write_json_atomic(
      path, {"generate": {"prompts": list(_PROMPT.value), "texts": texts, "tokens": out.tokens.tolist(), "stats": s}}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
  cli.run(main)
