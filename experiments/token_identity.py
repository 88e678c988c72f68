"""A fixed set of generate() calls whose tokens must not change across a refactor or an upgrade.

  python -m experiments.token_identity --record=runs/identity/before.json
  python -m experiments.token_identity --check=runs/identity/before.json
  python -m experiments.token_identity --record=runs/identity/default.json --models= (the default model only)

Plain, MTP, n-gram, auto K (greedy only: its K per pass follows timed calibrations), the budgeted
mode and the controlled drafter (greedy, proposing the plain greedy tokens with probability 0.8,
so that long accepted runs, rollbacks and EOS paths are exercised on random models too); greedy
and sampled with a seed; batch 1 and a ragged batch of 4; on two random
models (GQA and MLA, each with an MTP module) and, with --default_model, the cached trained
model. Deterministic calls also record their statistics (accepted lengths, acceptance by depth,
experts per pass). --check prints every call that differs and exits 1 if any does.
"""

from __future__ import annotations

import json
import pathlib
import sys

from absl import flags

import moespec_jax as msj
from moespec_jax import cli

_RECORD = flags.DEFINE_string("record", None, "Write the calls' tokens to this JSON file.")
_CHECK = flags.DEFINE_string("check", None, "Compare the calls' tokens with this recorded JSON file.")
_DEFAULT = flags.DEFINE_bool("default_model", True, "Also run the cached default trained model (when present).")
_MODEL_NAMES = flags.DEFINE_list("models", ["gqa", "mla"], "The random models to run (gqa, mla; none: '').")
_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 40, "Tokens per call.", lower_bound=2)

_MODELS = {
  "gqa": dict(
    vocab_size=264,
    d_model=64,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    max_seq_len=256,
    n_routed_experts=8,
    top_k=2,
    n_shared_experts=1,
    expert_hidden=32,
    dense_hidden=96,
    first_k_dense=1,
    num_mtp_modules=1,
  ),
  "mla": dict(
    vocab_size=264,
    d_model=64,
    n_layers=3,
    n_heads=4,
    n_kv_heads=4,
    head_dim=16,
    max_seq_len=256,
    n_routed_experts=16,
    top_k=4,
    n_shared_experts=1,
    expert_hidden=16,
    dense_hidden=96,
    first_k_dense=1,
    num_mtp_modules=1,
    attention_type="mla",
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    score_func="sigmoid",
    use_score_bias=True,
    n_groups=4,
    topk_groups=2,
    routed_scaling_factor=2.5,
  ),
}
_PROMPTS = {
  1: ["def fib(n):"],
  4: ["import os\n", "class Tree:\n    def __init__(self", "x = [", "for i in range(10):\n    print("],
}
_SAMPLINGS = {
  "greedy": dict(temperature=0.0),
  "t1_top_p": dict(temperature=1.0, top_p=0.9),
  "t07_top_k": dict(temperature=0.7, top_k=20),
}
_SPECS = {
  "plain": dict(drafter="none"),
  "mtp3": dict(drafter="mtp", num_draft=3),
  "ngram4": dict(drafter="ngram", num_draft=4),
  "mtp_auto": dict(drafter="mtp", num_draft="auto", max_draft=6),
  "ngram_auto": dict(drafter="ngram", num_draft="auto", max_draft=6),
  "budget_trunc": dict(drafter="mtp", num_draft=3, mode="budgeted", expert_budget="top_k+1"),
  "budget_subst_row": dict(
    drafter="ngram",
    num_draft=3,
    mode="budgeted",
    expert_budget="top_k+1",
    budget_policy="substitute",
    budget_scope="row",
  ),
  "per_slot": dict(drafter="mtp", num_draft=2, kernel="per_slot"),
  "xla_kernels": dict(
    drafter="ngram",
    num_draft=2,
    kernel="xla",
    research=msj.ResearchOptions(head_kernel="xla", attention_kernel="xla", dense_kernel="xla"),
  ),
}
_STAT_KEYS = ("passes", "mean_accepted_length", "acceptance_by_depth", "unique_experts_per_pass", "generated_tokens")


