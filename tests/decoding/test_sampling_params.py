"""SamplingParams (moespec_jax/decoding/sampling_params.py): what a value may be, and greedy."""

import pytest

from moespec_jax.decoding.sampling_params import SamplingParams


def test_temperature_zero_is_greedy():
  assert SamplingParams().greedy and SamplingParams(temperature=0).greedy
  assert not SamplingParams(temperature=0.5).greedy
  assert SamplingParams(temperature=1.0, top_k=5, top_p=0.5) == SamplingParams(temperature=1.0, top_k=5, top_p=0.5)
  assert len({SamplingParams(), SamplingParams(temperature=0.0)}) == 1  # hashable: it selects programs


@pytest.mark.parametrize(
  "kwargs, name",
  [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
  ],
)
def test_a_bad_value_is_refused_naming_the_argument(kwargs, name):
  with pytest.raises(ValueError, match=f"^{name} must"):
    SamplingParams(**kwargs)
