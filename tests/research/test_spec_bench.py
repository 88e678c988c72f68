"""decoding/spec_bench.py: how paired plain / speculative runs are ordered and combined."""

import pytest

import moespec_jax as msj
from moespec_jax.research import spec_bench


def _stats(rate: float, **extra) -> dict:
  """A generate() call's statistics at `rate` tokens/s: 8 tokens in 4 verify passes."""
  return {
    "tokens_per_second": rate,
    "generated_tokens": 8,
    "seconds": 8 / rate,
    "verify_passes": 4,
    "mean_accepted_length": 1.5,
    "acceptance_by_depth": [0.5],
    "unique_experts_per_pass": [2.0],
    **extra,
  }


def _run_bench(tiny_config, tmp_path, *, num_drafts, log=lambda *_: None, **sweep) -> dict:
  """run_spec_bench on a stand-in model (generate is faked by each test): batch 1, greedy, ngram."""
  import types

  from moespec_jax.data.tokenizer import ByteTokenizer

  model = types.SimpleNamespace(config=tiny_config, tokenizer=ByteTokenizer())
  return spec_bench.run_spec_bench(
    model,
    tmp_path,
    batch_sizes=(1,),
    temperatures=(0.0,),
    drafters=("ngram",),
    num_drafts=num_drafts,
    max_new_tokens=8,
    repeats=1,
    prompt_bytes=32,
    log=log,
    **sweep,
  )


def test_paired_reverses_the_order_within_each_pair(monkeypatch):
  """Pairs alternate plain-first and speculative-first, each pair on its own seed, and the speedup
  is the median of the ratios within pairs (not the ratio of the medians)."""
  calls = []
  rates = {
    ("none", 0): 100.0,
    ("ngram", 0): 150.0,
    ("ngram", 1): 180.0,
    ("none", 1): 100.0,
    ("none", 2): 50.0,
    ("ngram", 2): 100.0,
  }

  def fake_generate(model, prompts, *, max_new_tokens, sampling, spec, seed):
    calls.append((spec.drafter, seed))
    return msj.GenerateOutput(
      tokens=None,
      stats=_stats(rates[(spec.drafter, seed)], mean_accepted_length=2.0 if spec.drafter == "ngram" else 1.0),
    )

  monkeypatch.setattr(msj, "generate", fake_generate)
  spec = msj.SpecParams(drafter="ngram", num_draft=2)
  runs = spec_bench.paired(None, [["x"]], 8, msj.SamplingParams(), spec, repeats=3)
  assert calls == [("none", 0), ("ngram", 0), ("ngram", 1), ("none", 1), ("none", 2), ("ngram", 2)]
  assert (runs.tokens_per_second, runs.plain_tokens_per_second, runs.mean_accepted_length) == (150.0, 100.0, 2.0)
  assert runs.speedup == 1.8  # ratios 1.5, 1.8, 2.0
  low, high = runs.speedup_interval  # medians of resampled ratios lie among the ratios
  assert 1.5 <= low <= 1.8 <= high <= 2.0 and low < high


def test_every_program_runs_once_untimed_before_it_is_timed(monkeypatch, tmp_path, tiny_config):
  """A program's first run (slower than its later ones) never enters a row: plain and each K are run
  once before their timed runs, whatever the repeats (--quick's were one)."""
  seen = set()

  def fake_generate(model, prompts, *, max_new_tokens, sampling, spec, seed):
    rate = 100.0 if spec.drafter == "none" else 150.0
    if (spec.drafter, spec.num_draft) not in seen:
      seen.add((spec.drafter, spec.num_draft))
      rate /= 10.0
    return msj.GenerateOutput(tokens=None, stats=_stats(rate))

  monkeypatch.setattr(msj, "generate", fake_generate)
  result = _run_bench(tiny_config, tmp_path, num_drafts=(1, 2))
  bench = result["spec_bench"]
  assert bench["plain"][0]["tokens_per_second"] == 100.0
  assert [(r["tokens_per_second"], r["plain_tokens_per_second"], r["speedup"]) for r in bench["rows"]] == [
    (150.0, 100.0, 1.5),
    (150.0, 100.0, 1.5),
  ]


def test_auto_rows_are_compared_with_the_best_fixed_k(monkeypatch, tmp_path, tiny_config):
  rates = {"none": 100.0, 1: 120.0, 2: 150.0, "auto": 141.0}

  def fake_generate(model, prompts, *, max_new_tokens, sampling, spec, seed):
    key = "none" if spec.drafter == "none" else spec.num_draft
    stats = _stats(rates[key])
    if key == "auto":
      stats.update(mean_num_draft=1.75, chosen_num_draft=2)
    return msj.GenerateOutput(tokens=None, stats=stats)

  monkeypatch.setattr(msj, "generate", fake_generate)
  lines = []
  result = _run_bench(tiny_config, tmp_path, num_drafts=(1, 2, "auto"), log=lines.append)
  auto = result["spec_bench"]["rows"][-1]
  assert (auto["num_draft"], auto["mean_num_draft"], auto["chosen_num_draft"]) == ("auto", 1.75, 2)
  assert "auto K, ngram T=0 batch 1: 1.41x plain [1.41, 1.41], 0.94x the best fixed K (mean K 1.75)" in lines
  assert auto["speedup_interval_90"] == [auto["speedup"], auto["speedup"]]  # every pair ran at one ratio
  assert (tmp_path / "speedup_vs_k.png").stat().st_size > 0


