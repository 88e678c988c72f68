"""Plain decoding through the speculative loop: no drafts, every pass K = 0."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from moespec_jax.decoding.drafters.base import Drafter


@dataclasses.dataclass(frozen=True)
class NoDrafter(Drafter):
  """Proposes nothing: the plain pass verifies the pending token alone."""

  drafts: ClassVar[bool] = False
