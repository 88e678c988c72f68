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
  tc = mtp.MTPTrainConfig(num_mtp_modules=2, loss="distill", batch_size=2, seq_len=24, steps=3,
                          warmup_steps=1, eval_batches=1, checkpoint_every=2, log_every_seconds=1e9)
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
