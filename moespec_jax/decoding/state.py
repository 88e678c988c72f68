"""The typed state of a generation program: its static settings (`LoopSpec`), the statistics it
keeps (`Stats`, defined once: fields, shapes, zero values and the one packed vector that leaves
the program) and the `lax.while_loop` carry (`LoopState`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.typing import ArrayLike, DTypeLike

from moespec_jax.decoding.sampling_params import SamplingParams
from moespec_jax.model.budget import ExpertBudget
from moespec_jax.model.kernels import Kernels
from moespec_jax.model.mtp import MTPTarget
from pallas_kernels.policy import KernelPolicy

if TYPE_CHECKING:
  from moespec_jax.model.cache import KVCache
  from moespec_jax.model.transformer import ForwardOutput


class ProgramTarget(MTPTarget, Protocol):
  """The target inside a compiled program as the passes and the drafters use it
  (`programs.ProgramModel`, from a layer above: the `Transformer`'s attributes and the program's kernels)."""

  kernels: Kernels

  def __call__(
    self,
    tokens_BT: jax.Array,
    positions_BT: jax.Array | None = None,
    cache: KVCache | None = None,
    *,
    kernels: Kernels = ...,
    expert_budget: ExpertBudget | None = None,
    valid_BT: jax.Array | None = None,
    compute_logits: bool = True,
    fresh_cache: bool = False,
    hidden_at_B: jax.Array | None = None,
  ) -> ForwardOutput: ...

  def new_cache(self, batch: int, max_len: int) -> KVCache: ...


@dataclasses.dataclass(frozen=True)
class LoopSpec:
  """The static choices of one compiled generation program (hashable: part of its signature)."""

  max_new_tokens: int
  cache_len: int
  sampling: SamplingParams
  # The experts' method, and C++ or XLA head, dense projections and attention (`programs.merge`).
  kernels: KernelPolicy
  # The drafter (a `drafters.base.Drafter`: frozen, with its own static settings); the none
  # drafter for plain decoding.
  drafter: Any
  # The largest K a pass may run, and the width of the per-depth statistics: every pass's K
  # with auto False, the top of auto K's range with auto True. 0: plain decoding.
  max_k: int = 0
  # Draft trees: the nodes a pass verifies (SpecParams.tree_nodes; max_k is then the trees' depth).
  # 0: chains of max_k drafts.
  tree_nodes: int = 0
  auto: bool = False  # K chosen per segment of passes in 0..max_k by the cost model (`auto_draft`)
  timed: bool = False  # auto K corrects its calibration by the loop's own clock (CPU)
  trace_passes: bool = False  # every pass timed by a clock read as it starts (CPU): ResearchOptions.pass_trace
  expert_budget: ExpertBudget | None = None
  measure_quality: bool = False
  # (routed experts, top-k), (0, 0) for a dense model: the shape of the experts' part of the
  # pass times that auto K's calibration fits (auto_draft.smooth_step_times)
  routing: tuple[int, int] = (0, 0)

  @property
  def trace_rows(self) -> int:
    """Rows of the pass trace: one per pass (at most max_new_tokens - 1), none without it."""
    return self.max_new_tokens if self.trace_passes else 0


def _stat(
  shape: tuple, dtype: DTypeLike = jnp.float32, *, reported: Callable[[LoopSpec], bool] | None = None, init: int = 0
) -> Any:
  """A field of `Stats`: its shape in named dimensions (K: max_k, K+1, B: batch, L: MoE layers,
  P: pass-trace rows, R: expert ranks; or a number), dtype, starting value and whether a program reports it to the
  host (`reported(ls)`; None: never, the loop's own bookkeeping)."""
  return dataclasses.field(metadata={"shape": shape, "dtype": dtype, "reported": reported, "init": init})


def _always(ls: LoopSpec) -> bool:
  del ls
  return True


@struct.dataclass(kw_only=True)
class Stats:
  """Every statistic the loop carries, each field's shape, start and reporting declared once.

  Counts over the active rows' passes. `zeros` starts a record, `pack` ravels the reported
  fields into one float32 vector (one copy to the host per call instead of one per statistic),
  `unpack` reads them back as a record of NumPy arrays (None where not reported).
  """

  verify_passes: jax.Array = _stat((), jnp.int32, reported=_always)
  """int32 []: verification passes run."""
  row_passes: jax.Array = _stat((), reported=_always)
  """[]: passes summed over the rows active in them."""
  accepted_tokens: jax.Array = _stat((), reported=_always)
  """[]: tokens committed by active rows (accepted drafts + 1 per pass)."""
  reached_K: jax.Array = _stat(("K",), reported=_always)
  """[K]: active rows' passes that reached draft depth j (drafts before it accepted)."""
  accepted_K: jax.Array = _stat(("K",), reported=_always)
  """[K]: of those, the passes whose draft at depth j was accepted."""
  unique_L: jax.Array = _stat(("L",), reported=_always)
  """[L]: distinct experts read per MoE layer, summed over passes."""
  verified_nodes: jax.Array = _stat((), reported=lambda ls: bool(ls.tree_nodes))
  """[]: tree passes: the valid draft nodes of the active rows, summed over passes."""
  predicted_unique_L: jax.Array = _stat(("L",), reported=lambda ls: ls.drafter.predicts_experts)
  """[L]: drafters that predict their nodes' experts: the predicted distinct experts per MoE layer
  of each pass (pending tokens and valid nodes of the active rows), summed over passes."""
  rank_load_R: jax.Array = _stat(("R",), reported=lambda ls: ls.kernels.experts is not None)
  """[R]: a model on a mesh: the (token, slot) pairs of the active rows routed to each expert rank,
  summed over passes and MoE layers."""
  rank_unique_R: jax.Array = _stat(("R",), reported=lambda ls: ls.kernels.experts is not None)
  """[R]: a model on a mesh: the distinct experts each rank reads, summed over passes and MoE layers."""
  rank_imbalance: jax.Array = _stat((), reported=lambda ls: ls.kernels.experts is not None)
  """[]: a model on a mesh: the slowest rank's pairs over the mean rank's, summed over passes and
  MoE layers."""
  passes_by_K: jax.Array = _stat(("K+1",), reported=lambda ls: ls.auto)
  """[K + 1]: passes run at each K."""
  acceptance_evidence_B2: jax.Array = _stat(("B", 2), reported=lambda ls: ls.auto)
  """[B, 2]: auto K: each row's decayed (accepted, tried) draft counts, shadow drafts included."""
  depth_evidence_BK2: jax.Array = _stat(("B", "K", 2))
  """[B, K, 2]: auto K, drafters read per depth: the same per depth, (accepted, reached)."""
  auto_k: jax.Array = _stat((), jnp.int32)
  """int32 []: auto K: the K of the last segment."""
  drafter_started: jax.Array = _stat((), jnp.int32, reported=lambda ls: ls.auto, init=1)
  """int32 []: auto K: 1 where the drafter was started (`passes.init_state`), 0 where its first
  choice was already the final K = 0 and it never drafts."""
  pass_timing_K2: jax.Array = _stat(("K+1", 2), reported=lambda ls: ls.timed)
  """[K + 1, 2]: auto K, timed: per-K evidence of measured / calibrated pass time
  (auto_draft.record_pass_time)."""
  segment_clock_2: jax.Array = _stat((2,), jnp.int32)
  """int32 [2]: auto K, timed: the clock at the last segment's start."""
  segment_start_passes: jax.Array = _stat((), jnp.int32, init=-1)
  """int32 []: auto K, timed: the passes run before the last segment (-1: no segment yet)."""
  trace_clock_2: jax.Array = _stat((2,), jnp.int32)
  """int32 [2]: pass_trace: the clock when the first token is out (`passes.start_trace`)."""
  pass_trace_P4: jax.Array = _stat(("P", 4), reported=lambda ls: ls.trace_passes)
  """[P, 4]: pass_trace, per pass: ms from the first token to the pass's start, K, tokens
  committed over the rows, distinct experts read summed over the MoE layers."""
  trace_end_ms_1: jax.Array = _stat((1,), reported=lambda ls: ls.trace_passes)
  """[1]: pass_trace: ms from the first token to the end of the last pass."""
  quality_3: jax.Array = _stat((3,), reported=lambda ls: ls.measure_quality)
  """[3]: budgeted mode, measure_quality: top-1 agreements, KL sum, positions compared."""

  @classmethod
  def zeros(cls, ls: LoopSpec, batch: int, n_moe_layers: int) -> Stats:
    """A record at its start (zeros, and -1 where a field says so)."""
    return cls(
      **{name: jnp.full(shape, init, dtype) for name, (shape, dtype, init) in _shapes(ls, batch, n_moe_layers).items()}
    )

  @staticmethod
  def reported_fields(ls: LoopSpec) -> tuple[str, ...]:
    """The fields a program of `ls` reports to the host, in their packed order."""
    return tuple(
      f.name for f in dataclasses.fields(Stats) if f.metadata["reported"] is not None and f.metadata["reported"](ls)
    )

  def pack(self, ls: LoopSpec) -> jax.Array:
    """The reported fields raveled into one float32 vector (counts stay exact below 2^24)."""
    return jnp.concatenate([jnp.ravel(getattr(self, name)).astype(jnp.float32) for name in Stats.reported_fields(ls)])

  @classmethod
  def unpack(cls, packed: ArrayLike, ls: LoopSpec, batch: int, n_moe_layers: int) -> Stats:
    """`pack`'s vector as a record of NumPy arrays in their shapes; None for fields not reported."""
    packed = np.asarray(packed)
    fields, start = dict.fromkeys(_FIELD_NAMES), 0
    for name, shape, size in _layout(ls, batch, n_moe_layers):
      fields[name] = packed[start : start + size].reshape(shape)
      start += size
    if start != packed.size:
      raise AssertionError(f"packed statistics hold {packed.size} values, their layout {start}")
    return cls(**fields)


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(Stats))


