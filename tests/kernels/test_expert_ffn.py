"""The entry point `pallas_kernels.expert_ffn`: its methods and backends against the reference, what
`auto` chooses per pass size and backend, refusals."""

import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import cpu
from pallas_kernels.reference import expert_ffn_reference
from tests.kernels.problems import CASES, problem


def test_entry_point_interpret_backend():
  args = problem(*CASES["n1"])
  ref = expert_ffn_reference(*args)
  for method in ("dedup", "per_slot"):
    y = pallas_kernels.expert_ffn(*args, method=method, backend="interpret")
    np.testing.assert_allclose(y, ref, atol=1e-4)


def test_auto_and_xla_methods():
  args = problem(*CASES["top8"])
  ref = expert_ffn_reference(*args)
  for method in ("auto", "xla"):
    np.testing.assert_allclose(pallas_kernels.expert_ffn(*args, method=method), ref, atol=1e-4)
  assert pallas_kernels.choose_method(4096, 4, backend="tpu") == "xla"
  assert pallas_kernels.choose_method(4096, 4, backend="gpu") == "xla"
  assert pallas_kernels.choose_method(2, 4, backend="tpu") == "dedup"
  # CPU: the C++ kernel at every pass size, prefill included (the fastest forward measured).
  assert pallas_kernels.choose_method(4096, 4, backend="cpu") == ("dedup" if cpu.available() else "xla")
  assert pallas_kernels.choose_method(4, 4, backend="cpu") in ("dedup", "per_slot")
  with pytest.raises(ValueError, match="method"):
    pallas_kernels.expert_ffn(*args, method="nope")
  with pytest.raises(ValueError, match="backend"):
    pallas_kernels.expert_ffn(*args, method="dedup", backend="nope")
