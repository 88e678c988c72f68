"""The default trained model (moespec_jax/default_model.py): its config, where it trains, and a cached
model loaded as it is (training itself runs in tests/training and in `make demo`)."""

import json

import jax
import numpy as np

import moespec_jax as msj
from configs import tiny
from moespec_jax import default_model
from moespec_jax.io import paths
from moespec_jax.training import mtp as mtp_training
from moespec_jax.training import pretrain


def test_the_default_config_is_configs_tiny():
  assert default_model.default_config().to_dict() == tiny.get_config().to_dict()


def test_it_trains_in_the_cache_one_workdir_per_recipe(monkeypatch, tmp_path):
  monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
  fingerprint, target_fingerprint = default_model.recipe_fingerprint(), default_model.target_fingerprint()
  assert default_model.training_workdir() == tmp_path / "runs" / f"pretrain-tiny-{target_fingerprint}"
  assert default_model.mtp_workdir() == tmp_path / "runs" / f"train-mtp-tiny-{fingerprint}"
  changed = tiny.get_config()
  changed.train.steps += 1
  monkeypatch.setattr(default_model, "default_config", lambda: changed)
  assert default_model.recipe_fingerprint() != fingerprint
  assert default_model.target_fingerprint() != target_fingerprint
  # The heads' recipe alone: the target's fingerprint (and its workdir) stay.
  heads_only = tiny.get_config()
  heads_only.mtp.steps += 1
  monkeypatch.setattr(default_model, "default_config", lambda: heads_only)
  assert default_model.recipe_fingerprint() != fingerprint
  assert default_model.target_fingerprint() == target_fingerprint


def test_the_eos_and_bos_of_the_default_config_are_its_tokenizers():
  # A BPE's special tokens take its first ids whatever its size: a small one trained here says which.
  from moespec_jax.data import tokenizer as tok_lib

  config = tiny.get_config().model
  assert config.tokenizer.startswith("bpe-")
  bpe = tok_lib.BpeTokenizer.train(["def f(x):\n    return x\n"] * 4, vocab_size=300)
  assert (config.eos_id, config.bos_id) == (bpe.eos_id, bpe.bos_id)
  assert config.vocab_size >= int(config.tokenizer[4:])


def test_a_model_trained_from_another_recipe_is_trained_again(monkeypatch, tmp_path, tiny_config):
  monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
  target = paths.default_model_dir()
  msj.Model.init(tiny_config.replace(num_mtp_modules=1), seed=1).save(target)
  (target / default_model.RECIPE_FILE).write_text('{"fingerprint": "an-old-one"}')
  fresh = msj.Model.init(tiny_config, seed=3)
  calls = []

  def train(config, tc, workdir, **kwargs):
    calls.append(("pretrain", workdir))
    return fresh, {}

  def train_heads(model, tc, workdir, **kwargs):
    calls.append(("mtp", workdir))
    return msj.Model.init(tiny_config.replace(num_mtp_modules=1), seed=4), {"teacher_forced": []}

  monkeypatch.setattr(pretrain, "train", train)
  monkeypatch.setattr(mtp_training, "train", train_heads)
  lines = []
  default_model.ensure_default_model(log=lines.append)
  assert calls == [("pretrain", default_model.training_workdir()), ("mtp", default_model.mtp_workdir())]
  assert "another configs/tiny.py (recipe an-old-one" in lines[0]
  # The record survives the save with heads, so the next call loads the model as it is.
  assert default_model.cached_recipe(target) == default_model.recipe_fingerprint()
  calls.clear()
  assert default_model.ensure_default_model(log=lines.append).config.num_mtp_modules == 1 and calls == []


def test_heads_from_another_recipe_of_the_same_target_are_trained_again(monkeypatch, tmp_path, tiny_config):
  """Where only configs/tiny.py's `mtp` section changed, the cached target is kept and its heads
  alone are trained again."""
  monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
  target = paths.default_model_dir()
  cached = msj.Model.init(tiny_config.replace(num_mtp_modules=1), seed=1)
  cached.save(target)
  record = {"fingerprint": "old-heads", "target": default_model.target_fingerprint()}
  (target / default_model.RECIPE_FILE).write_text(json.dumps(record))
  calls = []

  def no_pretraining(*args, **kwargs):
    raise AssertionError("the cached target was trained again")

  def train_heads(model, tc, workdir, **kwargs):
    calls.append(workdir)
    for a, b in zip(jax.tree.leaves(model.state), jax.tree.leaves(cached.state)):
      np.testing.assert_array_equal(a, b)
    return msj.Model.init(tiny_config.replace(num_mtp_modules=1), seed=4), {"teacher_forced": []}

  monkeypatch.setattr(pretrain, "train", no_pretraining)
  monkeypatch.setattr(mtp_training, "train", train_heads)
  lines = []
  default_model.ensure_default_model(log=lines.append)
  assert calls == [default_model.mtp_workdir()]
  assert "MTP heads from another configs/tiny.py (recipe old-heads" in lines[0]
  assert default_model.cached_recipe(target) == default_model.recipe_fingerprint()
  calls.clear()
  default_model.ensure_default_model(log=lines.append)
  assert calls == []


def test_a_cached_model_is_loaded_without_training(monkeypatch, tmp_path, tiny_config):
  monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))

  def no_training(*args, **kwargs):
    raise AssertionError("a cached default model was trained again")

  monkeypatch.setattr(pretrain, "train", no_training)
  monkeypatch.setattr(mtp_training, "train", no_training)
  lines = []
  with_heads = msj.Model.init(tiny_config.replace(num_mtp_modules=1), seed=1)
  with_heads.save(paths.default_model_dir())
  model = default_model.ensure_default_model(log=lines.append)
  assert model.config == with_heads.config and lines == []
  for a, b in zip(jax.tree.leaves(model.state), jax.tree.leaves(with_heads.state)):
    np.testing.assert_array_equal(a, b)
  # Without heads, and none asked for: loaded as it is.
  msj.Model.init(tiny_config, seed=2).save(paths.default_model_dir())
  assert default_model.ensure_default_model(log=lines.append, train_heads=False).config == tiny_config
  assert lines == []
