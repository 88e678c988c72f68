"""Speculative decoding: greedy equality with plain decoding, EOS and max_new_tokens inside
accepted runs, rollback of the KV caches, validation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moespec_jax as msj
from moespec_jax.decoding import loop, passes, programs, rejection
from moespec_jax.decoding import state as state_lib
from moespec_jax.decoding.drafters.none import NoDrafter
from moespec_jax.model import Kernels
from moespec_jax.model import mtp as mtp_lib
from pallas_kernels.policy import KernelPolicy

RAGGED = [[5, 9, 30, 41], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
# Repetitive prompts give the n-gram drafter matches.
REPEATS = [[10, 20, 30, 40, 10, 20, 30, 40, 10, 20], [3, 3, 3], [7, 8, 7, 8, 7]]
# The XLA expert path and XLA's ops.
XLA = Kernels(KernelPolicy(expert_method="xla"))


@pytest.fixture(scope="session")
def mtp_model(tiny_config):
  return msj.Model.init(tiny_config.replace(num_mtp_modules=1), seed=0)


@pytest.fixture(scope="session")
def two_module_model(tiny_config):
  """Two MTP modules: K = 1..5 runs module 1, module 2, then module 2 recursively."""
  return msj.Model.init(tiny_config.replace(num_mtp_modules=2), seed=1)


@pytest.fixture(scope="session")
def plain_greedy(two_module_model):
  return msj.generate(two_module_model, RAGGED + REPEATS, max_new_tokens=24).tokens


def test_mtp_heads_do_not_change_the_target(tiny_model, mtp_model):
  plain = nnx.to_pure_dict(tiny_model.state)
  with_heads = nnx.to_pure_dict(mtp_model.state)
  assert set(with_heads) == set(plain) | {"mtp"}
  for key in plain:
    for a, b in zip(jax.tree.leaves(plain[key]), jax.tree.leaves(with_heads[key])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("drafter", ["mtp", "ngram"])
def test_greedy_speculative_tokens_equal_plain_greedy(two_module_model, plain_greedy, drafter, k):
  spec = msj.SpecParams(drafter=drafter, num_draft=k)
  # One call per drafter and K: a ragged batch of plain and repetitive prompts.
  out = msj.generate(two_module_model, RAGGED + REPEATS, max_new_tokens=24, spec=spec)
  np.testing.assert_array_equal(out.tokens, plain_greedy)
  assert len(out.stats["acceptance_by_depth"]) == k
  assert out.stats["mean_accepted_length"] >= 1.0
  if drafter == "ngram":  # the repetitive prompts make some drafts correct
    assert out.stats["mean_accepted_length"] > 1.0


@pytest.mark.parametrize("depth,nodes", [(1, 3), (2, 4), (3, 8)])
def test_greedy_tree_tokens_equal_plain_greedy(two_module_model, plain_greedy, depth, nodes):
  """Prompt lookup's trees (several matches' continuations) verified in one tree pass, the path
  moved into place in the cache: the tokens of plain greedy decoding, on a ragged batch."""
  spec = msj.SpecParams(drafter="ngram", num_draft=depth, tree_nodes=nodes)
  out = msj.generate(two_module_model, RAGGED + REPEATS, max_new_tokens=24, spec=spec)
  np.testing.assert_array_equal(out.tokens, plain_greedy)
  assert len(out.stats["acceptance_by_depth"]) == depth
  assert out.stats["mean_accepted_length"] > 1.0  # the repetitive prompts make some paths right


@pytest.mark.parametrize("depth,nodes", [(1, 3), (2, 5), (4, 8)])
def test_greedy_mtp_tree_tokens_equal_plain_greedy(mtp_model, depth, nodes):
  """The MTP heads' trees (their likeliest paths, each level one module call over the frontier
  with a tree mask over the heads' cache): plain greedy decoding's tokens on a ragged batch."""
  plain = msj.generate(mtp_model, RAGGED + REPEATS, max_new_tokens=20)
  spec = msj.SpecParams(drafter="mtp", num_draft=depth, tree_nodes=nodes)
  out = msj.generate(mtp_model, RAGGED + REPEATS, max_new_tokens=20, spec=spec)
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  assert len(out.stats["acceptance_by_depth"]) == depth


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(tree_policy="expert_aware", expert_penalty=1.0),
    dict(tree_truncate=True),
    dict(tree_policy="expert_aware", expert_penalty=0.3, tree_truncate=True),
  ],
)
def test_greedy_trees_chosen_by_their_experts_equal_plain_greedy(mtp_model, kwargs):
  """Trees chosen by their predicted experts, truncated or not, verify to plain greedy decoding's
  tokens on a ragged batch, and report the experts they predicted beside those read."""
  config = mtp_model.config
  plain = msj.generate(mtp_model, RAGGED + REPEATS, max_new_tokens=20)
  spec = msj.SpecParams(drafter="mtp", num_draft=3, tree_nodes=6, **kwargs)
  out = msj.generate(mtp_model, RAGGED + REPEATS, max_new_tokens=20, spec=spec)
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  predicted = out.stats["predicted_unique_experts_per_pass"]
  assert len(predicted) == config.n_moe_layers
  assert all(config.top_k <= p <= config.n_routed_experts for p in predicted)
  assert 1.0 <= out.stats["verified_nodes_per_pass"] <= 6.0


def test_expert_choice_without_a_penalty_is_the_probability_tree(mtp_model):
  """At penalty 0 the expert-aware policy chooses the same nodes (in another order): the same
  passes and acceptance. Truncation: where only tokens cost (one plain pass each), a node is worth
  its path's q < 1 and the first node alone pays best; where nothing costs, every node is kept."""
  prompts, greedy = RAGGED + REPEATS, dict(drafter="mtp", num_draft=3, tree_nodes=6)
  prob = msj.generate(mtp_model, prompts, max_new_tokens=20, spec=msj.SpecParams(**greedy))
  aware = msj.generate(
    mtp_model, prompts, max_new_tokens=20, spec=msj.SpecParams(**greedy, tree_policy="expert_aware", expert_penalty=0.0)
  )
  for key in ("verify_passes", "mean_accepted_length", "acceptance_by_depth", "unique_experts_per_pass"):
    np.testing.assert_allclose(aware.stats[key], prob.stats[key], err_msg=key)
  assert prob.stats["verified_nodes_per_pass"] == 6.0 and "predicted_unique_experts_per_pass" not in prob.stats
  for cost, nodes in (
    (msj.TreeCost(fixed=0.0, per_node=1.0, per_expert=0.0), 1.0),
    (msj.TreeCost(1.0, 0.0, 0.0), 6.0),
  ):
    spec = msj.SpecParams(**greedy, tree_truncate=True, tree_cost=cost)
    out = msj.generate(mtp_model, prompts, max_new_tokens=20, spec=spec)
    assert out.stats["verified_nodes_per_pass"] == nodes
    np.testing.assert_array_equal(out.tokens, prob.tokens)


