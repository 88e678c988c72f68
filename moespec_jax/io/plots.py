"""The experiments' figures: matplotlib on its file-only backend, the axes' common finish, and
an atomic save."""

from __future__ import annotations

import pathlib
from types import ModuleType
from typing import TYPE_CHECKING

from moespec_jax.io import atomic

if TYPE_CHECKING:
  from matplotlib.axes import Axes
  from matplotlib.figure import Figure


def pyplot() -> ModuleType:
  """matplotlib.pyplot on the Agg backend: figures go to files, no display is needed or opened
  (imported on first use: a run that writes no plot never loads matplotlib)."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  return plt


def finish_axes(
  ax: Axes, xlabel: str, ylabel: str, title: str | None = None, legend_fontsize: float | str | None = None
) -> None:
  """Axis labels, an optional title, a light grid and the legend."""
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  if title is not None:
    ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=legend_fontsize)


def save(fig: Figure, path: atomic.PathLike, *, dpi: int = 110) -> pathlib.Path:
  """Lays the figure out, writes it as PNG atomically and closes it."""
  fig.tight_layout()
  return atomic.save_figure_atomic(fig, path, dpi=dpi)
