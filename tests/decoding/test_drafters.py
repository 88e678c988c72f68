"""The drafters: the registry from a user's name to an implementation (a drafter defined here and
registered in one place runs through the loop), the draft tree, and the drafters' own functions
(n-gram prompt lookup, the controlled drafter's table)."""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moespec_jax as msj
from moespec_jax.decoding import auto_draft, drafters, loop, programs
from moespec_jax.decoding import state as state_lib
from moespec_jax.decoding.calibration import Calibration
from moespec_jax.decoding.drafters import controlled, ngram

PROMPTS = [[3, 3, 3, 3, 3], [7, 8, 7, 8, 7, 8], [5, 9, 30, 41]]


@dataclasses.dataclass(frozen=True)
class ReplayDrafter(drafters.Drafter):
  """A drafter defined outside the package: it proposes a given continuation (generate's
  `reference_tokens`, drawn into its state before the program) as a chain. Its proposals cost
  nothing, so it also shadow-drafts on auto K's plain passes."""

  shadows: ClassVar[bool] = True
  takes_reference: ClassVar[bool] = True

  def host_inputs(self, spec, *, model, reference_tokens, seed_u32, n_rows, max_new_tokens, length, vocab_size):
    table_BN = np.zeros((n_rows, length), np.int32)
    table_BN[:, :max_new_tokens] = np.maximum(np.asarray(reference_tokens)[:, :max_new_tokens], 0)
    return table_BN

  def start(self, model, tokens_BT, lengths_B, prompt_BT, prefilled, note, first_B, inputs, ls):
    return inputs

  def propose(self, model, state, k, keys_B, ls):
    index_BK = jnp.minimum(state.generated_B[:, None] + jnp.arange(k)[None], state.draft_state.shape[1] - 1)
    return drafters.DraftTree.chain(jnp.take_along_axis(state.draft_state, index_BK, axis=1)), state.draft_state


@dataclasses.dataclass(frozen=True)
class ForkDrafter(ReplayDrafter):
  """Proposes a tree: every node a child of the pending token."""

  def propose(self, model, state, k, keys_B, ls):
    chain, _ = super().propose(model, state, k, keys_B, ls)
    return dataclasses.replace(chain, parent_BN=jnp.full_like(chain.parent_BN, -1), is_chain=False), None


@dataclasses.dataclass(frozen=True)
class DetourDrafter(ReplayDrafter):
  """Proposes a tree of two children per depth: a wrong token first, then the given continuation's
  token, whose own two children follow. The continuation's path runs through every second node
  (1, 3, 5, ...), so its cache entries must move after each pass."""

  branches: ClassVar[bool] = True

  def propose(self, model, state, k, keys_B, ls):
    chain, _ = super().propose(model, state, k, keys_B, ls)
    right_BK = chain.tokens_BN
    wrong_BK = (right_BK + 1) % model.config.vocab_size
    tokens_BN = jnp.stack([wrong_BK, right_BK], axis=2).reshape(right_BK.shape[0], 2 * k)
    parent_N = jnp.repeat(jnp.arange(-1, 2 * k - 2, 2), 2)  # depth d's pair follows node 2d - 1
    parent_BN = jnp.broadcast_to(parent_N, tokens_BN.shape)
    tree = drafters.DraftTree(
      tokens_BN=tokens_BN, parent_BN=parent_BN, q_BNV=None, valid_BN=jnp.ones(tokens_BN.shape, bool)
    )
    return tree, state.draft_state


@pytest.fixture
def registered(monkeypatch):
  """The test drafters, registered by their one entry each in the registry."""
  monkeypatch.setitem(drafters.REGISTRY, "replay", ReplayDrafter)
  monkeypatch.setitem(drafters.REGISTRY, "fork", ForkDrafter)
  monkeypatch.setitem(drafters.REGISTRY, "detour", DetourDrafter)


