"""io/compile_cache: command-line runs keep their compiled programs, per host, opt-out by env."""

import os

import jax
import pytest

from moespec_jax.io import compile_cache
from pallas_kernels import cpu
from tests.cli_run import run_module


def test_host_fingerprint_is_stable_and_short():
  assert compile_cache.host_fingerprint() == compile_cache.host_fingerprint()
  assert len(compile_cache.host_fingerprint()) == 16
  assert compile_cache.compilation_cache_dir().parent.name == "xla"


_SETTINGS = (
  "jax_compilation_cache_dir",
  "jax_persistent_cache_min_compile_time_secs",
  "jax_compilation_cache_max_size",
)


@pytest.fixture
def unconfigured():
  """JAX's cache directory unset for the test; the suite's settings restored after."""
  before = {name: getattr(jax.config, name) for name in _SETTINGS}
  jax.config.update("jax_compilation_cache_dir", None)
  yield
  for name, value in before.items():
    jax.config.update(name, value)


def test_enable_sets_our_directory_keeps_the_users_and_can_be_turned_off(unconfigured, tmp_path, monkeypatch):
  monkeypatch.setenv(compile_cache.DISABLE_ENV, "0")
  assert compile_cache.enable(tmp_path / "off") is None
  assert jax.config.jax_compilation_cache_dir is None and not (tmp_path / "off").exists()
  monkeypatch.delenv(compile_cache.DISABLE_ENV)
  blocker = tmp_path / "file"
  blocker.write_text("")
  assert compile_cache.enable(blocker / "xla") is None  # cannot be created: no cache, no error
  assert jax.config.jax_compilation_cache_dir is None
  assert compile_cache.enable(tmp_path / "ours") == tmp_path / "ours"
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "ours") and (tmp_path / "ours").is_dir()
  # Once a directory is configured (by the user, or by an earlier call), it is kept.
  assert compile_cache.enable(tmp_path / "other") == tmp_path / "ours"
  assert not (tmp_path / "other").exists()


def test_a_second_command_line_run_loads_what_the_first_compiled(tiny_model, tmp_path):
  """`experiments.generate` twice with our cache (the suite's own unset): the first run writes
  compiled programs under $MOESPEC_CACHE/xla/<host>, the second writes nothing new and prints the
  same tokens; with MOESPEC_COMPILATION_CACHE=0 a new program is not written."""
  cpu.ensure_built()
  cache = tmp_path / "cache"
  cache.mkdir()
  os.symlink(cpu.cache_dir() / "build", cache / "build")  # the built kernels, not a rebuild
  model = str(tiny_model.save(tmp_path / "model"))
  env = {
    "JAX_COMPILATION_CACHE_DIR": "",
    "MOESPEC_CACHE": str(cache),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
  }
  args = (f"--model={model}", "--prompt=def f(x):", "--max_new_tokens=5")
  first = run_module("experiments.generate", *args, env=env)
  assert first.returncode == 0, first.stderr
  (host,) = (cache / "xla").iterdir()
  assert host.name == compile_cache.host_fingerprint()
  written = sorted(p.name for p in host.iterdir())
  assert written
  second = run_module("experiments.generate", *args, env=env)
  assert second.returncode == 0, second.stderr
  assert sorted(p.name for p in host.iterdir()) == written
  assert second.stdout.splitlines()[0] == first.stdout.splitlines()[0]
  # Another program (7 tokens): written with the cache on, not with it off.
  off = run_module("experiments.generate", *args[:2], "--max_new_tokens=7", env={**env, compile_cache.DISABLE_ENV: "0"})
  assert off.returncode == 0, off.stderr
  assert sorted(p.name for p in host.iterdir()) == written
  on = run_module("experiments.generate", *args[:2], "--max_new_tokens=7", env=env)
  assert on.returncode == 0, on.stderr
  assert len(list(host.iterdir())) > len(written)


def test_trim_empties_a_cache_over_its_size_only(tmp_path):
  cache = tmp_path / "c"
  assert not compile_cache.trim(cache, 10)  # no cache yet
  (cache / "sub").mkdir(parents=True)
  (cache / "a-cache").write_bytes(b"x" * 6)
  (cache / "sub" / "b-atime").write_bytes(b"y" * 4)
  assert not compile_cache.trim(cache, 10) and len(list(cache.rglob("*-*"))) == 2
  assert compile_cache.trim(cache, 9)
  assert [p for p in cache.rglob("*") if p.is_file()] == [] and cache.is_dir()
