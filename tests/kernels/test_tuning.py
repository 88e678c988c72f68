"""What `auto` picks per backend (pallas_kernels/tuning.py): the measured dedup crossovers."""

import pytest

from pallas_kernels import choose_method, tuning


@pytest.mark.parametrize("backend, tokens", [("cpu", 1), ("tpu", 2), ("gpu", 2), ("interpret", 2), ("other", 2)])
def test_dedup_starts_at_the_measured_pass_size(backend, tokens):
  assert tuning.dedup_min_tokens(backend) == tokens


def test_auto_follows_the_table_below_the_grouped_path():
  assert choose_method(1, 2, backend="interpret") == "per_slot"
  assert choose_method(tuning.dedup_min_tokens("interpret"), 2, backend="interpret") == "dedup"
