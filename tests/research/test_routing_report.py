"""routing_stats: the plot names model layers, and the --quick run as a user runs it (the files it
says it wrote)."""

import json

import numpy as np

import moespec_jax as msj
from moespec_jax.analysis.routing import RoutingTrace
from moespec_jax.research import routing_report, traces
from tests.cli_run import run_module


def _legend(stats, monkeypatch, tmp_path) -> list[str]:
  figures = []
  monkeypatch.setattr(routing_report.plots, "save", lambda fig, path: figures.append(fig))
  routing_report.plot_routing(stats, tmp_path / "routing.png")
  return [t.get_text() for t in figures[0].axes[1].get_legend().get_texts()]


def test_overlap_curves_name_the_model_layer(monkeypatch, tmp_path):
  """A trace holds the MoE layers only: the legend says which model layer each is (first layers dense)."""
  rng = np.random.default_rng(0)
  segments = [
    np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(24)]) for _ in range(2)]) for _ in range(4)
  ]
  stats = routing_report.routing_stats(
    RoutingTrace(segments, 8, {"model_layers": [1, 3]}), max_tokens=4, ipf_max_tokens=3
  )
  assert stats["model_layers"] == [1, 3]
  labels = _legend(stats, monkeypatch, tmp_path)
  assert "layer 1 (MoE)" in labels and "layer 3 (MoE)" in labels and not any("MoE layer 0" in t for t in labels)
  # A trace that does not say: the curves are named by their place among the MoE layers, and say so.
  unnamed = routing_report.routing_stats(RoutingTrace(segments, 8, {}), max_tokens=4, ipf_max_tokens=3)
  assert "MoE layer 0 (of the MoE layers)" in _legend(unnamed, monkeypatch, tmp_path)


def test_traces_record_the_model_layers(tiny_config):
  model = msj.Model.init(tiny_config.replace(first_k_dense=1), seed=0)
  assert traces.moe_layers(model) == list(range(1, tiny_config.n_layers))


def test_quick_run_names_every_file_it_wrote(tiny_config, tmp_path):
  msj.Model.init(tiny_config, seed=0).save(tmp_path / "m")
  out = tmp_path / "out"
  proc = run_module(
    "experiments.routing_stats", f"--workdir={out}", f"--model={tmp_path / 'm'}", "--quick", "--max_tokens=6"
  )
  assert proc.returncode == 0, proc.stderr
  wrote = [line for line in proc.stdout.splitlines() if line.startswith("wrote ")]
  assert wrote == [f"wrote {out / 'trace.npz'}, {out / 'metrics.json'}, {out / 'routing.png'}"]
  for name in ("trace.npz", "metrics.json", "routing.png"):
    assert (out / name).stat().st_size > 0
  stats = json.loads((out / "metrics.json").read_text())["routing_stats"]
  assert stats["model_layers"] == list(range(1, tiny_config.n_layers))
  # --quick's other settings, and the --max_tokens given.
  assert [r["n_tokens"] for r in stats["unique_experts"]] == list(range(1, 7))
  assert stats["trace"]["n_segments"] == 8 and stats["error_range"] == "n = 2..5, every layer"
