"""Building and loading the C++ CPU kernels: one shared library compiled from csrc/ on first use,
its FFI targets registered with XLA (the calls themselves: `ffi.py`).

The library is compiled by the system C++ compiler ($MOESPEC_CXX, default g++) into
$MOESPEC_CACHE/build (default ~/.cache/moespec_jax/build), named by a hash of the sources, the
flags, the compiler, the CPU and the jax version, and written atomically (temporary file +
os.replace), so concurrent processes never load a half-written library. Nothing is downloaded.
If no compiler is found, `ensure_built` raises `CpuKernelUnavailable` with the reason; callers
that can fall back to XLA log that reason (never silently).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading

import jax

_CSRC = pathlib.Path(__file__).parent / "csrc"
_SOURCES = tuple(
  _CSRC / name
  for name in ("moe_ffn_cpu.cc", "dense_cpu.cc", "attention_cpu.cc", "mla_attention_cpu.cc", "clock_cpu.cc")
)
_HEADERS = (_CSRC / "gemv.h", _CSRC / "slots.h", _CSRC / "vmath.h")
# FFI target -> the handler symbol the library exports.
_TARGETS = {
  "moespec_moe_ffn_f32": "MoespecMoeFfnF32",
  "moespec_dense_f32": "MoespecDenseF32",
  "moespec_attention_f32": "MoespecAttentionF32",
  "moespec_tree_attention_f32": "MoespecTreeAttentionF32",
  "moespec_mla_attention_f32": "MoespecMlaAttentionF32",
  "moespec_clock_cpu": "MoespecClockCpu",
}
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=fast")

_lock = threading.Lock()
_state = {"lib": None, "error": None}


class CpuKernelUnavailable(RuntimeError):
  """The C++ CPU kernel cannot be built or loaded (e.g. no C++ compiler)."""


def cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get("MOESPEC_CACHE", os.path.expanduser("~/.cache/moespec_jax")))


def _cpu_signature() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      flags = next((line for line in f if line.startswith("flags")), "")
  except OSError:
    flags = ""
  return platform.machine() + flags


def _compiler() -> str:
  cxx = os.environ.get("MOESPEC_CXX", "g++")
  path = shutil.which(cxx)
  if path is None:
    raise CpuKernelUnavailable(
      f"C++ compiler {cxx!r} not found (set MOESPEC_CXX or install g++); the C++ CPU expert "
      "kernels (dedup/per_slot) are unavailable"
    )
  return path


def library_path() -> pathlib.Path:
  """Where the library for this source/compiler/CPU lives (it may not exist yet)."""
  cxx = _compiler()
  h = hashlib.sha256()
  sources = tuple(src.read_bytes() for src in (*_SOURCES, *_HEADERS))
  for part in (*sources, " ".join(_FLAGS).encode(), cxx.encode(), _cpu_signature().encode(), jax.__version__.encode()):
    h.update(part)
  return cache_dir() / "build" / f"moe_ffn_cpu-{h.hexdigest()[:16]}.so"


def _build(out: pathlib.Path) -> None:
  """Compiles each source in its own compiler process, all at once (the build is compile-bound
  and the sources are independent), links them into `out` atomically."""
  cxx = _compiler()
  out.parent.mkdir(parents=True, exist_ok=True)
  compile_flags = [f for f in _FLAGS if f != "-shared"]
  includes = [f"-I{jax.ffi.include_dir()}", f"-I{_CSRC}"]
  with tempfile.TemporaryDirectory(dir=out.parent, prefix=out.name + ".") as tmp:
    objects = [str(pathlib.Path(tmp) / f"{src.stem}.o") for src in _SOURCES]
    commands = [[cxx, *compile_flags, *includes, "-c", str(src), "-o", obj] for src, obj in zip(_SOURCES, objects)]
    running = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for cmd in commands]
    failures = []
    for src, cmd, proc in zip(_SOURCES, commands, running):
      _, stderr = proc.communicate()
      if proc.returncode != 0:
        failures.append(f"compiling {src.name} failed:\n{' '.join(cmd)}\n{stderr[-4000:]}")
    if failures:
      raise CpuKernelUnavailable("\n".join(failures))
    library = str(pathlib.Path(tmp) / out.name)
    link = [cxx, *_FLAGS, *objects, "-o", library]
    proc = subprocess.run(link, capture_output=True, text=True)
    if proc.returncode != 0:
      raise CpuKernelUnavailable(f"linking {out.name} failed:\n{' '.join(link)}\n{proc.stderr[-4000:]}")
    os.replace(library, out)


def ensure_built() -> ctypes.CDLL:
  """Builds (once per source hash) and registers the FFI target; raises CpuKernelUnavailable."""
  with _lock:
    if _state["lib"] is not None:
      return _state["lib"]
    try:
      path = library_path()
      if not path.exists():
        logging.info("building the C++ CPU expert kernel into %s", path)
        _build(path)
      lib = ctypes.CDLL(str(path))
      for target, symbol in _TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except CpuKernelUnavailable as e:
      _state["error"] = str(e)
      raise
    except OSError as e:
      _state["error"] = f"loading the C++ CPU expert kernel failed: {e}"
      raise CpuKernelUnavailable(_state["error"]) from e
    _state["lib"] = lib
    _state["error"] = None
    return lib


def available() -> bool:
  """True if the C++ kernel builds and loads here; the reason otherwise is in `unavailable_reason`."""
  try:
    ensure_built()
    return True
  except CpuKernelUnavailable:
    return False


def unavailable_reason() -> str | None:
  return _state["error"]


def reset_for_tests() -> None:
  """Forgets a cached failure (tests switch MOESPEC_CXX)."""
  with _lock:
    if _state["lib"] is None:
      _state["error"] = None
