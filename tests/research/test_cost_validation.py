"""The cost-model validation: byte accounting of a predicted pass, the --quick run end to end."""

import json

import numpy as np
import pytest

import moespec_jax as msj
from moespec_jax.analysis import cost_model
from moespec_jax.research import cost_validation
from pallas_kernels import bytes as kbytes
from tests.cli_run import run_module


def test_predicted_expert_time_follows_bytes(tiny_config):
  fits = {
    "dedup": cost_model.KernelFit(gbps=10.0, fixed_ms=0.01),
    "per_slot": cost_model.KernelFit(gbps=20.0, fixed_ms=0.02),
  }
  e_bytes = kbytes.expert_bytes(tiny_config.d_model, tiny_config.expert_hidden, 4)
  act = kbytes.activation_bytes(3, tiny_config.top_k, tiny_config.d_model, 4)
  assert cost_validation.layer_bytes(tiny_config, 4.0, 3, "dedup") == 4 * e_bytes + act
  assert cost_validation.layer_bytes(tiny_config, 4.0, 3, "per_slot") == 3 * tiny_config.top_k * e_bytes + act
  two_layers = cost_validation.expert_time_ms(tiny_config, fits, [4.0, 5.0], 3, "dedup")
  expected = sum(fits["dedup"].time_ms(cost_validation.layer_bytes(tiny_config, u, 3, "dedup")) for u in (4.0, 5.0))
  assert two_layers == pytest.approx(expected)
  with pytest.raises(ValueError, match="no kernel fit"):
    cost_validation.expert_time_ms(tiny_config, {"dedup": fits["dedup"]}, [4.0], 3, "per_slot")


def test_auto_goals_count_medians_and_interval_ends():
  def row(vs_plain, vs_plain_hi, vs_best, vs_best_hi):
    return {
      "speedup_vs_plain": vs_plain,
      "speedup_vs_plain_interval": (vs_plain - 0.05, vs_plain_hi),
      "vs_best_fixed": vs_best,
      "vs_best_fixed_interval": (vs_best - 0.05, vs_best_hi),
    }

  rows = [row(1.0, 1.02, 0.96, 0.99), row(0.95, 0.98, 0.9, 0.93), row(0.9, 0.92, 0.99, 1.0)]
  assert cost_validation.auto_goals(rows) == {
    "rows": 3,
    "within_plain": 1,
    "not_measurably_below_plain": 2,
    "within_best_fixed": 2,
    "not_measurably_below_best_fixed": 2,
  }


def test_flat_kernel_timings_give_an_overhead_bound_fit(tiny_config, monkeypatch):
  times = iter([0.06, 0.05, 0.04])  # n = 1, 2, 4; both methods: faster with n
  monkeypatch.setattr(
    cost_validation, "time_layer_pair", lambda *a, **k: dict.fromkeys(cost_validation.FITTED_METHODS, next(times))
  )
  fits, rows = cost_validation.fit_kernels(tiny_config, (1, 2, 4), repeats=1)
  assert len(rows) == 6
  for fit in fits.values():
    assert fit.gbps == float("inf") and fit.fixed_ms == pytest.approx(0.05)
    assert fit.time_ms(1e6) == pytest.approx(0.05)


def test_config_rejects_bad_values():
  with pytest.raises(ValueError, match="alphas"):
    cost_validation.CostValidationConfig(alphas=(0.5, 1.5))
  with pytest.raises(ValueError, match="max_k"):
    cost_validation.CostValidationConfig(max_k=0)
  with pytest.raises(ValueError, match="real_drafters"):
    cost_validation.CostValidationConfig(real_drafters=("eagle",))
  with pytest.raises(ValueError, match="drafter_prompts"):
    cost_validation.CostValidationConfig(drafter_prompts=0)


