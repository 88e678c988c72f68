"""The embedded corpus: the Python standard library's own `.py` sources.

Every machine with Python has it, so training needs no download (its size:
docs/findings/2026-11-29-corpus-size.md). Choices:

- Files: every `*.py` under `sysconfig.get_paths()["stdlib"]`, walked in sorted
  order, except anything below `site-packages`, `dist-packages` or
  `__pycache__` (installed third-party code differs between machines). The
  `test/` packages are kept: they are real code (a large share of the corpus), and
  the split below is per file, so no file is in both splits.
- Encoding: files that are not valid UTF-8 (a handful of deliberately
  mis-encoded test modules) are skipped, so the corpus is valid UTF-8 and every
  document decodes exactly.
- Split: a file is in "validation" when the SHA-1 of its path relative to the
  stdlib root (POSIX separators), read as a fraction in [0, 1), is below
  `VALIDATION_FRACTION` (5%). The split depends on the path only: identical on
  every machine with the same Python version, and stable when files are added.
- Layout: `load_bytes` concatenates the documents of a split, each followed by
  `DOC_SEPARATOR` (0xFF, a byte that never occurs in UTF-8 text); tokenizers
  turn it into their EOS token.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pathlib
import re
import sys
import sysconfig
from typing import Literal

import numpy as np

Split = Literal["train", "validation"]
SPLITS: tuple[str, ...] = ("train", "validation")
VALIDATION_FRACTION = 0.05
DOC_SEPARATOR = 0xFF
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> pathlib.Path:
  """The directory of the running Python's standard library sources."""
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def corpus_name() -> str:
  """A short name of the corpus source, e.g. 'stdlib-py3.11.7'."""
  v = sys.version_info
  return f"stdlib-py{v.major}.{v.minor}.{v.micro}"


def split_of(relpath: str) -> str:
  """The split of a file, from the SHA-1 of its root-relative POSIX path."""
  digest = hashlib.sha1(relpath.encode("utf-8")).digest()
  fraction = int.from_bytes(digest[:8], "big") / 2.0**64
  return "validation" if fraction < VALIDATION_FRACTION else "train"


