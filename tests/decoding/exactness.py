"""Statistical checks of exact sampling, shared by the kernel-level and loop-level exactness tests.

Each check returns a `Check`: its p-value under the null hypothesis that the sampler is exact,
its sample size, and the smallest relative bias it detects with probability POWER at level
ALPHA at that sample size (the power calculation, done by the check itself so that a test can
assert it).

- `acceptance_test`: accepted drafts against their acceptance probabilities. One probability:
  the exact two-sided binomial test; one per trial (a loop's passes): the Poisson-binomial sum,
  normal with continuity correction (the trials form a martingale: each is Bernoulli given the
  past, so the sum's predictable variance is Sum a (1 - a)). Detectable bias: the relative excess
  delta in the rate with Sum a delta = z_(1-ALPHA/2) sqrt(Sum a(1-a)) + z_POWER sqrt(Sum a'(1-a')),
  a' = a (1 + delta).
- `chi_square_test` / `pooled_chi_square_test`: draws against one distribution, or each draw
  against its own (`probs_RC`, e.g. the target's conditional at every verified position of a
  generation). Cells whose expected count is under MIN_EXPECTED are pooled before seeing the
  data, from the least expected up, into groups of at least MIN_EXPECTED (a short remainder
  joins the last group). The statistic is the generalised Pearson form (O - E)' C+ (O - E) with
  the exact covariance C = Sum_r (diag pi_r - pi_r pi_r'), chi-square with rank(C) degrees of
  freedom; with one distribution it is Pearson's. A draw in a cell of probability 0 (for its
  own record) is impossible under the null: p-value 0. Detectable bias: the relative excess
  eps of one pooled cell (the others scaled down in proportion) whose noncentrality
  eps^2 u' C+ u reaches the noncentral chi-square's POWER at ALPHA; reported for the median cell
  and for the most detectable one.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
from scipy import optimize, stats

# Level of every check: a fixed-seed run of exact code fails it with probability ALPHA, so a
# change of random stream (another key split, another batch layout) rarely breaks a test.
ALPHA = 1e-4
# Power at which each check's detectable bias is computed.
POWER = 0.99
MIN_EXPECTED = 5.0


@dataclasses.dataclass(frozen=True)
class Check:
  """A check's outcome: p-value, sample size, degrees of freedom and detectable relative bias
  (acceptance: of the rate; chi-square: of one pooled cell, the median cell and the best). An
  acceptance check also gives the realised rate and the interval that holds it with probability
  1 - ALPHA under exactness."""

  pvalue: float
  n: int
  df: int
  detectable: float
  detectable_best: float
  rate: float | None = None
  interval: tuple[float, float] | None = None

  @property
  def rejects(self) -> bool:
    return self.pvalue < ALPHA

  def describe(self) -> str:
    best = "" if self.df <= 1 else f", best cell {self.detectable_best:.1%}"
    rate = "" if self.rate is None else f"rate {self.rate:.4f} in [{self.interval[0]:.4f}, {self.interval[1]:.4f}], "
    return f"{rate}p={self.pvalue:.3g} (n={self.n}, df={self.df}; detects {self.detectable:.1%}{best})"


def acceptance_test(accepted, rate) -> Check:
  """Accepted flags [R] against their acceptance probabilities ([R], or one for all)."""
  accepted = np.asarray(accepted, bool).ravel()
  rate = np.broadcast_to(np.asarray(rate, np.float64), accepted.shape).ravel()
  n, k = accepted.size, int(accepted.sum())
  mean, var = float(rate.sum()), float(np.sum(rate * (1.0 - rate)))
  if n == 0:
    return Check(1.0, 0, 0, math.inf, math.inf)
  if var == 0.0:  # every probability 0 or 1: any other outcome is impossible
    pvalue, low, high = (1.0 if k == round(mean) else 0.0), mean, mean
  elif np.ptp(rate) == 0.0:
    pvalue = float(stats.binomtest(k, n, float(rate[0])).pvalue)
    low, high = stats.binom.ppf(ALPHA / 2, n, rate[0]), stats.binom.isf(ALPHA / 2, n, rate[0])
  else:
    z = max(abs(k - mean) - 0.5, 0.0) / math.sqrt(var)
    pvalue = float(2.0 * stats.norm.sf(z))
    half = stats.norm.isf(ALPHA / 2) * math.sqrt(var)
    low, high = mean - half, mean + half
  delta = rate_detectable_bias(rate)
  return Check(pvalue, n, 1, delta, delta, rate=k / n, interval=(float(low) / n, float(high) / n))


def rate_detectable_bias(rate) -> float:
  """Smallest relative excess of the acceptance rate that `acceptance_test` detects with POWER."""
  rate = np.asarray(rate, np.float64).ravel()
  mean, var0 = rate.sum(), np.sum(rate * (1.0 - rate))
  if var0 == 0.0 or mean == 0.0:
    return math.inf
  za, zb = stats.norm.isf(ALPHA / 2), stats.norm.isf(1.0 - POWER)

  def shortfall(delta):
    biased = np.minimum(rate * (1.0 + delta), 1.0)
    return (biased.sum() - mean) - za * math.sqrt(var0) - zb * math.sqrt(np.sum(biased * (1.0 - biased)))

  top = 1.0 / rate[rate > 0].min() - 1.0  # every rate capped at 1 beyond it
  if top <= 0.0 or shortfall(top) < 0.0:
    return math.inf
  return float(optimize.brentq(shortfall, 0.0, top, xtol=1e-6))


def pool_cells(expected_C, min_expected: float = MIN_EXPECTED) -> np.ndarray:
  """Group index of each cell (-1: expected count 0): cells in increasing order of expected
  count are merged until a group holds at least `min_expected`; a short remainder joins the
  last group. Depends on the expected counts only, so the test's null distribution holds."""
  expected_C = np.asarray(expected_C, np.float64)
  group_C = np.full(expected_C.shape, -1, np.int64)
  n_groups, members, total = 0, [], 0.0
  for c in np.argsort(expected_C, kind="stable"):
    if expected_C[c] <= 0.0:
      continue
    members.append(c)
    total += expected_C[c]
    if total >= min_expected:
      group_C[members] = n_groups
      n_groups, members, total = n_groups + 1, [], 0.0
  if members:
    group_C[members] = max(n_groups - 1, 0)
  return group_C