def test_registry_maps_the_users_names_to_drafters():
  assert drafters.names() == ("none", "mtp", "ngram", "controlled")
  assert all(issubclass(drafters.lookup(name), drafters.Drafter) for name in drafters.names())
  with pytest.raises(
    ValueError,
    match=r"drafter must be one of \('none', 'mtp', 'ngram', 'controlled'\), "
    r"got 'replay'",
  ):
    msj.SpecParams(drafter="replay")


def test_a_drafter_registered_in_one_place_runs_through_the_loop(tiny_model, registered, monkeypatch):
  """Fixed K and auto K (with shadow drafts on plain passes) with a drafter the package does not
  know: greedy output equals plain decoding's, and its drafts (plain decoding's own tokens) are all
  accepted."""
  plain = msj.generate(tiny_model, PROMPTS, max_new_tokens=12)
  spec = msj.SpecParams(drafter="replay", num_draft=2)
  fixed = msj.generate(tiny_model, PROMPTS, max_new_tokens=12, spec=spec, reference_tokens=plain.tokens)
  np.testing.assert_array_equal(fixed.tokens, plain.tokens)
  assert fixed.stats["drafter"] == "replay" and fixed.stats["acceptance_by_depth"] == [1.0, 1.0]
  assert fixed.stats["mean_accepted_length"] > 2.5
  with pytest.raises(ValueError, match="reference_tokens is used by drafter='controlled' or drafter='replay'"):
    msj.generate(tiny_model, PROMPTS, max_new_tokens=12, reference_tokens=plain.tokens)
  monkeypatch.setattr(
    loop,
    "calibrate_step_ms",
    lambda ls, args, run, progress: Calibration(np.array([1.0, 1.2, 1.4], np.float32), "held_runs"),
  )
  auto = msj.generate(
    tiny_model,
    PROMPTS,
    max_new_tokens=12,
    reference_tokens=plain.tokens,
    spec=msj.SpecParams(drafter="replay", num_draft="auto", max_draft=2),
  )
  np.testing.assert_array_equal(auto.tokens, plain.tokens)
  assert sum(auto.stats["passes_by_num_draft"]) == auto.stats["verify_passes"]
  assert auto.stats["passes_by_num_draft"][2] > 0 and auto.stats["acceptance_estimate"] > 0.5


def test_verification_refuses_a_draft_tree_that_is_not_a_chain(tiny_model, registered):
  with pytest.raises(ValueError, match="where a chain of 2 drafts was asked"):
    msj.generate(
      tiny_model,
      PROMPTS,
      max_new_tokens=4,
      spec=msj.SpecParams(drafter="fork", num_draft=2),
      reference_tokens=np.zeros((len(PROMPTS), 4), np.int32),
    )


