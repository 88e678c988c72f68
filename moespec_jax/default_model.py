"""The default trained model: cached at `$MOESPEC_CACHE/models/tiny`, trained when missing."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from moespec_jax.api import Model
from moespec_jax.config import model_config_from
from moespec_jax.io import paths

if TYPE_CHECKING:
  import ml_collections


def default_config() -> ml_collections.ConfigDict:
  from configs import tiny

  return tiny.get_config()


def training_workdir() -> pathlib.Path:
  """Where the default model trains (resumable if interrupted)."""
  return paths.cache_dir() / "runs" / "pretrain-tiny"


def mtp_workdir() -> pathlib.Path:
  """Where the default model's MTP heads train (resumable if interrupted)."""
  return paths.cache_dir() / "runs" / "train-mtp-tiny"


def ensure_default_model(log: Callable[[str], None] = print, *, train_heads: bool = True) -> Model:
  """Loads the default model, training it first if missing (minutes on 2 CPU cores; the
  durations: docs/findings/2026-12-04-make-demo.md).

  With `train_heads`, a cached model without MTP heads gets them trained (configs/tiny.py `mtp`
  section, within the demo's time budget below) and saved with it, atomically, in the same
  directory.
  """
  target = paths.default_model_dir()
  cfg = default_config()
  if (target / "config.json").exists():
    model = Model.load(target)
  else:
    from moespec_jax.training import pretrain

    log(
      f"no default model at {target}: training it (configs/tiny.py, {cfg.train.steps} steps; "
      f"resumable in {training_workdir()})"
    )
    model, _ = pretrain.train(
      model_config_from(cfg.model),
      pretrain.TrainConfig.from_dict(cfg.train),
      training_workdir(),
      config_name="tiny",
      log=log,
    )
    model.save(target)
    log(f"default model saved to {target}")
    model = Model.load(target)
  if train_heads and model.config.num_mtp_modules == 0:
    from moespec_jax.training import mtp

    tc = mtp.MTPTrainConfig.from_dict(cfg.mtp)
    if not tc.time_budget_s:  # the demo's budget for the heads: about 3 minutes
      tc = dataclasses.replace(tc, time_budget_s=180.0)
    log(
      f"the default model has no MTP heads: training {tc.num_mtp_modules} ({tc.loss} loss, "
      f"{tc.steps} steps; resumable in {mtp_workdir()})"
    )
    with_heads, metrics = mtp.train(model, tc, mtp_workdir(), log=log)
    for row in metrics["teacher_forced"]:
      log(
        f"MTP depth {row['depth']}: held-out greedy acceptance {row['greedy_acceptance']:.3f}, "
        f"expected acceptance at T=1 {row['expected_acceptance_t1']:.3f}"
      )
    with_heads.save(target)
    log(f"default model saved with its MTP heads to {target}")
    model = Model.load(target)
  return model
