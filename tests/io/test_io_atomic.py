"""Tests of atomic writes and cache paths."""

import json
import os
import pathlib

import numpy as np
import pytest

from moespec_jax.io import atomic, paths


def test_paths_follow_env(monkeypatch, tmp_path):
  monkeypatch.setenv("MOESPEC_CACHE", str(tmp_path / "c"))
  assert paths.cache_dir() == tmp_path / "c"
  assert paths.default_model_dir() == tmp_path / "c" / "models" / "tiny"
  monkeypatch.delenv("MOESPEC_CACHE")
  assert paths.cache_dir() == pathlib.Path.home() / ".cache" / "moespec_jax"


def test_write_json_converts_numpy(tmp_path):
  obj = {
    "a": np.float32(1.5),
    "b": np.arange(3, dtype=np.int64),
    "c": (1, np.bool_(True)),
    "d": float("nan"),
    "e": tmp_path,
    3: np.array([[1.0, 2.0]]),
  }
  path = atomic.write_json_atomic(tmp_path / "sub" / "m.json", obj)
  assert json.loads(path.read_text()) == {
    "a": 1.5,
    "b": [0, 1, 2],
    "c": [1, True],
    "d": None,
    "e": str(tmp_path),
    "3": [[1.0, 2.0]],
  }
  assert os.listdir(tmp_path / "sub") == ["m.json"]


def test_failed_write_keeps_old_file_and_leaves_nothing(tmp_path, monkeypatch):
  path = tmp_path / "m.json"
  atomic.write_json_atomic(path, {"v": 1})
  with pytest.raises(TypeError):
    atomic.write_json_atomic(path, {"v": object()})

  def broken_replace(src, dst):
    raise OSError("disk full")

  monkeypatch.setattr(os, "replace", broken_replace)
  with pytest.raises(OSError, match="disk full"):
    atomic.write_bytes_atomic(path, b"new content")
  assert json.loads(path.read_text()) == {"v": 1}
  assert os.listdir(tmp_path) == ["m.json"]


def test_write_npy_atomic(tmp_path):
  arr = np.arange(12, dtype=np.uint16).reshape(3, 4)
  atomic.write_npy_atomic(tmp_path / "a.npy", arr)
  np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), arr)


def test_atomic_dir_success_and_replace(tmp_path):
  target = tmp_path / "model"
  with atomic.atomic_dir(target) as tmp:
    assert tmp.parent == tmp_path and tmp.name.startswith(".model.tmp-")
    assert not target.exists()  # nothing visible until complete
    (tmp / "a.txt").write_text("1")
  assert (target / "a.txt").read_text() == "1"
  with atomic.atomic_dir(target) as tmp:
    (tmp / "b.txt").write_text("2")
  assert sorted(os.listdir(target)) == ["b.txt"]  # replaced whole, no mix
  assert os.listdir(tmp_path) == ["model"]
  with pytest.raises(FileExistsError):
    with atomic.atomic_dir(target, overwrite=False):
      pass


def test_atomic_dir_exception_leaves_old_content(tmp_path):
  target = tmp_path / "model"
  with pytest.raises(RuntimeError):
    with atomic.atomic_dir(target) as tmp:
      (tmp / "half.bin").write_bytes(b"x" * 100)
      raise RuntimeError("interrupted")
  assert os.listdir(tmp_path) == []
  with atomic.atomic_dir(target) as tmp:
    (tmp / "ok.txt").write_text("old")
  with pytest.raises(KeyboardInterrupt):
    with atomic.atomic_dir(target) as tmp:
      (tmp / "new.txt").write_text("new")
      raise KeyboardInterrupt
  assert os.listdir(target) == ["ok.txt"]
  assert os.listdir(tmp_path) == ["model"]


def test_modes_follow_umask(tmp_path):
  old = os.umask(0o022)
  try:
    atomic.write_bytes_atomic(tmp_path / "f", b"x")
    with atomic.atomic_dir(tmp_path / "d"):
      pass
  finally:
    os.umask(old)
  assert (tmp_path / "f").stat().st_mode & 0o777 == 0o644
  assert (tmp_path / "d").stat().st_mode & 0o777 == 0o755