def test_expert_choice_is_greedy_only(mtp_model):
  spec = msj.SpecParams(drafter="mtp", num_draft=2, tree_nodes=4, tree_policy="expert_aware")
  with pytest.raises(ValueError, match="temperature 0"):
    msj.generate(mtp_model, [[1, 2, 3]], sampling=msj.SamplingParams(temperature=1.0), spec=spec)


def test_an_mtp_tree_of_one_node_a_level_is_the_chain(mtp_model):
  """N = D keeps one path (W = 1): the greedy chain's drafts, so the same acceptance pass by pass."""
  chain = msj.generate(mtp_model, RAGGED, max_new_tokens=16, spec=msj.SpecParams(drafter="mtp", num_draft=3))
  tree = msj.generate(
    mtp_model, RAGGED, max_new_tokens=16, spec=msj.SpecParams(drafter="mtp", num_draft=3, tree_nodes=3)
  )
  np.testing.assert_array_equal(tree.tokens, chain.tokens)
  for key in ("verify_passes", "acceptance_by_depth", "mean_accepted_length"):
    np.testing.assert_allclose(tree.stats[key], chain.stats[key], err_msg=key)


def test_mtp_trees_need_one_module_and_levels_the_vocabulary_holds(two_module_model, tiny_config):
  with pytest.raises(ValueError, match="one MTP module at every depth"):
    msj.generate(two_module_model, [[1, 2, 3]], spec=msj.SpecParams(drafter="mtp", num_draft=2, tree_nodes=4))
  small_vocab = msj.Model.init(tiny_config.replace(vocab_size=32, eos_id=31, num_mtp_modules=1), seed=0)
  with pytest.raises(ValueError, match="keeps 64 children a level, more than the vocabulary's 32"):
    msj.generate(small_vocab, [[1, 2, 3]], spec=msj.SpecParams(drafter="mtp", num_draft=1, tree_nodes=64))


