"""Cache locations (moespec_jax/io/paths.py): everything under $MOESPEC_CACHE, else ~/.cache."""

import pathlib

from moespec_jax.io import paths


def test_every_location_is_under_the_cache_root(monkeypatch, tmp_path):
  monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
  assert paths.cache_dir() == tmp_path
  assert paths.default_model_dir() == tmp_path / "models" / "tiny"
  assert paths.data_cache_dir() == tmp_path / "data"
  assert paths.tokenizer_dir("bpe-1024") == tmp_path / "tokenizers" / "bpe-1024"
  assert not (tmp_path / "models").exists()  # named, not created


def test_without_the_variable_the_root_is_in_the_home_directory(monkeypatch):
  monkeypatch.delenv(paths.CACHE_ENV, raising=False)
  assert paths.cache_dir() == pathlib.Path.home() / ".cache" / "moespec_jax"
  monkeypatch.setenv(paths.CACHE_ENV, "~/elsewhere")
  assert paths.cache_dir() == pathlib.Path.home() / "elsewhere"
