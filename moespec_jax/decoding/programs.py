"""Compiled generation programs: the model's static definition, its state merged back inside a
program beside the program's kernels (policy and packed weights), and the caches of ahead-of-time compiled programs
and of auto K's calibrations, one per program signature. The programs' cache drops its least
recently used programs where the process runs short of memory mappings (`drop_least_recent`).
"""

from __future__ import annotations

import gc
import itertools
import logging
from typing import Any

import jax
from flax import nnx

from moespec_jax.decoding.params import SpecParams
from moespec_jax.decoding.passes import LoopSpec
from moespec_jax.model import Kernels, PackedWeights
from pallas_kernels.policy import KernelPolicy


class ModelDefinition:
  """A program's static view of the model: its NNX graphdef and the tree structure of its state,
  which programs take as a flat list of arrays (flattening an NNX State walks it in Python, about
  80 us a time, and a call did so four times). Its hash is computed once: hashing a GraphDef
  walks the whole module tree, and a generate() call looks its program up two to four times
  (about 1 ms of host time per call, 5% of a 64-token batch-1 call on a tiny model). Equal
  definitions (models of the same structure) share programs."""

  __slots__ = ("graphdef", "state_treedef", "_hash")

  def __init__(self, graphdef, state_treedef):
    self.graphdef, self.state_treedef = graphdef, state_treedef
    self._hash = hash((graphdef, state_treedef))

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    return isinstance(other, ModelDefinition) and (self is other or (
        self._hash == other._hash and self.graphdef == other.graphdef and self.state_treedef == other.state_treedef))


# id(graphdef) -> its definition, whose graphdef field keeps the id from being reused.
_DEFINITIONS: dict[int, ModelDefinition] = {}


def model_definition(graphdef, state_treedef) -> ModelDefinition:
  """The one definition object per (graphdef object, state structure), hashed once."""
  found = _DEFINITIONS.get(id(graphdef))
  if found is None or found.graphdef is not graphdef or found.state_treedef != state_treedef:
    found = _DEFINITIONS[id(graphdef)] = ModelDefinition(graphdef, state_treedef)
  return found


class ProgramModel:
  """The target inside a program: its module (the mathematics; any attribute not defined here is the
  module's) and the program's `kernels` (`LoopSpec.kernels` and the packed weights), which every model
  call is handed explicitly: `model(tokens, ..., kernels=model.kernels)`."""

  __slots__ = ("module", "kernels")

  def __init__(self, module, kernels: Kernels):
    self.module, self.kernels = module, kernels

  def __call__(self, *args, **kwargs):
    return self.module(*args, **kwargs)

  def __getattr__(self, name):
    return getattr(self.module, name)


def merge(definition: ModelDefinition, params, ls: LoopSpec) -> ProgramModel:
  """The model inside a program. `params`: (the state's leaves, the packed weights: see
  `decode_params`); `ls.kernels`: the program's kernel policy."""
  leaves, packed = params
  module = nnx.merge(definition.graphdef, jax.tree.unflatten(definition.state_treedef, leaves))
  return ProgramModel(module, Kernels(ls.kernels, packed))


def kernel_policy(model, spec: SpecParams, platform: str | None = None) -> KernelPolicy:
  """The kernel policy of `spec`'s programs for `model` on `platform` (None: this process's default
  backend; 'tpu', 'gpu' or 'cuda' build a program for another platform): the expert method
  (`SpecParams.kernel`, 'auto' meaning the model config's), and where the output head, the dense
  projections and attention against the cache run the C++ kernels."""
  return KernelPolicy.resolve(kernel=model.expert_method(spec.kernel), head=spec.head_kernel, dense=spec.dense_kernel,
                              attention=spec.attention_kernel, platform=platform)


def decode_params(model, policy: KernelPolicy, leaves) -> tuple[list, PackedWeights]:
  """What the programs take as parameters: the leaves of the model's state (`leaves`:
  `jax.tree.leaves(model.state)`, flattened once per call by the caller) and the weights the C++
  products of `policy` read (its output head where `policy.head` is 'cpu', its dense projections
  where `policy.dense` is), packed once per model (`Model.packed_weights`): a decode step reads
  them from memory, and XLA's dot reads the head slower and re-packs the projections on every
  multi-row product."""
  return leaves, model.packed_weights(head=policy.head == "cpu", dense=policy.dense == "cpu", leaves=leaves)


