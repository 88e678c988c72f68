"""Checkpoints: training state with orbax (resume) and finished parameter trees.

`CheckpointManager` keeps the last N training states (any pytree, e.g.
{params, opt_state, step, rng}) saved every K steps. Orbax writes each step
into a temporary directory and renames it when complete, so a step interrupted
mid-write is never listed by `latest_step()`; on top of that, a step directory
without orbax's metadata file is ignored here.

`save_pytree` / `load_pytree` store a finished model's parameters bit-exactly
(float32, bfloat16, integers); the directory appears only once complete.
"""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from moespec_jax.io import atomic

PyTree = Any
PathLike = str | os.PathLike

_METADATA_FILE = "_CHECKPOINT_METADATA"


def _drop_orbax_info(record: logging.LogRecord) -> bool:
  return record.levelno >= logging.WARNING or "orbax" not in record.pathname


def _quiet_orbax() -> None:
  """Drops orbax's INFO records (dozens per save); other absl logs are untouched."""
  logger = logging.getLogger("absl")
  if _drop_orbax_info not in logger.filters:
    logger.addFilter(_drop_orbax_info)


def abstract_tree(tree: PyTree) -> PyTree:
  """The restore target for `tree`: arrays become shape/dtype structs.

  jax arrays keep their sharding (restored as jax arrays on the same devices),
  numpy arrays stay numpy (restored as numpy), numpy scalars become 0-d numpy
  arrays, Python scalars are kept. ShapeDtypeStructs without a sharding get the
  default device.
  """
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

  def one(x: Any):
    if isinstance(x, jax.ShapeDtypeStruct):
      if x.sharding is None:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device)
      return x
    if isinstance(x, jax.Array):
      return ocp.utils.to_shape_dtype_struct(x)
    if isinstance(x, np.generic):
      return np.asarray(x)
    return x

  return jax.tree.map(one, tree)


class CheckpointManager:
  """Keeps the last `max_to_keep` training states under `directory/<step>`.

  Example:
    ckpt = CheckpointManager(workdir / "checkpoints", save_interval_steps=100)
    start = 0
    if ckpt.latest_step() is not None:
      state = ckpt.restore(ckpt.latest_step(), state)
      start = int(state["step"])
    for step in range(start, total):
      ...
      ckpt.save(step + 1, state)
    ckpt.save(total, state, force=True)
    ckpt.close()
  """

  def __init__(
    self, directory: PathLike, *, max_to_keep: int = 3, save_interval_steps: int = 1, async_save: bool = False
  ) -> None:
    if max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
    if save_interval_steps < 1:
      raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}")
    _quiet_orbax()
    self.directory = pathlib.Path(directory).absolute()
    self.directory.mkdir(parents=True, exist_ok=True)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep,
      save_interval_steps=1,  # the interval is applied in `save`
      enable_async_checkpointing=async_save,
      create=True,
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)
    self.save_interval_steps = save_interval_steps

  def should_save(self, step: int) -> bool:
    """Whether `save(step, ...)` would write: `step` is a multiple of the interval."""
    return int(step) % self.save_interval_steps == 0

  def save(self, step: int, state: PyTree, *, force: bool = False) -> bool:
    """Saves `state` at `step` if the interval says so (or `force`); True if saved.

    A step already saved completely is not written again (returns False). A
    leftover incomplete directory for `step` (no orbax metadata) is removed
    first, so a resumed run can save the step an interrupted one did not finish.
    """
    if not (force or self.should_save(step)):
      return False
    stale = self.directory / str(int(step))
    if (stale / _METADATA_FILE).exists():
      return False
    if stale.is_dir():
      shutil.rmtree(stale)
      self._manager.reload()
    saved = self._manager.save(int(step), args=ocp.args.StandardSave(state), force=True)
    return bool(saved)

  def all_steps(self) -> list[int]:
    """Completed steps on disk, ascending."""
    self._manager.reload()
    steps = sorted(self._manager.all_steps())
    return [s for s in steps if (self.directory / str(s) / _METADATA_FILE).exists()]

  def latest_step(self) -> int | None:
    """The newest completed step, or None when there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def restore(self, step: int | None = None, abstract_state: PyTree | None = None) -> PyTree:
    """Restores the state saved at `step` (default: the latest).

    Args:
      step: the step to restore; None for `latest_step()`.
      abstract_state: a pytree like the saved one (concrete arrays or
        `jax.ShapeDtypeStruct`s) giving the structure, dtypes and array types
        of the result; None restores as saved.

    Raises:
      FileNotFoundError: no completed checkpoint at `step`.
    """
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"no checkpoint in {self.directory}")
      step = steps[-1]
    if int(step) not in steps:
      raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory} (have {steps})")
    target = None if abstract_state is None else abstract_tree(abstract_state)
    return self._manager.restore(int(step), args=ocp.args.StandardRestore(target))

  def wait_until_finished(self) -> None:
    """Blocks until an asynchronous save is on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Finishes pending saves and releases resources."""
    self._manager.close()

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


def save_pytree(directory: PathLike, tree: PyTree, *, overwrite: bool = True) -> pathlib.Path:
  """Saves a pytree of arrays to `directory`, atomically and bit-exactly.

  The checkpoint is written into a temporary sibling and renamed into place when
  complete, so an interrupted save leaves the previous `directory` (if any)
  intact and never a partial one.
  """
  _quiet_orbax()
  directory = pathlib.Path(directory).absolute()
  if not overwrite and directory.exists():
    raise FileExistsError(f"{directory} already exists")
  tmp = atomic.fresh_sibling(directory)
  try:
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
      ckptr.save(tmp, args=ocp.args.StandardSave(tree))
    atomic.replace_dir(tmp, directory)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    for leftover in tmp.parent.glob(tmp.name + ".orbax-checkpoint-tmp*"):
      shutil.rmtree(leftover, ignore_errors=True)
    raise
  return directory


def load_pytree(directory: PathLike, abstract: PyTree | None = None) -> PyTree:
  """Loads a pytree written by `save_pytree`.

  Args:
    directory: the directory given to `save_pytree`.
    abstract: optional target (see `abstract_tree`); None restores as saved.

  Raises:
    FileNotFoundError: `directory` is not a saved pytree.
  """
  _quiet_orbax()
  directory = pathlib.Path(directory).absolute()
  if not (directory / _METADATA_FILE).exists():
    raise FileNotFoundError(f"no saved pytree at {directory}")
  target = None if abstract is None else abstract_tree(abstract)
  with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
    return ckptr.restore(directory, args=ocp.args.StandardRestore(target))
