"""Where the framework keeps its caches, tokenizers and the default model."""

from __future__ import annotations

import os
import pathlib

CACHE_ENV = "MOESPEC_CACHE"


def cache_dir() -> pathlib.Path:
  """The cache root: `$MOESPEC_CACHE`, else `~/.cache/moespec_jax` (not created)."""
  root = os.environ.get(CACHE_ENV)
  if root:
    return pathlib.Path(root).expanduser()
  return pathlib.Path.home() / ".cache" / "moespec_jax"


def default_model_dir() -> pathlib.Path:
  """The default trained model: `cache_dir()/models/tiny`."""
  return cache_dir() / "models" / "tiny"


def data_cache_dir() -> pathlib.Path:
  """Tokenized corpus arrays: `cache_dir()/data`."""
  return cache_dir() / "data"


def tokenizer_dir(name: str) -> pathlib.Path:
  """A trained tokenizer cached by name, e.g. `cache_dir()/tokenizers/bpe-1024`."""
  return cache_dir() / "tokenizers" / name
