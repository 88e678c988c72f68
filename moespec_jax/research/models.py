"""The models the experiments run on: `cli.load_model`'s (a directory, the default trained model, or
`config:NAME` for a random model of configs/NAME.py) with the harness's variants of a config model:
`routing=correlated[:STRENGTH]` (research/correlated_routing.py)."""

from __future__ import annotations

from moespec_jax import cli
from moespec_jax.research import correlated_routing

VARIANTS = {"routing": correlated_routing.correlated_variant}


def load_model(value: str | None, *, train_heads: bool = True):
  """The model a `--model` flag names (`cli.load_model`, with the harness's VARIANTS)."""
  return cli.load_model(value, train_heads=train_heads, variants=VARIANTS)
