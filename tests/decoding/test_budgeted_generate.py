"""Budgeted (approximate) speculative decoding through `generate`."""

import numpy as np
import pytest

import moespec_jax as msj

QUALITY = msj.ResearchOptions(measure_quality=True)


def _gen(model, spec, prompts=([5, 9, 30, 41], [7, 8, 9])):
  return msj.generate(model, list(prompts), max_new_tokens=10, spec=spec)


def test_budget_covering_the_pass_is_bit_identical_to_exact(tiny_model, tiny_config):
  # K = 1, batch 2: a pass has 4 tokens of top_k = 2 -> at most 8 = n_routed experts ... use row
  # scope so that each row's budget n * top_k = 4 < n_routed_experts covers its pass.
  exact = _gen(tiny_model, msj.SpecParams(drafter="ngram", num_draft=1))
  n_k = 2 * tiny_config.top_k
  assert n_k < tiny_config.n_routed_experts
  budgeted = _gen(
    tiny_model,
    msj.SpecParams(
      drafter="ngram", num_draft=1, mode="budgeted", expert_budget=n_k, budget_scope="row", research=QUALITY
    ),
  )
  np.testing.assert_array_equal(budgeted.tokens, exact.tokens)
  assert budgeted.stats["approximate"] and budgeted.stats["top1_agreement"] == 1.0
  assert budgeted.stats["mean_kl"] == pytest.approx(0.0, abs=1e-6)


def test_tight_budget_caps_unique_experts_and_reports_quality(tiny_model, tiny_config):
  spec = msj.SpecParams(
    drafter="ngram", num_draft=3, mode="budgeted", expert_budget=tiny_config.top_k, research=QUALITY
  )
  out = _gen(tiny_model, spec)
  assert out.stats["approximate"] and out.stats["expert_budget"] == tiny_config.top_k
  assert all(u <= tiny_config.top_k + 1e-6 for u in out.stats["unique_experts_per_pass"])
  assert 0.0 <= out.stats["top1_agreement"] <= 1.0 and out.stats["mean_kl"] >= 0.0
  assert out.stats["quality_positions"] > 0


def test_budget_at_or_above_the_expert_count_is_exact_mode(tiny_model, tiny_config):
  spec = msj.SpecParams(mode="budgeted", expert_budget=tiny_config.n_routed_experts)
  out = _gen(tiny_model, spec)
  assert out.stats["approximate"] is False
  np.testing.assert_array_equal(out.tokens, _gen(tiny_model, msj.SpecParams()).tokens)


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(mode="budgeted"), "expert_budget"),
    (dict(mode="budgeted", expert_budget=-1), "expert_budget"),
    (dict(expert_budget=4), "budgeted"),
    (dict(mode="budgeted", expert_budget=4, budget_policy="drop"), "budget_policy"),
    (dict(research=QUALITY), "measure_quality"),
  ],
)
def test_bad_budget_params(kwargs, match):
  with pytest.raises(ValueError, match=match):
    msj.SpecParams(**kwargs)


def test_budget_below_top_k_is_refused(tiny_model, tiny_config):
  with pytest.raises(ValueError, match="top_k"):
    _gen(tiny_model, msj.SpecParams(mode="budgeted", expert_budget=tiny_config.top_k - 1))


def test_compare_modes_budgets_and_table_keep_exact_and_approximate_apart():
  from moespec_jax.research import compare_modes

  assert compare_modes.budgets_for(4, (1.0, 1.5, 2.0, 3.0, 4.0, None)) == [4, 6, 8, 12, 16, None]
  assert compare_modes.budgets_for(6, (1.0, 1.5)) == [6, 9]
  base = dict(
    num_draft=2,
    batch_size=1,
    temperature=0.0,
    tokens_per_second=10.0,
    top1_agreement=1.0,
    mean_kl=0.0,
    mean_accepted_length=2.0,
    first_divergence=None,
  )
  rows = [
    dict(base, mode="budgeted", policy="truncate", expert_budget=4, speedup_vs_exact=1.1),
    dict(base, mode="exact", policy=None, expert_budget=None, speedup_vs_exact=1.0),
  ]
  table = compare_modes.format_table(rows)
  exact_part, approx_part = table.split("APPROXIMATE")
  assert "exact " in exact_part and "budgeted" not in exact_part and "budgeted" in approx_part


def test_run_compare_modes_refuses_unknown_policies_before_any_run(tmp_path):
  """The library checks its budget policies first (no model is touched: None would fail) and
  names them as its argument; the CLI passes its flag's name."""
  from moespec_jax.research import compare_modes

  with pytest.raises(ValueError, match=r"^policies must be among truncate, substitute; got \['drop'\]"):
    compare_modes.run_compare_modes(None, tmp_path / "out", policies=["drop"])
  with pytest.raises(ValueError, match=r"^policies must be among truncate, substitute; got \[\]"):
    compare_modes.run_compare_modes(None, tmp_path / "out", policies=[])
  assert not (tmp_path / "out").exists()
