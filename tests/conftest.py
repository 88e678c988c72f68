"""Shared fixtures (one tiny random model per session, so compiled programs are reused) and what
keeps the compile-bound suite fast: see the comments below."""

import os
import pathlib
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles a few hundred small programs, and their compile time is most of its time:
# LLVM's optimisations took a third of it and buy nothing at these shapes; without XLA:CPU's
# newer fusion emitters and LLVM's expensive passes as well, plain, auto-K and n-gram generate
# calls on the tiny model compiled in 9.5-9.6 s against 12.0-18.4 s with them (make test: 6m14s
# against 8m45s). CLI tests' subprocesses inherit these.
_FAST_COMPILE_FLAGS = {
  "xla_backend_optimization_level": "0",
  "xla_cpu_use_fusion_emitters": "false",
  "xla_llvm_disable_expensive_passes": "true",
}
# The expert-parallel tests (tests/mesh/) need MESH_DEVICES simulated CPU devices, which XLA sets up
# as JAX starts: a process gets them with MOESPEC_TEST_MESH=1 (make test's second run) and then runs
# those tests alone; other runs leave them out (`pytest_collection_modifyitems`).
MESH_DEVICES = 8
MESH_RUN = os.environ.get("MOESPEC_TEST_MESH") == "1"
if MESH_RUN:
  _FAST_COMPILE_FLAGS["xla_force_host_platform_device_count"] = str(MESH_DEVICES)
for _name, _value in _FAST_COMPILE_FLAGS.items():
  if _name not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --{_name}={_value}").strip()

import jax  # noqa: E402  (after JAX_PLATFORMS)
import pytest  # noqa: E402

from moespec_jax.config import ModelConfig  # noqa: E402
from moespec_jax.io import compile_cache  # noqa: E402

# One compilation cache shared by the workers and the CLI tests' subprocesses (the same tiny
# programs are compiled in several processes), kept between runs ($MOESPEC_CACHE/xla-tests/<host>):
# a rerun loads what it compiled before (make test: 4 min 18 s with an empty cache, 2 min 45 s on
# the next run). Emptied before a run once it holds over 1 GiB (about 15 runs of changed code; JAX's
# own cap rescans it on every write: 11 minutes). A JAX_COMPILATION_CACHE_DIR you set is used instead.
_TEST_CACHE_BYTES = 1 << 30
_TEMPORARY_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = compile_cache.compilation_cache_dir("xla-tests")
  try:
    if "PYTEST_XDIST_WORKER" not in os.environ:  # the controller, before any worker starts
      compile_cache.trim(_cache, _TEST_CACHE_BYTES)
    _cache.mkdir(parents=True, exist_ok=True)
  except OSError:  # a read-only cache root: one folder for this run, removed when it ends
    _cache = pathlib.Path(tempfile.mkdtemp(prefix="moespec-tests-xla-"))
    _TEMPORARY_CACHE = _cache
  os.environ["JAX_COMPILATION_CACHE_DIR"] = str(_cache)  # the subprocesses'
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  # This process imported jax before: its configuration is set directly.
  jax.config.update("jax_compilation_cache_dir", str(_cache))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

TINY = dict(
  vocab_size=264,
  d_model=32,
  n_layers=3,
  n_heads=2,
  n_kv_heads=1,
  head_dim=16,
  max_seq_len=64,
  n_routed_experts=8,
  top_k=2,
  n_shared_experts=1,
  expert_hidden=16,
  dense_hidden=48,
  first_k_dense=1,
)


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
  return ModelConfig(**TINY)


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
  import moespec_jax as msj

  return msj.Model.init(tiny_config, seed=0)


def _is_mesh_test(item) -> bool:
  return "mesh" in pathlib.Path(item.path).relative_to(pathlib.Path(__file__).parent).parts[:1]


def pytest_report_header(config):
  del config
  if MESH_RUN:
    return f"the expert-parallel tests alone, on {MESH_DEVICES} simulated CPU devices"
  return "tests/mesh/ left out: they run with MOESPEC_TEST_MESH=1 (make test's second run)"


def pytest_collection_modifyitems(config, items):
  """The mesh run's tests alone, or every other test (see MESH_RUN). Files with slow tests first,
  each file's order kept: `make test` deals whole files to two workers (pytest-xdist, --dist
  loadfile), and a long file dealt last would run alone."""
  keep = [item for item in items if _is_mesh_test(item) == MESH_RUN]
  if len(keep) != len(items):
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep
  slow_files = {item.path for item in items if item.get_closest_marker("slow")}
  items.sort(key=lambda item: item.path not in slow_files)


def pytest_unconfigure(config):
  del config
  if _TEMPORARY_CACHE is not None and "PYTEST_XDIST_WORKER" not in os.environ:
    shutil.rmtree(_TEMPORARY_CACHE, ignore_errors=True)
