"""Progress of long runs: a progress line every few seconds (`Progress`), and resumable long
measurements (`RunProgress`): each finished part of a run is kept in one JSON file, written
atomically after every part, and a rerun with the same settings reuses the parts it finds
instead of measuring them again (an interrupted 20-minute sweep loses at most one part)."""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import jax
import numpy as np

from moespec_jax.io import atomic


def _as_json(value: Any) -> Any:
  """`value` as it reads back from JSON (tuples as lists, dict keys as strings)."""
  return json.loads(json.dumps(atomic.to_jsonable(value), allow_nan=False))


def weights_fingerprint(state: Any, values_per_leaf: int = 4096) -> str:
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

  def __init__(self, path: atomic.PathLike, settings: dict, log: Callable[[str], None] = print) -> None:
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


def _fmt_duration(seconds: float) -> str:
  seconds = max(0, int(round(seconds)))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  if h:
    return f"{h}h{m:02d}m{s:02d}s"
  if m:
    return f"{m}m{s:02d}s"
  return f"{s}s"


def _fmt_rate(rate: float) -> str:
  if rate >= 1e6:
    return f"{rate / 1e6:.2f}M"
  if rate >= 1e4:
    return f"{rate / 1e3:.1f}k"
  if rate >= 100:
    return f"{rate:.0f}"
  return f"{rate:.2f}"


class Progress:
  """Prints a progress line every `every_s` seconds or `every_steps` steps.

  A line reads, e.g.:
    train step 1200/5000 (24.0%) | 2.81k tokens/s | loss 2.315 | 3m10s elapsed, eta 10m02s

  Rates and ETA are measured from the first `update` (or `start_step`), so a
  resumed run reports its own speed. Lines go to `emit` (a caller's `log`, where it takes one:
  whatever silences or redirects its other output does the same to these), else to `stream`
  (default stdout), flushed.
  """

  def __init__(
    self,
    total: int,
    *,
    desc: str = "",
    unit: str = "tokens",
    every_s: float = 10.0,
    every_steps: int | None = None,
    start_step: int = 0,
    stream: TextIO | None = None,
    emit: Callable[[str], Any] | None = None,
    clock: Callable[[], float] = time.monotonic,
  ) -> None:
    if total < 0:
      raise ValueError(f"total must be >= 0, got {total}")
    if emit is not None and stream is not None:
      raise ValueError("Progress takes emit or stream, not both")
    self._emit = emit
    self.total = int(total)
    self.desc = desc
    self.unit = unit
    self.every_s = every_s
    self.every_steps = every_steps
    self._stream = stream
    self._clock = clock
    self._start_time = clock()
    self._start_step = int(start_step)
    self._units = 0.0
    self._last_print_time = self._start_time
    self._last_print_step = self._start_step
    self.last_line: str | None = None

  def _due(self, step: int, now: float) -> bool:
    if step >= self.total:
      return True
    if self.every_steps is not None and step - self._last_print_step >= self.every_steps:
      return True
    return self.every_s is not None and now - self._last_print_time >= self.every_s

  def format(self, step: int, now: float, metrics: dict[str, float]) -> str:
    """The progress line for `step` at time `now`."""
    elapsed = max(now - self._start_time, 1e-9)
    done = step - self._start_step
    pct = 100.0 * step / self.total if self.total else 100.0
    parts = [f"{self.desc + ' ' if self.desc else ''}step {step}/{self.total} ({pct:.1f}%)"]
    if self._units:
      parts.append(f"{_fmt_rate(self._units / elapsed)} {self.unit}/s")
    else:
      parts.append(f"{_fmt_rate(done / elapsed)} steps/s")
    for k, v in metrics.items():
      parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
    timing = f"{_fmt_duration(elapsed)} elapsed"
    if 0 < done and step < self.total:
      timing += f", eta {_fmt_duration(elapsed / done * (self.total - step))}"
    parts.append(timing)
    return " | ".join(parts)

  def update(self, step: int, units: float = 0, **metrics: float) -> bool:
    """Records that `step` steps are done (and `units` more tokens); maybe prints.

    Returns:
      True if a line was printed.
    """
    self._units += units
    now = self._clock()
    if not self._due(step, now):
      return False
    line = self.format(step, now, metrics)
    self.last_line = line
    if self._emit is not None:
      self._emit(line)
    else:
      stream = self._stream if self._stream is not None else sys.stdout
      stream.write(line + "\n")
      stream.flush()
    self._last_print_time = now
    self._last_print_step = step
    return True
