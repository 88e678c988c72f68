"""CPU fast paths, built on first use and called via jax.ffi: the C++ expert FFN
(csrc/moe_ffn_cpu.cc), the dense product of the decoding output head (csrc/dense_cpu.cc), the
attention of decoding passes against the KV cache (csrc/attention_cpu.cc; DeepSeek MLA's against
its compressed cache: csrc/mla_attention_cpu.cc; all on csrc/gemv.h) and a monotonic clock that compiled programs read (csrc/clock_cpu.cc).

The shared library is compiled by the system C++ compiler ($MOESPEC_CXX, default g++) into
$MOESPEC_CACHE/build (default ~/.cache/moespec_jax/build), named by a hash of the sources, the
flags, the compiler, the CPU and the jax version, and written atomically (temporary file +
os.replace), so concurrent processes never load a half-written library. Nothing is downloaded.
If no compiler is found, `ensure_built` raises `CpuKernelUnavailable` with the reason; callers
that can fall back to XLA log that reason (never silently).
"""

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
import jax.numpy as jnp
import numpy as np

_CSRC = pathlib.Path(__file__).parent / "csrc"
_SOURCES = (_CSRC / "moe_ffn_cpu.cc", _CSRC / "dense_cpu.cc", _CSRC / "attention_cpu.cc", _CSRC / "mla_attention_cpu.cc",
            _CSRC / "clock_cpu.cc")
_HEADERS = (_CSRC / "gemv.h", _CSRC / "slots.h", _CSRC / "vmath.h")
# FFI target -> the handler symbol the library exports.
_TARGETS = {"moespec_moe_ffn_f32": "MoespecMoeFfnF32", "moespec_dense_f32": "MoespecDenseF32",
            "moespec_attention_f32": "MoespecAttentionF32", "moespec_mla_attention_f32": "MoespecMlaAttentionF32",
            "moespec_clock_cpu": "MoespecClockCpu"}
# Columns per block of a packed dense weight (`pack_columns`): 4 vectors, so that register panels
# of up to 4 rows cover a block (gemv.h) and a pass of several rows reads each block once from
# memory. Output head of a Mixtral-layout checkpoint ([256, 8192]), 64 against 256 columns:
# 1.05x whole calls at batch 1 and 8, 1.17x with n-gram drafts of 4 (9 rounds each); default model
# (264 columns) within the noise (0.97-1.03x).
PACK_COLUMNS = 64
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=fast")
MODES = {"dedup": 0, "per_slot": 1}

_lock = threading.Lock()
_state = {"lib": None, "error": None}


class CpuKernelUnavailable(RuntimeError):
  """The C++ CPU kernel cannot be built or loaded (e.g. no C++ compiler)."""


def cache_dir():
  return pathlib.Path(os.environ.get("MOESPEC_CACHE", os.path.expanduser("~/.cache/moespec_jax")))


def _cpu_signature():
  try:
    with open("/proc/cpuinfo") as f:
      flags = next((l for l in f if l.startswith("flags")), "")
  except OSError:
    flags = ""
  return platform.machine() + flags


def _compiler():
  cxx = os.environ.get("MOESPEC_CXX", "g++")
  path = shutil.which(cxx)
  if path is None:
    raise CpuKernelUnavailable(
        f"C++ compiler {cxx!r} not found (set MOESPEC_CXX or install g++); the C++ CPU expert "
        "kernels (dedup/per_slot) are unavailable")
  return path


def library_path():
  """Where the library for this source/compiler/CPU lives (it may not exist yet)."""
  cxx = _compiler()
  h = hashlib.sha256()
  sources = tuple(src.read_bytes() for src in (*_SOURCES, *_HEADERS))
  for part in (*sources, " ".join(_FLAGS).encode(), cxx.encode(), _cpu_signature().encode(),
               jax.__version__.encode()):
    h.update(part)
  return cache_dir() / "build" / f"moe_ffn_cpu-{h.hexdigest()[:16]}.so"


def _build(out):
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


def ensure_built():
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


def available():
  """True if the C++ kernel builds and loads here; the reason otherwise is in `unavailable_reason`."""
  try:
    ensure_built()
    return True
  except CpuKernelUnavailable:
    return False


def unavailable_reason():
  return _state["error"]


def reset_for_tests():
  """Forgets a cached failure (tests switch MOESPEC_CXX)."""
  with _lock:
    if _state["lib"] is None:
      _state["error"] = None


def expert_ffn_cpu(x_TD, expert_ids_TK, gates_TK, w_gate_EDF, w_up_EDF, w_down_EFD, *, method="dedup"):
  """The C++ kernel: method 'dedup' (each unique expert streamed once) or 'per_slot'.

  Computes in f32 (inputs are cast; keep weights f32 on CPU so the cast is free) and returns
  x's dtype. Not differentiable by itself (the entry point attaches the grouped XLA VJP).
  """
  if method not in MODES:
    raise ValueError(f"method must be one of {tuple(MODES)}, got {method!r}")
  ensure_built()
  f32 = jnp.float32
  out = jax.ffi.ffi_call("moespec_moe_ffn_f32", jax.ShapeDtypeStruct(x_TD.shape, f32), vmap_method="sequential")(
      x_TD.astype(f32), expert_ids_TK.astype(jnp.int32), gates_TK.astype(f32), w_gate_EDF.astype(f32),
      w_up_EDF.astype(f32), w_down_EFD.astype(f32), mode=np.int32(MODES[method]))
  return out.astype(x_TD.dtype)


