"""analysis/timing: interleaved rounds, decode phases, medians and their intervals."""

import collections

import pytest

from moespec_jax.analysis import timing


def test_interleaved_seconds_runs_every_function_once_per_round_in_the_balanced_order():
  calls = []
  fns = {name: (lambda name=name: calls.append(name) or name) for name in ("a", "b", "c")}
  seconds, last = timing.interleaved_seconds(
    fns, 3, before=lambda: calls.append("flush"), on_round=lambda r: calls.append(f"round {r}")
  )
  assert calls == [
    "flush",
    "a",
    "flush",
    "b",
    "flush",
    "c",
    "round 0",
    "flush",
    "b",
    "flush",
    "c",
    "flush",
    "a",
    "round 1",
    "flush",
    "c",
    "flush",
    "a",
    "flush",
    "b",
    "round 2",
  ]
  assert last == {"a": "a", "b": "b", "c": "c"} and all(len(v) == 3 for v in seconds.values())


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9])
def test_round_order_balances_positions_and_predecessors_over_a_cycle(n):
  labels = [f"l{i}" for i in range(n)]
  cycle = n if n % 2 == 0 else 2 * n
  rows = [timing.round_order(labels, r) for r in range(cycle)]
  assert all(sorted(row) == sorted(labels) for row in rows)
  positions = collections.Counter((row[i], i) for row in rows for i in range(n))
  assert len(positions) == n * n and len(set(positions.values())) == 1
  pairs = collections.Counter(pair for row in rows for pair in zip(row, row[1:]))
  assert len(pairs) == n * (n - 1) and len(set(pairs.values())) <= 1
  assert timing.round_order(labels, cycle) == rows[0]
  if n == 2:
    assert rows == [labels, labels[::-1]]


def test_decode_phase_is_a_run_less_its_first_token_per_step():
  assert timing.decode_ms_per_step([0.05, 0.09], [0.01, 0.03], 5) == pytest.approx([10.0, 15.0])
  with pytest.raises(ValueError, match="max_new_tokens >= 2"):
    timing.decode_ms_per_step([1.0], [0.5], 1)


def test_median_interval_brackets_the_median_and_refuses_nothing_to_resample():
  lo, hi = timing.median_interval([1.0, 2.0, 3.0, 4.0, 5.0])
  assert lo <= 3.0 <= hi and 1.0 <= lo and hi <= 5.0
  with pytest.raises(ValueError, match="non-empty"):
    timing.median_interval([])


def test_alternating_medians_time_each_call_in_balanced_rounds():
  """One warm-up call each, then `repeats` timed calls each, in round_order's order."""
  order = []
  calls = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c")}
  medians = timing.median_times_alternating_ms(calls, repeats=3)
  assert set(medians) == {"a", "b", "c"} and all(m >= 0 for m in medians.values())
  assert order[:3] == ["a", "b", "c"]
  assert order[3:] == [name for r in range(3) for name in timing.round_order(["a", "b", "c"], r)]
  args_seen = []
  assert timing.median_time_ms(lambda x: args_seen.append(x), (7,), repeats=2) >= 0
  assert args_seen == [7, 7, 7]  # one warm-up call, then two timed ones, with the given arguments