def _shapes(ls: LoopSpec, batch: int, n_moe_layers: int) -> dict[str, tuple[tuple[int, ...], Any, int]]:
  """Every field's (shape, dtype, starting value), its named dimensions resolved."""
  ranks = 0 if ls.kernels.experts is None else ls.kernels.experts.n_ranks
  dims = {"K": ls.max_k, "K+1": ls.max_k + 1, "B": batch, "L": n_moe_layers, "P": ls.trace_rows, "R": ranks}
  return {
    f.name: (tuple(dims.get(d, d) for d in f.metadata["shape"]), f.metadata["dtype"], f.metadata["init"])
    for f in dataclasses.fields(Stats)
  }


@functools.cache
def _layout(ls: LoopSpec, batch: int, n_moe_layers: int) -> tuple[tuple[str, tuple[int, ...], int], ...]:
  """(name, shape, size) of each reported field in packed order (once per program signature)."""
  shapes = _shapes(ls, batch, n_moe_layers)
  return tuple((name, shapes[name][0], math.prod(shapes[name][0])) for name in Stats.reported_fields(ls))


@struct.dataclass(kw_only=True)
class LoopState:
  """The `lax.while_loop` carry of a generation program: everything a pass reads and writes."""

  step: jax.Array
  """int32 []: the index of the next pass (1: the first after the prefill; 0 drew the first token)."""
  cache: Any
  """The target's KV cache (`model.cache.KVCache`); entries past a row's position are stale."""
  pos_B: jax.Array
  """int32 [B]: each row's pending token's position (the cache holds every position before it)."""
  pending_B: jax.Array
  """int32 [B]: each row's last committed token, not yet in the cache: a pass's first input."""
  generated_B: jax.Array
  """int32 [B]: tokens each row has committed (the pending one included)."""
  done_B: jax.Array
  """bool [B]: rows past their EOS or their max_new_tokens."""
  out_BN: jax.Array
  """int32 [B, max_new_tokens + max_k + 1]: the committed tokens, -1 after a row's end."""
  draft_state: Any
  """The drafter's own state (its dataclass; None for plain decoding)."""
  stats: Stats
  """The statistics."""
  row_keys_B: jax.Array
  """key [B]: each row's PRNG key (`row_keys`), folded with the pass index for its draws."""

  @property
  def active_B(self) -> jax.Array:
    """bool [B]: rows still generating."""
    return ~self.done_B


def row_keys(seed: ArrayLike, batch: int) -> jax.Array:
  """Each row's PRNG key, split from `seed` (uint32) by row index."""
  return jax.random.split(jax.random.key(seed), batch)


def stream_keys(row_keys_B: jax.Array, stream: int | jax.Array) -> jax.Array:
  """Each row's key for one stream of draws: pass `step` (0: the first token), or a drafter's
  own stream (e.g. the controlled drafter's table)."""
  return jax.vmap(lambda k: jax.random.fold_in(k, stream))(row_keys_B)