@pytest.mark.parametrize("depth", [1, 3])
def test_a_tree_whose_right_path_runs_through_second_siblings_decodes_the_plain_tokens(tiny_model, registered, depth):
  """Greedy tree verification takes the second child at every depth, and the path's cache entries
  (at every second slot) are moved into place: the tokens are plain greedy decoding's, every
  pass commits the whole depth but the last."""
  plain = msj.generate(tiny_model, PROMPTS, max_new_tokens=10)
  out = msj.generate(
    tiny_model,
    PROMPTS,
    max_new_tokens=10,
    spec=msj.SpecParams(drafter="detour", num_draft=depth, tree_nodes=2 * depth),
    reference_tokens=plain.tokens,
  )
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  # 9 tokens after the first, depth + 1 a pass (the continuation's padding is wrong past its end).
  assert out.stats["verify_passes"] == -(-9 // (depth + 1))
  assert out.stats["acceptance_by_depth"][0] == 1.0


def test_a_chain_is_the_tree_whose_nodes_follow_the_one_before():
  tokens = jnp.asarray([[4, 5, 6], [7, 8, 9]], jnp.int32)
  chain = drafters.DraftTree.chain(tokens)
  assert chain.is_chain and chain.num_nodes == 3 and chain.q_BNV is None
  np.testing.assert_array_equal(chain.parent_BN, [[-1, 0, 1], [-1, 0, 1]])
  assert np.asarray(chain.valid_BN).all()
  empty = drafters.DraftTree.empty(2)
  assert empty.num_nodes == 0 and empty.tokens_BN.shape == empty.valid_BN.shape == (2, 0)


def test_ngram_proposes_what_followed_the_longest_earlier_match():
  seq = jnp.asarray(
    [
      [1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3, 0, 0, 0],
      [5, 6, 7, 8, 5, 6, 0, 0, 0, 0, 0, 0, 0, 0],
      [1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    ]
  )
  n = jnp.asarray([11, 6, 4])
  d, valid = ngram.prompt_lookup(seq, n, 3)
  # Row 0: suffix [1, 2, 3] occurred at 0..2 (longest), followed by 9, 2, 3.
  assert d[0].tolist() == [9, 2, 3] and valid[0].all()
  # Row 1: suffix [5, 6] occurred at 0..1, followed by 7, 8, then the suffix itself (5).
  assert d[1].tolist() == [7, 8, 5] and valid[1].all()
  # Row 2: no earlier occurrence of 4: nothing proposed.
  assert not valid[2].any()


def test_ngram_in_a_run_of_equal_tokens_proposes_num_draft_tokens():
  seq = jnp.asarray([[4, 7, 7, 7, 7, 7, 7, 7, 0, 0]])
  d, valid = ngram.prompt_lookup(seq, jnp.asarray([8]), 3)
  assert d[0].tolist() == [7, 7, 7] and valid[0].all()


def _prompt_lookup_reference(seq_S: np.ndarray, n: int, num_draft: int) -> tuple[list, list]:
  """prompt_lookup's rule, one row, by brute force: every earlier end j < n - 1 with its common
  suffix with seq[:n] (capped at NGRAM_MAX), ranked by (min(length, NGRAM_PREFER), followed by
  num_draft known tokens, length, recency)."""
  best, best_j = None, -1
  for j in range(n - 1):
    length = 0
    while length < ngram.NGRAM_MAX and j - length >= 0 and seq_S[j - length] == seq_S[n - 1 - length]:
      length += 1
    if length:
      rank = (min(length, ngram.NGRAM_PREFER), int(j + num_draft < n), length, j)
      if best is None or rank > best:
        best, best_j = rank, j
  if best is None:
    return [0] * num_draft, [False] * num_draft
  follow = [best_j + 1 + i for i in range(num_draft)]
  return [int(seq_S[f]) if f < n else 0 for f in follow], [f < n for f in follow]


@pytest.mark.parametrize("vocab", [2, 5, 40])
def test_ngram_matches_the_brute_force_rule_on_random_sequences(vocab):
  rng = np.random.default_rng(vocab)
  seq = rng.integers(0, vocab, (6, 40)).astype(np.int32)
  n = np.array([1, 2, 9, 23, 39, 40], np.int32)
  for k in (1, 4):
    d, valid = ngram.prompt_lookup(jnp.asarray(seq), jnp.asarray(n), k)
    for row in range(seq.shape[0]):
      want_d, want_valid = _prompt_lookup_reference(seq[row], int(n[row]), k)
      assert np.asarray(valid[row]).tolist() == want_valid, (row, k)
      assert np.asarray(d[row]).tolist() == want_d, (row, k)


def _prompt_lookup_tree_reference(seq_S, n, depth, n_nodes):
  """prompt_lookup_tree's rule, one row, by brute force: the best n_nodes match ends in
  prompt_lookup's rank order, their continuations as a trie built match by match, its first
  n_nodes nodes."""
  ends = []
  for j in range(n - 1):
    length = 0
    while length < ngram.NGRAM_MAX and j - length >= 0 and seq_S[j - length] == seq_S[n - 1 - length]:
      length += 1
    if length:
      ends.append(((min(length, ngram.NGRAM_PREFER), int(j + depth < n), length, j), j))
  ends = [j for _, j in sorted(ends, reverse=True)[:n_nodes]]
  node_of, tokens, parents = {}, [], []
  for j in ends:
    prefix = ()
    for d in range(depth):
      if j + 1 + d >= n or (prefix and prefix not in node_of):  # no follower, or no room for the parent
        break
      parent = node_of[prefix] if prefix else -1
      prefix = (*prefix, int(seq_S[j + 1 + d]))
      if prefix not in node_of and len(tokens) < n_nodes:
        node_of[prefix] = len(tokens)
        tokens.append(prefix[-1])
        parents.append(parent)
  valid = [True] * len(tokens) + [False] * (n_nodes - len(tokens))
  return tokens + [0] * (n_nodes - len(tokens)), parents + [-1] * (n_nodes - len(parents)), valid


@pytest.mark.parametrize("vocab", [2, 5, 40])
def test_ngram_tree_matches_the_brute_force_rule_on_random_sequences(vocab):
  rng = np.random.default_rng(vocab + 1)
  seq = rng.integers(0, vocab, (6, 40)).astype(np.int32)
  n = np.array([1, 2, 9, 23, 39, 40], np.int32)
  for depth, n_nodes in ((1, 3), (3, 4), (4, 9)):
    got = ngram.prompt_lookup_tree(jnp.asarray(seq), jnp.asarray(n), depth, n_nodes)
    for row in range(seq.shape[0]):
      want = _prompt_lookup_tree_reference(seq[row], int(n[row]), depth, n_nodes)
      for name, g, w in zip(("tokens", "parents", "valid"), got, want):
        assert np.asarray(g[row]).tolist() == w, (row, depth, n_nodes, name)
  # The best match's whole continuation comes first: prompt lookup's chain, where it is complete.
  chain, valid = (np.asarray(x) for x in ngram.prompt_lookup(jnp.asarray(seq), jnp.asarray(n), 4))
  tokens, parents, _ = (np.asarray(x) for x in ngram.prompt_lookup_tree(jnp.asarray(seq), jnp.asarray(n), 4, 9))
  full = valid.all(axis=1)
  assert full.sum() >= 2
  np.testing.assert_array_equal(tokens[full, :4], chain[full])
  np.testing.assert_array_equal(parents[full, :4], np.broadcast_to([-1, 0, 1, 2], (full.sum(), 4)))


def test_controlled_table_wrong_tokens_differ_from_the_reference():
  ref = jnp.asarray([[5, 6, 7, 8, 9, 10], [1, 1, 1, 1, 1, 1]], jnp.int32)
  keys = jax.random.split(jax.random.key(0), 2)
  table = controlled.controlled_table(ref, keys, 0.0, 264)
  assert table.shape == (2, 6) and np.all(np.asarray(table) != np.asarray(ref))
  assert np.all((np.asarray(table) >= 0) & (np.asarray(table) < 264))
  np.testing.assert_array_equal(controlled.controlled_table(ref, keys, 1.0, 264), ref)
  d = controlled.controlled_propose(ref, jnp.asarray([1, 4]), 4)  # clipped at the table's end
  np.testing.assert_array_equal(d, [[6, 7, 8, 9], [1, 1, 1, 1]])


def test_controlled_draft_table_is_drawn_from_each_rows_key_before_the_program():
  """generate's table (drawn before its program): each row's proposals from that row's key's
  table stream, the reference padded with zeros (or cut) to the program's length; the same seed
  gives the same table, another seed another one."""
  ref = np.asarray([[5, 6, 7, 8], [9, 9, 9, 9]], np.int32)
  seed = np.uint32(3)
  table = np.asarray(controlled.draw_table(ref, seed, np.float32(0.5), length=7, vocab_size=264))
  keys = jax.vmap(lambda k: jax.random.fold_in(k, controlled.TABLE_STREAM))(state_lib.row_keys(seed, 2))
  padded = np.pad(ref, ((0, 0), (0, 3)))
  np.testing.assert_array_equal(table, controlled.controlled_table(jnp.asarray(padded), keys, 0.5, 264))
  np.testing.assert_array_equal(controlled.draw_table(ref, seed, np.float32(0.5), length=7, vocab_size=264), table)
  assert not np.array_equal(controlled.draw_table(ref, np.uint32(4), np.float32(0.5), length=7, vocab_size=264), table)
  np.testing.assert_array_equal(controlled.draw_table(ref, seed, np.float32(1.0), length=3, vocab_size=264), ref[:, :3])


def test_controlled_drafts_keep_the_mtp_heads_computation_alive_and_stay_the_tables():
  table_BK = jnp.asarray([[4, 5], [6, 7]])
  np.testing.assert_array_equal(controlled.keep_alive(table_BK, jnp.asarray([[0, 263], [9, 1]])), table_BK)


def test_controlled_drafter_paying_the_mtp_heads_cost_decodes_the_plain_tokens():
  """controlled_draft_cost='mtp': the heads run every pass, the proposals stay the table's, so
  greedy output is plain decoding's; a model without heads is refused."""
  from moespec_jax import cli

  model = cli.model_from_config("membound_coarse", size="tiny")
  plain = msj.generate(model, PROMPTS[:2], max_new_tokens=10)
  research = msj.ResearchOptions(controlled_acceptance=0.6, controlled_draft_cost="mtp")
  spec = msj.SpecParams(drafter="controlled", num_draft=2, research=research)
  out = msj.generate(model, PROMPTS[:2], max_new_tokens=10, spec=spec, reference_tokens=plain.tokens)
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  assert out.stats["mean_accepted_length"] >= 1.0
  no_heads = msj.Model.init(model.config.replace(num_mtp_modules=0), 0)
  with pytest.raises(ValueError, match="controlled_draft_cost='mtp' needs a model with MTP heads"):
    msj.generate(no_heads, PROMPTS[:2], max_new_tokens=10, spec=spec, reference_tokens=plain.tokens)
  with pytest.raises(ValueError, match="controlled_draft_cost must be one of"):
    msj.ResearchOptions(controlled_draft_cost="free")


@pytest.mark.parametrize("right", [True, False])
def test_auto_segment_ends_after_a_pass_that_accepts_no_draft(tiny_model, registered, monkeypatch, right):
  """A segment of auto K runs its passes at one K until a drafting pass accepts no draft in any
  row; K is then chosen again at once. With a choice pinned to K = 2 for 50 passes before any
  evidence and K = 1 after it: drafts that are all right keep the first segment at K = 2 to the
  end; drafts that are all wrong end it after one pass, and every later segment after one pass
  (the last pass, for the last token, drafts nothing: K is never more than a row can commit)."""
  prompts = PROMPTS[:1]
  plain = msj.generate(tiny_model, prompts, max_new_tokens=15).tokens
  vocab = tiny_model.config.vocab_size
  reference = plain if right else (plain + 1) % vocab

  def pinned_choice(evidence_B2, step_ms_K, **_):
    k = jnp.where(jnp.sum(evidence_B2[:, 1]) > 0, 1, 2).astype(jnp.int32)
    return k, jnp.int32(50)

  monkeypatch.setattr(auto_draft, "choose_k", pinned_choice)
  monkeypatch.setattr(
    loop,
    "calibrate_step_ms",
    lambda ls, args, run, progress: Calibration(np.array([1.0, 1.2, 1.4], np.float32), "held_runs"),
  )
  programs.PROGRAMS.forget()  # programs compiled with the real choice must not be reused
  try:
    out = msj.generate(
      tiny_model,
      prompts,
      max_new_tokens=15,
      reference_tokens=reference,
      spec=msj.SpecParams(drafter="replay", num_draft="auto", max_draft=2),
    )
  finally:
    programs.PROGRAMS.forget()
  np.testing.assert_array_equal(out.tokens, plain)
  passes = out.stats["verify_passes"]
  assert out.stats["passes_by_num_draft"] == ([0, 0, passes] if right else [1, passes - 2, 1])
