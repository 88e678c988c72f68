import json

import jax.numpy as jnp
import numpy as np
import pytest

from moespec_jax.io import progress


def test_parts_are_reused_by_a_rerun_with_the_same_settings(tmp_path):
  path, calls, logs = tmp_path / "progress.json", [], []

  def compute(value):
    calls.append(value)
    return {1: np.float32(value), "pair": (value, value)}

  run = progress.RunProgress(path, {"a": (1, 2)}, log=logs.append)
  fresh = run.cached("x", lambda: compute(0.5))
  assert fresh == {"1": 0.5, "pair": [0.5, 0.5]}  # the JSON form, as a resumed run reads it

  def interrupted():
    raise RuntimeError("killed")

  with pytest.raises(RuntimeError):  # interrupted during the next part: nothing of it is kept
    run.cached("y", interrupted)
  rerun = progress.RunProgress(path, {"a": [1, 2]}, log=logs.append)
  assert rerun.cached("x", lambda: compute(9.0)) == fresh and calls == [0.5]
  assert rerun.cached("y", lambda: compute(2.0)) == {"1": 2.0, "pair": [2.0, 2.0]} and calls == [0.5, 2.0]
  assert any("resuming: 1 finished part(s)" in line for line in logs)
  rerun.finish()
  assert not path.exists()
  rerun.finish()  # idempotent


def test_other_settings_or_an_unreadable_file_measure_afresh(tmp_path):
  path, logs = tmp_path / "progress.json", []
  progress.RunProgress(path, {"repeats": 7}).cached("x", lambda: 1.0)
  other = progress.RunProgress(path, {"repeats": 9}, log=logs.append)
  assert other.cached("x", lambda: 2.0) == 2.0
  assert "other settings" in logs[-1]
  assert json.loads(path.read_text())["settings"] == {"repeats": 9}
  path.write_text("{not json")
  assert progress.RunProgress(path, {"repeats": 9}, log=logs.append).cached("x", lambda: 3.0) == 3.0


def test_weights_fingerprint_tells_weights_apart():
  state = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.zeros(3)}
  same = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.zeros(3)}
  assert progress.weights_fingerprint(state) == progress.weights_fingerprint(same)
  assert progress.weights_fingerprint(state) != progress.weights_fingerprint(dict(state, b=jnp.ones(3)))
  assert progress.weights_fingerprint(state) != progress.weights_fingerprint(dict(state, w=state["w"].reshape(3, 2)))
