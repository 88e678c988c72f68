"""auto K's calibration: per-K pass times from held runs of the program itself (solved by least
squares) or from loops of passes; kept once per program, with its wall time and progress lines."""

import numpy as np
import pytest

import moespec_jax as msj
from moespec_jax.decoding import calibration, programs


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
  """A held run (`calibration.HeldRunResult`) as `calibration.measure_held_step_ms` calls it: held
  at the K whose step time is smallest, its passes `passes_KK[k]` at each K's pass time."""
  rng = np.random.default_rng(seed)

  def run(held_ms_K, prefill_only):
    no_drafts = np.zeros(2)
    if prefill_only:
      return calibration.HeldRunResult(prefill_ms * 1e-3, np.zeros(len(step_ms_K)), no_drafts)
    passes_K = passes_KK[int(np.argmin(held_ms_K))]
    seconds = (prefill_ms + passes_K @ step_ms_K) * 1e-3 * (1.0 + noise * rng.standard_normal())
    return calibration.HeldRunResult(seconds, passes_K, no_drafts)

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
      return calibration.HeldRunResult(0.01, np.zeros(3), np.zeros(2))
    k = int(np.argmin(held_ms_K))
    passes_K = np.zeros(3)
    passes_K[0], passes_K[k] = 2 + next(calls) % 3, 20 + 10 * k + next(calls) % 5  # K = 0: 2-4 more
    return calibration.HeldRunResult(0.01 + passes_K @ step_ms_K * 1e-3, passes_K, np.zeros(2))

  np.testing.assert_allclose(calibration.measure_held_step_ms(2, run, repeats=3), step_ms_K, rtol=1e-6)


@pytest.fixture
def fresh_programs(monkeypatch):
  """An empty program cache for the test (the default one is the process's)."""
  cache = programs.ProgramCache()
  monkeypatch.setattr(programs, "PROGRAMS", cache)
  return cache


def test_calibration_reports_its_progress_and_time_once_per_program(tiny_model, fresh_programs, monkeypatch):
  """The first auto call for a program calibrates: a progress line as it starts and one as it ends,
  its wall time in stats["calibration_seconds"]; the next call reuses it (no line, 0.0 seconds)."""
  step_ms_K = np.array([1.0, 1.2, 1.4], np.float32)

  def held(max_k, run, rounds):
    run(calibration.held_step_ms(max_k, 1), False)  # the program really runs while it measures
    return step_ms_K

  monkeypatch.setattr(calibration, "measure_held_step_ms", held)
  spec = msj.SpecParams(drafter="ngram", num_draft="auto", max_draft=2)
  lines = []
  first = msj.generate(tiny_model, [[3, 3, 3, 3]], max_new_tokens=8, spec=spec, progress=lines.append)
  assert len(lines) == 2 and lines[0].startswith("calibrating num_draft='auto'") and "K = 0..2" in lines[0]
  assert lines[1].startswith("calibrated in ") and "held runs" in lines[1] and "K=2 1.400" in lines[1]
  assert first.stats["calibration"] == "held_runs" and first.stats["calibration_seconds"] > 0
  np.testing.assert_allclose(first.stats["calibrated_step_ms"], step_ms_K)
  again = msj.generate(tiny_model, [[3, 3, 3, 3]], max_new_tokens=8, spec=spec, progress=lines.append)
  assert len(lines) == 2 and again.stats["calibration_seconds"] == 0.0
  assert again.stats["calibrated_step_ms"] == first.stats["calibrated_step_ms"]
  assert len(fresh_programs.calibration_keys()) == 1
  plain = msj.generate(tiny_model, [[3, 3, 3, 3]], max_new_tokens=8, progress=lines.append)
  assert len(lines) == 2 and "calibration_seconds" not in plain.stats
  with pytest.raises(ValueError, match="progress"):
    msj.generate(tiny_model, [[3, 3, 3, 3]], max_new_tokens=8, progress="stderr")
