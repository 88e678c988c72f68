"""Tests of corpus tokenization caching and of training / validation batches."""

import itertools
import os

import numpy as np
import pytest

from moespec_jax.data import batches
from moespec_jax.data import tokenizer as tok_lib


def test_train_windows_are_slices_and_deterministic():
  tokens = np.arange(10_000, dtype=np.uint16)
  b = batches.train_batch(tokens, batch_size=8, seq_len=16, seed=1, step=5)
  assert b.shape == (8, 17) and b.dtype == np.int32
  np.testing.assert_array_equal(b, b[:, :1] + np.arange(17))  # contiguous windows
  assert b.min() >= 0 and b.max() < tokens.size
  np.testing.assert_array_equal(b, batches.train_batch(tokens, 8, 16, 1, 5))
  assert not np.array_equal(b, batches.train_batch(tokens, 8, 16, 1, 6))
  assert not np.array_equal(b, batches.train_batch(tokens, 8, 16, 2, 5))


def test_train_resume_reproduces_uninterrupted_run():
  tokens = np.random.default_rng(0).integers(0, 264, 5000).astype(np.uint16)
  full = list(itertools.islice(batches.train_batches(tokens, 4, 32, seed=7), 8))
  resumed = list(itertools.islice(batches.train_batches(tokens, 4, 32, seed=7, start_step=5), 3))
  for a, b in zip(full[5:], resumed):
    np.testing.assert_array_equal(a, b)


def test_train_windows_reach_both_ends():
  tokens = np.arange(40)
  starts = np.concatenate([batches.train_batch(tokens, 64, 8, 0, s)[:, 0] for s in range(20)])
  assert starts.min() == 0 and starts.max() == 40 - 9


def test_bad_batch_arguments():
  with pytest.raises(ValueError, match="fewer than"):
    batches.train_batch(np.arange(10), 2, 10, 0, 0)
  with pytest.raises(ValueError, match="batch_size"):
    next(batches.train_batches(np.arange(100), 0, 10, 0))
  with pytest.raises(ValueError, match="step"):
    batches.train_batch(np.arange(100), 2, 10, 0, -1)


def test_validation_windows_contiguous_and_non_overlapping():
  tokens = np.arange(1000)
  vb = list(batches.validation_batches(tokens, batch_size=4, seq_len=10))
  # (1000 - 1) // 10 = 99 windows -> 24 full batches.
  assert len(vb) == 24
  targets = np.concatenate([b.tokens[:, 1:].ravel() for b in vb])
  np.testing.assert_array_equal(targets, np.arange(1, 1 + 24 * 40))
  assert all(b.n_bytes == b.n_targets == 40 for b in vb)
  # Fewer batches: spread over the whole split (first, middle, last), not its first stretch.
  again = list(batches.validation_batches(tokens, 4, 10, max_batches=3))
  assert len(again) == 3
  for got, b in zip(again, (0, 12, 23)):
    np.testing.assert_array_equal(got.tokens, vb[b].tokens)
  assert len(list(batches.validation_batches(tokens, 4, 10, max_batches=24))) == 24
  assert len(list(batches.validation_batches(tokens, 4, 10, max_batches=0))) == 0
  lengths = np.zeros(1000, np.int32)
  lengths[::2] = 3
  vb_bytes = next(batches.validation_batches(tokens, 4, 10, byte_lengths=lengths))
  assert vb_bytes.n_bytes == 3 * 20


def test_corpus_tokens_cached_atomically(tmp_path):
  root = tmp_path / "lib"
  root.mkdir()
  for i in range(40):
    (root / f"m{i}.py").write_text(f"x = '{i}é'\n", encoding="utf-8")
  cache = tmp_path / "cache"
  tok = tok_lib.ByteTokenizer()
  first = batches.corpus_tokens(tok, "train", cache_dir=cache, root=root)
  files = os.listdir(cache)
  assert len(files) == 1 and files[0].endswith("-train-byte.npy")
  second = batches.corpus_tokens(tok, "train", cache_dir=cache, root=root)
  assert isinstance(second, np.memmap)  # read back, not recomputed
  np.testing.assert_array_equal(first, second)
  assert int((first == tok.eos_id).sum()) == len(
    [f for f in root.iterdir() if batches.corpus.split_of(f.name) == "train"]
  )
  uncached = batches.corpus_tokens(tok, "train", cache=False, root=root)
  np.testing.assert_array_equal(first, uncached)
