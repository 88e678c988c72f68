"""The persistent cache of compiled programs: command-line runs (`cli.run` enables it) and the
test suite (tests/conftest.py, its own folder, `trim`med between runs).

A generation with num_draft="auto" and the MTP heads compiles for tens of seconds on CPU; every
command-line run used to pay it again. With JAX's persistent compilation cache at
`compilation_cache_dir()` (`$MOESPEC_CACHE/xla/<host>`), a rerun loads the compiled programs
instead. Compiled CPU code targets the processor it was built on and JAX's cache key does not
name the processor, so each host (machine type, processor model and instruction-set flags) gets
its own folder: a cache shared between machines never hands one another's code.

Not enabled on import: a library does not change JAX's global configuration behind its user's
back; call `enable()` to opt in. A cache the user configured (JAX_COMPILATION_CACHE_DIR or
`jax.config`) is kept; `MOESPEC_COMPILATION_CACHE=0` turns ours off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import platform

import jax

from moespec_jax.io import paths

DISABLE_ENV = "MOESPEC_COMPILATION_CACHE"
# Programs that compile faster than this are not written (plain decoding's programs compile in
# about a second, auto K's with the MTP heads in tens).
MIN_COMPILE_SECONDS = 0.5
# Least recently used entries are dropped beyond this size: room for hundreds of auto-K programs
# (docs/findings/2026-12-05-compilation-cache.md).
MAX_BYTES = 1 << 30


def host_fingerprint() -> str:
  """A short hash of what compiled CPU code depends on: machine type, processor model and its
  instruction-set flags (Linux: /proc/cpuinfo; elsewhere `platform.processor()`)."""
  parts = dict.fromkeys([platform.machine(), platform.processor()])
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:  # one block per processor: each distinct line once
        if line.split(":", 1)[0].strip() in ("model name", "flags", "Features", "CPU part"):
          parts[line.strip()] = None
  except OSError:
    pass
  return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def compilation_cache_dir(name: str = "xla") -> pathlib.Path:
  """`paths.cache_dir()/<name>/<host_fingerprint()>` (`xla`: command-line runs; the test suite
  keeps its own, `xla-tests`, compiled with its own XLA flags)."""
  return paths.cache_dir() / name / host_fingerprint()


def enable(directory: str | os.PathLike | None = None) -> pathlib.Path | None:
  """Turns JAX's persistent compilation cache on at `directory` (default
  `compilation_cache_dir()`) and returns where it is; the user's own cache directory where one is
  configured; None where `MOESPEC_COMPILATION_CACHE=0` or the directory cannot be created (logged).
  Call before the first compilation."""
  if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
    return None
  configured = jax.config.jax_compilation_cache_dir
  if configured:
    return pathlib.Path(configured)
  target = pathlib.Path(directory) if directory is not None else compilation_cache_dir()
  try:
    target.mkdir(parents=True, exist_ok=True)
  except OSError as e:  # a read-only home: run without the cache rather than not at all
    logging.warning("compiled programs are not cached: cannot create %s (%s)", target, e)
    return None
  jax.config.update("jax_compilation_cache_dir", str(target))
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # else the user's
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
  if jax.config.jax_compilation_cache_max_size < 0:  # JAX's LRU cap (it locks with filelock)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
  return target


def trim(directory: str | os.PathLike, max_bytes: int) -> bool:
  """Empties `directory` where its files take more than `max_bytes`; returns whether it did.

  For a cache that many processes write at once (the test suite's): JAX's own cap
  (`jax_compilation_cache_max_size`, as `enable` sets it) rescans the whole directory under a
  file lock on every write, which more than doubled `make test`'s time
  (docs/findings/2026-12-05-compilation-cache.md); this runs once, before the writers start."""
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    return False
  files = [p for p in directory.rglob("*") if p.is_file()]
  if sum(p.stat().st_size for p in files) <= max_bytes:
    return False
  for p in files:
    p.unlink(missing_ok=True)
  return True
