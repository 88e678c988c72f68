"""The research drafter with controllable acceptance (cost-model validation, greedy only): it
proposes the target's own greedy token with probability a, else another token.

Its proposals for every output index are drawn before the generation's program (`draw_table`),
from a plain greedy run's tokens (generate's `reference_tokens`): the table stands in for a drafter
whose proposals cost nothing, so decoding pays a lookup per pass and its random draws are not timed
as part of decoding. With `ResearchOptions(controlled_draft_cost="mtp")` every pass also runs the
model's MTP heads as the MTP drafter does (`MtpDrafter`: its prefill, drafts and cache fills), and the
proposal takes a data dependency on their drafts, so that the compiled program keeps their cost;
the tokens proposed are still the table's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.typing import ArrayLike

from moespec_jax.config import ModelConfig
from moespec_jax.decoding.drafters.base import Drafter, DraftSpec, DraftTree, Verified
from moespec_jax.decoding.drafters.mtp import MtpDrafter, MtpState
from moespec_jax.decoding.sampling_params import SamplingParams
from moespec_jax.decoding.state import LoopSpec, LoopState, ProgramTarget, row_keys, stream_keys

if TYPE_CHECKING:
  from moespec_jax.model.cache import KVCache
  from moespec_jax.model.handle import ModelHandle
  from moespec_jax.model.transformer import ForwardOutput

# The table draws from this stream of each row's key (passes use 0, 1, ...).
TABLE_STREAM = 0x7FFFFFFF


def controlled_table(
  reference_BN: jax.Array, key_B: jax.Array, acceptance: float | jax.Array, vocab_size: int
) -> jax.Array:
  """The proposal for every output index, drawn once per generation.

  The proposal at index g of a row is the reference (the target's plain greedy output) at g with
  probability `acceptance`, else a uniformly chosen different token, independently per index. A
  draft at index g is verified at most once (then the output moves past g), so under greedy
  verification the accepted length is exactly geometric in `acceptance`.
  """
  n = reference_BN.shape[1]

  def one_row(key: jax.Array, ref_N: jax.Array):
    k_hit, k_other = jax.random.split(key)
    hit_N = jax.random.uniform(k_hit, (n,)) < acceptance
    offset_N = jax.random.randint(k_other, (n,), 1, vocab_size)
    return jnp.where(hit_N, ref_N, (ref_N + offset_N) % vocab_size).astype(jnp.int32)

  return jax.vmap(one_row)(key_B, reference_BN)


@functools.partial(jax.jit, static_argnames=("length", "vocab_size"))
def draw_table(
  reference_BN: ArrayLike, seed: ArrayLike, acceptance: float | jax.Array, *, length: int, vocab_size: int
) -> jax.Array:
  """`controlled_table` for output indices 0..length-1 of every row (the reference padded with
  zeros or cut to `length`), from each row's key's TABLE_STREAM."""
  ref_BN = jnp.maximum(reference_BN, 0)
  ref_BN = jnp.pad(ref_BN, ((0, 0), (0, max(length - ref_BN.shape[1], 0))))[:, :length]
  keys_B = stream_keys(row_keys(seed, ref_BN.shape[0]), TABLE_STREAM)
  return controlled_table(ref_BN, keys_B, acceptance, vocab_size)


def controlled_propose(table_BN: jax.Array, gen_B: jax.Array, num_draft: int) -> jax.Array:
  """K drafts per row: the table (`controlled_table`) from index gen."""
  n = table_BN.shape[1]
  idx_BK = jnp.clip(gen_B[:, None] + jnp.arange(num_draft, dtype=jnp.int32)[None], 0, n - 1)
  return jnp.take_along_axis(table_BN, idx_BK, axis=1)


@struct.dataclass(kw_only=True)
class ControlledInputs:
  """What generate() draws before the program."""

  table_BN: np.ndarray
  """int32 [B, max_new_tokens + max_k + 1]: the proposal at every output index."""
  acceptance: np.ndarray
  """float32 []: the acceptance rate the table was drawn at (the calibration's key; unread inside)."""


@struct.dataclass(kw_only=True)
class ControlledState:
  table_BN: jax.Array
  """int32 [B, max_new_tokens + max_k + 1]: the proposals (`ControlledInputs.table_BN`)."""
  mtp: MtpState | None = None
  """The MTP heads' state where their cost is paid (`ControlledDrafter.mtp`), else None."""


def keep_alive(table_BK: jax.Array, computed_BK: jax.Array) -> jax.Array:
  """The table's drafts with a data dependency on `computed_BK` (token ids, never negative): the
  program cannot drop the computation that made them, and the drafts stay the table's."""
  return jnp.where(computed_BK < 0, computed_BK, table_BK)


@dataclasses.dataclass(frozen=True)
class ControlledDrafter(Drafter):
  """Needs `ResearchOptions(controlled_acceptance=a)`, greedy sampling and `reference_tokens`.

  mtp: where the passes pay the MTP heads' cost (`controlled_draft_cost="mtp"`), the MTP drafter
  run beside the table; None: drafting costs a lookup."""

  mtp: MtpDrafter | None = None
  shadows: ClassVar[bool] = True
  takes_reference: ClassVar[bool] = True

  @classmethod
  def check_spec(cls, spec: DraftSpec) -> None:
    if spec.research.controlled_acceptance is None:
      raise ValueError(
        "drafter='controlled' needs research=ResearchOptions(controlled_acceptance=a), "
        "a in [0, 1]: the probability that it proposes the target's greedy token"
      )

  @classmethod
  def for_call(
    cls, spec: DraftSpec, *, config: ModelConfig, sampling: SamplingParams, prompt_len: int
  ) -> ControlledDrafter:
    if not sampling.greedy:
      raise ValueError(
        "drafter='controlled' needs greedy sampling (temperature 0): its acceptance is "
        "geometric in controlled_acceptance only against the target's greedy tokens"
      )
    if spec.research.controlled_draft_cost == "mtp":
      if config.num_mtp_modules == 0:
        raise ValueError(
          "controlled_draft_cost='mtp' needs a model with MTP heads (num_mtp_modules > 0), "
          "this one has none; use controlled_draft_cost='none'"
        )
      return cls(mtp=MtpDrafter.for_call(spec, config=config, sampling=sampling, prompt_len=prompt_len))
    return cls()

  def host_inputs(
    self,
    spec: DraftSpec,
    *,
    model: ModelHandle,
    reference_tokens: ArrayLike | None,
    seed_u32: np.ndarray,
    n_rows: int,
    max_new_tokens: int,
    length: int,
    vocab_size: int,
  ) -> ControlledInputs:
    """The table, drawn and fetched to the host (dispatch is asynchronous: a table still being
    drawn would be timed with the program)."""
    del model
    if reference_tokens is None:
      raise ValueError(
        "drafter='controlled' needs reference_tokens: the plain greedy output "
        "(generate(...).tokens) for the same prompts"
      )
    ref = np.asarray(reference_tokens)
    if (
      ref.ndim != 2
      or ref.shape[0] != n_rows
      or ref.shape[1] < max_new_tokens
      or not np.issubdtype(ref.dtype, np.integer)
    ):
      raise ValueError(
        f"reference_tokens must be an int array [{n_rows}, >= {max_new_tokens}], got "
        f"shape {ref.shape} and dtype {ref.dtype}"
      )
    # The rate is an input, not a static setting: every rate runs one program.
    acceptance = np.float32(spec.research.controlled_acceptance)
    table = draw_table(
      ref[:, :max_new_tokens].astype(np.int32), seed_u32, acceptance, length=length, vocab_size=vocab_size
    )
    return ControlledInputs(table_BN=np.asarray(table), acceptance=acceptance)

  def calibration_key(self, inputs: ControlledInputs) -> float:
    """A pass costs more when its drafts are wrong (random tokens route to more distinct experts
    than the model's own continuation): one calibration per acceptance rate."""
    return float(inputs.acceptance)

  def prefill(
    self,
    model: ProgramTarget,
    tokens_BT: jax.Array,
    lengths_B: jax.Array,
    prompt_BT: jax.Array,
    cache: KVCache,
    ls: LoopSpec,
  ) -> tuple[Any, jax.Array, Any]:
    if self.mtp is None:
      return super().prefill(model, tokens_BT, lengths_B, prompt_BT, cache, ls)
    return self.mtp.prefill(model, tokens_BT, lengths_B, prompt_BT, cache, ls)

  def start(
    self,
    model: ProgramTarget,
    tokens_BT: jax.Array,
    lengths_B: jax.Array,
    prompt_BT: jax.Array,
    prefilled: ForwardOutput,
    note: Any,
    first_B: jax.Array,
    inputs: ControlledInputs,
    ls: LoopSpec,
  ) -> ControlledState:
    mtp = None
    if self.mtp is not None:
      mtp = self.mtp.start(model, tokens_BT, lengths_B, prompt_BT, prefilled, note, first_B, inputs, ls)
    return ControlledState(table_BN=inputs.table_BN, mtp=mtp)

  def propose(
    self, model: ProgramTarget, state: LoopState, k: int, keys_B: jax.Array, ls: LoopSpec
  ) -> tuple[DraftTree, ControlledState]:
    drafts_BK = controlled_propose(state.draft_state.table_BN, state.generated_B, k)
    if self.mtp is None:
      return DraftTree.chain(drafts_BK), state.draft_state
    mtp_tree, mtp_state = self.mtp.propose(model, state.replace(draft_state=state.draft_state.mtp), k, keys_B, ls)
    drafts_BK = keep_alive(drafts_BK, mtp_tree.tokens_BN)
    return DraftTree.chain(drafts_BK), state.draft_state.replace(mtp=mtp_state)

  def update(
    self, model: ProgramTarget, draft_state: ControlledState, verified: Verified, ls: LoopSpec
  ) -> ControlledState:
    """The MTP heads' cache fill over the accepted positions, where their cost is paid."""
    if self.mtp is None:
      return draft_state
    return draft_state.replace(mtp=self.mtp.update(model, draft_state.mtp, verified, ls))

  def shadow(
    self, model: ProgramTarget, state: LoopState, keys_B: jax.Array, ls: LoopSpec
  ) -> tuple[jax.Array, jax.Array]:
    """The table's next proposal: a plain pass runs no MTP heads (as for the MTP drafter)."""
    tokens_BK = controlled_propose(state.draft_state.table_BN, state.generated_B, 1)
    return tokens_BK[:, 0], jnp.ones_like(tokens_BK[:, 0], jnp.bool_)