def chi_square_test(counts_C, probs_C, min_expected: float = MIN_EXPECTED) -> Check:
  """Counts of draws from one distribution `probs_C` (Pearson, sparse cells pooled)."""
  counts_C = np.asarray(counts_C, np.float64).ravel()
  probs_C = np.asarray(probs_C, np.float64).ravel()
  probs_C = probs_C / probs_C.sum()
  n = counts_C.sum()
  impossible = bool(np.any(counts_C[probs_C <= 0.0] > 0))
  return _generalised_pearson(counts_C, n * probs_C, n * np.outer(probs_C, probs_C), int(n), impossible, min_expected)


def pooled_chi_square_test(cells_R, probs_RC, min_expected: float = MIN_EXPECTED) -> Check:
  """Draws `cells_R`, record r drawn from its own distribution `probs_RC[r]`; tests the cell
  counts against Sum_r probs_r with the exact covariance (module docstring)."""
  cells_R = np.asarray(cells_R, np.int64).ravel()
  probs_RC = np.asarray(probs_RC, np.float64).reshape(cells_R.size, -1)
  probs_RC = probs_RC / probs_RC.sum(axis=1, keepdims=True)
  n = cells_R.size
  impossible = bool(np.any(probs_RC[np.arange(n), cells_R] <= 0.0))
  counts_C = np.bincount(cells_R, minlength=probs_RC.shape[1]).astype(np.float64)
  return _generalised_pearson(counts_C, probs_RC.sum(axis=0), probs_RC.T @ probs_RC, n, impossible, min_expected)


def _generalised_pearson(observed_C, expected_C, moment_CC, n, impossible, min_expected) -> Check:
  group_C = pool_cells(expected_C, min_expected)
  n_groups = int(group_C.max()) + 1 if np.any(group_C >= 0) else 0
  pool_GC = np.zeros((n_groups, group_C.size))
  pool_GC[group_C[group_C >= 0], np.flatnonzero(group_C >= 0)] = 1.0
  observed_G, expected_G = pool_GC @ observed_C, pool_GC @ expected_C
  cov_GG = np.diag(expected_G) - pool_GC @ moment_CC @ pool_GC.T
  w, v = np.linalg.eigh(cov_GG)
  keep = w > 1e-9 * max(float(w.max(initial=0.0)), 1e-300)
  df = int(keep.sum())
  if df == 0:
    return Check(0.0 if impossible else 1.0, n, 0, math.inf, math.inf)
  inv_GG = (v[:, keep] / w[keep]) @ v[:, keep].T
  diff_G = observed_G - expected_G
  stat = float(diff_G @ inv_GG @ diff_G)
  pvalue = 0.0 if impossible else float(stats.chi2.sf(stat, df))
  lam = _noncentrality_for_power(df)
  eps_G = []
  for g in range(n_groups):
    others_G = expected_G.copy()
    others_G[g] = 0.0
    u_G = -expected_G[g] * others_G / others_G.sum() if others_G.sum() > 0 else np.zeros(n_groups)
    u_G[g] = expected_G[g]
    kappa = float(u_G @ inv_GG @ u_G)
    eps_G.append(math.sqrt(lam / kappa) if kappa > 0 else math.inf)
  return Check(pvalue, n, df, float(np.median(eps_G)), float(np.min(eps_G)))


@functools.cache
def _noncentrality_for_power(df: int) -> float:
  """The noncentrality at which a chi-square test with `df` degrees of freedom at ALPHA rejects
  with probability POWER."""
  critical = stats.chi2.isf(ALPHA, df)
  return float(optimize.brentq(lambda lam: stats.ncx2.sf(critical, df, lam) - POWER, 1e-6, 1e6))
