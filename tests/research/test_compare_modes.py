"""compare_modes: speedups from warm programs only, the divergence column, the Pareto plot, and the
--quick run as a user runs it (its defaults yield to the flags given)."""

import json
import types

import numpy as np
import pytest

import moespec_jax as msj
from moespec_jax.research import compare_modes
from tests.cli_run import run_module

N_NEW = 16


def _fake_generate(calls):
  """A generate() whose first run of each program is 10x slower than the later ones (compilation
  itself excluded, as generate excludes it); exact runs at 1000 tokens/s, budgeted at 1100. Budget
  2's greedy text departs from exact at the last token of row 1; budget 4's never does."""
  seen = set()

  def generate(model, prompts, *, max_new_tokens, sampling, spec, seed):
    calls.append((spec.mode, spec.expert_budget, spec.research.measure_quality, seed))
    key = (spec.mode, spec.expert_budget, spec.research.measure_quality)
    rate = 1000.0 if spec.mode == "exact" else 1100.0
    if key not in seen:
      seen.add(key)
      rate /= 10.0
    tokens = np.zeros((len(prompts), max_new_tokens), np.int32)
    if spec.expert_budget == 2:
      tokens[1, -1] = 7
    stats = {
      "tokens_per_second": rate,
      "mean_accepted_length": 2.0,
      "approximate": spec.mode == "budgeted",
      "unique_experts_per_pass": [3.0],
      "top1_agreement": 0.9,
      "mean_kl": 0.01,
    }
    return msj.GenerateOutput(tokens=tokens, stats=stats)

  return generate


@pytest.mark.parametrize("repeats", [1, 3])
def test_speedups_compare_warm_runs_only(tiny_config, tmp_path, monkeypatch, repeats):
  """Each program runs once untimed before its timed runs: a cold first run never enters a median
  or a ratio, whatever the repeats (one repeat was --quick's, and set a cold run against warm ones)."""
  calls = []
  monkeypatch.setattr(msj, "generate", _fake_generate(calls))
  model = types.SimpleNamespace(config=tiny_config)
  result = compare_modes.run_compare_modes(
    model,
    tmp_path,
    drafter="ngram",
    num_drafts=(2,),
    budget_multipliers=(1.0, 2.0, None),
    policies=("truncate",),
    batch_sizes=(2,),
    temperatures=(0.0,),
    max_new_tokens=N_NEW,
    repeats=repeats,
    log=lambda *_: None,
  )
  rows = result["compare_modes"]["rows"]
  assert [(r["mode"], r["expert_budget"]) for r in rows] == [("exact", None), ("budgeted", 2), ("budgeted", 4)]
  assert rows[0]["tokens_per_second"] == 1000.0
  for r in rows[1:]:
    assert r["tokens_per_second"] == 1100.0 and r["speedup_vs_exact"] == pytest.approx(1.1)
    assert (r["speedup_interval"] is None) == (repeats == 1)
  assert result["compare_modes"]["repeats"] == repeats and result["compare_modes"]["max_new_tokens"] == N_NEW
  # Never diverged and diverged at the last token are told apart.
  assert rows[1]["first_divergence_by_row"] == [None, N_NEW - 1] and rows[1]["diverged_rows"] == 1
  assert rows[1]["first_divergence"] == N_NEW - 1
  assert rows[2]["first_divergence_by_row"] == [None, None] and rows[2]["first_divergence"] is None
  assert [compare_modes.divergence_text(r) for r in rows] == ["-", f"{N_NEW - 1:.1f} 1/2", "never"]
  table = compare_modes.format_table(rows)
  assert "never" in table and f"{N_NEW - 1:.1f} 1/2" in table
  assert (tmp_path / "pareto.png").stat().st_size > 0


def test_divergence_of_every_row_at_the_last_token_is_not_never():
  exact = np.zeros((1, N_NEW), np.int32)
  last = exact.copy()
  last[0, -1] = 1
  assert compare_modes.divergence(exact, exact) == {
    "first_divergence_by_row": [None],
    "diverged_rows": 0,
    "first_divergence": None,
  }
  assert compare_modes.divergence(exact, last) == {
    "first_divergence_by_row": [N_NEW - 1],
    "diverged_rows": 1,
    "first_divergence": N_NEW - 1,
  }
  assert compare_modes.divergence_text(compare_modes.divergence(exact, exact)) == "never"
  assert compare_modes.divergence_text(compare_modes.divergence(exact, last)) == f"{N_NEW - 1:.1f}"


def test_pareto_points_name_their_budget_with_intervals(monkeypatch, tmp_path):
  figures = []
  monkeypatch.setattr(compare_modes.plots, "save", lambda fig, path: figures.append(fig))
  base = dict(mode="budgeted", policy="truncate", num_draft=2, batch_size=1, temperature=0.0, top1_agreement=0.9)
  rows = [
    dict(base, expert_budget=2, speedup_vs_exact=1.1, speedup_interval=[1.0, 1.2]),
    dict(base, expert_budget=4, speedup_vs_exact=1.05, speedup_interval=None, policy="substitute"),
  ]
  compare_modes.plot_pareto(rows, tmp_path / "pareto.png")
  ax = figures[0].axes[0]
  assert sorted(t.get_text() for t in ax.texts) == ["B=2", "B=4"]
  bars = [c for c in ax.containers if c.has_yerr]
  assert len(bars) == 2  # one error-bar series per policy
  segments = bars[0].lines[2][0].get_segments()
  assert [tuple(np.round(seg[:, 1], 6)) for seg in segments] == [(1.0, 1.2)]


@pytest.mark.slow
def test_quick_run_keeps_the_flags_given_and_writes_the_plot(tiny_config, tmp_path):
  msj.Model.init(tiny_config.replace(max_seq_len=512), seed=0).save(tmp_path / "m")
  proc = run_module(
    "experiments.compare_modes",
    f"--workdir={tmp_path / 'out'}",
    f"--model={tmp_path / 'm'}",
    "--quick",
    "--repeats=2",
    "--drafter=ngram",
    "--policies=truncate",
    timeout=900,
  )
  assert proc.returncode == 0, proc.stderr
  cm = json.loads((tmp_path / "out" / "metrics.json").read_text())["compare_modes"]
  assert (cm["repeats"], cm["max_new_tokens"]) == (2, 32)  # --repeats given; --quick's max_new_tokens
  budgets = [r["expert_budget"] for r in cm["rows"]]
  assert budgets == [None, tiny_config.top_k, 2 * tiny_config.top_k]  # --quick's budgets: 1x and 2x top_k
  for r in cm["rows"][1:]:
    lo, hi = r["speedup_interval"]
    assert lo <= r["speedup_vs_exact"] <= hi
  assert (tmp_path / "out" / "pareto.png").stat().st_size > 0
  assert "diverge" in proc.stdout and "--quick: a smoke run" in proc.stdout
