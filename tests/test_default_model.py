"""The default trained model (moespec_jax/default_model.py): its config, where it trains, and a cached
model loaded as it is (training itself runs in tests/training and in `make demo`)."""

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


def test_it_trains_in_the_cache(monkeypatch, tmp_path):
  monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
  assert default_model.training_workdir() == tmp_path / "runs" / "pretrain-tiny"
  assert default_model.mtp_workdir() == tmp_path / "runs" / "train-mtp-tiny"


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