def test_trees_run_beside_chains_and_the_best_tree_is_compared_with_the_best_chain(monkeypatch, tmp_path, tiny_config):
  """--tree_nodes: each fixed K <= N also as a tree of N nodes (auto K and K > N: chains only);
  the summary line sets the best tree against the best chain, its tokens and experts a pass."""
  specs = []

  def fake_generate(model, prompts, *, max_new_tokens, sampling, spec, seed):
    specs.append((spec.num_draft, spec.tree_nodes))
    rate = 100.0  # plain; chains 120 + K (auto: 121), trees of 4 nodes 150 + K
    if spec.drafter != "none":
      rate = (150.0 if spec.tree_nodes else 120.0) + (spec.num_draft if spec.num_draft != "auto" else 1)
    stats = _stats(rate, unique_experts_per_pass=[3.0])
    if spec.num_draft == "auto":
      stats.update(mean_num_draft=1.0, chosen_num_draft=1)
    return msj.GenerateOutput(tokens=None, stats=stats)

  monkeypatch.setattr(msj, "generate", fake_generate)
  lines = []
  result = _run_bench(tiny_config, tmp_path, num_drafts=(2, 6, "auto"), tree_nodes=(0, 4), log=lines.append)
  rows = result["spec_bench"]["rows"]
  assert [(r["num_draft"], r["tree_nodes"]) for r in rows] == [(2, 0), (2, 4), (6, 0), ("auto", 0)]
  assert (2, 4) in specs and (6, 4) not in specs and ("auto", 4) not in specs
  assert "trees, ngram T=0 batch 1: best tree (N=4, depth 2) 1.52x plain, 1.21x the best chain (K=6); " in "".join(
    lines
  )
  assert any("experts a pass 3.0 vs 3.0" in line for line in lines)


def test_every_batch_size_decodes_the_same_prompts_in_consecutive_batches():
  prompts = ["a", "b", "c", "d", "e"]
  assert spec_bench.prompt_groups(prompts, 1) == [["a"], ["b"], ["c"], ["d"], ["e"]]
  assert spec_bench.prompt_groups(prompts, 2) == [["a", "b"], ["c", "d"]]
  with pytest.raises(ValueError, match="batch size 6 needs 1..5 prompts"):
    spec_bench.prompt_groups(prompts, 6)


def test_a_runs_rate_is_over_all_its_batches(monkeypatch):
  """tokens/s of several generate() calls: all their tokens over all their seconds (not a mean
  of rates); accepted length, K and acceptance weighted by each call's verify passes."""
  calls = {
    ("a",): _stats(100.0, mean_accepted_length=1.0, acceptance_by_depth=[float("nan")], passes_by_num_draft=[4, 0]),
    ("b",): dict(
      _stats(25.0, mean_accepted_length=2.5, acceptance_by_depth=[0.8], passes_by_num_draft=[0, 12]),
      verify_passes=12,
    ),
  }

  def fake_generate(model, prompts, *, max_new_tokens, sampling, spec, seed):
    return msj.GenerateOutput(tokens=None, stats=calls[tuple(prompts)])

  monkeypatch.setattr(msj, "generate", fake_generate)
  merged = spec_bench.decode_groups(None, [["a"], ["b"]], 8, msj.SamplingParams(), msj.SpecParams(), seed=0)
  assert merged["tokens_per_second"] == pytest.approx(16 / (0.08 + 0.32))
  assert merged["mean_accepted_length"] == pytest.approx((1.0 * 4 + 2.5 * 12) / 16)
  assert merged["acceptance_by_depth"] == [pytest.approx(0.8)]  # the NaN of a call that drafted nothing left out
  assert merged["passes_by_num_draft"] == [4, 12]
  assert (merged["chosen_num_draft"], merged["mean_num_draft"]) == (1, pytest.approx(12 / 16))


def test_warm_up_runs_every_group(monkeypatch):
  """Groups whose prompts pad to another length run programs of their own: each is run once
  before the timed runs, not the first group's alone."""
  seen = []

  def fake_generate(model, prompts, *, max_new_tokens, sampling, spec, seed):
    seen.append((spec.drafter, tuple(prompts)))

  monkeypatch.setattr(msj, "generate", fake_generate)
  spec_bench.warm_up(None, [["a"], ["bb"]], 8, msj.SamplingParams(), msj.SpecParams(), msj.SpecParams(drafter="ngram"))
  assert seen == [("none", ("a",)), ("none", ("bb",)), ("ngram", ("a",)), ("ngram", ("bb",))]
