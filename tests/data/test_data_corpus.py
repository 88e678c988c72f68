"""Tests of the embedded corpus: file selection, split, layout and prompts."""

import hashlib
import re

import numpy as np
import pytest

from moespec_jax.data import corpus


def _make_tree(root, n=60):
  """A fake stdlib: n modules, one non-UTF-8 file, and paths that must be skipped."""
  for i in range(n):
    sub = root / f"pkg{i % 4}"
    sub.mkdir(exist_ok=True)
    (sub / f"mod{i}.py").write_text(f"# módulo {i}\ndef f{i}(x):\n    return x + {i}\n", encoding="utf-8")
  (root / "bad.py").write_bytes(b"s = '\xe9t\xe9'\n")  # Latin-1, not UTF-8
  for skipped in ("site-packages", "dist-packages", "__pycache__"):
    (root / skipped).mkdir()
    (root / skipped / "thirdparty.py").write_text("x = 1\n")
  (root / "notes.txt").write_text("not python\n")


def test_split_is_sha1_of_relative_path():
  # Pinned values: a change of the hash, the fraction or the path form moves files
  # between splits and silently invalidates caches and reported validation numbers.
  assert corpus.split_of("os.py") == "train"
  assert corpus.split_of("json/__init__.py") == "train"
  assert corpus.split_of("copy.py") == "validation"
  assert corpus.split_of("collections/__init__.py") == "validation"
  for rel in ("a.py", "x/y/z.py", "test/test_os.py"):
    frac = int.from_bytes(hashlib.sha1(rel.encode()).digest()[:8], "big") / 2**64
    assert corpus.split_of(rel) == ("validation" if frac < 0.05 else "train")


def test_stdlib_splits_disjoint_deterministic_and_complete():
  train = corpus.list_files("train")
  val = corpus.list_files("validation")
  assert train == corpus.list_files("train")
  assert train == sorted(train) and val == sorted(val)
  assert not set(train) & set(val)
  assert all(corpus.split_of(p) == "validation" for p in val)
  assert all(corpus.split_of(p) == "train" for p in train)
  assert not any("site-packages" in p for p in train + val)
  assert 0.02 < len(val) / (len(train) + len(val)) < 0.10
  assert corpus.load_bytes("validation").size > 500_000


def test_load_bytes_layout_and_exclusions(tmp_path):
  _make_tree(tmp_path)
  train = corpus.list_files("train", tmp_path)
  val = corpus.list_files("validation", tmp_path)
  skipped = corpus.skipped_files("train", tmp_path) + corpus.skipped_files("validation", tmp_path)
  assert skipped == ["bad.py"]
  assert sorted(train + val) == sorted(f"pkg{i % 4}/mod{i}.py" for i in range(60))
  for split, files in (("train", train), ("validation", val)):
    data = corpus.load_bytes(split, tmp_path)
    assert data.dtype == np.uint8 and not data.flags.writeable
    assert int((data == corpus.DOC_SEPARATOR).sum()) == len(files)
    if files:
      assert data[-1] == corpus.DOC_SEPARATOR
    docs = corpus.documents(split, tmp_path)
    assert docs == [(tmp_path / f).read_bytes() for f in files]
    assert all(d.decode("utf-8") for d in docs)
  assert corpus.load_bytes("train", tmp_path) is corpus.load_bytes("train", tmp_path)


def test_bad_arguments(tmp_path):
  with pytest.raises(ValueError, match="split"):
    corpus.list_files("test")
  with pytest.raises(FileNotFoundError):
    corpus.load_bytes("train", tmp_path / "missing")
  with pytest.raises(ValueError, match="n="):
    corpus.held_out_prompts(10**6, 256, 0)
  with pytest.raises(ValueError, match="n must be"):
    corpus.held_out_prompts(0)


def test_held_out_prompts_deterministic_and_from_validation_only():
  prompts = corpus.held_out_prompts(12, prompt_bytes=200, seed=3)
  assert prompts == corpus.held_out_prompts(12, prompt_bytes=200, seed=3)
  assert prompts != corpus.held_out_prompts(12, prompt_bytes=200, seed=4)
  assert len(set(prompts)) == 12
  val_text = "\n".join(d.decode("utf-8") for d in corpus.documents("validation"))
  def_line = re.compile(r"^[ \t]*(async[ \t]+)?def[ \t]+\w+[ \t]*\(.*\).*:[ \t]*(#.*)?$")
  for p in prompts:
    assert p in val_text
    assert len(p.encode("utf-8")) <= 200
    assert def_line.match(p.splitlines()[-1]), p
    assert not p[-1].isspace()  # ends on the header, before its line end
    start = val_text.index(p)
    assert start == 0 or val_text[start - 1] == "\n"  # starts on a line start
    assert val_text[start + len(p)].isspace()
