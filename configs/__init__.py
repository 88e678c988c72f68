"""Model and training configs, one `get_config()` file per model (see WORKSPACE.md)."""

import importlib


def load(name: str):
  """The ConfigDict of configs/<name>.py."""
  return importlib.import_module(f"configs.{name}").get_config()


def model_config(name: str):
  """The ModelConfig of configs/<name>.py."""
  from moespec_jax.config import model_config_from  # pylint: disable=g-import-not-at-top

  return model_config_from(load(name).model)
