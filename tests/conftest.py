"""Shared fixtures: one tiny random model per session, so compiled programs are reused."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

from moespec_jax.config import ModelConfig  # noqa: E402

TINY = dict(vocab_size=264, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=16,
            max_seq_len=64, n_routed_experts=8, top_k=2, n_shared_experts=1, expert_hidden=16,
            dense_hidden=48, first_k_dense=1)


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
  return ModelConfig(**TINY)


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
  import moespec_jax as msj
  return msj.Model.init(tiny_config, seed=0)
