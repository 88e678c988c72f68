"""Sampling filters at their edges, and sampling frequencies against the filtered distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moespec_jax.decoding import sampling as sampling_lib
from moespec_jax.decoding.params import SamplingParams, SpecParams
from moespec_jax.decoding.sampling import filtered_logprobs, sample

LOGITS = jnp.asarray([[2.0, 1.0, 1.0, 0.5, -1.0, 3.0]], jnp.float32)


def _support(params):
  return np.isfinite(np.asarray(filtered_logprobs(LOGITS, params)))[0]


def test_no_filter_is_plain_softmax():
  got = np.exp(np.asarray(filtered_logprobs(LOGITS, SamplingParams(temperature=1.0))))
  np.testing.assert_allclose(got, np.asarray(jax.nn.softmax(LOGITS)), rtol=1e-6)


def test_temperature_scales_logits():
  got = np.exp(np.asarray(filtered_logprobs(LOGITS, SamplingParams(temperature=0.5))))
  np.testing.assert_allclose(got, np.asarray(jax.nn.softmax(LOGITS / 0.5)), rtol=1e-5)


def test_top_k_at_or_above_vocab_keeps_everything():
  for k in (6, 7, 1000):
    assert _support(SamplingParams(temperature=1.0, top_k=k)).all()


def test_top_k_keeps_ties_at_the_threshold():
  # Sorted: 3.0, 2.0, 1.0, 1.0, ...: top-3 keeps both 1.0s.
  assert _support(SamplingParams(temperature=1.0, top_k=3)).tolist() == [True, True, True, False, False, True]
  assert _support(SamplingParams(temperature=1.0, top_k=1)).tolist() == [False] * 5 + [True]


def test_top_p_one_keeps_everything_and_small_p_keeps_the_argmax():
  assert _support(SamplingParams(temperature=1.0, top_p=1.0)).all()
  assert _support(SamplingParams(temperature=1.0, top_p=1e-6)).tolist() == [False] * 5 + [True]


def test_top_p_keeps_the_smallest_prefix_reaching_p_and_renormalises():
  probs = np.asarray(jax.nn.softmax(LOGITS))[0]
  order = np.argsort(-probs)
  p = probs[order[0]] + probs[order[1]] + 1e-3  # needs a third token
  params = SamplingParams(temperature=1.0, top_p=float(p))
  support = _support(params)
  # The third token is tied (two 1.0 logits): both stay in.
  assert support.sum() == 4 and support[order[:2]].all()
  kept = np.exp(np.asarray(filtered_logprobs(LOGITS, params)))[0]
  np.testing.assert_allclose(kept.sum(), 1.0, rtol=1e-6)


def test_greedy_takes_the_argmax_lowest_id_on_ties():
  logits = jnp.asarray([[1.0, 5.0, 5.0, 0.0]])
  keys = jax.random.split(jax.random.key(0), 1)
  assert int(sample(keys, logits, SamplingParams())[0]) == 1


def test_argmax_equals_jnp_argmax_with_ties_infinities_and_nans():
  rng = np.random.default_rng(0)
  x = rng.integers(-3, 4, size=(6, 5, 7)).astype(np.float32)  # many ties
  x[0, 0, 2] = np.inf
  x[1, 1] = -np.inf
  x[2, 2, [3, 5]] = np.nan
  x[3, 3, :] = np.nan
  for axis in (0, 1, -1):
    np.testing.assert_array_equal(
      np.asarray(sampling_lib.argmax(jnp.asarray(x), axis=axis)), np.asarray(jnp.argmax(jnp.asarray(x), axis=axis))
    )


def test_categorical_draws_what_jax_random_categorical_draws():
  logits = jnp.asarray(np.random.default_rng(1).normal(size=(64, 50)), jnp.float32).at[:, :10].set(-jnp.inf)
  keys = jax.random.split(jax.random.key(2), 64)
  got = jax.vmap(sampling_lib.categorical)(keys, logits)
  want = jax.vmap(jax.random.categorical)(keys, logits)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert got.dtype == jnp.int32 and int(got.min()) >= 10


def test_sample_frequencies_match_filtered_distribution():
  params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
  want = np.exp(np.asarray(filtered_logprobs(LOGITS, params)))[0]
  n = 20000
  keys = jax.random.split(jax.random.key(1), n)
  draws = np.asarray(jax.jit(lambda k: sample(k, jnp.repeat(LOGITS, n, 0), params))(keys))
  freq = np.bincount(draws, minlength=6) / n
  assert freq[want == 0].sum() == 0
  tolerance = 4 * np.sqrt(want * (1 - want) / n) + 1e-9  # four standard errors per token
  assert np.all(np.abs(freq - want) <= tolerance), (freq, want)


@pytest.mark.parametrize(
  "kwargs,name",
  [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
  ],
)
def test_bad_sampling_params_name_the_argument(kwargs, name):
  with pytest.raises(ValueError, match=name):
    SamplingParams(**kwargs)


@pytest.mark.parametrize(
  "kwargs,name",
  [
    (dict(drafter="bogus"), "drafter"),
    (dict(mode="fast"), "mode"),
    (dict(kernel="cuda"), "kernel"),
    (dict(num_draft=-1), "num_draft"),
  ],
)
def test_bad_spec_params_name_the_argument(kwargs, name):
  with pytest.raises(ValueError, match=name):
    SpecParams(**kwargs)


def test_all_drafters_are_accepted_and_a_budget_needs_budgeted_mode():
  for drafter in ("none", "mtp", "ngram"):
    assert SpecParams(drafter=drafter).drafter == drafter
  with pytest.raises(ValueError, match="expert_budget"):
    SpecParams(mode="budgeted")
  assert SpecParams(mode="budgeted", expert_budget=8).expert_budget == 8
