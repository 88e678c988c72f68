"""Shared fixtures (one tiny random model per session, so compiled programs are reused) and what
keeps the compile-bound suite fast: see the comments below."""

import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles a few hundred small programs, and their compile time is most of its time:
# LLVM's optimisations took a third of it and buy nothing at these shapes; without XLA:CPU's
# newer fusion emitters and LLVM's expensive passes as well, plain, auto-K and n-gram generate
# calls on the tiny model compiled in 9.5-9.6 s against 12.0-18.4 s with them (make test: 6m14s
# against 8m45s). CLI tests' subprocesses inherit these.
_FAST_COMPILE_FLAGS = {"xla_backend_optimization_level": "0", "xla_cpu_use_fusion_emitters": "false",
                       "xla_llvm_disable_expensive_passes": "true"}
for _name, _value in _FAST_COMPILE_FLAGS.items():
  if _name not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --{_name}={_value}").strip()
# One compilation cache per run, shared by the workers and the CLI tests' subprocesses (the same
# tiny programs are compiled in several processes); made here, removed when the run ends.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="moespec-tests-xla-")
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

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


def pytest_collection_modifyitems(config, items):
  """Files with slow tests first, each file's order kept: `make test` deals whole files to two
  workers (pytest-xdist, --dist loadfile), and a long file dealt last would run alone."""
  del config
  slow_files = {item.path for item in items if item.get_closest_marker("slow")}
  items.sort(key=lambda item: item.path not in slow_files)


def pytest_unconfigure(config):
  del config
  if _OWN_CACHE:
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
