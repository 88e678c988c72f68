"""Tests of training checkpoints (resume) and finished-parameter pytrees."""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from moespec_jax.io import checkpoint


def _state(seed=0):
  rng = np.random.default_rng(seed)
  return {
    "params": {
      "w_f32": jnp.asarray(rng.standard_normal((4, 5)), jnp.float32),
      "w_bf16": jnp.asarray(rng.standard_normal((3, 2)), jnp.bfloat16),
      "np_bf16": rng.standard_normal(7).astype(ml_dtypes.bfloat16),
      "ids": np.arange(-3, 3, dtype=np.int32),
      "i8": np.asarray([-128, 0, 127], np.int8),
    },
    "opt_state": [jnp.zeros(3), jnp.asarray(seed, jnp.int32)],
    "step": 3,
    "rng": jax.random.key_data(jax.random.key(seed)),
  }


def _assert_bit_exact(a, b):
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  assert tree_a == tree_b
  for x, y in zip(leaves_a, leaves_b):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()


def test_manager_resume_in_new_manager(tmp_path):
  state = _state(1)
  mngr = checkpoint.CheckpointManager(tmp_path / "ckpt", max_to_keep=2)
  assert mngr.latest_step() is None
  assert mngr.save(3, state)
  mngr.close()
  fresh = checkpoint.CheckpointManager(tmp_path / "ckpt", max_to_keep=2)
  assert fresh.latest_step() == 3
  _assert_bit_exact(fresh.restore(3, _state(0)), state)
  _assert_bit_exact(fresh.restore(None, _state(0)), state)
  restored = fresh.restore(
    3,
    jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype) if hasattr(x, "dtype") else x, state),
  )
  _assert_bit_exact(restored, state)
  with pytest.raises(FileNotFoundError):
    fresh.restore(4, state)


def test_manager_interval_and_keep_last(tmp_path):
  mngr = checkpoint.CheckpointManager(tmp_path, max_to_keep=2, save_interval_steps=2)
  saved = [s for s in range(1, 8) if mngr.save(s, _state(s))]
  assert saved == [2, 4, 6]
  assert mngr.all_steps() == [4, 6]
  assert mngr.save(7, _state(7), force=True)
  assert not mngr.save(7, _state(0), force=True)  # already complete: kept as is
  assert mngr.all_steps() == [6, 7]
  _assert_bit_exact(mngr.restore(7, _state(0)), _state(7))


def test_interrupted_step_is_ignored_and_can_be_redone(tmp_path):
  mngr = checkpoint.CheckpointManager(tmp_path, max_to_keep=3)
  mngr.save(3, _state(3))
  # A write killed midway: orbax's temporary dir, and a step dir without metadata.
  (tmp_path / "5.orbax-checkpoint-tmp-1700000000").mkdir()
  (tmp_path / "5.orbax-checkpoint-tmp-1700000000" / "partial").write_bytes(b"x")
  (tmp_path / "6").mkdir()
  (tmp_path / "6" / "partial").write_bytes(b"x")
  fresh = checkpoint.CheckpointManager(tmp_path, max_to_keep=3)
  assert fresh.latest_step() == 3
  _assert_bit_exact(fresh.restore(None, _state(0)), _state(3))
  assert fresh.save(6, _state(6))
  assert fresh.latest_step() == 6
  _assert_bit_exact(fresh.restore(6, _state(0)), _state(6))


def test_save_load_pytree_bit_exact(tmp_path):
  params = _state(2)["params"]
  params["nan_payload"] = np.array([np.nan, -0.0, np.inf], np.float32)
  checkpoint.save_pytree(tmp_path / "params", params)
  assert os.listdir(tmp_path) == ["params"]
  _assert_bit_exact(checkpoint.load_pytree(tmp_path / "params"), params)
  abstract = jax.eval_shape(lambda: jax.tree.map(jnp.asarray, params))
  loaded = checkpoint.load_pytree(tmp_path / "params", checkpoint.abstract_tree(abstract))
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(loaded))
  _assert_bit_exact(loaded, params)


def test_save_pytree_failure_keeps_previous(tmp_path):
  target = tmp_path / "params"
  checkpoint.save_pytree(target, {"a": np.ones(3, np.float32)})
  with pytest.raises(Exception):  # noqa: B017 - whatever the writer raises on an unstorable leaf
    checkpoint.save_pytree(target, {"a": np.zeros(3, np.float32), "bad": object()})
  _assert_bit_exact(checkpoint.load_pytree(target), {"a": np.ones(3, np.float32)})
  assert os.listdir(tmp_path) == ["params"]
  checkpoint.save_pytree(target, {"b": np.zeros(2, np.int32)})
  _assert_bit_exact(checkpoint.load_pytree(target), {"b": np.zeros(2, np.int32)})
  with pytest.raises(FileNotFoundError):
    checkpoint.load_pytree(tmp_path / "missing")
