"""Atomic file and directory writes.

A reader (or a resumed run) sees either the old content or the complete new
content, never a half-written file: everything is written to a temporary
sibling in the same directory (same filesystem), flushed to disk, then renamed
into place. Temporary siblings start with "." and contain ".tmp-"; one left by
a killed process is never mistaken for the real path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
  from matplotlib.figure import Figure

PathLike = str | os.PathLike


def _fsync_dir(path: pathlib.Path) -> None:
  """Flushes a directory entry (a rename) to disk; best effort."""
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def _umask() -> int:
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def write_bytes_atomic(path: PathLike, data: bytes) -> pathlib.Path:
  """Writes `data` to `path` atomically (temp file + fsync + os.replace)."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
  try:
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; use the usual mode
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise
  _fsync_dir(path.parent)
  return path


def write_text_atomic(path: PathLike, text: str) -> pathlib.Path:
  """Writes UTF-8 `text` to `path` atomically."""
  return write_bytes_atomic(path, text.encode("utf-8"))


def to_jsonable(obj: Any) -> Any:
  """Converts numpy/jax values, paths, tuples and dataclasses to JSON types.

  Non-finite floats become None (strict JSON has no NaN or Infinity).
  """
  if isinstance(obj, dict):
    return {str(k): to_jsonable(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [to_jsonable(v) for v in obj]
  if isinstance(obj, (bool, np.bool_)):
    return bool(obj)
  if isinstance(obj, (int, np.integer)):
    return int(obj)
  if isinstance(obj, (float, np.floating)):
    value = float(obj)
    return value if math.isfinite(value) else None
  if obj is None or isinstance(obj, str):
    return obj
  if isinstance(obj, os.PathLike):
    return os.fspath(obj)
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    return to_jsonable(dataclasses.asdict(obj))
  if hasattr(obj, "__array__"):  # numpy or jax array
    return to_jsonable(np.asarray(obj).tolist())
  raise TypeError(f"cannot convert {type(obj).__name__} to JSON")


def read_json(path: PathLike) -> Any:
  """The JSON document in `path`; a file that does not parse is a ValueError naming it (a
  missing one stays a FileNotFoundError)."""
  path = pathlib.Path(path)
  text = path.read_text()
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None


def write_json_atomic(path: PathLike, obj: Any, *, indent: int | None = 2) -> pathlib.Path:
  """Writes `obj` as strict JSON to `path` atomically (numpy values converted)."""
  text = json.dumps(to_jsonable(obj), indent=indent, allow_nan=False)
  return write_text_atomic(path, text + "\n")


def write_npy_atomic(path: PathLike, array: np.ndarray) -> pathlib.Path:
  """Saves `array` in .npy format to `path` atomically."""
  buf = io.BytesIO()
  np.save(buf, np.asarray(array), allow_pickle=False)
  return write_bytes_atomic(path, buf.getbuffer())


def fresh_sibling(path: PathLike, tag: str = "tmp") -> pathlib.Path:
  """A unique, not yet existing path next to `path` (for writers that create it)."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.{tag}-"))
  tmp.rmdir()
  return tmp


def replace_dir(src: PathLike, dst: PathLike) -> pathlib.Path:
  """Moves the complete directory `src` to `dst`, replacing any old `dst`.

  The old `dst` is first renamed aside, then deleted, so `dst` is never a mix
  of old and new files. (A crash between the two renames leaves no `dst` but
  the old one intact under a ".<name>.old-*" sibling.)
  """
  src, dst = pathlib.Path(src), pathlib.Path(dst)
  old = None
  if dst.exists() or dst.is_symlink():
    old = fresh_sibling(dst, "old")
    os.rename(dst, old)
  os.rename(src, dst)
  _fsync_dir(dst.parent)
  if old is not None:
    if old.is_dir() and not old.is_symlink():
      shutil.rmtree(old, ignore_errors=True)
    else:
      old.unlink()
  return dst


@contextlib.contextmanager
def atomic_dir(path: PathLike, *, overwrite: bool = True) -> Iterator[pathlib.Path]:
  """Yields an empty temporary sibling of `path`; renames it to `path` on success.

  On an exception the temporary directory is removed and `path` is untouched.

  Args:
    path: the final directory.
    overwrite: replace an existing `path`; when False an existing `path`
      raises FileExistsError before anything is written.
  """
  path = pathlib.Path(path)
  if not overwrite and path.exists():
    raise FileExistsError(f"{path} already exists")
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
  try:
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; use the usual mode
    yield tmp
    for root, _, files in os.walk(tmp):
      for name in files:
        full = os.path.join(root, name)
        if os.path.islink(full):
          continue
        with open(full, "rb") as f:
          os.fsync(f.fileno())
    if not overwrite and path.exists():
      raise FileExistsError(f"{path} already exists")
    replace_dir(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def save_figure_atomic(fig: Figure, path: PathLike, *, dpi: int = 110) -> pathlib.Path:
  """Saves a matplotlib figure as PNG atomically (temporary sibling, then rename) and closes it."""
  import matplotlib.pyplot as plt

  path = pathlib.Path(path)
  tmp = path.with_name(f".{path.name}.tmp.png")
  try:
    fig.savefig(tmp, dpi=dpi)
    os.replace(tmp, path)
  finally:
    plt.close(fig)
    if tmp.exists():
      tmp.unlink()
  return path
