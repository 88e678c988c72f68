"""The default trained model: cached at `$MOESPEC_CACHE/models/tiny`, trained when missing or when
it was trained from another recipe (`configs/tiny.py` as it was then: a `recipe.json` beside it)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from moespec_jax.api import Model
from moespec_jax.config import model_config_from
from moespec_jax.io import atomic, paths

if TYPE_CHECKING:
  import ml_collections


def default_config() -> ml_collections.ConfigDict:
  from configs import tiny

  return tiny.get_config()


RECIPE_FILE = "recipe.json"


def recipe_fingerprint() -> str:
  """A digest of the default recipe (`configs/tiny.py`: model, training, MTP heads): a model the
  demo trained from another recipe is trained again, and each recipe resumes in its own workdir."""
  text = json.dumps(default_config().to_dict(), sort_keys=True)
  return hashlib.sha256(text.encode("utf-8")).hexdigest()[:10]


def training_workdir() -> pathlib.Path:
  """Where the default model trains (resumable if interrupted), one per recipe."""
  return paths.cache_dir() / "runs" / f"pretrain-tiny-{recipe_fingerprint()}"


def mtp_workdir() -> pathlib.Path:
  """Where the default model's MTP heads train (resumable if interrupted), one per recipe."""
  return paths.cache_dir() / "runs" / f"train-mtp-tiny-{recipe_fingerprint()}"


def cached_recipe(directory: pathlib.Path) -> str | None:
  """The recipe a cached default model was trained from; None where it has no record (a model
  saved by `experiments.pretrain --export_default` or by hand: kept as it is)."""
  path = directory / RECIPE_FILE
  if not path.is_file():
    return None
  return str(json.loads(path.read_text()).get("fingerprint"))


def _record_recipe(directory: pathlib.Path) -> None:
  atomic.write_json_atomic(directory / RECIPE_FILE, {"config": "configs/tiny.py", "fingerprint": recipe_fingerprint()})


def ensure_default_model(log: Callable[[str], None] = print, *, train_heads: bool = True) -> Model:
  """Loads the default model, training it first if missing (minutes on 2 CPU cores; the
  durations: docs/findings/2026-12-04-make-demo.md).

  With `train_heads`, a cached model without MTP heads gets them trained (configs/tiny.py `mtp`
  section, within the demo's time budget below) and saved with it, atomically, in the same
  directory.
  """
  target = paths.default_model_dir()
  cfg = default_config()
  recipe = cached_recipe(target)
  stale = recipe is not None and recipe != recipe_fingerprint()
  if stale:
    log(
      f"the default model at {target} was trained from another configs/tiny.py (recipe {recipe}, now "
      f"{recipe_fingerprint()}): training the current one"
    )
  recorded = recipe is not None  # trained by this function (from this recipe, or again below)
  if (target / "config.json").exists() and not stale:
    model = Model.load(target)
  else:
    from moespec_jax.training import pretrain

    if not stale:
      log(f"no default model at {target}: training it")
    log(f"configs/tiny.py, {cfg.train.steps} steps; resumable in {training_workdir()}")
    model, _ = pretrain.train(
      model_config_from(cfg.model),
      pretrain.TrainConfig.from_dict(cfg.train),
      training_workdir(),
      config_name="tiny",
      log=log,
    )
    model.save(target)
    _record_recipe(target)
    recorded = True
    log(f"default model saved to {target}")
    model = Model.load(target)
  if train_heads and model.config.num_mtp_modules == 0:
    from moespec_jax.training import mtp

    tc = mtp.MTPTrainConfig.from_dict(cfg.mtp)
    if not tc.time_budget_s:  # the demo's budget for the heads: 2.5 minutes at most
      tc = dataclasses.replace(tc, time_budget_s=150.0)
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
    if recorded:  # the save replaced the directory, its record too
      _record_recipe(target)
    log(f"default model saved with its MTP heads to {target}")
    model = Model.load(target)
  return model
