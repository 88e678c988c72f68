"""Maximum-entropy joint routing of one expert over n consecutive tokens, fitted by IPF.

For each expert e, its activation over n consecutive tokens is a binary vector a in {0,1}^n.
Among the distributions on the 2^n states whose one-token marginals P(a_t = 1) equal the
measured popularity p_e and whose pairwise co-activations P(a_t = 1, a_{t+d} = 1) equal those
measured at each distance d, iterative proportional fitting from the uniform table converges
to the one of maximum entropy. The expected number of distinct experts that n tokens load is
then sum_e (1 - P_e(a = 0)). With only the one-token marginals it reduces to the independence
model sum_e [1 - (1 - p_e)^n].
"""

from __future__ import annotations

import functools

import numpy as np

MAX_TOKENS = 12


@functools.cache
def _states(n: int) -> np.ndarray:
  """bool [2^n, n]: every activation pattern of n tokens."""
  return ((np.arange(2**n)[:, None] >> np.arange(n)[None, :]) & 1).astype(bool)


def _constraints(p_X: np.ndarray, co_XD: np.ndarray, n: int):
  """(one-hot cell map [2^n, C], targets [X, C]) for every single and pair constraint."""
  states = _states(n)
  out = []
  for t in range(n):
    cell = states[:, t].astype(int)
    out.append((np.eye(2)[cell], np.stack([1 - p_X, p_X], -1)))
  for d in range(1, n):
    # Feasible pair targets: max(0, 2p - 1) <= c <= p.
    c_X = np.clip(co_XD[:, d - 1], np.maximum(0.0, 2 * p_X - 1), p_X)
    cells_X4 = np.stack([1 - 2 * p_X + c_X, p_X - c_X, p_X - c_X, c_X], -1)  # 00 01 10 11
    for t in range(n - d):
      cell = states[:, t].astype(int) * 2 + states[:, t + d].astype(int)
      out.append((np.eye(4)[cell], cells_X4))
  return out


def fit_joint(p_X: np.ndarray, co_XD: np.ndarray, n: int, *, iterations: int = 500, tol: float = 1e-9) -> np.ndarray:
  """Max-entropy probabilities [X, 2^n], one table per (expert) row: marginal p_X[x] and
  pair co-activations co_XD[x, d-1] at distance d, for n consecutive tokens."""
  if not 1 <= n <= MAX_TOKENS:
    raise ValueError(f"n must be in [1, {MAX_TOKENS}], got {n}")
  p_X = np.clip(np.asarray(p_X, np.float64), 0.0, 1.0)
  co_XD = np.asarray(co_XD, np.float64).reshape(len(p_X), -1)
  if co_XD.shape[1] < n - 1:
    raise ValueError(f"need co-activations for distances 1..{n - 1}, got {co_XD.shape[1]}")
  constraints = _constraints(p_X, co_XD, n)
  prob_XS = np.full((len(p_X), 2**n), 1.0 / 2**n)
  for _ in range(iterations):
    worst = 0.0
    for onehot_SC, target_XC in constraints:
      current_XC = prob_XS @ onehot_SC
      worst = max(worst, float(np.max(np.abs(current_XC - target_XC))))
      ratio_XC = np.divide(target_XC, current_XC, out=np.zeros_like(target_XC), where=current_XC > 0)
      prob_XS = prob_XS * (ratio_XC @ onehot_SC.T)
    if worst < tol:
      break
  return prob_XS / prob_XS.sum(-1, keepdims=True)


def expected_unique(p_E: np.ndarray, co_ED: np.ndarray, n: int) -> float:
  """E[distinct experts among n consecutive tokens] of one layer under the IPF model."""
  if n == 1:
    return float(np.sum(p_E))
  return float(np.sum(1.0 - fit_joint(p_E, co_ED, n)[:, 0]))