@pytest.mark.slow
def test_quick_run_writes_the_documented_metrics(tiny_config, tmp_path):
  msj.Model.init(tiny_config.replace(max_seq_len=512), seed=0).save(tmp_path / "m")
  # A run interrupted after one acceptance rate of the sweep: the rerun resumes it, not re-measures it.
  settings = cost_validation.progress_settings(msj.Model.load(tmp_path / "m"), cost_validation.QUICK_CONFIG)
  # Its prefill (99 s) is far above any real one: the prefill range's top shows it was kept.
  done = {
    "prefills": [99.0],
    "round_speedups": [[1.2345], [1.2345]],
    "rows": [
      {"num_draft": k, "speedup": 1.2345, "tokens_per_second": 99.0, "mean_accepted_length": 1.5} for k in (1, 2)
    ],
  }
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "progress.json").write_text(json.dumps({"settings": settings, "parts": {"sweep/0.5": done}}))
  env = {"JAX_PLATFORMS": "cpu"}
  res = run_module(
    "experiments.cost_model",
    f"--workdir={tmp_path / 'out'}",
    f"--model={tmp_path / 'm'}",
    "--quick",
    env=env,
    timeout=600,
  )
  assert res.returncode == 0, res.stderr
  assert "resuming: 1 finished part(s)" in res.stdout + res.stderr
  # One round per comparison: the run says its figures are a pipeline check, not results.
  assert "--quick: a check of the pipeline (1 round(s) per comparison)" in res.stdout
  assert not (tmp_path / "out" / "progress.json").exists()  # removed once the run is complete
  cm = json.loads((tmp_path / "out" / "metrics.json").read_text())["cost_model"]
  assert [r["speedup"] for r in cm["speedups"] if r["alpha"] == 0.5] == [1.2345, 1.2345]
  assert [r["speedup"] for r in cm["speedups"] if r["alpha"] == 0.25] != [1.2345, 1.2345]
  assert cm["prefill_ms_range"][1] == pytest.approx(99000.0) and cm["prefill_ms_range"][0] < 99000.0
  assert {f["method"] for f in cm["fitted"]} == {"dedup", "per_slot"}
  # Tiny layers can be overhead-bound (gbps None: no growth with bytes); never a negative fit.
  assert all((f["gbps"] is None or f["gbps"] > 0) and f["fixed_ms"] >= 0 for f in cm["fitted"])
  assert len(cm["best_k"]) == 5 and all({"alpha", "predicted", "measured"} <= set(r) for r in cm["best_k"])
  assert all(0 <= r["predicted"] <= 2 and 0 <= r["measured"] <= 2 for r in cm["best_k"])
  assert all(
    0.0 <= cm["best_k_within_one_fraction" + suffix] <= 1.0 for suffix, _ in cost_validation.PREDICTORS.values()
  )
  assert set(cm["speedup_at_predicted_over_best"]) == set(cost_validation.PREDICTORS)
  assert all(
    0.0 <= c["within_5pct"] <= 1.0 and 0.0 < c["worst"] <= c["median"] <= 1.0
    for c in cm["speedup_at_predicted_over_best"].values()
  )
  assert set(cm["crossover"]) >= {"predicted_n", "measured_n", "measured_first_faster_n"}
  # Measured dedup faster from measured_n on, and first faster no later than that.
  cross = cm["crossover"]
  if cross["measured_n"] is not None:
    assert all(r["dedup_ms"] < r["per_slot_ms"] for r in cross["rows"] if r["n_tokens"] >= cross["measured_n"])
    assert cross["measured_first_faster_n"] <= cross["measured_n"]
  for r in cm["best_k"]:  # one round: every resample is that round, so the bootstrap is its argmax
    shares = r["measured_best_k_bootstrap_shares"]
    assert len(shares) == 3 and sum(shares) == pytest.approx(1.0) and shares[r["measured"]] == 1.0
  assert cm["measured_best_k_self_agreement"] == 1.0
  assert all(
    cm["best_k_within_one_resampled" + suffix] == cm["best_k_within_one_fraction" + suffix]
    for suffix, _ in cost_validation.PREDICTORS.values()
  )
  assert [r["n_tokens"] for r in cm["verify_time"]] == [1, 2, 3]
  # The passes timed without their routed experts, and the prediction with their measured growth.
  assert all(r["nonexpert_measured_ms"] > 0 and r["predicted_measured_nonexpert_ms"] > 0 for r in cm["verify_time"])
  assert cm["nonexpert_ms_per_token_measured"] >= 0 and cm["verify_time_median_rel_error_measured_nonexpert"] >= 0
  assert cm["verify_time"][0]["predicted_measured_nonexpert_ms"] == pytest.approx(cm["verify_time"][0]["measured_ms"])
  vt = cm["verify_time"]
  growth = vt[-1]["measured_ms"] - vt[0]["measured_ms"]
  if growth > 0:
    assert cm["nonexpert_share_of_pass_growth"] == pytest.approx(
      (vt[-1]["nonexpert_measured_ms"] - vt[0]["nonexpert_measured_ms"]) / growth
    )
  else:
    assert cm["nonexpert_share_of_pass_growth"] is None
  assert {r["drafter"] for r in cm["auto"]} == {"controlled", "ngram"}
  # The model drafter's row ran over the quick config's two held-out prompts, one a round.
  assert [r.get("prompts") for r in cm["auto"] if r["drafter"] == "ngram"] == [2]
  assert all(r["mean_accepted_length"] >= 1.0 and r["tokens_per_second"] > 0 for r in cm["auto"])
  assert all(r["plain_vs_plain"] > 0 for r in cm["auto"])
  assert not any(r["auto_timing"] for r in cm["auto"]) and cm["config"]["auto_timing"] is False
  for r in cm["auto"]:
    for name in ("speedup_vs_plain", "vs_best_fixed", "best_fixed_speedup", "plain_vs_plain"):
      lo, hi = r[name + "_interval"]
      assert 0 < lo <= r[name] <= hi
  for r in cm["auto"]:  # the controlled rows beside their simulation (analysis/draft_policy_sim)
    assert ("simulated" in r) == (r["drafter"] == "controlled")
    if "simulated" in r:
      assert r["simulated"]["plain_over_auto"] > 0 and 0 <= r["simulated"]["best_fixed_num_draft"] <= 2
      # Both quick auto rates (0 and 1) are sweep rates: the policy also paid the sweep's pass times.
      paid = r["simulated_on_measured_pass_times"]
      assert paid["plain_over_auto"] > 0 and 0 <= paid["best_fixed_num_draft"] <= 2
      assert len(paid["pass_time_ratios"]) == 3 and paid["pass_time_ratios"][0] == 1.0
  assert cm["auto_goals"] == cost_validation.auto_goals(cm["auto"]) and cm["auto_goals"]["rows"] == 3
  for name in ("staircase.png", "verify_time.png", "unique_experts.png"):
    assert (tmp_path / "out" / name).stat().st_size > 0
  bad = run_module("experiments.cost_model", "--n_alphas=1", env=env)
  assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "n_alphas" in bad.stderr


