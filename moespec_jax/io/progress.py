"""Resumable long measurements: each finished part of a run is kept in one JSON file, written
atomically after every part, and a rerun with the same settings reuses the parts it finds
instead of measuring them again (an interrupted 20-minute sweep loses at most one part)."""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Any, Callable

import jax
import numpy as np

from moespec_jax.io import atomic


def _as_json(value: Any) -> Any:
  """`value` as it reads back from JSON (tuples as lists, dict keys as strings)."""
  return json.loads(json.dumps(atomic.to_jsonable(value), allow_nan=False))


def weights_fingerprint(state, values_per_leaf: int = 4096) -> str:
  """A short digest of a parameter pytree (shapes and the first values of every leaf): a
  retrained model with the same config must not resume another model's measurements."""
  digest = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    array = np.asarray(leaf)
    digest.update(f"{jax.tree_util.keystr(path)}{array.shape}{array.dtype}".encode())
    digest.update(np.ascontiguousarray(array.reshape(-1)[:values_per_leaf]).tobytes())
  return digest.hexdigest()[:16]


class RunProgress:
  """The finished parts of one run (`path`), reused only by a run with equal `settings`."""

  def __init__(self, path, settings: dict, log: Callable[[str], None] = print):
    self.path = pathlib.Path(path)
    self.settings = _as_json(settings)
    self.parts: dict[str, Any] = {}
    if not self.path.exists():
      return
    try:
      old = json.loads(self.path.read_text())
    except (OSError, ValueError):
      old = None
    if isinstance(old, dict) and old.get("settings") == self.settings:
      self.parts = dict(old.get("parts", {}))
      if self.parts:
        log(f"resuming: {len(self.parts)} finished part(s) from {self.path}")
    else:
      log(f"{self.path} holds another run's parts (other settings or unreadable): measuring afresh")

  def cached(self, key: str, compute: Callable[[], Any]) -> Any:
    """The part `key`: as stored, or computed now and stored. Either way in its JSON form."""
    if key not in self.parts:
      self.parts[key] = _as_json(compute())
      atomic.write_json_atomic(self.path, {"settings": self.settings, "parts": self.parts})
    return self.parts[key]

  def finish(self) -> None:
    """The run is complete (its results written elsewhere): the parts are no longer needed."""
    self.path.unlink(missing_ok=True)
