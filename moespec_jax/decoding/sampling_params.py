"""How tokens are sampled: the one setting that sampling, rejection and the drafters all read.

Apart from `params` (which re-exports it) so that the drafters, which sample, sit below the
generation parameters that validate a drafter's name against their registry.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature == 0 means greedy; top_k == 0 and top_p == 1 disable those filters."""

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self) -> None:
    if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
      raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
    if not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
    if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0
