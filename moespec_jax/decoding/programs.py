"""Compiled generation programs: the model's static definition, its state merged back inside a
program beside its kernels (policy and packed weights), and `ProgramCache`: the ahead-of-time compiled
programs and auto K's calibrations of them, one per program signature, dropping its least recently
used programs where the process runs short of memory mappings. `PROGRAMS` is the one generate() uses.
"""

from __future__ import annotations

import gc
import itertools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from jax.tree_util import PyTreeDef

from moespec_jax.decoding.params import SpecParams
from moespec_jax.decoding.state import LoopSpec
from moespec_jax.model import ForwardOutput, Kernels, ModelHandle, PackedWeights, Transformer
from pallas_kernels.cpu import threefry
from pallas_kernels.policy import KernelPolicy

# Sampling's keys and noise as one fused kernel per draw on CPU, not a loop of small ones
# (pallas_kernels/cpu/threefry.py): the same bits, for every program compiled from here on.
threefry.use_unrolled_threefry()


class ModelDefinition:
  """A program's static view of the model: its NNX graphdef and the tree structure of its state,
  which programs take as a flat list of arrays (flattening an NNX State walks it in Python, and a
  call did so four times). Its hash is computed once: hashing a GraphDef walks the whole module
  tree, and a generate() call looks its program up two to four times (the host time this saves:
  docs/findings/2026-12-02-program-cache.md). Equal definitions (models of the same structure)
  share programs."""

  __slots__ = ("graphdef", "state_treedef", "_hash")

  def __init__(self, graphdef: nnx.GraphDef, state_treedef: PyTreeDef) -> None:
    self.graphdef, self.state_treedef = graphdef, state_treedef
    self._hash = hash((graphdef, state_treedef))

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: object) -> bool:
    return isinstance(other, ModelDefinition) and (
      self is other
      or (self._hash == other._hash and self.graphdef == other.graphdef and self.state_treedef == other.state_treedef)
    )


class ProgramModel:
  """The target inside a program: its module (the mathematics; any attribute not defined here is the
  module's) and the program's `kernels` (`LoopSpec.kernels` and the packed weights), which every model
  call is handed explicitly: `model(tokens, ..., kernels=model.kernels)`."""

  __slots__ = ("module", "kernels")

  def __init__(self, module: Transformer, kernels: Kernels) -> None:
    self.module, self.kernels = module, kernels

  def __call__(self, *args: Any, **kwargs: Any) -> ForwardOutput:
    return self.module(*args, **kwargs)

  def __getattr__(self, name: str) -> Any:
    return getattr(self.module, name)


# A program's parameters (`decode_params`: the state's leaves and the packed weights) and its
# arguments after the static LoopSpec: (definition, parameters, tokens [B, T], lengths [B], the
# uint32 seed, the drafter's inputs).
ProgramParams = tuple[list[jax.Array], PackedWeights]
ProgramArgs = tuple[ModelDefinition, ProgramParams, np.ndarray, np.ndarray, np.ndarray, Any]


def merge(definition: ModelDefinition, params: ProgramParams, ls: LoopSpec) -> ProgramModel:
  """The model inside a program. `params`: (the state's leaves, the packed weights: see
  `decode_params`); `ls.kernels`: the program's kernel policy."""
  leaves, packed = params
  module = nnx.merge(definition.graphdef, jax.tree.unflatten(definition.state_treedef, leaves))
  return ProgramModel(module, Kernels(ls.kernels, packed))


def kernel_policy(model: ModelHandle, spec: SpecParams, platform: str | None = None) -> KernelPolicy:
  """The kernel policy of `spec`'s programs for `model` on `platform` (None: this process's default
  backend; 'tpu', 'gpu' or 'cuda' build a program for another platform): the expert method
  (`SpecParams.kernel`, 'auto' meaning the model config's), and where the output head, the dense
  projections and attention against the cache run the C++ kernels (`ResearchOptions`' kernel choices)."""
  research = spec.research
  return KernelPolicy.resolve(
    kernel=model.expert_method(spec.kernel),
    head=research.head_kernel,
    dense=research.dense_kernel,
    attention=research.attention_kernel,
    platform=platform,
    experts=model.expert_sharding(),
  )


