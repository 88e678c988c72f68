"""Speculative decoding: greedy equality with plain decoding, EOS and max_new_tokens inside
accepted runs, rollback of the KV caches, validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moespec_jax as msj
from moespec_jax.decoding import drafters, loop, rejection
from moespec_jax.model import mtp as mtp_lib

RAGGED = [[5, 9, 30, 41], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
# Repetitive prompts give the n-gram drafter matches.
REPEATS = [[10, 20, 30, 40, 10, 20, 30, 40, 10, 20], [3, 3, 3], [7, 8, 7, 8, 7]]


@pytest.fixture(scope="session")
def mtp_model(tiny_config):
  return msj.Model.init(tiny_config.replace(num_mtp_modules=1), seed=0)


@pytest.fixture(scope="session")
def plain_greedy(mtp_model):
  return {name: msj.generate(mtp_model, prompts, max_new_tokens=24).tokens
          for name, prompts in (("ragged", RAGGED), ("repeats", REPEATS))}


def test_mtp_heads_do_not_change_the_target(tiny_model, mtp_model):
  plain = nnx.to_pure_dict(tiny_model.state)
  with_heads = nnx.to_pure_dict(mtp_model.state)
  assert set(with_heads) == set(plain) | {"mtp"}
  for key in plain:
    for a, b in zip(jax.tree.leaves(plain[key]), jax.tree.leaves(with_heads[key])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("drafter", ["mtp", "ngram"])
def test_greedy_speculative_tokens_equal_plain_greedy(mtp_model, plain_greedy, drafter, k):
  spec = msj.SpecParams(drafter=drafter, num_draft=k)
  # One call per drafter and K: both prompt sets in one ragged batch.
  out = msj.generate(mtp_model, RAGGED + REPEATS, max_new_tokens=24, spec=spec)
  want = np.concatenate([plain_greedy["ragged"], plain_greedy["repeats"]])
  np.testing.assert_array_equal(out.tokens, want)
  assert len(out.stats["acceptance_by_depth"]) == k
  assert out.stats["mean_accepted_length"] >= 1.0
  if drafter == "ngram":  # the repetitive prompts make some drafts correct
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


def test_fully_accepted_runs_take_the_bonus_and_stop_exactly(constant_model):
  k, n = 3, 10
  out = msj.generate(constant_model, [[1, 2], [3]], max_new_tokens=n,
                     spec=msj.SpecParams(drafter="mtp", num_draft=k))
  assert (out.tokens == 0).all() and out.tokens.shape == (2, n)
  assert out.stats["mean_accepted_length"] == pytest.approx(k + 1)
  assert out.stats["acceptance_by_depth"] == [1.0] * k
  assert out.stats["passes"] == 1 + -(-(n - 1) // (k + 1))


def test_eos_inside_accepted_runs_stops_the_row_there(constant_model):
  """p = q = uniform at temperature 1: all drafts are accepted and EOS (1 in 264 tokens) falls
  anywhere inside the runs; each row must end right after its first EOS."""
  eos = constant_model.config.eos_id
  n, k = 40, 3
  out = msj.generate(constant_model, [[5, 6]] * 48, max_new_tokens=n,
                     sampling=msj.SamplingParams(temperature=1.0),
                     spec=msj.SpecParams(drafter="mtp", num_draft=k), seed=3)
  assert out.stats["acceptance_by_depth"] == [1.0] * k
  rows_with_eos = 0
  for row in out.tokens.tolist():
    if eos in row:
      rows_with_eos += 1
      first = row.index(eos)
      assert all(t == -1 for t in row[first + 1:]) and all(t >= 0 for t in row[:first])
    else:
      assert all(t >= 0 for t in row)
  assert rows_with_eos >= 3  # about 48 * (1 - (263/264)^40) = 6.6 expected
  assert out.stats["generated_tokens"] == int((out.tokens >= 0).sum())


def test_commit_cuts_at_eos_and_max_new_tokens():
  cand = jnp.asarray([[4, 9, 5, 6], [4, 5, 6, 7], [4, 5, 6, 7], [9, 9, 9, 9]])
  n_acc = jnp.asarray([3, 3, 1, 3])
  active = jnp.asarray([True, True, True, False])
  gen = jnp.asarray([0, 8, 0, 0])
  n, eos = loop._commit(cand, n_acc, active, gen, eos_id=9, max_new_tokens=10)
  assert n.tolist() == [2, 2, 2, 0] and eos.tolist() == [True, False, False, False]


def test_ngram_proposes_what_followed_the_longest_earlier_match():
  seq = jnp.asarray([[1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3, 0, 0, 0],
                     [5, 6, 7, 8, 5, 6, 0, 0, 0, 0, 0, 0, 0, 0],
                     [1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
  n = jnp.asarray([11, 6, 4])
  d, valid = drafters.ngram_propose(seq, n, 3)
  # Row 0: suffix [1, 2, 3] occurred at 0..2 (longest), followed by 9, 2, 3.
  assert d[0].tolist() == [9, 2, 3] and valid[0].all()
  # Row 1: suffix [5, 6] occurred at 0..1, followed by 7, 8, then the suffix itself (5).
  assert d[1].tolist() == [7, 8, 5] and valid[1].all()
  # Row 2: no earlier occurrence of 4: nothing proposed.
  assert not valid[2].any()


def test_rolled_back_caches_match_a_fresh_forward(mtp_model):
  """After a pass of K = 3 drafts of which one is accepted, the next pass's target logits
  (rolled-back cache) equal a fresh forward over the committed tokens, and the MTP fill gives
  the depth-1 draft logits that teacher forcing computes over the committed sequence."""
  model = mtp_model.module()
  config = mtp_model.config
  prompt = jnp.asarray([[4, 8, 15, 16, 23]], jnp.int32)
  plen, k, cache_len = prompt.shape[1], 3, 32
  out = model(prompt, None, model.new_cache(1, cache_len))
  y = int(jnp.argmax(out.logits[0, -1]))
  mcache = mtp_lib.new_cache(config, 1, cache_len)
  next_tokens = jnp.asarray([[8, 15, 16, 23, y]], jnp.int32)
  _, _, mcache = mtp_lib.fill(model, out.hidden, next_tokens, jnp.arange(plen)[None], mcache,
                              expert_method="xla")
  # Verify pass: [y, d1, d2, d3] at positions plen..plen+3; accept d1, reject d2 (y2 sampled).
  drafts = [77, 78, 79]
  inputs = jnp.asarray([[y] + drafts], jnp.int32)
  positions = plen + jnp.arange(k + 1)[None]
  vout = model(inputs, positions, out.cache)
  a, y2 = 1, 200
  fill_next = jnp.asarray([[77, y2, y2, y2]], jnp.int32)
  _, logits1, mcache = mtp_lib.fill(model, vout.hidden, fill_next, positions, mcache,
                                    expert_method="xla")
  committed = [4, 8, 15, 16, 23, y, 77, y2]
  # Next pass from the rolled-back target cache, with stale entries at positions >= plen + 2.
  nout = model(jnp.asarray([[y2, 1, 2]]), plen + a + 1 + jnp.arange(3)[None], vout.cache)
  fresh = model(jnp.asarray([committed]))
  np.testing.assert_allclose(np.asarray(nout.logits[0, 0]), np.asarray(fresh.logits[0, -1]),
                             rtol=1e-5, atol=1e-5)
  # The MTP depth-1 logits at slot a: module 1 at index plen + a, predicting the token after y2.
  tf = mtp_lib.forward_train(model, fresh.hidden, jnp.asarray([committed + [0]]), 1)[0]
  np.testing.assert_allclose(np.asarray(logits1[0, a]), np.asarray(tf[0, len(committed) - 2]),
                             rtol=1e-5, atol=1e-5)


def test_recursive_depths_reuse_the_last_module():
  assert [mtp_lib.module_for_depth(d, 1) for d in (1, 2, 3)] == [(0, 0), (0, 1), (0, 2)]
  assert [mtp_lib.module_for_depth(d, 2) for d in (1, 2, 3, 4)] == [(0, 0), (1, 0), (1, 1), (1, 2)]


def test_two_modules_and_k_beyond_them_stay_exact_in_greedy(tiny_config):
  model = msj.Model.init(tiny_config.replace(num_mtp_modules=2), seed=1)
  plain = msj.generate(model, RAGGED, max_new_tokens=12)
  out = msj.generate(model, RAGGED, max_new_tokens=12, spec=msj.SpecParams(drafter="mtp", num_draft=4))
  np.testing.assert_array_equal(out.tokens, plain.tokens)


def test_uniforms_are_strictly_inside_the_unit_interval():
  u = np.asarray(rejection.uniform_open(jax.random.key(0), (200000,)))
  assert u.min() > 0.0 and u.max() < 1.0


@pytest.mark.parametrize("kwargs,match", [
    (dict(spec=msj.SpecParams(drafter="mtp", num_draft=2)), "drafter 'mtp'"),
    (dict(max_new_tokens=58, spec=msj.SpecParams(drafter="ngram", num_draft=4)), "num_draft"),
])
def test_spec_validation_errors(tiny_model, kwargs, match):
  with pytest.raises(ValueError, match=match):
    msj.generate(tiny_model, [[1, 2, 3]], **kwargs)