def _check_split(split: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def _root(root: str | os.PathLike | None) -> pathlib.Path:
  return stdlib_root() if root is None else pathlib.Path(root)


@functools.lru_cache(maxsize=8)
def _all_relpaths(root: pathlib.Path) -> tuple[str, ...]:
  """All candidate `.py` files under `root`, as sorted relative POSIX paths."""
  if not root.is_dir():
    raise FileNotFoundError(f"corpus root {root} is not a directory")
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
    for name in filenames:
      if name.endswith(".py"):
        full = pathlib.Path(dirpath, name)
        if full.is_file():
          out.append(full.relative_to(root).as_posix())
  return tuple(sorted(out))


@dataclasses.dataclass(frozen=True)
class _SplitData:
  relpaths: tuple[str, ...]  # files kept (valid UTF-8), sorted
  skipped: tuple[str, ...]  # files dropped as invalid UTF-8
  data: np.ndarray  # uint8, documents each followed by DOC_SEPARATOR


@functools.lru_cache(maxsize=4)
def _load_split(split: str, root: pathlib.Path) -> _SplitData:
  kept, skipped, chunks = [], [], []
  for rel in _all_relpaths(root):
    if split_of(rel) != split:
      continue
    raw = (root / rel).read_bytes()
    try:
      raw.decode("utf-8")
    except UnicodeDecodeError:
      skipped.append(rel)
      continue
    kept.append(rel)
    chunks.append(raw)
    chunks.append(bytes([DOC_SEPARATOR]))
  data = np.frombuffer(b"".join(chunks), dtype=np.uint8)
  data.flags.writeable = False
  return _SplitData(tuple(kept), tuple(skipped), data)


def list_files(split: Split, root: str | os.PathLike | None = None) -> list[str]:
  """The files of `split` (root-relative POSIX paths, sorted), as loaded."""
  _check_split(split)
  return list(_load_split(split, _root(root)).relpaths)


def skipped_files(split: Split, root: str | os.PathLike | None = None) -> list[str]:
  """Files of `split` left out because they are not valid UTF-8."""
  _check_split(split)
  return list(_load_split(split, _root(root)).skipped)


def load_bytes(split: Split, root: str | os.PathLike | None = None) -> np.ndarray:
  """All documents of `split` as one read-only uint8 array, cached in memory.

  Each document is followed by `DOC_SEPARATOR`.
  """
  _check_split(split)
  return _load_split(split, _root(root)).data


def documents(split: Split, root: str | os.PathLike | None = None) -> list[bytes]:
  """The documents of `split`, as UTF-8 bytes, in `list_files` order."""
  data = load_bytes(split, root)
  return data.tobytes().split(bytes([DOC_SEPARATOR]))[:-1]


def fingerprint(split: Split, root: str | os.PathLike | None = None) -> str:
  """A 12-hex-digit digest of the split's content (for cache keys)."""
  data = load_bytes(split, root)
  h = hashlib.sha1(data.tobytes())
  return h.hexdigest()[:12]


# A one-line function header: optional indentation, `def` or `async def`, a name,
# and a line ending in ':' (an optional trailing comment allowed).
_DEF_LINE = re.compile(rb"^[ \t]*(?:async[ \t]+)?def[ \t]+\w+[ \t]*\(.*\).*:[ \t]*(?:#.*)?$", re.MULTILINE)


def held_out_prompts(
  n: int, prompt_bytes: int = 256, seed: int = 0, root: str | os.PathLike | None = None
) -> list[str]:
  """`n` code prompts from the validation split, ending with a `def` line.

  Each prompt is up to `prompt_bytes` bytes of preceding context (cut at a line
  start, never before the document start) followed by a one-line function
  header without its line end (trailing blanks dropped), so the natural
  continuation is the line end, the body's indentation and the body. The prompt
  stops before the newline because a BPE merges a newline with the next line's
  indentation: a prompt ending in a bare newline token asks the model to go on
  from a token that in training only ever precedes a column-0 line. Headers
  whose next line is not more indented are skipped. The choice is deterministic
  in (`n`, `prompt_bytes`, `seed`) and the Python version.

  Raises:
    ValueError: bad `n` / `prompt_bytes`, or fewer than `n` candidates.
  """
  if n < 1:
    raise ValueError(f"n must be >= 1, got {n}")
  if prompt_bytes < 16:
    raise ValueError(f"prompt_bytes must be >= 16, got {prompt_bytes}")
  candidates = []
  for doc in documents("validation", root):
    for m in _DEF_LINE.finditer(doc):
      line_end = m.end()
      if doc[line_end : line_end + 1] != b"\n":
        continue
      next_start = line_end + 1
      next_end = doc.find(b"\n", next_start)
      next_line = doc[next_start : next_end if next_end >= 0 else len(doc)]
      indent = len(m.group(0)) - len(m.group(0).lstrip())
      body_indent = len(next_line) - len(next_line.lstrip())
      if not next_line.strip() or body_indent <= indent:
        continue
      end = m.start() + len(m.group(0).rstrip(b" \t"))
      if end - m.start() > prompt_bytes:
        continue
      start = max(0, end - prompt_bytes)
      if start > 0 and doc[start - 1 : start] != b"\n":
        nl = doc.find(b"\n", start, m.start())
        start = m.start() if nl < 0 else nl + 1
      candidates.append(doc[start:end])
  if len(candidates) < n:
    raise ValueError(f"n={n} exceeds the {len(candidates)} prompts available with prompt_bytes={prompt_bytes}")
  rng = np.random.default_rng(seed)
  picks = rng.choice(len(candidates), size=n, replace=False)
  return [candidates[i].decode("utf-8") for i in picks]