def test_pass_costs_from_sweep_invert_the_speedup():
  """A pass at K committing 3 tokens where plain commits 1, at 1.5x plain's speed: it costs 2 plain passes."""
  costs = cost_validation.pass_costs_from_sweep([1.5, 2.0], [3.0, 5.0])
  np.testing.assert_allclose(costs, [1.0, 2.0, 2.5])
  with pytest.raises(ValueError, match="accepted length"):
    cost_validation.pass_costs_from_sweep([1.5], [0.5])
  with pytest.raises(ValueError, match="one positive speedup"):
    cost_validation.pass_costs_from_sweep([1.5, 2.0], [3.0])


def test_auto_rows_run_auto_k_up_to_max_k_with_the_configured_timing():
  spec = cost_validation.auto_spec(cost_validation.CostValidationConfig(max_k=5), "controlled", 0.7)
  assert (spec.num_draft, spec.max_draft, spec.research.controlled_acceptance, spec.research.auto_timing) == (
    "auto",
    5,
    0.7,
    False,
  )
  timed = cost_validation.auto_spec(cost_validation.CostValidationConfig(auto_timing=True), "mtp")
  assert (timed.drafter, timed.max_draft, timed.research.auto_timing) == ("mtp", 8, True)


def test_accepted_lengths_are_pooled_over_every_round():
  stats = [{"mean_accepted_length": 4.0, "verify_passes": 30}, {"mean_accepted_length": 6.0, "verify_passes": 10}]
  assert cost_validation.pooled_accepted_length(stats) == pytest.approx(180.0 / 40)
  assert cost_validation.pooled_accepted_length(stats[1:]) == 6.0