_COMPILED: dict[Any, Any] = {}
# When each program was last asked for (`compiled`), for `drop_least_recent`.
_LAST_USE: dict[Any, int] = {}
_USES = itertools.count()
# Calibrated pass times of auto K (`calibration.calibrate_step_ms`), per program signature (the
# controlled drafter's: per (signature, acceptance rate)); dropped with the programs.
CALIBRATED: dict[Any, Any] = {}  # calibration.Calibration values


def forget_compiled(keep=frozenset()) -> None:
  """Drops the compiled programs whose signatures are not in `keep` (a set of earlier
  `compiled_signatures()`): a sweep over dozens of programs does not fit in memory otherwise.
  Models that no remaining program or calibration refers to are forgotten too (their
  definitions hold their graphdefs)."""
  for sig in set(_COMPILED) - set(keep):
    del _COMPILED[sig]
  for sig in set(_LAST_USE) - set(_COMPILED):
    del _LAST_USE[sig]
  live = {id(_signature_definition(sig)) for sig in (*_COMPILED, *CALIBRATED)}
  for graphdef_id in [i for i, definition in _DEFINITIONS.items() if id(definition) not in live]:
    del _DEFINITIONS[graphdef_id]
  jax.clear_caches()


def _signature_definition(sig) -> ModelDefinition:
  """The model definition of a program signature, or of a calibration's ((signature,
  acceptance) for the controlled drafter: `calibrate_step_ms`)."""
  return sig[2] if isinstance(sig[0], str) else sig[0][2]


def compiled_signatures() -> frozenset:
  return frozenset(_COMPILED)


def compiled_signatures_by_use() -> tuple:
  """The cached programs' signatures, least recently used first."""
  return tuple(sorted(_COMPILED, key=lambda sig: _LAST_USE.get(sig, -1)))


def signature(fn, ls: LoopSpec, definition, *args):
  return (fn.__name__, ls, definition, tuple((a.shape, a.dtype) for a in jax.tree.leaves(args)))


def compiled(fn, ls: LoopSpec, *args, donate_argnums=()):
  """AOT-compiles `fn` once per (LoopSpec, argument shapes) so timing excludes compilation; the
  cache keeps its programs in order of last use (`drop_least_recent` after each compilation)."""
  sig = signature(fn, ls, *args)
  _LAST_USE[sig] = next(_USES)
  program = _COMPILED.get(sig)
  if program is None:
    jitted = jax.jit(fn, static_argnums=(0,), static_argnames=("ls",), donate_argnums=donate_argnums)
    program = _COMPILED[sig] = jitted.lower(*args, ls=ls).compile()
    drop_least_recent()
  return program


# XLA:CPU maps each kernel of a compiled program into memory apart: on the default model a plain
# generate() program held about 370 memory mappings and each of auto K's three programs (the run,
# its held runs and loops) 1400-1900, and a Linux process may hold at most vm.max_map_count
# (65530 by default), past which a compilation fails and the process crashes (52 generate()
# configurations of the default model in one process, with and without drafting: a segmentation
# fault at 65386 mappings). Where a compilation leaves the process above MAP_HIGH_WATER of its
# limit, the least recently used programs are dropped until it is below MAP_LOW_WATER.
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


def drop_least_recent() -> int:
  """Where the process holds more than MAP_HIGH_WATER of its memory mappings, drops the older half
  of the cached programs (least recently used first; never the newest), then JAX's caches, which
  hold them too (`forget_compiled`), until it holds less than MAP_LOW_WATER or one program is
  left. A dropped program is compiled again when next asked for; one a caller still holds keeps
  working. Returns the number dropped."""
  counts = memory_mappings()
  if counts is None or counts[0] <= MAP_HIGH_WATER * counts[1]:
    return 0
  (before, limit), held, dropped = counts, counts[0], 0
  while held > MAP_LOW_WATER * limit and len(_COMPILED) > 1:
    older = compiled_signatures_by_use()[:-1]
    oldest = older[:max(1, len(older) // 2)]
    forget_compiled(keep=frozenset(_COMPILED) - frozenset(oldest))
    gc.collect()
    dropped += len(oldest)
    held = (memory_mappings() or (0, limit))[0]
  logging.info("dropped the %d least recently used compiled programs: the process held %d memory mappings, "
               "now %d, of at most %d", dropped, before, held, limit)
  return dropped