def _calls(model):
  """(name, prompts, sampling, spec, deterministic statistics) of every call on `model`."""
  for batch, prompts in _PROMPTS.items():
    for sampling_name, sampling in _SAMPLINGS.items():
      for spec_name, spec in _SPECS.items():
        auto = spec.get("num_draft") == "auto"
        if auto and sampling_name != "greedy":
          continue  # sampled auto K draws per pass with timing-dependent K: not reproducible
        if spec_name in ("per_slot", "xla_kernels") and sampling_name == "t07_top_k":
          continue
        spec = dict(spec)
        if spec.get("expert_budget") == "top_k+1":
          spec["expert_budget"] = model.config.top_k + 1
        yield (
          f"b{batch}/{sampling_name}/{spec_name}",
          prompts,
          msj.SamplingParams(**sampling),
          msj.SpecParams(**spec),
          not auto,
        )


def _controlled_spec(num_draft, auto: bool):
  """The controlled drafter at acceptance 0.8 (its settings moved into a research group later)."""
  k = dict(num_draft="auto", max_draft=num_draft) if auto else dict(num_draft=num_draft)
  if hasattr(msj, "ResearchOptions"):
    return msj.SpecParams(drafter="controlled", research=msj.ResearchOptions(controlled_acceptance=0.8), **k)
  return msj.SpecParams(drafter="controlled", controlled_acceptance=0.8, **k)


def _controlled_calls():
  """(name, spec) of the controlled-drafter calls: greedy only, against the plain greedy tokens."""
  yield "controlled4", _controlled_spec(4, auto=False), True
  yield "controlled_auto", _controlled_spec(6, auto=True), False


def _run_model(label: str, model, max_new_tokens: int) -> dict:
  out = {}
  calls = list(_calls(model))
  for batch, prompts in _PROMPTS.items():
    plain = msj.generate(model, prompts, max_new_tokens=max_new_tokens, seed=7).tokens
    for name, spec, deterministic in _controlled_calls():
      calls.append((f"b{batch}/greedy/{name}", prompts, msj.SamplingParams(), spec, deterministic, plain))
  for name, prompts, sampling, spec, deterministic, *reference in calls:
    result = msj.generate(
      model,
      prompts,
      max_new_tokens=max_new_tokens,
      sampling=sampling,
      spec=spec,
      seed=7,
      reference_tokens=reference[0] if reference else None,
    )
    entry = {"tokens": result.tokens.tolist()}
    if deterministic:
      entry["stats"] = {k: result.stats[k] for k in _STAT_KEYS}
    out[f"{label}/{name}"] = entry
    print(
      f"{label}/{name}: {result.stats['generated_tokens']} tokens, mean accepted length "
      f"{result.stats['mean_accepted_length']:.3f}",
      flush=True,
    )
  return out


def _models():
  for label in cli.choice_list("models", _MODEL_NAMES.value, list(_MODELS)) if _MODEL_NAMES.value else []:
    yield label, msj.Model.init(msj.ModelConfig(**_MODELS[label]), seed=3)
  if _DEFAULT.value:
    from moespec_jax.io import paths

    if (paths.default_model_dir() / "config.json").exists():
      yield "default", msj.Model.load(paths.default_model_dir())
    else:
      print("no cached default model: its calls are skipped", flush=True)


def _same(a, b) -> bool:
  if isinstance(a, float) and isinstance(b, float):
    return a == b or (a != a and b != b)  # NaN (a depth never reached) equals NaN
  if isinstance(a, list) and isinstance(b, list):
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
  return a == b


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  if (_RECORD.value is None) == (_CHECK.value is None):
    raise ValueError("give exactly one of --record=FILE and --check=FILE")
  recorded = None
  if _CHECK.value is not None:
    recorded = json.loads(pathlib.Path(_CHECK.value).read_text())
  calls = {}
  for label, model in _models():
    calls.update(_run_model(label, model, _NEW_TOKENS.value))
  if recorded is None:
    path = pathlib.Path(_RECORD.value)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"max_new_tokens": _NEW_TOKENS.value, "calls": calls}))
    tmp.replace(path)
    print(f"recorded {len(calls)} calls to {path}")
    return
  differ = []
  for name, entry in recorded["calls"].items():
    if name not in calls:
      print(f"MISSING {name}")
      differ.append(name)
      continue
    for part in ("tokens", "stats"):
      if part in entry and not _same(entry[part], calls[name].get(part)):
        print(f"DIFFERS {name} ({part}): recorded {entry[part]} now {calls[name].get(part)}")
        differ.append(name)
  checked = len(recorded["calls"])
  print(f"{checked - len(set(differ))} of {checked} recorded calls identical")
  if differ:
    sys.exit(1)


if __name__ == "__main__":
  cli.run(main)