def test_auto_row_text_says_where_the_passes_went():
  row = {
    "drafter": "controlled",
    "alpha": 0.7,
    "best_fixed_num_draft": 2,
    "mean_num_draft": 2.18,
    "passes_by_num_draft": [1236, 6, 3, 353, 106, 132, 1, 2, 316],
    **{name: 1.0 for name in ("speedup_vs_plain", "vs_best_fixed", "plain_vs_plain")},
    **{f"{name}_interval": (0.9, 1.1) for name in ("speedup_vs_plain", "vs_best_fixed", "plain_vs_plain")},
  }
  text = cost_validation.describe_auto(row)
  assert "57% of passes plain, drafting mostly at K=3, mean K 2.18" in text
  assert text.startswith("auto controlled a=0.70:")
  assert cost_validation.describe_auto(dict(row, drafter="mtp", alpha=None, prompts=8)).startswith(
    "auto mtp (8 prompts):"
  )
  assert "100% of passes plain, never drafting" in cost_validation.describe_auto(
    dict(row, passes_by_num_draft=[40, 0, 0], mean_num_draft=0.0)
  )
  simulated = {"plain_over_auto": 1.25, "best_fixed_num_draft": 3, "best_fixed_over_auto": 0.97}
  assert "simulated: 1.250x plain, 0.970 of best fixed K=3" in cost_validation.describe_auto(
    dict(row, simulated=simulated)
  )
  paid = dict(simulated, best_fixed_over_auto=0.91, pass_time_ratios=[1.0, 1.3, 1.6, 1.9])
  assert (
    "choosing on its calibration, paying the sweep's pass times: 1.250x plain, 0.910 of best fixed K=3"
    in cost_validation.describe_auto(dict(row, simulated=simulated, simulated_on_measured_pass_times=paid))
  )


def test_sweep_round_settings_are_checked():
  with pytest.raises(ValueError, match="max_repeats"):
    cost_validation.CostValidationConfig(repeats=7, max_repeats=5)
  with pytest.raises(ValueError, match="settled_share"):
    cost_validation.CostValidationConfig(settled_share=1.5)


def _verify_times(tiny_config, step_ms_K, nonexpert_ms_K=None):
  fits = {m: cost_model.KernelFit(gbps=10.0, fixed_ms=0.01) for m in cost_validation.FITTED_METHODS}
  unique_by_n = {
    n: [min(n * tiny_config.top_k, tiny_config.n_routed_experts) * 0.8] * tiny_config.n_moe_layers
    for n in range(1, len(step_ms_K) + 1)
  }
  nonexpert_ms_K = [0.5] * len(step_ms_K) if nonexpert_ms_K is None else nonexpert_ms_K
  return cost_validation.verify_times(
    tiny_config, fits, unique_by_n, np.asarray(step_ms_K), np.asarray(nonexpert_ms_K), len(step_ms_K) - 1
  )


def test_verify_times_fit_the_fixed_time_at_one_token_and_the_linear_term_at_both_ends(tiny_config):
  exact = _verify_times(tiny_config, [1.0] * 5)
  # Pass times that are exactly the bytes model's: no error anywhere.
  model_ms = [exact.predicted_ms[n] - exact.predicted_ms[1] + 1.0 for n in range(1, 6)]
  fitted = _verify_times(tiny_config, model_ms)
  assert fitted.predicted_ms[1] == pytest.approx(1.0) and fitted.slope_ms == pytest.approx(0.0, abs=1e-9)
  assert max(fitted.rel_err) == pytest.approx(0.0, abs=1e-9) and len(fitted.rel_err) == 4
  # Non-expert time growing by 0.1 ms a token: the bytes model misses it, the linear term fits it.
  grown = _verify_times(tiny_config, [t + 0.1 * i for i, t in enumerate(model_ms)])
  assert grown.slope_ms == pytest.approx(0.1)
  assert min(grown.rel_err) > 0 and max(grown.rel_err_linear) == pytest.approx(0.0, abs=1e-9)
  assert [r["n_tokens"] for r in grown.rows] == [1, 2, 3, 4, 5] and len(grown.rel_err_linear) == 3


def test_the_measured_nonexpert_term_is_the_slope_of_the_passes_without_routed_experts(tiny_config):
  exact = _verify_times(tiny_config, [1.0] * 5)
  model_ms = [exact.predicted_ms[n] - exact.predicted_ms[1] + 1.0 for n in range(1, 6)]
  grown = [t + 0.1 * i for i, t in enumerate(model_ms)]
  # Passes without their routed experts growing 0.1 ms a token (one of them noisy): the least-squares
  # slope recovers most of it, and the prediction takes nothing else from the pass times but n = 1.
  nonexpert = [0.4 + 0.1 * i for i in range(5)]
  v = _verify_times(tiny_config, grown, nonexpert)
  assert v.measured_slope_ms == pytest.approx(0.1)
  assert max(v.rel_err_measured_nonexpert) == pytest.approx(0.0, abs=1e-9) and len(v.rel_err_measured_nonexpert) == 4
  assert [r["nonexpert_measured_ms"] for r in v.rows] == pytest.approx(nonexpert)
  assert [r["expert_measured_ms"] for r in v.rows] == pytest.approx([t - u for t, u in zip(grown, nonexpert)])
  noisy = _verify_times(tiny_config, grown, [0.4, 0.5, 0.9, 0.7, 0.8])
  assert noisy.measured_slope_ms == pytest.approx(0.1) and max(noisy.rel_err_measured_nonexpert) < 1e-9
  # Flat or falling times measure no growth (a slope below zero would make longer passes cheaper).
  assert _verify_times(tiny_config, grown, [0.6, 0.5, 0.5, 0.4, 0.4]).measured_slope_ms == 0.0
  assert _verify_times(tiny_config, model_ms).rel_err_measured_nonexpert == pytest.approx([0.0] * 4, abs=1e-9)
  with pytest.raises(ValueError, match="non-expert pass time per n"):
    _verify_times(tiny_config, grown, [0.5, 0.6])