def test_trees_keep_eos_max_new_tokens_and_the_budgeted_mode(tiny_model):
  """A tree pass cuts at EOS and at max_new_tokens inside its accepted path like a chain, and the
  budgeted (APPROXIMATE) mode runs over trees, each row's tokens those of the budgeted chain."""
  prompts = [[5, 6, 5, 6, 5, 6, 5], [9, 9, 9, 9]]
  for max_new in (3, 7):
    plain = msj.generate(tiny_model, prompts, max_new_tokens=max_new)
    tree = msj.generate(
      tiny_model, prompts, max_new_tokens=max_new, spec=msj.SpecParams(drafter="ngram", num_draft=3, tree_nodes=6)
    )
    np.testing.assert_array_equal(tree.tokens, plain.tokens)
    assert (tree.tokens >= 0).sum(axis=1).tolist() == (plain.tokens >= 0).sum(axis=1).tolist()
  budget = dict(mode="budgeted", expert_budget=tiny_model.config.top_k)
  chain = msj.generate(tiny_model, prompts, max_new_tokens=8, spec=msj.SpecParams(drafter="none", **budget))
  tree = msj.generate(
    tiny_model, prompts, max_new_tokens=8, spec=msj.SpecParams(drafter="ngram", num_draft=2, tree_nodes=4, **budget)
  )
  assert tree.tokens.shape == chain.tokens.shape and (tree.tokens[:, 0] == chain.tokens[:, 0]).all()


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(drafter="none", num_draft=2, tree_nodes=4), "drafter 'none' does not branch"),
    (dict(drafter="ngram", num_draft="auto", tree_nodes=4), "chains only"),
    (dict(drafter="ngram", num_draft=4, tree_nodes=3), r"tree_nodes \(3\) must be >= num_draft \(4\)"),
    (dict(drafter="ngram", num_draft=2, tree_nodes=0), "tree_nodes must be None"),
    (dict(drafter="ngram", num_draft=2, tree_nodes=4, tree_policy="cheapest"), "tree_policy"),
    (dict(drafter="ngram", num_draft=2, tree_nodes=4, tree_policy="expert_aware"), "cannot weigh"),
    (dict(drafter="ngram", num_draft=2, tree_nodes=4, tree_truncate=True), "cannot weigh"),
    (dict(drafter="mtp", num_draft=2, tree_policy="expert_aware"), "give tree_nodes"),
    (dict(drafter="mtp", num_draft=2, tree_truncate=True), "give tree_nodes"),
    (dict(drafter="mtp", num_draft=2, tree_nodes=4, expert_penalty=-1.0), "expert_penalty"),
    (dict(drafter="mtp", num_draft=2, tree_nodes=4, tree_truncate=1), "tree_truncate must be a bool"),
    (dict(drafter="mtp", num_draft=2, tree_nodes=4, tree_cost=msj.TreeCost(1.0, 0.0, 0.1)), "set tree_truncate"),
  ],
)
def test_tree_settings_are_checked(kwargs, match):
  with pytest.raises(ValueError, match=match):
    msj.SpecParams(**kwargs)