def pack_columns(w_DV, block: int = PACK_COLUMNS):
  """`w_DV` [D, V] as column blocks [ceil(V / block), D, block] (zero-padded), the layout
  `packed_matmul` streams: each block one contiguous [D, block] matrix."""
  if w_DV.ndim != 2 or block < 1:
    raise ValueError(f"pack_columns needs a [D, V] weight and block >= 1, got {w_DV.shape}, {block}")
  d, v = w_DV.shape
  n = -(-v // block)
  w = jnp.pad(w_DV.astype(jnp.float32), ((0, 0), (0, n * block - v)))
  return w.reshape(d, n, block).transpose(1, 0, 2)


def packed_matmul(x_MD, w_NDC, n_cols: int | None = None):
  """x [M, D] @ W for W packed by `pack_columns` (f32): [M, n_cols] (default all N * C columns;
  pass V to drop the padding). Or G products side by side: x [G, M, D] and W [G, N, D, C]
  (`pack_columns` vmapped over G) give [G, M, n_cols]. The C++ kernel: each block streamed once
  for all M rows, and a row's result does not depend on the other rows."""
  ensure_built()
  grouped = x_MD.ndim == 3
  if not ((x_MD.ndim == 2 and w_NDC.ndim == 3) or (grouped and w_NDC.ndim == 4 and w_NDC.shape[0] == x_MD.shape[0])) \
      or x_MD.shape[-1] != w_NDC.shape[-2]:
    raise ValueError(f"packed_matmul needs x [M, D] and W [N, D, C], or x [G, M, D] and W [G, N, D, C], "
                     f"got {x_MD.shape} and {w_NDC.shape}")
  n, _, c = w_NDC.shape[-3:]
  y = jax.ffi.ffi_call("moespec_dense_f32", jax.ShapeDtypeStruct((*x_MD.shape[:-1], n * c), jnp.float32),
                       vmap_method="sequential")(x_MD.astype(jnp.float32), w_NDC.astype(jnp.float32))
  return y if n_cols is None or n_cols == n * c else y[..., :n_cols]


def cached_attention(q_NQD, keys_NDS, values_NSD, limit_NQ):
  """softmax(q . K) . V per (row, KV head) pair n against its cache: q [N, Q, D] (already
  scaled), keys key-major [N, D, S], values [N, S, D], limit [N, Q] (query i sees positions
  0..limit[n, i]). f32 [N, Q, D]. The C++ kernel reads each pair's cache once, up to its last
  visible position. Not differentiable (decoding only)."""
  ensure_built()
  n, q, d = q_NQD.shape
  if keys_NDS.shape[:2] != (n, d) or values_NSD.shape != (n, keys_NDS.shape[2], d) or limit_NQ.shape != (n, q):
    raise ValueError(f"cached_attention needs q [N, Q, D], keys [N, D, S], values [N, S, D], limit [N, Q]; "
                     f"got {q_NQD.shape}, {keys_NDS.shape}, {values_NSD.shape}, {limit_NQ.shape}")
  f32 = jnp.float32
  return jax.ffi.ffi_call("moespec_attention_f32", jax.ShapeDtypeStruct((n, q, d), f32), vmap_method="sequential")(
      q_NQD.astype(f32), keys_NDS.astype(f32), values_NSD.astype(f32), limit_NQ.astype(jnp.int32))


def mla_attention(q_lat_BQC, q_rope_BQR, latent_BSC, rope_BSR, limit_BQ):
  """DeepSeek MLA against its compressed cache, the key up-projection absorbed into the queries:
  softmax(q_lat . latent + q_rope . rope) . latent per cache row b, every query row (tokens x
  heads) against the row's one shared cache. q_lat [B, Q, C] and q_rope [B, Q, R] (already
  scaled), latent [B, S, C], rope [B, S, R], limit [B, Q] (query i sees positions 0..limit[b, i]).
  f32 [B, Q, C]. Each row's cache is read up to its last visible position. Not differentiable."""
  ensure_built()
  b, q, c = q_lat_BQC.shape
  r = q_rope_BQR.shape[-1]
  s = latent_BSC.shape[1] if latent_BSC.ndim == 3 else -1
  if (q_rope_BQR.shape != (b, q, r) or latent_BSC.shape != (b, s, c) or rope_BSR.shape != (b, s, r)
      or limit_BQ.shape != (b, q)):
    raise ValueError(f"mla_attention needs q_lat [B, Q, C], q_rope [B, Q, R], latent [B, S, C], rope [B, S, R], "
                     f"limit [B, Q]; got {q_lat_BQC.shape}, {q_rope_BQR.shape}, {latent_BSC.shape}, "
                     f"{rope_BSR.shape}, {limit_BQ.shape}")
  f32 = jnp.float32
  return jax.ffi.ffi_call("moespec_mla_attention_f32", jax.ShapeDtypeStruct((b, q, c), f32),
                          vmap_method="sequential")(
      q_lat_BQC.astype(f32), q_rope_BQR.astype(f32), latent_BSC.astype(f32), rope_BSR.astype(f32),
      limit_BQ.astype(jnp.int32))


def clock_after(x):
  """(x, now): `x` (int32, any shape) passed through, and a CLOCK_MONOTONIC reading taken after
  x was computed and before anything that uses the returned x runs (int32 [2]: seconds,
  nanoseconds). Inside a compiled CPU program, no host round trip; see `elapsed_ms`."""
  ensure_built()
  x = jnp.asarray(x, jnp.int32)
  return jax.ffi.ffi_call("moespec_clock_cpu", (jax.ShapeDtypeStruct(x.shape, jnp.int32),
                                                jax.ShapeDtypeStruct((2,), jnp.int32)),
                          has_side_effect=True, vmap_method="sequential")(x)


def elapsed_ms(start_2, end_2):
  """Milliseconds (f32) between two `clock_after` readings."""
  seconds = (end_2[0] - start_2[0]).astype(jnp.float32)
  return seconds * 1e3 + (end_2[1] - start_2[1]).astype(jnp.float32) * 1e-6