def test_the_nonexpert_share_of_growth_is_what_the_passes_without_experts_grow_of_the_whole():
  assert cost_validation.nonexpert_share_of_growth([1.0, 1.5, 2.0], [0.8, 1.0, 1.4]) == pytest.approx(0.6)
  assert cost_validation.nonexpert_share_of_growth([1.0, 1.5, 2.0], [0.8, 0.8, 0.8]) == 0.0
  # The experts' part as decoding pays it can shrink: the share is reported as measured, above 1.
  assert cost_validation.nonexpert_share_of_growth([1.0, 1.2], [0.9, 1.2]) == pytest.approx(1.5)
  assert cost_validation.nonexpert_share_of_growth([1.0, 1.0], [0.5, 0.7]) is None
  assert cost_validation.nonexpert_share_of_growth([1.2, 1.0], [0.5, 0.7]) is None


def test_verify_times_carry_the_nonexpert_share_of_growth(tiny_config):
  exact = _verify_times(tiny_config, [1.0] * 5)
  model_ms = [exact.predicted_ms[n] - exact.predicted_ms[1] + 1.0 for n in range(1, 6)]
  grown = [t + 0.1 * i for i, t in enumerate(model_ms)]
  v = _verify_times(tiny_config, grown, [0.4 + 0.1 * i for i in range(5)])
  assert v.nonexpert_growth_share == pytest.approx(0.4 / (grown[-1] - grown[0]))
  assert 0 < v.nonexpert_growth_share < 1


def test_best_k_comparison_counts_rates_within_one_of_the_measured_best(tiny_config):
  alphas, max_k = (0.2, 0.5, 0.8, 0.95), 6
  step_ms = [1.0 + 0.15 * k for k in range(max_k + 1)]
  passes = cost_validation.PassTimes(
    reference=None,
    step_ms_K=np.asarray(step_ms),
    step_ms_by_end={0.0: np.asarray(step_ms), 1.0: np.asarray(step_ms)},
    verify=_verify_times(tiny_config, step_ms),
  )
  # Measured speedups that follow these pass times exactly: every predictor from the pass times
  # finds the measured best K.
  speedups = {
    (a, k): float(cost_model.speedup(a, k, 1.0, lambda _: 0.0, lambda n: step_ms[n - 1]))
    for a in alphas
    for k in range(max_k + 1)
  }
  shares = {a: np.eye(max_k + 1)[max(range(max_k + 1), key=lambda k, a=a: speedups[(a, k)])] for a in alphas}
  sweep = cost_validation.SpeedupSweep(speedups, {}, [], [], shares, {a: 3 for a in alphas})
  best = cost_validation.best_k_comparison(alphas, max_k, sweep, passes)
  assert [r["measured"] for r in best.rows] == [r["predicted_from_step_times"] for r in best.rows]
  assert best.within_one["predicted_from_step_times"] == 1.0 and best.self_agreement == 1.0
  assert best.cost_of_prediction["predicted_from_step_times"]["worst"] == pytest.approx(1.0)
  # One rate whose measured speedups peak far from the prediction: one rate in four is missed.
  a = alphas[-1]
  far = 0 if best.rows[-1]["measured"] > 2 else max_k
  speedups[(a, far)] = 10.0
  best = cost_validation.best_k_comparison(alphas, max_k, sweep, passes)
  assert best.rows[-1]["measured"] == far
  assert best.within_one["predicted_from_step_times"] == 0.75
  assert best.cost_of_prediction["predicted_from_step_times"]["worst"] < 1.0
  assert cost_validation.measured_best_k({(a, k): 1.0 for k in range(3)}, a, 2) == 0  # ties: the smallest K