def test_cpu_decode_kernels_decode_like_xla(two_module_model, plain_greedy):
  """On CPU the output head and the dense projections (packed) and the attention against the
  cache run on the C++ kernels by default (what plain_greedy ran); XLA's ops (head_kernel /
  attention_kernel / dense_kernel 'xla') emit the same tokens."""
  leaves = jax.tree.leaves(two_module_model.state)

  def policy(**kernels):
    return programs.kernel_policy(two_module_model, msj.SpecParams(research=msj.ResearchOptions(**kernels)))

  _, packed = programs.decode_params(two_module_model, policy(), leaves)
  assert packed.head_NDC is not None and packed.layers is not None and packed.mtp is not None
  assert programs.decode_params(two_module_model, policy(head_kernel="xla"), leaves)[1].head_NDC is None
  assert programs.decode_params(two_module_model, policy(dense_kernel="xla"), leaves)[1].layers is None
  assert policy().head == policy().dense == policy().attention == "cpu"
  assert policy(head_kernel="xla").head == policy(dense_kernel="xla").dense == policy(attention_kernel="xla").attention
  assert policy(attention_kernel="xla").attention == "xla"
  spec = msj.SpecParams(research=msj.ResearchOptions(head_kernel="xla", attention_kernel="xla", dense_kernel="xla"))
  out = msj.generate(two_module_model, RAGGED + REPEATS, max_new_tokens=24, spec=spec)
  np.testing.assert_array_equal(out.tokens, plain_greedy)
  for name in ("head_kernel", "attention_kernel", "dense_kernel"):
    with pytest.raises(ValueError, match=f"{name} must be one of"):
      msj.ResearchOptions(**{name: "pallas"})


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_cpu_decoding_pass_gives_a_token_the_bits_of_a_plain_step(tiny_config, attention, batch):
  """A decoding program on CPU (C++ kernels, row-invariant norms: its `KernelPolicy`) gives a token
  the same logits, bit for bit, in a verification pass of 5 tokens per row as in 5 plain steps:
  greedy speculative decoding then emits plain decoding's tokens even where two logits tie to the
  last bit. At width 256 and 16 experts XLA's ops do not: its router dot gave a token other last
  bits among 5 rows than alone (batch 1), its reduction in the norms among 40 rows than among 8
  (batch 8)."""
  config = tiny_config.replace(d_model=256, n_routed_experts=16, n_shared_experts=1, shared_expert_gate=True)
  if attention == "mla":
    config = config.replace(attention_type="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
  model = msj.Model.init(config, seed=3)
  policy = programs.kernel_policy(model, msj.SpecParams(kernel="dedup"))
  leaves = jax.tree.leaves(model.state)
  definition = programs.ProgramCache().definition(model.graphdef, jax.tree.structure(model.state))
  params = programs.decode_params(model, policy, leaves)
  rng = np.random.default_rng(0)
  prompt_len, steps = 12, 5
  prompt_BT = jnp.asarray(rng.integers(0, config.vocab_size, (batch, prompt_len)), jnp.int32)
  next_BT = jnp.asarray(rng.integers(0, config.vocab_size, (batch, steps)), jnp.int32)
  positions_BT = jnp.broadcast_to(jnp.arange(prompt_len, prompt_len + steps, dtype=jnp.int32), (batch, steps))

  ls = state_lib.LoopSpec(
    max_new_tokens=steps, cache_len=32, sampling=msj.SamplingParams(), kernels=policy, drafter=NoDrafter(), max_k=0
  )

  @jax.jit
  def pass_and_steps(params):
    m = programs.merge(definition, params, ls)
    cache = m(prompt_BT, None, m.new_cache(batch, 32), kernels=m.kernels, compute_logits=False, fresh_cache=True).cache
    together = m(next_BT, positions_BT, cache, kernels=m.kernels).logits
    alone = []
    for i in range(steps):
      out = m(next_BT[:, i : i + 1], positions_BT[:, i : i + 1], cache, kernels=m.kernels)
      alone.append(out.logits[:, 0])
      cache = out.cache
    return together, jnp.stack(alone, axis=1)

  together, alone = pass_and_steps(params)
  np.testing.assert_array_equal(np.asarray(together), np.asarray(alone))
  kernels = programs.merge(definition, params, ls).kernels
  assert kernels.policy == policy and policy.row_invariant_norms and policy.attention == "cpu"
  assert kernels.packed.head_NDC is not None and kernels.packed.layers is not None


def test_mla_greedy_speculative_tokens_equal_plain_greedy(tiny_config):
  """DeepSeek MLA with an MTP module: plain decoding with MLA's passes on the C++ kernel emits
  XLA's tokens, and greedy speculative decoding (MTP heads, from every prompt position and from a
  window of the last 3; prompt lookup, whose repetitive prompts get drafts accepted) emits the
  same tokens as plain."""
  config = tiny_config.replace(
    attention_type="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_mtp_modules=1
  )
  model = msj.Model.init(config, seed=2)
  plain = msj.generate(model, RAGGED + REPEATS, max_new_tokens=16).tokens
  xla = msj.generate(
    model,
    RAGGED + REPEATS,
    max_new_tokens=16,
    spec=msj.SpecParams(research=msj.ResearchOptions(attention_kernel="xla")),
  )
  np.testing.assert_array_equal(xla.tokens, plain)
  for spec in (
    msj.SpecParams(drafter="mtp", num_draft=3),
    msj.SpecParams(drafter="mtp", num_draft=2, research=msj.ResearchOptions(mtp_prompt_window=3)),
    msj.SpecParams(drafter="ngram", num_draft=2),
  ):
    out = msj.generate(model, RAGGED + REPEATS, max_new_tokens=16, spec=spec)
    np.testing.assert_array_equal(out.tokens, plain)
    if spec.drafter == "ngram":
      assert out.stats["mean_accepted_length"] > 1.0


def _constant_model(config, seed=0):
  """Target and heads with a zero final-norm weight: all logits are 0 (p = q = uniform,
  greedy token 0), so every draft is accepted."""
  model = msj.Model.init(config, seed=seed)
  pure = nnx.to_pure_dict(model.state)
  pure["final_norm"]["weight"] = jnp.zeros_like(pure["final_norm"]["weight"])
  nnx.replace_by_pure_dict(model.state, pure)
  return model


@pytest.fixture(scope="session")
def constant_model(tiny_config):
  return _constant_model(tiny_config.replace(num_mtp_modules=1))


def test_accepted_runs_take_the_bonus_stop_at_eos_and_at_max_new_tokens(constant_model):
  """p = q = uniform at temperature 1: every draft is accepted (bonus tokens after each run)
  and EOS (1 in 264 tokens) falls anywhere inside the runs: each row must end right after its
  first EOS, and the others after exactly max_new_tokens (1 + 9 runs of 4, then 3 of 4)."""
  eos = constant_model.config.eos_id
  n, k = 40, 3
  out = msj.generate(
    constant_model,
    [[5, 6]] * 48,
    max_new_tokens=n,
    sampling=msj.SamplingParams(temperature=1.0),
    spec=msj.SpecParams(drafter="mtp", num_draft=k),
    seed=3,
  )
  assert out.stats["acceptance_by_depth"] == [1.0] * k
  assert out.stats["mean_accepted_length"] == pytest.approx(k + 1)
  assert out.tokens.shape == (48, n)
  rows_with_eos = 0
  for row in out.tokens.tolist():
    if eos in row:
      rows_with_eos += 1
      first = row.index(eos)
      assert all(t == -1 for t in row[first + 1 :]) and all(t >= 0 for t in row[:first])
    else:
      assert all(t >= 0 for t in row)
  assert 3 <= rows_with_eos < 48  # about 48 * (1 - (263/264)^40) = 6.6 expected
  assert out.stats["passes"] == 1 + -(-(n - 1) // (k + 1))
  assert out.stats["generated_tokens"] == int((out.tokens >= 0).sum())


def test_commit_cuts_at_eos_and_max_new_tokens():
  cand = jnp.asarray([[4, 9, 5, 6], [4, 5, 6, 7], [4, 5, 6, 7], [9, 9, 9, 9]])
  n_acc = jnp.asarray([3, 3, 1, 3])
  active = jnp.asarray([True, True, True, False])
  gen = jnp.asarray([0, 8, 0, 0])
  n, eos = passes.commit_counts(cand, n_acc, active, gen, eos_id=9, max_new_tokens=10)
  assert n.tolist() == [2, 2, 2, 0] and eos.tolist() == [True, False, False, False]


def test_padded_lengths_waste_at_most_a_quarter():
  """Prompt and cache lengths are rounded up to share compiled programs, by less than a quarter
  (or 16 positions)."""
  # `loop._bucket` on purpose: the padding rule has no public name (generate() applies it inside).
  for n in range(1, 5000):
    b = loop._bucket(n)
    assert b >= n and b % 16 == 0 and b - n < max(16, n / 4), (n, b)
  assert loop._bucket(192) == 192 and loop._bucket(257, 64) == 320 and loop._bucket(30, 64) == 64
  assert loop._bucket(1000, 64) == 1024


def test_empty_draft_slots_read_no_experts(tiny_model):
  """Without an n-gram match (no generated token occurs earlier) every draft slot is empty: a
  K = 4 pass reads the experts of its pending token alone, as a plain pass does."""
  prompts = [list(range(10, 30)), list(range(50, 62))]
  plain = msj.generate(tiny_model, prompts, max_new_tokens=5)
  spec = msj.generate(tiny_model, prompts, max_new_tokens=5, spec=msj.SpecParams(drafter="ngram", num_draft=4))
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  for prompt, row in zip(prompts, plain.tokens.tolist()):  # the premise: no token occurs twice
    assert len(set(prompt + row)) == len(prompt + row)
  assert spec.stats["passes"] == plain.stats["passes"]
  np.testing.assert_allclose(spec.stats["unique_experts_per_pass"], plain.stats["unique_experts_per_pass"])


def test_rolled_back_caches_match_a_fresh_forward(mtp_model):
  """After a pass of K = 3 drafts of which one is accepted, the next pass's target logits
  (rolled-back cache) equal a fresh forward over the committed tokens, and the MTP fill gives
  the depth-1 draft logits that teacher forcing computes over the committed sequence."""
  config = mtp_model.config
  plen, k, cache_len, a = 5, 3, 32, 1

  @jax.jit
  def run(state, prompt, drafts, y2):
    model = nnx.merge(mtp_model.graphdef, state)
    out = model(prompt, None, model.new_cache(1, cache_len))
    y = jnp.argmax(out.logits[:, -1], axis=-1).astype(jnp.int32)
    next_tokens = jnp.concatenate([prompt[:, 1:], y[:, None]], axis=1)
    _, _, mcache = mtp_lib.fill(
      model, out.hidden, next_tokens, jnp.arange(plen)[None], mtp_lib.new_cache(config, 1, cache_len), kernels=XLA
    )
    # Verify pass: [y, d1, d2, d3] at positions plen..plen+3; d1 accepted, then y2 sampled.
    positions = plen + jnp.arange(k + 1)[None]
    vout = model(jnp.concatenate([y[:, None], drafts], axis=1), positions, out.cache)
    fill_next = jnp.concatenate([drafts[:, :a], jnp.broadcast_to(y2, (1, k + 1 - a))], axis=1)
    _, logits1, mcache = mtp_lib.fill(model, vout.hidden, fill_next, positions, mcache, kernels=XLA)
    # Next pass from the rolled-back cache (stale entries at positions >= plen + a + 1).
    nout = model(jnp.concatenate([y2, drafts[:, :2]], axis=1), plen + a + 1 + jnp.arange(3)[None], vout.cache)
    committed = jnp.concatenate([prompt, y[:, None], drafts[:, :a], y2], axis=1)
    fresh = model(committed)
    tf = mtp_lib.forward_train(model, fresh.hidden, jnp.pad(committed, ((0, 0), (0, 1))), 1)[0]
    return nout.logits[0, 0], fresh.logits[0, -1], logits1[0, a], tf[0, plen + a]

  got, want, mtp_got, mtp_want = run(
    mtp_model.state, jnp.asarray([[4, 8, 15, 16, 23]]), jnp.asarray([[77, 78, 79]]), jnp.asarray([[200]])
  )
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(mtp_got), np.asarray(mtp_want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("modules", [1, 2])
def test_fill_at_one_index_runs_the_last_module_there_only(mtp_model, two_module_model, modules, monkeypatch):
  """`fill(at_B=...)` (prompt fills and passes) runs the last module at one index per row
  and gives the module-1 state and logits there, and every cache entry, of a fill over every
  index."""
  model = mtp_model if modules == 1 else two_module_model
  run_module, output_at = mtp_lib.run_module, []

  def recording_run_module(*args, **kwargs):
    output_at.append(kwargs.get("output_at_B") is not None)
    return run_module(*args, **kwargs)

  monkeypatch.setattr(mtp_lib, "run_module", recording_run_module)
  config = model.config
  b, t, cache_len = 2, 6, 16
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.normal(size=(b, t, config.d_model)), jnp.float32)
  seq = jnp.asarray(rng.integers(0, config.vocab_size, (b, t + modules)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  valid = jnp.arange(t)[None] < jnp.asarray([[6], [4]])
  at = jnp.asarray([5, 3])

  @jax.jit
  def run(state):
    m = nnx.merge(model.graphdef, state)
    fills = [
      mtp_lib.fill(
        m, hidden, seq, positions, mtp_lib.new_cache(config, b, cache_len), kernels=XLA, valid_BT=valid, at_B=at_B
      )
      for at_B in (None, at)
    ]
    last = modules - 1
    one_index, _, _ = run_module(
      m,
      last,
      hidden,
      seq[:, last : last + t],
      positions,
      None,
      kernels=XLA,
      compute_logits=False,
      valid_BT=valid,
      output_at_B=at,
    )
    return fills, one_index

  ((h_all, logits_all, cache_all), (h1, logits1, cache_one)), one_index = run(model.state)
  rows = np.arange(b)
  np.testing.assert_allclose(h1, h_all[rows, at], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logits1, logits_all[rows, at], rtol=1e-5, atol=1e-5)
  for got, want in zip(jax.tree.leaves(cache_one), jax.tree.leaves(cache_all)):
    np.testing.assert_array_equal(got, want)
  assert one_index.shape == (b, 1, config.d_model)
  # The fill over every index runs every module everywhere; the fill at one index, the
  # last module's at that index only.
  assert output_at == [False] * modules + [False] * (modules - 1) + [True]


@pytest.mark.parametrize(
  "drafter,window,reads_every_index",
  [("none", None, False), ("ngram", None, False), ("mtp", None, True), ("mtp", 3, False)],
)
def test_prefill_computes_hidden_states_where_they_are_read(
  two_module_model, monkeypatch, drafter, window, reads_every_index
):
  """The prompt prefill asks the target for its last position's hidden state alone
  (`hidden_at_B`: the last layer's queries and FFN run there only), except for the MTP drafter,
  whose fill reads every position's, or its prompt window's (`hidden_at_B` [B, W])."""
  asked = []
  call = type(two_module_model.module()).__call__

  def recording_call(self, *args, **kwargs):
    asked.append(kwargs.get("hidden_at_B") is not None)
    return call(self, *args, **kwargs)

  monkeypatch.setattr(type(two_module_model.module()), "__call__", recording_call)
  spec = (
    msj.SpecParams()
    if drafter == "none"
    else msj.SpecParams(drafter=drafter, num_draft=2, research=msj.ResearchOptions(mtp_prompt_window=window))
  )
  # Private on purpose: the LoopSpec and program arguments of a generate() call have no public name.
  _, ls, (definition, params, tokens, lengths, seed, inputs) = loop._prepare(
    two_module_model, RAGGED, 8, None, spec, 0, None
  )
  jax.eval_shape(
    lambda p: passes.init_state(programs.merge(definition, p, ls), tokens, lengths, seed, inputs, ls).out_BN, params
  )
  assert asked == [not reads_every_index]


def test_mtp_prompt_window_keeps_greedy_tokens(two_module_model, plain_greedy):
  """A window shorter than the longest prompt (two modules: module 2 reads the window's next
  tokens one further) changes drafts only: the tokens are plain greedy's."""
  spec = msj.SpecParams(drafter="mtp", num_draft=3, research=msj.ResearchOptions(mtp_prompt_window=3))
  # Private on purpose: the LoopSpec and program arguments of a generate() call have no public name.
  assert loop._prepare(two_module_model, RAGGED + REPEATS, 24, None, spec, 0, None)[1].drafter.prompt_window == 3
  out = msj.generate(two_module_model, RAGGED + REPEATS, max_new_tokens=24, spec=spec)
  np.testing.assert_array_equal(out.tokens, plain_greedy)


def test_mtp_prompt_window_drafts_from_the_window_stream(mtp_model):
  """With a prompt window W, the heads' stream of a row starts at prompt position max(L - W, 0),
  at stream position 0: after the prefill and after a pass of K = 2, the depth-1 draft logits
  equal the module run afresh (no cache) over the target's hidden states from there on, at
  stream positions 0, 1, ... (the target's hidden states from a fresh forward over the whole
  committed sequence)."""
  window, k = 5, 2
  prompts = [[4, 8, 15, 16, 23, 42, 7, 9, 11, 13, 17, 19], [3, 1, 4]]
  spec = msj.SpecParams(drafter="mtp", num_draft=k, research=msj.ResearchOptions(mtp_prompt_window=window))
  # Private on purpose: the LoopSpec and program arguments of a generate() call have no public name.
  _, ls, (definition, params, tokens, lengths, seed, inputs) = loop._prepare(mtp_model, prompts, 8, None, spec, 0, None)
  assert ls.drafter.prompt_window == window

  @jax.jit
  def prefill_and_pass(params):
    model = programs.merge(definition, params, ls)
    state = passes.init_state(model, tokens, lengths, seed, inputs, ls)
    return state, passes.speculative_pass(model, state, k, ls)

  @jax.jit
  def drafts(params, state):
    model = programs.merge(definition, params, ls)
    return passes.draft(model, state, k, state.row_keys_B, ls)[1].tokens_BN

  @functools.partial(jax.jit, static_argnums=2)
  def fresh_stream(state, committed, offset):
    """Depth-1 logits at the stream's last index, and the greedy depth-1 and depth-2 drafts
    (depth 2: the module once more, on its own output and the depth-1 draft)."""
    m = nnx.merge(mtp_model.graphdef, state)
    hidden = m(committed[None]).hidden[:, offset:-1]
    positions = jnp.arange(hidden.shape[1] + 1)[None]
    h, logits, _ = mtp_lib.run_module(m, 0, hidden, committed[None, offset + 1 :], positions[:, :-1], None, kernels=XLA)
    draft1 = jnp.argmax(logits[0, -1]).astype(jnp.int32)
    _, logits2, _ = mtp_lib.run_module(
      m,
      0,
      jnp.concatenate([hidden, h[:, -1:]], axis=1),
      jnp.concatenate([committed[offset + 1 :], draft1[None]])[None],
      positions,
      None,
      kernels=XLA,
    )
    return logits[0, -1], jnp.stack([draft1, jnp.argmax(logits2[0, -1]).astype(jnp.int32)])

  states = prefill_and_pass(params)
  np.testing.assert_array_equal(states[0].draft_state.offset_B, [len(prompts[0]) - window, 0])
  for state in states:
    got_drafts = drafts(params, state)
    for row, prompt in enumerate(prompts):
      gen = int(state.generated_B[row])
      committed = jnp.asarray(prompt + list(np.asarray(state.out_BN[row, :gen])), jnp.int32)
      assert int(state.pos_B[row]) == len(committed) - 1  # the pending token's position
      logits1, want_drafts = fresh_stream(mtp_model.state, committed, max(len(prompt) - window, 0))
      np.testing.assert_allclose(state.draft_state.logits1_BV[row], logits1, rtol=1e-4, atol=1e-4)
      np.testing.assert_array_equal(got_drafts[row], want_drafts)


def test_recursive_depths_reuse_the_last_module():
  assert [mtp_lib.module_for_depth(d, 1) for d in (1, 2, 3)] == [(0, 0), (0, 1), (0, 2)]
  assert [mtp_lib.module_for_depth(d, 2) for d in (1, 2, 3, 4)] == [(0, 0), (1, 0), (1, 1), (1, 2)]


def test_uniforms_are_strictly_inside_the_unit_interval():
  u = np.asarray(rejection.uniform_open(jax.random.key(0), (200000,)))
  assert u.min() > 0.0 and u.max() < 1.0


def test_mtp_prompt_window_must_be_a_positive_int():
  for bad in (0, -1, 2.5, True):
    with pytest.raises(ValueError, match="mtp_prompt_window"):
      msj.ResearchOptions(mtp_prompt_window=bad)


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(spec=msj.SpecParams(drafter="mtp", num_draft=2)), "drafter 'mtp'"),
    (dict(max_new_tokens=58, spec=msj.SpecParams(drafter="ngram", num_draft=4)), "num_draft"),
  ],
)
def test_spec_validation_errors(tiny_model, kwargs, match):
  with pytest.raises(ValueError, match=match):
    msj.generate(tiny_model, [[1, 2, 3]], **kwargs)


def test_programs_take_the_state_flat_and_the_seed_as_jax_random_key_does(tiny_model):
  """generate() hands its program the state's leaves (one flatten per call) and host arrays; the
  program makes the PRNG key from the seed's low 32 bits, which is what jax.random.key does."""
  # Private on purpose: the LoopSpec and program arguments of a generate() call have no public name.
  _, _, args = loop._prepare(tiny_model, [[1, 2, 3]], 4, None, msj.SpecParams(), 2**32 + 7, None)
  definition, (leaves, _), tokens, lengths, seed, _ = args
  assert isinstance(leaves, list) and all(isinstance(x, jax.Array) for x in leaves)
  assert jax.tree.structure(tiny_model.state) == definition.state_treedef
  assert all(isinstance(x, np.ndarray) for x in (tokens, lengths, seed)) and int(seed) == 7
  for s in (0, 7, -3, 2**31, 2**32 + 7):
    np.testing.assert_array_equal(
      jax.random.key_data(jax.random.key(np.uint32(s & 0xFFFFFFFF))), jax.random.key_data(jax.random.key(s))
    )
  sampling = msj.SamplingParams(temperature=1.0)
  a = msj.generate(tiny_model, [[1, 2, 3]], max_new_tokens=6, sampling=sampling, seed=7).tokens
  b = msj.generate(tiny_model, [[1, 2, 3]], max_new_tokens=6, sampling=sampling, seed=2**32 + 7).tokens
  np.testing.assert_array_equal(a, b)


def test_pass_trace_times_every_pass_and_keeps_the_tokens(two_module_model, plain_greedy):
  """One record per pass: its K, the tokens it committed over the rows (with the prefill's first
  tokens, every generated token), the distinct experts it read (over the passes, the statistics'
  per-pass mean) and a positive time; together less than the whole call."""
  spec = msj.SpecParams(drafter="ngram", num_draft=3, research=msj.ResearchOptions(pass_trace=True))
  out = msj.generate(two_module_model, RAGGED + REPEATS, max_new_tokens=24, spec=spec)
  np.testing.assert_array_equal(out.tokens, plain_greedy)
  trace, stats = out.stats["pass_trace"], out.stats
  assert (
    len(trace["ms"])
    == len(trace["num_draft"])
    == len(trace["tokens"])
    == len(trace["experts"])
    == (stats["verify_passes"])
  )
  assert set(trace["num_draft"]) == {3}
  assert sum(trace["tokens"]) == stats["generated_tokens"] - len(RAGGED + REPEATS)
  config = two_module_model.config
  most = min(config.n_routed_experts, len(RAGGED + REPEATS) * 4 * config.top_k) * config.n_moe_layers
  assert all(config.top_k * config.n_moe_layers <= e <= most for e in trace["experts"])
  assert sum(trace["experts"]) == pytest.approx(sum(stats["unique_experts_per_pass"]) * stats["verify_passes"])
  assert min(trace["ms"]) > 0 and sum(trace["ms"]) < stats["seconds"] * 1e3
  assert "pass_trace" not in msj.generate(two_module_model, RAGGED, max_new_tokens=4).stats


def test_pass_trace_needs_the_clock_of_the_cpu_library(tiny_model, monkeypatch):
  with pytest.raises(ValueError, match="pass_trace must be a bool"):
    msj.ResearchOptions(pass_trace=1)
  monkeypatch.setattr(loop.cpu_ffi, "available", lambda: False)
  assert not loop.clock_available()  # what the demo asks before it traces passes
  with pytest.raises(ValueError, match="pass_trace reads a clock inside the compiled program"):
    msj.generate(
      tiny_model, [[1, 2, 3]], max_new_tokens=4, spec=msj.SpecParams(research=msj.ResearchOptions(pass_trace=True))
    )


def test_dense_mtp_heads_keep_greedy_tokens(tiny_config):
  # Heads with a dense FFN (`mtp_dense_hidden`): the same exactness, through the packed products.
  model = msj.Model.init(tiny_config.replace(num_mtp_modules=1, mtp_dense_hidden=24), seed=4)
  plain = msj.generate(model, RAGGED, max_new_tokens=16).tokens
  spec = msj.generate(model, RAGGED, max_new_tokens=16, spec=msj.SpecParams(drafter="mtp", num_draft=3))
  np.testing.assert_array_equal(spec.tokens, plain)
