"""The default trained model: cached at `$MOESPEC_CACHE/models/tiny`, trained when missing."""

from __future__ import annotations

import pathlib

from moespec_jax.api import Model
from moespec_jax.config import model_config_from
from moespec_jax.io import paths


def default_config():
  from configs import tiny
  return tiny.get_config()


def training_workdir() -> pathlib.Path:
  """Where the default model trains (resumable if interrupted)."""
  return paths.cache_dir() / "runs" / "pretrain-tiny"


def ensure_default_model(log=print) -> Model:
  """Loads the default model, training it first (about 6-10 minutes on 2 CPU cores) if missing."""
  target = paths.default_model_dir()
  if (target / "config.json").exists():
    return Model.load(target)
  from moespec_jax.training import pretrain
  cfg = default_config()
  log(f"no default model at {target}: training it (configs/tiny.py, {cfg.train.steps} steps; "
      f"resumable in {training_workdir()})")
  model, _ = pretrain.train(model_config_from(cfg.model), pretrain.TrainConfig.from_dict(cfg.train),
                            training_workdir(), config_name="tiny", log=log)
  model.save(target)
  log(f"default model saved to {target}")
  return Model.load(target)
