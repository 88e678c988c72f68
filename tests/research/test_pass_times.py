"""analysis/pass_times: the per-pass median of repeated runs, and the fit against experts read."""

import pytest

from moespec_jax.research import pass_times


def _trace(ms, ks=(0, 3, 3), experts=(4, 12, 16)):
  return {"ms": list(ms), "num_draft": list(ks), "tokens": [1] * len(ks), "experts": list(experts)}


def test_median_trace_takes_each_pass_median_of_runs_that_line_up():
  runs = [_trace([0.3, 0.5, 0.6]), _trace([0.2, 0.9, 0.4]), _trace([0.25, 0.7, 0.5])]
  median = pass_times.median_trace(runs)
  assert median["ms"] == pytest.approx([0.25, 0.7, 0.5])
  assert median["num_draft"] == [0, 3, 3] and median["experts"] == [4, 12, 16]
  with pytest.raises(ValueError, match="trace 1 differs from trace 0 in 'experts'"):
    pass_times.median_trace([runs[0], _trace([0.2, 0.9, 0.4], experts=(4, 12, 20))])
  with pytest.raises(ValueError, match="at least one"):
    pass_times.median_trace([])


def test_expert_read_fit_recovers_the_line_and_each_pass_excess():
  """Later passes on a line in the experts read with a level per K: the slope, the levels and
  each pass's excess over the line come back exactly; a K the later passes did not run has none."""
  ks = [1, 3, 3] + [0, 3] * 6
  experts = [9, 20, 24] + [4, 12, 4, 16, 4, 20, 4, 18, 4, 14, 4, 22]
  level = {0: 0.1, 1: 0.15, 3: 0.3}
  ms = [level[k] + 0.01 * e for k, e in zip(ks, experts)]
  ms[1] += 0.4
  trace = _trace(ms, ks, experts)
  fit = pass_times.expert_read_fit(trace, skip=3)
  assert fit["slope_ms_per_expert"] == pytest.approx(0.01)
  assert fit["level_ms"] == pytest.approx({0: 0.1, 3: 0.3})
  assert fit["excess_ms"][0] is None
  assert fit["excess_ms"][1:] == pytest.approx([0.4] + [0.0] * 13, abs=1e-9)
  assert pass_times.expert_read_fit(dict(trace, experts=[8] * len(ks)), skip=3) is None  # no spread
  assert pass_times.expert_read_fit(trace, skip=9) is None  # 6 later passes for 3 coefficients
  assert pass_times.expert_read_fit(trace, skip=8) is not None
