"""Token streams of the corpus and the training / validation batches cut from them.

`corpus_tokens` tokenizes a split once and caches the ids as a .npy file keyed
by the tokenizer and the corpus content. `train_batches` yields random windows
whose randomness depends only on (seed, step), so a run resumed at step s sees
exactly the batches an uninterrupted run would. `validation_batches` cuts
contiguous windows in a fixed order and reports the bytes their targets spell,
for bits per byte.
"""

from __future__ import annotations

import logging
import os
import pathlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from moespec_jax.data import corpus
from moespec_jax.io import atomic, paths

if TYPE_CHECKING:
  from moespec_jax.data.tokenizer import Tokenizer

PathLike = str | os.PathLike


def cache_path(
  tokenizer: Tokenizer, split: str, cache_dir: PathLike | None = None, root: PathLike | None = None
) -> pathlib.Path:
  """Where `corpus_tokens` caches the ids of `split` for `tokenizer`."""
  base = pathlib.Path(cache_dir) if cache_dir is not None else paths.data_cache_dir()
  name = (
    f"{corpus.corpus_name()}-{corpus.fingerprint(split, root)}-{split}-"
    f"{getattr(tokenizer, 'cache_key', tokenizer.name)}.npy"
  )
  return base / name


def corpus_tokens(
  tokenizer: Tokenizer,
  split: str = "train",
  *,
  cache: bool = True,
  cache_dir: PathLike | None = None,
  root: PathLike | None = None,
) -> np.ndarray:
  """Token ids of a corpus split (documents each followed by EOS).

  Args:
    tokenizer: a `moespec_jax.data.tokenizer` tokenizer.
    split: "train" or "validation".
    cache: read/write the ids at `cache_path(...)` (written atomically).
    cache_dir: overrides `cache_dir()/data`.
    root: overrides the corpus root (tests).

  Returns:
    The ids, uint16 when the vocabulary fits (half the memory), else int32;
    the batch functions return int32.
  """
  path = cache_path(tokenizer, split, cache_dir, root) if cache else None
  if path is not None and path.is_file():
    return np.load(path, mmap_mode="r")
  t0 = time.perf_counter()
  tokens = tokenizer.encode_corpus(corpus.load_bytes(split, root))
  dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
  tokens = tokens.astype(dtype)
  logging.info(
    "tokenized %s split with %s: %d tokens in %.1f s", split, tokenizer.name, tokens.size, time.perf_counter() - t0
  )
  if path is not None:
    atomic.write_npy_atomic(path, tokens)
  return tokens


def _check(tokens: np.ndarray, batch_size: int, seq_len: int) -> None:
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  if seq_len < 1:
    raise ValueError(f"seq_len must be >= 1, got {seq_len}")
  if tokens.ndim != 1:
    raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
  if tokens.size < seq_len + 1:
    raise ValueError(f"tokens has {tokens.size} ids, fewer than seq_len + 1 = {seq_len + 1}")


def train_batch(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int) -> np.ndarray:
  """The batch of `step`: int32 [B, T+1] windows at random offsets.

  The offsets come from a generator seeded with (seed, step) only, so any step
  can be reproduced on its own. Inputs are `[:, :-1]`, targets `[:, 1:]`.
  """
  tokens = np.asarray(tokens)
  _check(tokens, batch_size, seq_len)
  if step < 0:
    raise ValueError(f"step must be >= 0, got {step}")
  rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(step)])
  starts_B = rng.integers(0, tokens.size - seq_len, size=batch_size)
  idx_BT1 = starts_B[:, None] + np.arange(seq_len + 1)[None, :]
  return np.asarray(tokens[idx_BT1], dtype=np.int32)


def train_batches(
  tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, start_step: int = 0
) -> Iterator[np.ndarray]:
  """Endless `train_batch(..., step)` for step = start_step, start_step + 1, ..."""
  tokens = np.asarray(tokens)
  _check(tokens, batch_size, seq_len)
  step = int(start_step)
  while True:
    yield train_batch(tokens, batch_size, seq_len, seed, step)
    step += 1


class ValBatch(NamedTuple):
  """A validation batch and the UTF-8 bytes its targets spell."""

  tokens: np.ndarray  # int32 [B, T+1]: inputs [:, :-1], targets [:, 1:]
  n_bytes: int  # bytes spelled by tokens[:, 1:] (for bits per byte)
  n_targets: int  # B * T


def num_validation_windows(n_tokens: int, seq_len: int) -> int:
  """Windows of T+1 ids at stride T in a stream of `n_tokens` ids."""
  return max(0, (n_tokens - 1) // seq_len)


def validation_batches(
  tokens: np.ndarray,
  batch_size: int,
  seq_len: int,
  max_batches: int | None = None,
  byte_lengths: np.ndarray | None = None,
) -> Iterator[ValBatch]:
  """Contiguous windows over `tokens`, in order, as `ValBatch`es.

  Window i holds ids [i*T, i*T + T]: its targets (ids i*T+1 .. i*T+T) do not
  overlap those of any other window, so every id after the first is predicted
  at most once. Windows that do not fill a whole batch are dropped. With
  `max_batches` below the split's batches, that many batches spread evenly over
  the whole split (the split's first batches are one stretch of text, not a
  sample of it: tokenizers of different lengths would be judged on different
  stretches).

  Args:
    tokens: 1-D ids of the validation split.
    batch_size: windows per batch (B).
    seq_len: inputs per window (T).
    max_batches: at most this many batches, spread over the split (None: all).
    byte_lengths: bytes spelled by each id (`tokenizer.token_byte_lengths()`);
      None counts one byte per target (exact for the byte tokenizer).
  """
  tokens = np.asarray(tokens)
  _check(tokens, batch_size, seq_len)
  n_batches = num_validation_windows(tokens.size, seq_len) // batch_size
  chosen = np.arange(n_batches)
  if max_batches is not None and max_batches < n_batches:
    chosen = np.linspace(0, n_batches - 1, max(0, int(max_batches))).round().astype(int)
  offsets_T1 = np.arange(seq_len + 1)
  for b in chosen:
    starts_B = (b * batch_size + np.arange(batch_size)) * seq_len
    batch_BT1 = np.asarray(tokens[starts_B[:, None] + offsets_T1[None, :]], np.int32)
    targets_BT = batch_BT1[:, 1:]
    if byte_lengths is None:
      n_bytes = targets_BT.size
    else:
      n_bytes = int(np.asarray(byte_lengths)[targets_BT].sum())
    yield ValBatch(batch_BT1, n_bytes, targets_BT.size)
