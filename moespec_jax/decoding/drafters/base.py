"""The drafter interface: what the loop asks of a drafter, and the draft tree it proposes.

A drafter is a frozen (hashable) dataclass holding its static settings; it is part of its
program's `LoopSpec`. Its state is its own pytree in `LoopState.draft_state`. The loop calls:
`prefill` and `start` (the prompt pass and the state from it), `propose` (a tree of drafts with
their q), `update` (after verification), and for auto K `shadow` (the draft it would have
proposed on a plain pass, where `shadows`), `per_depth` and `has_proposal`. Registering a drafter
is one entry in `drafters.REGISTRY`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.typing import ArrayLike

from moespec_jax.config import ModelConfig
from moespec_jax.decoding.sampling_params import SamplingParams
from moespec_jax.decoding.state import LoopSpec, LoopState, ProgramTarget

if TYPE_CHECKING:
  from moespec_jax.decoding.tree_select import TreeCost
  from moespec_jax.model.cache import KVCache
  from moespec_jax.model.handle import ModelHandle
  from moespec_jax.model.transformer import ForwardOutput


class DraftResearch(Protocol):
  """The research options drafters read (`params.ResearchOptions`)."""

  @property
  def controlled_acceptance(self) -> float | None: ...

  @property
  def mtp_prompt_window(self) -> int | None: ...


class DraftSpec(Protocol):
  """A call's `params.SpecParams` as drafters read it (`params` imports the drafters, which name
  it by this protocol)."""

  @property
  def drafter(self) -> str: ...

  @property
  def num_draft(self) -> int | str: ...

  @property
  def max_draft(self) -> int: ...

  @property
  def tree_nodes(self) -> int | None: ...

  @property
  def tree_policy(self) -> str: ...

  @property
  def expert_penalty(self) -> float: ...

  @property
  def tree_truncate(self) -> bool: ...

  @property
  def tree_cost(self) -> TreeCost | None: ...

  @property
  def research(self) -> DraftResearch: ...


@struct.dataclass(kw_only=True)
class DraftTree:
  """One pass's proposal: per row N nodes, each a token that follows its parent node, or the row's
  pending token (the root, parent -1). A chain is the tree with parent[j] = j - 1."""

  tokens_BN: jax.Array
  """int32 [B, N]: each node's token (0 where not valid)."""
  parent_BN: jax.Array
  """int32 [B, N]: the node each node follows; -1: the pending token."""
  q_BNV: jax.Array | None
  """float32 [B, N, V]: the distribution each token was drawn from; None where only the tokens
  matter (greedy) or where every draft is deterministic and verified greedily."""
  valid_BN: jax.Array
  """bool [B, N]: False where the drafter proposed nothing (rejected; its token drawn from p)."""
  predicted_unique_L: jax.Array | None = None
  """float32 [L]: drafters that predict their nodes' experts: the distinct experts per MoE layer
  they predict the pass to read (the batch's pending tokens and valid nodes)."""
  is_chain: bool = struct.field(pytree_node=False, default=False)
  """Static: parent[j] = j - 1 in every row (what verification handles today)."""

  @property
  def num_nodes(self) -> int:
    return self.tokens_BN.shape[1]

  @classmethod
  def chain(cls, tokens_BN: jax.Array, q_BNV: jax.Array | None = None, valid_BN: jax.Array | None = None) -> DraftTree:
    """A chain of drafts: node j follows node j - 1 (node 0 the pending token); every node valid
    unless `valid_BN` says otherwise."""
    batch, n = tokens_BN.shape
    parent_BN = jnp.broadcast_to(jnp.arange(-1, n - 1, dtype=jnp.int32), (batch, n))
    if valid_BN is None:
      valid_BN = jnp.ones((batch, n), jnp.bool_)
    return cls(tokens_BN=tokens_BN, parent_BN=parent_BN, q_BNV=q_BNV, valid_BN=valid_BN, is_chain=True)

  @classmethod
  def empty(cls, batch: int) -> DraftTree:
    """No drafts (a plain pass)."""
    return cls.chain(jnp.zeros((batch, 0), jnp.int32), None, jnp.zeros((batch, 0), jnp.bool_))


@struct.dataclass(kw_only=True)
class Verified:
  """What a verification pass found: what the drafter's `update`, the commit and the statistics
  read. S = N + 1 verified positions per row: the pending token, then the drafts."""

  tree: DraftTree
  """The drafts verified."""
  pos_B: jax.Array
  """int32 [B]: each row's pending token's position when the pass began."""
  positions_BS: jax.Array
  """int32 [B, S]: the verified tokens' positions (after a tree pass: the accepted path's, as a
  chain's, and `output.hidden` the path's too; `output.logits` and `routing` stay the tree's)."""
  active_B: jax.Array
  """bool [B]: rows that were generating when the pass began."""
  experts_BS: jax.Array
  """bool [B, S]: the verified tokens that read routed experts (finished rows and empty draft
  slots read none)."""
  output: Any
  """The target's `ForwardOutput` over the verified tokens (logits, hidden states, routing, cache)."""
  accept_BN: jax.Array
  """bool [B, N]: drafts accepted (only a leading run counts); after a tree pass [B, D], per
  depth of the accepted path (the tree itself: `tree`)."""
  n_accepted_B: jax.Array
  """int32 [B]: leading drafts accepted."""
  next_B: jax.Array
  """int32 [B]: the token after them: the residual sample at the first rejection, or the bonus."""
  candidates_BS: jax.Array
  """int32 [B, S]: [d_1..d_a, y, ...]: the accepted drafts then `next_B` (before the EOS and
  max_new_tokens cut); after a tree pass [B, D + 1], the accepted path's tokens."""
  shadow_valid_B: jax.Array | None = None
  """bool [B]: auto K on a plain pass: rows whose shadow draft counts as evidence."""
  shadow_accept_B: jax.Array | None = None
  """float32 [B]: the shadow draft's acceptance (greedy: it matched; sampled: p(draft))."""
  quality_3: jax.Array | None = None
  """[3]: measure_quality: (top-1 agreements, KL sum, positions) against the exact pass."""


