"""What a generation reports: the pass trace's one-line description."""

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
