"""Pretraining: loss goes down, resume after interruption reproduces an uninterrupted run."""

import json

import jax
import numpy as np
import pytest

from moespec_jax.config import ModelConfig
from moespec_jax.data import batches as batches_lib
from moespec_jax.training import losses, pretrain
from pallas_kernels import cpu
from tests.conftest import TINY

TC = dict(
  batch_size=2,
  seq_len=16,
  steps=4,
  warmup_steps=1,
  eval_every=2,
  eval_batches=1,
  checkpoint_every=2,
  log_every_seconds=1000.0,
  learning_rate=1e-2,
)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
  # The C++ kernels are loaded from the shared build first: the isolated cache would rebuild them.
  cpu.available()
  monkeypatch.setenv("MOESPEC_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def _leaves(model):
  return [np.asarray(x) for x in jax.tree.leaves(model.state)]


@pytest.mark.slow
def test_resume_after_interruption_matches_an_uninterrupted_run(tmp_path, monkeypatch):
  config = ModelConfig(**TINY)
  tc = pretrain.TrainConfig(**TC)
  full, metrics = pretrain.train(config, tc, tmp_path / "full", log=lambda *_: None)
  assert metrics["val_curve"] and np.isfinite(metrics["final_val_bits_per_byte"])
  assert (tmp_path / "full" / "loss.png").stat().st_size > 0
  saved = json.loads((tmp_path / "full" / "metrics.json").read_text())
  assert [r["step"] for r in saved["val_curve"]] == [2, 4]
  # The final figure is the whole split's (the curve's points: eval_batches batches spread over it).
  whole = pretrain.validation_bits_per_byte(full, batch_size=2, seq_len=16, max_batches=None)
  assert saved["final_val_bits_per_byte"] == pytest.approx(whole, rel=1e-5)
  sampled = pretrain.validation_bits_per_byte(full, batch_size=2, seq_len=16, max_batches=1)
  assert saved["val_curve"][-1]["bits_per_byte"] == pytest.approx(sampled, rel=1e-5) and sampled != whole

  real_batch = batches_lib.train_batch

  def crash_at_step_3(tokens, b, t, seed, step):
    if step == 3:
      raise KeyboardInterrupt("simulated interruption")
    return real_batch(tokens, b, t, seed, step)

  monkeypatch.setattr(batches_lib, "train_batch", crash_at_step_3)
  with pytest.raises(KeyboardInterrupt):
    pretrain.train(config, tc, tmp_path / "resumed", log=lambda *_: None)
  assert not (tmp_path / "resumed" / "model").exists()
  monkeypatch.setattr(batches_lib, "train_batch", real_batch)
  logs = []
  resumed, _ = pretrain.train(config, tc, tmp_path / "resumed", log=logs.append)
  assert any("resuming from step 2" in line for line in logs)
  for a, b in zip(_leaves(full), _leaves(resumed)):
    np.testing.assert_array_equal(a, b)


def test_special_ids_other_than_the_tokenizers_are_refused_before_anything_is_written(tmp_path):
  config = ModelConfig(**{**TINY, "eos_id": 3})
  with pytest.raises(ValueError, match="eos_id 256 and bos_id 257, the config 3 and 257"):
    pretrain.train(config, pretrain.TrainConfig(**TC), tmp_path / "run", log=lambda *_: None)
  assert not (tmp_path / "run").exists()


def test_load_balance_loss_is_one_when_uniform_and_larger_when_skewed():
  e, k = 4, 1
  ids_uniform = np.arange(8).reshape(1, 1, 8, k) % e
  probs_uniform = np.full((1, 1, 8, e), 1 / e, np.float32)
  assert float(losses.load_balance_loss(ids_uniform, probs_uniform)) == pytest.approx(1.0)
  ids_skewed = np.zeros((1, 1, 8, k), np.int32)
  probs_skewed = np.tile(np.array([0.7, 0.1, 0.1, 0.1], np.float32), (1, 1, 8, 1))
  assert float(losses.load_balance_loss(ids_skewed, probs_skewed)) == pytest.approx(4 * 0.7)


def test_train_config_rejects_bad_values():
  with pytest.raises(ValueError, match="steps"):
    pretrain.TrainConfig(steps=0)
  with pytest.raises(ValueError, match="unknown"):
    pretrain.TrainConfig.from_dict({"stepz": 3})


@pytest.mark.slow
def test_quick_pretrain_runs_few_short_steps_and_keeps_the_fields_given(tmp_path):
  """`experiments.pretrain --quick`: --quick's short steps, a --config field given kept; --export_default
  refused with it (a smoke run's model is not the default model)."""
  from tests.cli_run import assert_one_line_error, run_module  # pylint: disable=g-import-not-at-top

  # The test model's shape with the byte tokenizer (the default config's BPE would be trained first).
  byte = dict(tokenizer="byte", eos_id=256, bos_id=257)
  small = [f"--config.model.{k}={v}" for k, v in {**TINY, **byte}.items()]
  out = tmp_path / "out"
  proc = run_module(
    "experiments.pretrain", f"--workdir={out}", "--quick", "--config.train.steps=4", *small, timeout=900
  )
  assert proc.returncode == 0, proc.stderr
  metrics = json.loads((out / "metrics.json").read_text())
  assert metrics["train_config"]["steps"] == 4 and metrics["train_config"]["seq_len"] == 64
  assert (out / "loss.png").stat().st_size > 0 and (out / "model" / "config.json").exists()
  assert_one_line_error(
    run_module("experiments.pretrain", f"--workdir={tmp_path / 'x'}", "--quick", "--export_default"),
    "--export_default does not go with --quick",
  )
