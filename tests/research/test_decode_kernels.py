"""decoding/kernel_ab: the decode-kernel comparison refuses what it cannot measure."""

import pytest

from moespec_jax.research import decode_kernels


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(variants=("cpp", "pallas")), "unknown variants"),
    (dict(variants=("xla",)), "must include 'cpp'"),
    (dict(max_new_tokens=1), "max_new_tokens must be >= 2"),
    (dict(rounds=0), "rounds must be >= 1"),
    (dict(batch_sizes=(1, 8)), "1 prompts for batch sizes up to 8"),
  ],
)
def test_bad_settings_are_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    decode_kernels.decode_kernels_ab(None, [[1, 2, 3]], **kwargs)


def test_table_marks_rows_without_a_figure():
  rows = [
    {"batch_size": 1, "variant": "cpp", "decode_ms_per_step": 0.5},
    {
      "batch_size": 1,
      "variant": "xla",
      "decode_ms_per_step": 0.6,
      "decode_time_over_cpp": 1.2,
      "decode_time_over_cpp_interval": (1.1, 1.3),
    },
    {"batch_size": 1, "variant": "xla_head", "decode_ms_per_step": None},
  ]
  table = decode_kernels.format_table(rows)
  assert "| 1 | xla | 0.600 | 1.200 [1.100, 1.300] |" in table and "| 1 | xla_head | - | - |" in table
