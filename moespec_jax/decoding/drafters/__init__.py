"""Drafters behind one interface (`base.Drafter`), one module each, and the one table from the
name a user gives (`SpecParams.drafter`) to the implementation.

A new drafter is a module here and an entry in REGISTRY; the loop never asks a drafter its name.
"""

from __future__ import annotations

from moespec_jax.decoding.drafters import controlled, mtp, ngram, none
from moespec_jax.decoding.drafters.base import Drafter, DraftTree, Verified

__all__ = ["REGISTRY", "Drafter", "DraftTree", "Verified", "lookup", "names"]

REGISTRY: dict[str, type[Drafter]] = {
  "none": none.NoDrafter,
  "mtp": mtp.MtpDrafter,
  "ngram": ngram.NgramDrafter,
  # Research drafter with controllable acceptance, for cost-model validation.
  "controlled": controlled.ControlledDrafter,
}


def names() -> tuple[str, ...]:
  """The drafter names users may give."""
  return tuple(REGISTRY)


def lookup(name: str) -> type[Drafter]:
  """The drafter registered under `name`; ValueError naming `drafter` otherwise."""
  found = REGISTRY.get(name) if isinstance(name, str) else None
  if found is None:
    raise ValueError(f"drafter must be one of {names()}, got {name!r}")
  return found
