"""What a generation reports: the pass trace's one-line description, the accepted drafts among its tokens."""

import numpy as np
import pytest

import moespec_jax as msj
from moespec_jax.decoding import report


def test_describe_pass_trace():
  trace = {"ms": [0.6, 0.3, 0.2, 0.25, 0.5, 0.52], "num_draft": [1, 0, 0, 0, 3, 3], "tokens": [2, 1, 1, 1, 4, 4]}
  line = report.describe_pass_trace(trace, first=2)
  assert line == (
    "pass times (ms): the first 2: 0.60 0.30; later, median at each K (passes): K=0 0.225 (2), "
    "K=3 0.510 (2); 2.37 ms over 6 passes"
  )
  assert report.describe_pass_trace({"ms": [], "num_draft": [], "tokens": []}) == (
    "pass times: no passes (every token came from the prefill)"
  )
  assert report.describe_pass_trace(trace, first=8).endswith(
    "the first 6: 0.60 0.30 0.20 0.25 0.50 0.52; 2.37 ms over 6 passes"
  )


def test_accepted_drafts_from_a_batch_1_trace():
  """Pass commits of 3, 1 and 2 tokens after the prefill's: the 3 holds two accepted drafts, the
  1 none; the last pass is left out (it may end on a draft cut at EOS or max_new_tokens)."""
  trace = {"tokens": [3, 1, 2]}
  tokens = np.arange(7)
  np.testing.assert_array_equal(report.accepted_drafts(trace, tokens), [False, True, True, False, False])
  with pytest.raises(ValueError, match="batch-1 trace"):
    report.accepted_drafts({"tokens": [2, 0, 1]}, tokens)
  with pytest.raises(ValueError, match="the row has 3"):
    report.accepted_drafts(trace, tokens[:3])


@pytest.mark.parametrize("acceptance", [0.0, 1.0])
def test_accepted_drafts_of_a_generation(tiny_model, acceptance):
  """With every draft right (K = 2), passes commit the two drafts then the target's token; with
  every draft wrong, no token is a draft."""
  prompts = [[5, 9, 30, 41]]
  plain = msj.generate(tiny_model, prompts, max_new_tokens=13).tokens
  research = msj.ResearchOptions(controlled_acceptance=acceptance, pass_trace=True)
  spec = msj.SpecParams(drafter="controlled", num_draft=2, research=research)
  out = msj.generate(tiny_model, prompts, max_new_tokens=13, spec=spec, reference_tokens=plain)
  drafted = report.accepted_drafts(out.stats["pass_trace"], out.tokens[0])
  expected = [i % 3 != 0 for i in range(len(drafted))] if acceptance else [False] * len(drafted)
  assert len(drafted) >= 10 and drafted.tolist() == expected
