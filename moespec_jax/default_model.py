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


def _digest(sections: dict) -> str:
  return hashlib.sha256(json.dumps(sections, sort_keys=True).encode("utf-8")).hexdigest()[:10]


def recipe_fingerprint() -> str:
  """A digest of the default recipe (`configs/tiny.py`: model, training, MTP heads): a model the
  demo trained from another recipe is trained again, and each recipe resumes in its own workdir."""
  return _digest(default_config().to_dict())


def target_fingerprint() -> str:
  """A digest of the target's part of the recipe (model and training): where only the MTP heads'
  recipe changed, the cached target is kept and its heads alone are trained again."""
  cfg = default_config().to_dict()
  return _digest({"model": cfg["model"], "train": cfg["train"]})


def training_workdir() -> pathlib.Path:
  """Where the default model's target trains (resumable if interrupted), one per target recipe."""
  return paths.cache_dir() / "runs" / f"pretrain-tiny-{target_fingerprint()}"


def mtp_workdir() -> pathlib.Path:
  """Where the default model's MTP heads train (resumable if interrupted), one per recipe."""
  return paths.cache_dir() / "runs" / f"train-mtp-tiny-{recipe_fingerprint()}"


def _record(directory: pathlib.Path) -> dict | None:
  path = directory / RECIPE_FILE
  return json.loads(path.read_text()) if path.is_file() else None


def cached_recipe(directory: pathlib.Path) -> str | None:
  """The recipe a cached default model was trained from; None where it has no record (a model
  saved by `experiments.pretrain --export_default` or by hand: kept as it is)."""
  record = _record(directory)
  return None if record is None else str(record.get("fingerprint"))


def _record_recipe(directory: pathlib.Path) -> None:
  atomic.write_json_atomic(
    directory / RECIPE_FILE,
    {"config": "configs/tiny.py", "fingerprint": recipe_fingerprint(), "target": target_fingerprint()},
  )


def ensure_default_model(log: Callable[[str], None] = print, *, train_heads: bool = True) -> Model:
  """Loads the default model, training it first if missing (minutes on 2 CPU cores; the
  durations: docs/findings/2026-12-04-make-demo.md).

  With `train_heads`, a cached model without MTP heads, or with heads from another recipe of the
  same target, gets them trained (configs/tiny.py `mtp` section, within the demo's time budget
  below) and saved with it, atomically, in the same directory.
  """
  target = paths.default_model_dir()
  cfg = default_config()
  record = _record(target)
  recipe = None if record is None else record.get("fingerprint")
  stale = recipe is not None and recipe != recipe_fingerprint()
  # A record from before targets had their own fingerprint: the whole recipe decides.
  stale_target = stale and record.get("target") != target_fingerprint()
  if stale_target:
    log(
      f"the default model at {target} was trained from another configs/tiny.py (recipe {recipe}, now "
      f"{recipe_fingerprint()}): training the current one"
    )
  elif stale:
    log(
      f"the default model at {target} has MTP heads from another configs/tiny.py (recipe {recipe}, now "
      f"{recipe_fingerprint()}; the same target): training the current heads"
    )
  recorded = recipe is not None  # trained by this function (from this recipe, or again below)
  if (target / "config.json").exists() and not stale_target:
    model = Model.load(target)
  else:
    from moespec_jax.training import pretrain

    if not stale_target:
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
  if train_heads and (model.config.num_mtp_modules == 0 or stale):
    from moespec_jax.training import mtp

    tc = mtp.MTPTrainConfig.from_dict(cfg.mtp)
    if not tc.time_budget_s:  # the demo's budget for the heads: 2.5 minutes at most
      tc = dataclasses.replace(tc, time_budget_s=150.0)
    log(
      f"the default model has no MTP heads of this recipe: training {tc.num_mtp_modules} ({tc.loss} loss, "
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