def decode_params(model: ModelHandle, policy: KernelPolicy, leaves: list[jax.Array]) -> tuple[list, PackedWeights]:
  """What the programs take as parameters: the leaves of the model's state (`leaves`:
  `jax.tree.leaves(model.state)`, flattened once per call by the caller) and the weights the C++
  products of `policy` read (its output head where `policy.head` is 'cpu', its dense projections
  where `policy.dense` is), packed once per model (`Model.packed_weights`): a decode step reads
  them from memory, and XLA's dot reads the head slower and re-packs the projections on every
  multi-row product."""
  return leaves, model.packed_weights(head=policy.head == "cpu", dense=policy.dense == "cpu", leaves=leaves)


def signature(fn: Callable[..., Any], ls: LoopSpec, definition: ModelDefinition, *args: Any) -> tuple:
  """A program's key: its function, static settings, model definition and argument shapes."""
  return (fn.__name__, ls, definition, tuple((a.shape, a.dtype) for a in jax.tree.leaves(args)))


# XLA:CPU maps each kernel of a compiled program into memory apart (hundreds of mappings for a
# plain generate() program, more for each of auto K's three: the run, its held runs and loops), and
# a Linux process may hold at most vm.max_map_count, past which a compilation fails and the
# process crashes: a sweep of a few dozen configurations in one process reached it
# (docs/findings/2026-12-02-program-cache.md). Where a compilation leaves the process above
# MAP_HIGH_WATER of its limit, the least recently used programs are dropped until it is below
# MAP_LOW_WATER.
MAP_HIGH_WATER = 0.5
MAP_LOW_WATER = 0.25


def memory_mappings() -> tuple[int, int] | None:
  """(memory mappings this process holds, the most it may hold); None where the system does not
  say (not Linux)."""
  try:
    with open("/proc/self/maps", "rb") as f:
      held = sum(1 for _ in f)
    with open("/proc/sys/vm/max_map_count", encoding="ascii") as f:
      limit = int(f.read())
  except (OSError, ValueError):
    return None
  return held, limit


