"""`ModelHandle` (moespec_jax/model/handle.py): the protocol by which layers below the API name a model."""

from moespec_jax.model import ModelHandle


def test_the_public_model_is_a_handle(tiny_model):
  assert isinstance(tiny_model, ModelHandle)
  assert tiny_model.expert_method("auto") == tiny_model.config.expert_method


def test_an_object_without_the_handles_methods_is_not():
  class ConfigOnly:
    config = graphdef = state = tokenizer = None

  assert not isinstance(ConfigOnly(), ModelHandle)
