"""MTP head training: losses, per-depth metrics, checkpoints and resume, saving with the model."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

import moespec_jax as msj
from moespec_jax.training import mtp


@pytest.mark.slow
def test_mtp_training_saves_heads_with_the_model_and_resumes(tiny_model, tmp_path):
  tc = mtp.MTPTrainConfig(
    num_mtp_modules=2,
    loss="distill",
    batch_size=2,
    seq_len=24,
    steps=3,
    warmup_steps=1,
    eval_batches=1,
    checkpoint_every=2,
    log_every_seconds=1e9,
  )
  logs = []
  model, metrics = mtp.train(tiny_model, tc, tmp_path, log=logs.append)
  assert model.config.num_mtp_modules == 2
  assert [r["depth"] for r in metrics["teacher_forced"]] == [1, 2]
  for row in metrics["teacher_forced"]:
    assert 0.0 <= row["greedy_acceptance"] <= 1.0 and 0.0 < row["expected_acceptance_t1"] <= 1.0
    assert np.isfinite(row["ce"]) and np.isfinite(row["distill_ce"])
  assert json.loads((tmp_path / "metrics.json").read_text())["train_mtp"]["steps_done"] == 3

  loaded = msj.Model.load(tmp_path / "model")
  assert loaded.config.num_mtp_modules == 2
  # The target is untouched; only the heads were trained.
  old, new = nnx.to_pure_dict(tiny_model.state), nnx.to_pure_dict(loaded.state)
  for key in old:
    for a, b in zip(jax.tree.leaves(old[key]), jax.tree.leaves(new[key])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # A second run in the same workdir resumes from the last checkpoint (nothing left to do).
  logs.clear()
  _, again = mtp.train(tiny_model, tc, tmp_path, log=logs.append)
  assert any("resuming" in line for line in logs) and again["steps_done"] == 3


def test_bad_mtp_config_names_the_field():
  with pytest.raises(ValueError, match="loss"):
    mtp.MTPTrainConfig(loss="mse")
  with pytest.raises(ValueError, match="unknown mtp config fields"):
    mtp.MTPTrainConfig.from_dict({"stepz": 3})


@pytest.mark.slow
def test_quick_train_mtp_writes_its_plot_and_keeps_the_flags_given(tiny_config, tmp_path):
  """`experiments.train_mtp --quick --model=DIR`: a few short steps (--quick's), a --config field given
  kept, the loss and acceptance plot written; --save_default refused with --quick."""
  from tests.cli_run import assert_one_line_error, run_module  # pylint: disable=g-import-not-at-top

  msj.Model.init(tiny_config.replace(max_seq_len=512), seed=0).save(tmp_path / "m")
  out = tmp_path / "out"
  proc = run_module(
    "experiments.train_mtp",
    f"--workdir={out}",
    f"--target={tmp_path / 'm'}",
    "--quick",
    "--config.mtp.steps=6",
    timeout=900,
  )
  assert proc.returncode == 0, proc.stderr
  metrics = json.loads((out / "metrics.json").read_text())["train_mtp"]
  assert metrics["steps_done"] == 6 and metrics["train_config"]["seq_len"] == 64
  assert set(metrics["decoding"]) == {"greedy", "t1"}
  cost = metrics["draft_cost"]
  assert cost["plain_pass_ms"] > 0 and len(cost["draft_ms_by_k"]) == len(cost["draft_over_plain_pass_by_k"]) == 4
  assert "a draft step over a plain pass" in proc.stdout
  assert (out / "mtp.png").stat().st_size > 0 and (out / "model" / "config.json").exists()
  assert f"wrote {out / 'metrics.json'}, {out / 'mtp.png'}" in proc.stdout
  assert_one_line_error(
    run_module("experiments.train_mtp", f"--workdir={tmp_path / 'x'}", "--quick", "--save_default"),
    "--save_default does not go with --quick",
  )


def test_dense_heads_train_and_read_no_routed_expert(tiny_model, tmp_path):
  """`dense_hidden`: heads whose block is a dense SwiGLU of that width (no router, no experts)."""
  tc = mtp.MTPTrainConfig(
    batch_size=2, seq_len=24, steps=2, warmup_steps=1, eval_batches=1, log_every_seconds=1e9, dense_hidden=24
  )
  model, _ = mtp.train(tiny_model, tc, tmp_path, log=lambda line: None)
  assert model.config.mtp_dense_hidden == 24
  block = model.module().mtp[0].block
  assert not block.is_moe and block.ffn.w_gate_DF.shape == (tiny_model.config.d_model, 24)
  assert msj.Model.load(tmp_path / "model").config.mtp_dense_hidden == 24
  with pytest.raises(ValueError, match="mtp.dense_hidden must be >= 0"):
    mtp.MTPTrainConfig(dense_hidden=-1)