class ProgramCache:
  """The compiled generation programs of a process, one per signature (function, LoopSpec, model
  definition, argument shapes; `signature`), auto K's calibrations of them, and the model
  definitions they refer to (`definition`: one per graphdef object, hashed once).

  It holds its programs until `forget` drops them (a sweep over dozens of programs does not fit in
  memory otherwise) and, after each compilation, drops the least recently used ones where the
  process holds more than `high_water` of its memory mappings (`drop_least_recent`). A dropped
  program is compiled again when next asked for; one a caller still holds keeps working. The
  module's `PROGRAMS` lives as long as the process and is the one generate() uses.
  """

  def __init__(
    self,
    *,
    mappings: Callable[[], tuple[int, int] | None] = memory_mappings,
    high_water: float = MAP_HIGH_WATER,
    low_water: float = MAP_LOW_WATER,
  ) -> None:
    self.mappings, self.high_water, self.low_water = mappings, high_water, low_water
    self._programs: dict[Any, Any] = {}
    self._last_use: dict[Any, int] = {}  # when each program was last asked for
    self._uses = itertools.count()
    # (signature, what else it depends on: `Drafter.calibration_key`) -> calibration.Calibration
    self._calibrations: dict[Any, Any] = {}
    # id(graphdef) -> its definition, whose graphdef field keeps the id from being reused.
    self._definitions: dict[int, ModelDefinition] = {}

  def __len__(self) -> int:
    return len(self._programs)

  def definition(self, graphdef: nnx.GraphDef, state_treedef: PyTreeDef) -> ModelDefinition:
    """The one definition object per (graphdef object, state structure), hashed once."""
    found = self._definitions.get(id(graphdef))
    if found is None or found.graphdef is not graphdef or found.state_treedef != state_treedef:
      found = self._definitions[id(graphdef)] = ModelDefinition(graphdef, state_treedef)
    return found

  def definitions(self) -> tuple[ModelDefinition, ...]:
    return tuple(self._definitions.values())

  def compiled(
    self, fn: Callable[..., Any], ls: LoopSpec, *args: Any, donate_argnums: tuple[int, ...] = ()
  ) -> jax.stages.Compiled:
    """`fn` AOT-compiled once per (LoopSpec, argument shapes), so that timing excludes compilation."""
    sig = signature(fn, ls, *args)
    self._last_use[sig] = next(self._uses)
    program = self._programs.get(sig)
    if program is None:
      # On a mesh, outputs are replicated: every process of a multi-host mesh reads them whole.
      experts = ls.kernels.experts
      out_shardings = None if experts is None else NamedSharding(experts.mesh, PartitionSpec())
      jitted = jax.jit(
        fn, static_argnums=(0,), static_argnames=("ls",), donate_argnums=donate_argnums, out_shardings=out_shardings
      )
      program = self._programs[sig] = jitted.lower(*args, ls=ls).compile()
      self.drop_least_recent()
    return program

  def program(self, sig: tuple) -> jax.stages.Compiled | None:
    """The compiled program of a signature, or None."""
    return self._programs.get(sig)

  def signatures(self) -> frozenset:
    return frozenset(self._programs)

  def signatures_by_use(self) -> tuple:
    """The programs' signatures, least recently used first."""
    return tuple(sorted(self._programs, key=lambda sig: self._last_use.get(sig, -1)))

  def calibration(self, key: tuple) -> Any:
    """The calibration kept under `key` ((signature, calibration key)), or None."""
    return self._calibrations.get(key)

  def set_calibration(self, key: tuple, value: Any) -> None:
    self._calibrations[key] = value

  def calibration_keys(self) -> frozenset:
    return frozenset(self._calibrations)

  def forget(self, keep: Iterable[tuple] = frozenset()) -> None:
    """Drops the programs whose signatures are not in `keep` (a set of earlier `signatures()`),
    and the models that no remaining program or calibration refers to (their definitions hold
    their graphdefs). Calibrations stay: they are cheap and slow to measure again."""
    for sig in set(self._programs) - set(keep):
      del self._programs[sig]
    for sig in set(self._last_use) - set(self._programs):
      del self._last_use[sig]
    live = {id(sig[2]) for sig in self._programs} | {id(key[0][2]) for key in self._calibrations}
    for graphdef_id in [i for i, definition in self._definitions.items() if id(definition) not in live]:
      del self._definitions[graphdef_id]
    jax.clear_caches()

  def clear(self) -> None:
    """Drops every program and calibration."""
    self._calibrations.clear()
    self.forget()

  def drop_least_recent(self) -> int:
    """Where the process holds more than `high_water` of its memory mappings, drops the older half
    of the programs (least recently used first; never the newest), then JAX's caches, which hold
    them too (`forget`), until it holds less than `low_water` or one program is left. Returns the
    number dropped."""
    counts = self.mappings()
    if counts is None or counts[0] <= self.high_water * counts[1]:
      return 0
    (before, limit), held, dropped = counts, counts[0], 0
    while held > self.low_water * limit and len(self._programs) > 1:
      older = self.signatures_by_use()[:-1]
      oldest = older[: max(1, len(older) // 2)]
      self.forget(keep=frozenset(self._programs) - frozenset(oldest))
      gc.collect()
      dropped += len(oldest)
      held = (self.mappings() or (0, limit))[0]
    logging.info(
      "dropped the %d least recently used compiled programs: the process held %d memory mappings, "
      "now %d, of at most %d",
      dropped,
      before,
      held,
      limit,
    )
    return dropped


PROGRAMS = ProgramCache()
