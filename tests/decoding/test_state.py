"""The typed state: the statistics record (defined once: shapes, starting values, what leaves the
program, packed in one vector) and out.stats's keys, which the record must not change."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moespec_jax as msj
from moespec_jax.decoding import calibration, loop
from moespec_jax.decoding.drafters.ngram import NgramDrafter
from moespec_jax.decoding.drafters.none import NoDrafter
from moespec_jax.decoding.state import LoopSpec, LoopState, Stats
from pallas_kernels.policy import KernelPolicy

XLA_POLICY = KernelPolicy(expert_method="xla")

FULL = LoopSpec(
  max_new_tokens=4,
  cache_len=64,
  sampling=msj.SamplingParams(),
  kernels=XLA_POLICY,
  drafter=NgramDrafter(),
  max_k=3,
  auto=True,
  timed=True,
  measure_quality=True,
  trace_passes=True,
)
PLAIN = LoopSpec(
  max_new_tokens=4, cache_len=64, sampling=msj.SamplingParams(), kernels=XLA_POLICY, drafter=NoDrafter(), max_k=0
)


def test_statistics_start_in_their_declared_shapes():
  """One declaration per field gives its shape in the loop's dimensions and its starting value."""
  stats = Stats.zeros(FULL, batch=2, n_moe_layers=5)
  shapes = {name: getattr(stats, name).shape for name in (f.name for f in dataclasses.fields(Stats))}
  assert shapes == {
    "verify_passes": (),
    "row_passes": (),
    "accepted_tokens": (),
    "reached_K": (3,),
    "accepted_K": (3,),
    "unique_L": (5,),
    "verified_nodes": (),
    "predicted_unique_L": (5,),
    "rank_load_R": (0,),  # no mesh: no expert ranks
    "rank_unique_R": (0,),
    "rank_imbalance": (),
    "passes_by_K": (4,),
    "acceptance_evidence_B2": (2, 2),
    "depth_evidence_BK2": (2, 3, 2),
    "auto_k": (),
    "drafter_started": (),
    "pass_timing_K2": (4, 2),
    "segment_clock_2": (2,),
    "segment_start_passes": (),
    "trace_clock_2": (2,),
    "pass_trace_P4": (4, 4),
    "trace_end_ms_1": (1,),
    "quality_3": (3,),
  }
  assert int(stats.segment_start_passes) == -1 and stats.verify_passes.dtype == jnp.int32
  assert int(stats.drafter_started) == 1  # started unless auto's first choice is the final K = 0
  starting = ("segment_start_passes", "drafter_started")
  assert all(not np.any(np.asarray(getattr(stats, name))) for name in shapes if name not in starting)
  assert Stats.zeros(PLAIN, batch=2, n_moe_layers=5).pass_trace_P4.shape == (0, 4)


def test_only_what_a_program_reads_is_reported():
  always = ("verify_passes", "row_passes", "accepted_tokens", "reached_K", "accepted_K", "unique_L")
  assert Stats.reported_fields(PLAIN) == always
  assert Stats.reported_fields(FULL) == always + (
    "passes_by_K",
    "acceptance_evidence_B2",
    "drafter_started",
    "pass_timing_K2",
    "pass_trace_P4",
    "trace_end_ms_1",
    "quality_3",
  )


def test_statistics_leave_the_program_as_one_vector_in_their_shapes(tiny_model):
  """The program's statistics come back packed in one float32 vector (one copy to the host per
  call); unpacked, each has the shape the program's state gives it, for every statistic a program
  reports, and None for the others."""
  # Private on purpose: the LoopSpec and program arguments of a generate() call have no public name.
  _, _, args = loop._prepare(tiny_model, [[1, 2, 3], [4, 5]], 4, None, msj.SpecParams(), 0, None)
  definition, params, tokens, lengths, seed, inputs = args
  state = jax.eval_shape(
    lambda *a: calibration.init_program(definition, *a, ls=FULL), params, tokens, lengths, seed, inputs
  )
  assert isinstance(state, LoopState)
  keys = Stats.reported_fields(FULL)
  values = {
    k: np.arange(np.prod(getattr(state.stats, k).shape), dtype=np.float32).reshape(getattr(state.stats, k).shape) + i
    for i, k in enumerate(keys)
  }
  record = Stats.zeros(FULL, batch=2, n_moe_layers=tiny_model.config.n_moe_layers).replace(**values)
  packed = jax.jit(lambda r: r.pack(FULL))(record)
  assert packed.ndim == 1 and packed.dtype == jnp.float32
  unpacked = Stats.unpack(packed, FULL, batch=2, n_moe_layers=tiny_model.config.n_moe_layers)
  for k in keys:
    np.testing.assert_array_equal(getattr(unpacked, k), values[k])
  assert unpacked.auto_k is None and unpacked.depth_evidence_BK2 is None
  with pytest.raises(AssertionError, match="layout"):
    Stats.unpack(np.zeros(packed.size + 1, np.float32), FULL, batch=2, n_moe_layers=tiny_model.config.n_moe_layers)


# out.stats's keys (DESIGN.md section 2, README), by what a call turns on.
BASE_KEYS = {
  "passes",
  "verify_passes",
  "generated_tokens",
  "mean_accepted_length",
  "acceptance_by_depth",
  "tokens_per_second",
  "seconds",
  "unique_experts_per_pass",
  "drafter",
  "num_draft",
  "expert_method",
  "mode",
  "approximate",
  "expert_budget",
}
AUTO_KEYS = {
  "max_draft",
  "passes_by_num_draft",
  "chosen_num_draft",
  "mean_num_draft",
  "calibrated_step_ms",
  "calibration",
  "calibration_seconds",
  "calibration_acceptance",
  "drafter_started",
  "auto_timing",
  "acceptance_estimate",
}


def test_out_stats_keys_are_the_documented_ones(tiny_model, monkeypatch):
  monkeypatch.setattr(
    loop,
    "calibrate_step_ms",
    lambda ls, args, run, progress: calibration.Calibration(np.array([1.0, 1.2, 1.4], np.float32), "held_runs", 0.25),
  )
  prompts = [[3, 3, 3, 3], [5, 6, 7]]
  plain = msj.generate(tiny_model, prompts, max_new_tokens=6)
  assert set(plain.stats) == BASE_KEYS
  fixed = msj.generate(tiny_model, prompts, max_new_tokens=6, spec=msj.SpecParams(drafter="ngram", num_draft=2))
  assert set(fixed.stats) == BASE_KEYS
  auto = msj.generate(
    tiny_model, prompts, max_new_tokens=6, spec=msj.SpecParams(drafter="ngram", num_draft="auto", max_draft=2)
  )
  assert set(auto.stats) == BASE_KEYS | AUTO_KEYS and auto.stats["calibration_seconds"] == 0.25
  budgeted = msj.generate(
    tiny_model,
    prompts,
    max_new_tokens=6,
    spec=msj.SpecParams(
      drafter="ngram",
      num_draft=2,
      mode="budgeted",
      expert_budget=tiny_model.config.top_k,
      research=msj.ResearchOptions(measure_quality=True),
    ),
  )
  assert set(budgeted.stats) == BASE_KEYS | {
    "budget_policy",
    "budget_scope",
    "top1_agreement",
    "mean_kl",
    "quality_positions",
  }
  traced = msj.generate(
    tiny_model, prompts, max_new_tokens=6, spec=msj.SpecParams(research=msj.ResearchOptions(pass_trace=True))
  )
  assert set(traced.stats) == BASE_KEYS | {"pass_trace"}
