"""The XLA oracles of the routed expert FFN (pallas_kernels/reference.py) against a loop over
(token, slot) pairs in NumPy."""

import numpy as np
import pytest

from pallas_kernels.reference import expert_ffn_dense, expert_ffn_reference
from tests.kernels.problems import CASES, problem


def _numpy_ffn(x_TD, ids_TK, gates_TK, wg_EDF, wu_EDF, wd_EFD):
  x, ids, gates = np.asarray(x_TD, np.float64), np.asarray(ids_TK), np.asarray(gates_TK, np.float64)
  wg, wu, wd = (np.asarray(w, np.float64) for w in (wg_EDF, wu_EDF, wd_EFD))
  y = np.zeros_like(x)
  for t in range(ids.shape[0]):
    for k in range(ids.shape[1]):
      e = ids[t, k]
      g, u = x[t] @ wg[e], x[t] @ wu[e]
      y[t] += gates[t, k] * ((g / (1 + np.exp(-g)) * u) @ wd[e])
  return y


@pytest.mark.parametrize("case", ["n1", "all_on_one_expert", "top8"])
def test_both_oracles_are_the_gated_sum_of_swiglu_experts(case):
  args = problem(*CASES[case])
  expected = _numpy_ffn(*args)
  np.testing.assert_allclose(expert_ffn_reference(*args), expected, atol=1e-4)
  np.testing.assert_allclose(expert_ffn_dense(*args), expected, atol=1e-4)