@dataclasses.dataclass(frozen=True)
class Drafter:
  """The interface every drafter implements (its defaults are the plain drafter's).

  Class-level facts the loop and auto K read:
    drafts: it proposes tokens (False: plain decoding, K = 0 whatever num_draft says).
    shadows: its proposals are cheap enough to check on plain passes (auto K's evidence at K = 0).
    per_depth: auto K reads its acceptance per draft depth (`auto_draft.depth_acceptance`).
    takes_reference: generate's `reference_tokens` are its input.
    branches: it proposes draft trees (`SpecParams.tree_nodes`): `propose` then returns a tree of
      `ls.tree_nodes` nodes of depth at most k.
    weighs_experts: its trees can be chosen by their predicted experts (`SpecParams.tree_policy`
      "expert_aware", `tree_truncate`).
  """

  drafts: ClassVar[bool] = True
  branches: ClassVar[bool] = False
  weighs_experts: ClassVar[bool] = False
  shadows: ClassVar[bool] = False
  per_depth: ClassVar[bool] = False
  takes_reference: ClassVar[bool] = False

  @property
  def predicts_experts(self) -> bool:
    """Whether its trees are chosen by their nodes' predicted experts (it then reports them in
    `DraftTree.predicted_unique_L`)."""
    return False

  # Host side: validation and configuration.

  @classmethod
  def check_spec(cls, spec: DraftSpec) -> None:
    """Raises ValueError where a `SpecParams` lacks what this drafter needs."""

  @classmethod
  def for_call(cls, spec: DraftSpec, *, config: ModelConfig, sampling: SamplingParams, prompt_len: int) -> Drafter:
    """The drafter a generate() call runs (its static settings from `spec`); raises ValueError
    where the model or the sampling cannot serve it. `prompt_len`: the padded prompt length."""
    del spec, config, sampling, prompt_len
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
  ) -> Any:
    """Arrays drawn before the program (a pytree, the program's `inputs` argument; None).
    `length`: output indices a pass may read (max_new_tokens + max_k + 1)."""
    del spec, model, reference_tokens, seed_u32, n_rows, max_new_tokens, length, vocab_size
    return None

  def calibration_key(self, inputs: Any) -> Any:
    """What besides its program a calibration of auto K's pass times depends on (None)."""
    del inputs
    return None

  # Traced.

  def prefill(
    self,
    model: ProgramTarget,
    tokens_BT: jax.Array,
    lengths_B: jax.Array,
    prompt_BT: jax.Array,
    cache: KVCache,
    ls: LoopSpec,
  ) -> tuple[Any, jax.Array, Any]:
    """The target's pass over the prompts: (its output, the last prompt position's logits [B, V],
    a note `start` reads). By default only the last position's hidden state is computed."""
    out = model(
      tokens_BT, None, cache, kernels=model.kernels, valid_BT=prompt_BT, fresh_cache=True, hidden_at_B=lengths_B - 1
    )
    return out, out.logits[:, 0], None

  def start(
    self,
    model: ProgramTarget,
    tokens_BT: jax.Array,
    lengths_B: jax.Array,
    prompt_BT: jax.Array,
    prefilled: ForwardOutput,
    note: Any,
    first_B: jax.Array,
    inputs: Any,
    ls: LoopSpec,
  ) -> Any:
    """The drafter's state after the prefill and the first token `first_B` (None)."""
    del model, tokens_BT, lengths_B, prompt_BT, prefilled, note, first_B, inputs, ls
    return None

  def propose(
    self, model: ProgramTarget, state: LoopState, k: int, keys_B: jax.Array, ls: LoopSpec
  ) -> tuple[DraftTree, Any]:
    """Up to k drafts per row as a chain (k >= 1), or with `ls.tree_nodes` (drafters that branch)
    a tree of that many nodes and depth at most k; and the drafter's state after drafting. A
    tree's nodes come after their parents, siblings in the order verification tries them."""
    raise NotImplementedError(f"{type(self).__name__} proposes no drafts")

  def update(self, model: ProgramTarget, draft_state: Any, verified: Verified, ls: LoopSpec) -> Any:
    """The drafter's state after a verification pass (unchanged)."""
    del model, verified, ls
    return draft_state

  def shadow(
    self, model: ProgramTarget, state: LoopState, keys_B: jax.Array, ls: LoopSpec
  ) -> tuple[jax.Array, jax.Array]:
    """(token_B, valid_B): the one draft it would propose, checked on plain passes (`shadows`)."""
    tree, _ = self.propose(model, state, 1, keys_B, ls)
    return tree.tokens_BN[:, 0], tree.valid_BN[:, 0]

  def has_proposal(self, state: LoopState, ls: LoopSpec) -> jax.Array | None:
    """bool []: whether any active row has something to propose (None: always)."""
    del state, ls
    return None
