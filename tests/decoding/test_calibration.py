"""auto K's calibration: per-K pass times from held runs of the program itself (solved by least
squares) or from loops of passes."""

import numpy as np

from moespec_jax.decoding import calibration


def test_calibration_loops_span_the_generation():
  """The long timed loop covers a generation's passes (its first ones are not typical of the
  rest), within bounds: short generations still get a slope over 20 passes, long ones a bounded
  calibration time."""
  short, long = calibration.calibration_passes(128)
  assert (short, long) == (4, 127)
  assert calibration.calibration_passes(64) == (4, 63)
  assert calibration.calibration_passes(8) == (4, 24)
  assert calibration.calibration_passes(4096) == (4, 127)


def _fake_held_run(passes_KK, step_ms_K, prefill_ms, noise=0.0, seed=0):
  """A held run's (seconds, passes by K) as `calibration.measure_held_step_ms` calls it: held at
  the K whose step time is smallest, its passes `passes_KK[k]` at each K's pass time."""
  rng = np.random.default_rng(seed)

  def run(held_ms_K, prefill_only):
    if prefill_only:
      return prefill_ms * 1e-3, np.zeros(len(step_ms_K))
    passes_K = passes_KK[int(np.argmin(held_ms_K))]
    return (prefill_ms + passes_K @ step_ms_K) * 1e-3 * (1.0 + noise * rng.standard_normal()), passes_K

  return run


def test_held_calibration_solves_for_pass_times():
  """Held runs that pass at other K's too (MTP drafts before plain may be final, prompt lookup
  passes plainly without a match, the last passes shrink K) still give each K's own pass time:
  exactly without noise, within 5% at 1% of noise; the prefill is not counted."""
  step_ms_K = np.array([0.3, 0.55, 0.8, 1.0])
  passes_KK = np.array([[120, 1, 0, 0], [4, 60, 0, 0], [4, 1, 40, 0], [4, 0, 1, 30]], float)
  held = calibration.held_step_ms(3, 2)
  assert held[2] == 1.0 and np.all(np.delete(held, 2) == calibration.HELD_OTHER_MS)
  exact = calibration.measure_held_step_ms(3, _fake_held_run(passes_KK, step_ms_K, prefill_ms=12.0), repeats=3)
  np.testing.assert_allclose(exact, step_ms_K, rtol=1e-6)
  noisy = calibration.measure_held_step_ms(3, _fake_held_run(passes_KK, step_ms_K, 12.0, noise=0.01), repeats=7)
  np.testing.assert_allclose(noisy, step_ms_K, rtol=0.05)


def test_held_calibration_needs_passes_at_every_k():
  step_ms_K = np.array([0.3, 0.55, 0.8])
  few = np.array([[60, 0, 0], [20, 10, 0], [20, 0, calibration.CALIBRATION_MIN_PASSES - 1]], float)
  assert calibration.measure_held_step_ms(2, _fake_held_run(few, step_ms_K, 10.0), repeats=2) is None


def test_held_calibration_solves_each_round_with_its_own_passes():
  """Were a held run's passes to change between rounds (a nondeterministic backend changing a
  token), each round solves with the passes it made."""
  step_ms_K = np.array([0.3, 0.55, 0.8])
  calls = iter(range(10_000))

  def run(held_ms_K, prefill_only):
    if prefill_only:
      return 0.01, np.zeros(3)
    k = int(np.argmin(held_ms_K))
    passes_K = np.zeros(3)
    passes_K[0], passes_K[k] = 2 + next(calls) % 3, 20 + 10 * k + next(calls) % 5  # K = 0: 2-4 more
    return 0.01 + passes_K @ step_ms_K * 1e-3, passes_K

  np.testing.assert_allclose(calibration.measure_held_step_ms(2, run, repeats=3), step_ms_K, rtol=1e-6)

