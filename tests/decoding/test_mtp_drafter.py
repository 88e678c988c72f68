"""The MTP heads as a drafter (moespec_jax/decoding/drafters/mtp.py): how a draft token and its q are
chosen, and the drafter a call builds. Its drafts through the loop run in test_spec_decoding.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moespec_jax as msj
from moespec_jax.config import ModelConfig
from moespec_jax.decoding import sampling as sampling_lib
from moespec_jax.decoding.drafters import mtp

LOGITS_BV = jnp.asarray([[0.0, 3.0, 1.0, -2.0], [2.0, 2.0, 0.0, 0.0]])


def test_greedy_drafts_the_argmax_with_no_q():
  tok_B, q_BV = mtp.choose(jax.random.split(jax.random.key(0), 2), LOGITS_BV, msj.SamplingParams())
  np.testing.assert_array_equal(tok_B, [1, 0])  # a tie goes to the lower id
  assert q_BV is None


def test_sampled_drafts_come_with_the_filtered_distribution_they_were_drawn_from():
  sampling = msj.SamplingParams(temperature=0.8, top_k=2)
  q_expected = np.exp(np.asarray(sampling_lib.filtered_logprobs(LOGITS_BV, sampling)))
  for seed in range(8):
    tok_B, q_BV = mtp.choose(jax.random.split(jax.random.key(seed), 2), LOGITS_BV, sampling)
    np.testing.assert_allclose(q_BV, q_expected, rtol=1e-6)
    assert all(q_expected[b, int(t)] > 0 for b, t in enumerate(tok_B))  # inside the top-2


def _for_call(window, prompt_len, num_mtp_modules=1):
  spec = msj.SpecParams(drafter="mtp", research=msj.ResearchOptions(mtp_prompt_window=window))
  config = ModelConfig(num_mtp_modules=num_mtp_modules)
  return mtp.MtpDrafter.for_call(spec, config=config, sampling=msj.SamplingParams(), prompt_len=prompt_len)


def test_the_prompt_window_is_kept_only_where_shorter_than_the_prompts():
  assert _for_call(16, 64).prompt_window == 16
  assert _for_call(16, 16).prompt_window == 0  # the whole prompt
  assert _for_call(None, 64).prompt_window == 0
  with pytest.raises(ValueError, match="needs MTP heads"):
    _for_call(16, 64, num_mtp_modules=0)
