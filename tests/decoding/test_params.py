"""The generation parameters: the user's SpecParams and the research options apart from them;
bad values raise a ValueError naming the argument."""

import pytest

import moespec_jax as msj
from moespec_jax.decoding import params


def test_research_options_are_a_group_of_their_own():
  assert msj.ResearchOptions is params.ResearchOptions
  spec = msj.SpecParams()
  assert spec.research == msj.ResearchOptions()
  assert spec.research.mtp_prompt_window == 16 and spec.research.controlled_acceptance is None
  assert not (spec.research.auto_timing or spec.research.pass_trace or spec.research.measure_quality)
  assert (spec.research.head_kernel, spec.research.attention_kernel, spec.research.dense_kernel) == ("auto",) * 3
  for name in (
    "controlled_acceptance",
    "auto_timing",
    "pass_trace",
    "measure_quality",
    "mtp_prompt_window",
    "head_kernel",
    "attention_kernel",
    "dense_kernel",
  ):
    with pytest.raises(TypeError, match=name):
      msj.SpecParams(**{name: None})  # not a SpecParams field: research=ResearchOptions(...) holds it
  hash(msj.SpecParams(research=msj.ResearchOptions(pass_trace=True)))  # frozen: selects compiled programs


@pytest.mark.parametrize(
  "kwargs,name",
  [
    (dict(controlled_acceptance=1.5), "controlled_acceptance"),
    (dict(controlled_acceptance=-0.1), "controlled_acceptance"),
    (dict(controlled_acceptance="high"), "controlled_acceptance"),
    (dict(auto_timing=1), "auto_timing"),
    (dict(pass_trace="yes"), "pass_trace"),
    (dict(measure_quality=None), "measure_quality"),
    (dict(mtp_prompt_window=0), "mtp_prompt_window"),
    (dict(mtp_prompt_window=True), "mtp_prompt_window"),
    (dict(head_kernel="pallas"), "head_kernel"),
    (dict(attention_kernel="cuda"), "attention_kernel"),
    (dict(dense_kernel=""), "dense_kernel"),
  ],
)
def test_bad_research_options_name_the_argument(kwargs, name):
  with pytest.raises(ValueError, match=name):
    msj.ResearchOptions(**kwargs)


def test_spec_params_check_their_research_group():
  with pytest.raises(ValueError, match="research must be a ResearchOptions"):
    msj.SpecParams(research={"pass_trace": True})
  with pytest.raises(ValueError, match="measure_quality applies to mode='budgeted' only"):
    msj.SpecParams(research=msj.ResearchOptions(measure_quality=True))
  assert msj.SpecParams(
    mode="budgeted", expert_budget=4, research=msj.ResearchOptions(measure_quality=True)
  ).research.measure_quality
  # The research drafter stays a drafter name, and needs its research option.
  with pytest.raises(ValueError, match=r"drafter='controlled' needs research=ResearchOptions\(controlled_acceptance"):
    msj.SpecParams(drafter="controlled", num_draft=2)
  spec = msj.SpecParams(drafter="controlled", num_draft=2, research=msj.ResearchOptions(controlled_acceptance=0.7))
  assert spec.research.controlled_acceptance == 0.7
