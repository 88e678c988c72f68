"""Tokenizers: raw UTF-8 bytes (the default) and a byte-level BPE.

Both share one interface: `encode(text) -> list[int]`, `decode(ids) -> str`,
`eos_id`, `bos_id`, `vocab_size` (padded to a multiple of 8), `name`,
`save(dir)`, `encode_corpus(data_u8)` for the corpus layout of
`moespec_jax.data.corpus` (documents separated by 0xFF -> EOS), and
`token_byte_lengths()` for bits per byte, and `hf_tokenizer()`: a `tokenizers.Tokenizer`
that Hugging Face loads (`Model.save_hf`), encoding `tokenizer(text)` as `prompt_ids(text)` does
(our models' prompts start with EOS, the document boundary they were trained on). `load_tokenizer`
builds one from a name ("byte", "bpe-1024", ...) or a directory written by `save`.

Bits per byte makes models with different tokenizers comparable: total
negative log-likelihood in nats over the evaluated target tokens, divided by
ln 2 and by the number of UTF-8 bytes those tokens spell (`bits_per_byte`).
The EOS token counts as one byte (it stands for the document separator), BOS
and padding as zero.
"""

from __future__ import annotations

import hashlib
import math
import os
import pathlib
from collections.abc import Iterable
from typing import NoReturn, Protocol

import numpy as np
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HfTokenizer

from moespec_jax.data import corpus
from moespec_jax.io import atomic, paths

META_FILE = "tokenizer_meta.json"
BPE_FILE = "tokenizer.json"
EOS_TOKEN = "<eos>"
BOS_TOKEN = "<bos>"

PathLike = str | os.PathLike


def _pad8(n: int) -> int:
  return (n + 7) // 8 * 8


def byte_level_chars() -> list[str]:
  """The character byte-level BPE writes for each byte 0..255 (GPT-2's table, which the `tokenizers`
  ByteLevel pre-tokenizer and decoder use): printable bytes as themselves, the others from U+0100 on."""
  printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
  chars, extra = [], 0
  for b in range(256):
    if b in printable:
      chars.append(chr(b))
    else:
      chars.append(chr(256 + extra))
      extra += 1
  return chars


def _eos_first(tok: HfTokenizer, eos_id: int) -> None:
  """Frames `tok`'s encodings with special tokens as our prompts are: EOS (the document boundary)
  first, and between the two texts of a pair."""
  tok.post_processor = processors.TemplateProcessing(
    single=f"{EOS_TOKEN} $A", pair=f"{EOS_TOKEN} $A {EOS_TOKEN} $B", special_tokens=[(EOS_TOKEN, eos_id)]
  )


def bits_per_byte(total_nats: float, total_bytes: int) -> float:
  """Validation bits per byte: total nats / ln 2 / total bytes."""
  if total_bytes <= 0:
    raise ValueError(f"total_bytes must be > 0, got {total_bytes}")
  return float(total_nats) / math.log(2.0) / float(total_bytes)


class Tokenizer(Protocol):
  """What the framework needs from a tokenizer."""

  name: str
  eos_id: int
  bos_id: int
  vocab_size: int

  def encode(self, text: str) -> list[int]: ...
  def prompt_ids(self, text: str) -> list[int]: ...
  def decode(self, ids: Iterable[int]) -> str: ...
  def save(self, directory: PathLike) -> pathlib.Path: ...
  def encode_corpus(self, data_u8: np.ndarray) -> np.ndarray: ...
  def token_byte_lengths(self) -> np.ndarray: ...
  def hf_tokenizer(self) -> HfTokenizer | None: ...


class ByteTokenizer:
  """Ids 0..255 are the UTF-8 bytes; 256 is EOS, 257 BOS; 264 ids in all."""

  name = "byte"
  cache_key = "byte"
  eos_id = 256
  bos_id = 257
  vocab_size = 264

  def encode(self, text: str) -> list[int]:
    """The UTF-8 bytes of `text` (no special tokens)."""
    if not isinstance(text, str):
      raise ValueError(f"text must be a str, got {type(text).__name__}")
    return list(text.encode("utf-8"))

  def prompt_ids(self, text: str) -> list[int]:
    """A generation prompt: EOS (the document boundary seen in training), then `text`."""
    return [self.eos_id] + self.encode(text)

  def decode(self, ids: Iterable[int]) -> str:
    """Text of the byte ids; special, padding and negative ids are dropped."""
    data = bytes(int(i) for i in np.asarray(list(ids), dtype=np.int64).ravel() if 0 <= i < 256)
    return data.decode("utf-8", errors="replace")

  def encode_corpus(self, data_u8: np.ndarray) -> np.ndarray:
    """Token ids (int32) of a corpus array; the 0xFF separators become EOS."""
    data_u8 = np.asarray(data_u8, dtype=np.uint8)
    tokens = data_u8.astype(np.int32)
    tokens[data_u8 == corpus.DOC_SEPARATOR] = self.eos_id
    return tokens

  def token_byte_lengths(self) -> np.ndarray:
    """UTF-8 bytes spelled by each id (EOS 1, BOS and padding 0)."""
    lengths = np.zeros(self.vocab_size, np.int32)
    lengths[:256] = 1
    lengths[self.eos_id] = 1
    return lengths

  def hf_tokenizer(self) -> HfTokenizer:
    """This tokenizer for Hugging Face: byte-level BPE without merges (one id per byte, the
    byte's value), <eos> (256) and <bos> (257); `encode(text, add_special_tokens=True)` is
    `prompt_ids(text)`, and special tokens' text in the input stays bytes
    (`encode_special_tokens`, which tokenizer_config.json's `split_special_tokens` carries)."""
    vocab = {c: b for b, c in enumerate(byte_level_chars())}
    vocab.update({EOS_TOKEN: self.eos_id, BOS_TOKEN: self.bos_id})
    tok = HfTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True), AddedToken(BOS_TOKEN, special=True)])
    tok.encode_special_tokens = True
    _eos_first(tok, self.eos_id)
    return tok

  def save(self, directory: PathLike) -> pathlib.Path:
    """Writes `directory/tokenizer_meta.json`."""
    directory = pathlib.Path(directory)
    atomic.write_json_atomic(
      directory / META_FILE,
      {"type": "byte", "name": self.name, "vocab_size": self.vocab_size, "eos_id": self.eos_id, "bos_id": self.bos_id},
    )
    return directory

  @classmethod
  def load(cls, directory: PathLike) -> ByteTokenizer:
    meta = _read_meta(pathlib.Path(directory))
    if meta.get("type") != "byte":
      raise ValueError(f"{directory} holds a {meta.get('type')!r} tokenizer, not 'byte'")
    return cls()

  def __repr__(self) -> str:
    return "ByteTokenizer()"


class BpeTokenizer:
  """A byte-level BPE (Hugging Face `tokenizers`) with <eos> and <bos> tokens.

  Decoding is lossless: `decode(encode(s)) == s` for any string.
  """

  def __init__(self, hf_tokenizer: HfTokenizer, name: str | None = None) -> None:
    self._tok = hf_tokenizer
    self.eos_id = self._tok.token_to_id(EOS_TOKEN)
    self.bos_id = self._tok.token_to_id(BOS_TOKEN)
    if self.eos_id is None or self.bos_id is None:
      raise ValueError(f"BPE tokenizer lacks the {EOS_TOKEN} / {BOS_TOKEN} tokens")
    self.base_vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.vocab_size = _pad8(self.base_vocab_size)
    self.name = name or f"bpe-{self.base_vocab_size}"
    self._special = {self.eos_id, self.bos_id}

  @property
  def cache_key(self) -> str:
    """The name plus a digest of the merges: names a corpus token cache."""
    digest = hashlib.sha1(self._tok.to_str().encode("utf-8")).hexdigest()[:8]
    return f"{self.name}-{digest}"

  @classmethod
  def train(cls, documents: Iterable[str], vocab_size: int = 1024, min_frequency: int = 2) -> BpeTokenizer:
    """Trains a byte-level BPE of `vocab_size` ids (specials included)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 2:
      raise ValueError(f"vocab_size must be >= {len(alphabet) + 2}, got {vocab_size}")
    tok = HfTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      min_frequency=min_frequency,
      special_tokens=[EOS_TOKEN, BOS_TOKEN],
      initial_alphabet=alphabet,
      show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    return cls(tok, name=f"bpe-{vocab_size}")

  def encode(self, text: str) -> list[int]:
    """Token ids of `text` (no special tokens added)."""
    if not isinstance(text, str):
      raise ValueError(f"text must be a str, got {type(text).__name__}")
    return self._tok.encode(text, add_special_tokens=False).ids

  def prompt_ids(self, text: str) -> list[int]:
    """A generation prompt: EOS (the document boundary seen in training), then `text`."""
    return [self.eos_id] + self.encode(text)

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`; special, padding and negative ids are dropped."""
    keep = [
      int(i)
      for i in np.asarray(list(ids), dtype=np.int64).ravel()
      if 0 <= i < self.base_vocab_size and int(i) not in self._special
    ]
    return self._tok.decode(keep, skip_special_tokens=True)

  def encode_corpus(self, data_u8: np.ndarray) -> np.ndarray:
    """Token ids (int32) of a corpus array: each document's ids, then EOS."""
    raw = np.asarray(data_u8, dtype=np.uint8).tobytes()
    docs = raw.split(bytes([corpus.DOC_SEPARATOR]))
    tail = docs.pop()  # text after the last separator (empty for corpus arrays)
    texts = [d.decode("utf-8", errors="replace") for d in docs]
    parts = []
    for enc in self._tok.encode_batch(texts, add_special_tokens=False):
      parts.append(np.asarray(enc.ids, np.int32))
      parts.append(np.asarray([self.eos_id], np.int32))
    if tail:
      parts.append(np.asarray(self.encode(tail.decode("utf-8", errors="replace")), np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)

  def token_byte_lengths(self) -> np.ndarray:
    """UTF-8 bytes spelled by each id (EOS 1, BOS and padding 0)."""
    lengths = np.zeros(self.vocab_size, np.int32)
    for i in range(self.base_vocab_size):
      if i not in self._special:
        # Byte-level tokens spell one byte per character of their string.
        lengths[i] = len(self._tok.id_to_token(i))
    lengths[self.eos_id] = 1
    return lengths

  def hf_tokenizer(self) -> HfTokenizer:
    """This tokenizer for Hugging Face: the same BPE, its `encode(text, add_special_tokens=True)`
    `prompt_ids(text)` (EOS first)."""
    tok = HfTokenizer.from_str(self._tok.to_str())
    _eos_first(tok, self.eos_id)
    return tok

  def save(self, directory: PathLike) -> pathlib.Path:
    """Writes `directory/tokenizer.json` and `directory/tokenizer_meta.json`."""
    directory = pathlib.Path(directory)
    atomic.write_text_atomic(directory / BPE_FILE, self._tok.to_str())
    atomic.write_json_atomic(
      directory / META_FILE,
      {"type": "bpe", "name": self.name, "vocab_size": self.vocab_size, "eos_id": self.eos_id, "bos_id": self.bos_id},
    )
    return directory

  @classmethod
  def load(cls, directory: PathLike) -> BpeTokenizer:
    directory = pathlib.Path(directory)
    meta = _read_meta(directory)
    if meta.get("type") != "bpe":
      raise ValueError(f"{directory} holds a {meta.get('type')!r} tokenizer, not 'bpe'")
    return cls(HfTokenizer.from_file(str(directory / BPE_FILE)), name=meta.get("name"))

  def __repr__(self) -> str:
    return f"BpeTokenizer(name={self.name!r}, vocab_size={self.vocab_size})"


def bytes_per_token(tokenizer: Tokenizer, split: str = "validation", root: PathLike | None = None) -> float:
  """Corpus bytes per token of `tokenizer` on `split` (EOS included; 1.0 for bytes).

  A model's bits per byte equals its bits per token divided by this ratio.
  """
  ids = tokenizer.encode_corpus(corpus.load_bytes(split, root))
  return float(tokenizer.token_byte_lengths()[ids].sum()) / max(1, ids.size)


def _read_meta(directory: pathlib.Path) -> dict:
  meta_file = directory / META_FILE
  if not meta_file.is_file():
    raise FileNotFoundError(f"no tokenizer at {directory}: {meta_file.name} is missing")
  return atomic.read_json(meta_file)


def _parse_bpe_name(name: str) -> int | None:
  """The vocabulary size in 'bpe-1024', or None for other names."""
  if name.startswith("bpe-") and name[4:].isdigit():
    return int(name[4:])
  return None


def train_bpe_on_corpus(vocab_size: int = 1024, root: PathLike | None = None) -> BpeTokenizer:
  """Trains a BPE on the train split of the embedded corpus (tens of seconds)."""
  docs = (d.decode("utf-8") for d in corpus.documents("train", root))
  return BpeTokenizer.train(docs, vocab_size=vocab_size)


def get_or_train_bpe(vocab_size: int = 1024) -> BpeTokenizer:
  """The BPE cached at `cache_dir()/tokenizers/bpe-<V>`, trained there if missing."""
  directory = paths.tokenizer_dir(f"bpe-{vocab_size}")
  if (directory / META_FILE).is_file():
    return BpeTokenizer.load(directory)
  tok = train_bpe_on_corpus(vocab_size)
  with atomic.atomic_dir(directory) as tmp:
    tok.save(tmp)
  return tok


def load_tokenizer(dir_or_name: PathLike) -> ByteTokenizer | BpeTokenizer:
  """A tokenizer by name ("byte", "bpe-<V>") or from a directory written by `save`.

  "bpe-<V>" loads the BPE cached under `cache_dir()/tokenizers`, training it on
  the corpus the first time.

  Raises:
    ValueError: an unknown name.
    FileNotFoundError: a directory without a saved tokenizer.
  """
  if isinstance(dir_or_name, str) and os.sep not in dir_or_name and "/" not in dir_or_name:
    if dir_or_name == "byte":
      return ByteTokenizer()
    vocab = _parse_bpe_name(dir_or_name)
    if vocab is not None:
      return get_or_train_bpe(vocab)
    if not pathlib.Path(dir_or_name).is_dir():
      raise ValueError(f"unknown tokenizer {dir_or_name!r}: expected 'byte', 'bpe-<vocab>' or a directory")
  directory = pathlib.Path(dir_or_name).expanduser()
  meta = _read_meta(directory)
  kind = meta.get("type")
  if kind == "byte":
    return ByteTokenizer.load(directory)
  if kind == "bpe":
    return BpeTokenizer.load(directory)
  if kind in ("pretrained", "missing"):  # a Hugging Face checkpoint's tokenizer
    return (PretrainedTokenizer if kind == "pretrained" else MissingTokenizer).load(directory)
  raise ValueError(f"{directory / META_FILE}: unknown tokenizer type {kind!r}")


KIND = "pretrained"


class PretrainedTokenizer(BpeTokenizer):
  """A checkpoint's own tokenizer with the framework's tokenizer interface.

  Encoding, decoding and corpus encoding are BpeTokenizer's; the special ids come from
  the model config and `vocab_size` is the model's (embedding rows, often padded).
  """

  def __init__(self, hf_tokenizer: HfTokenizer, *, vocab_size: int, eos_id: int, bos_id: int, name: str = KIND) -> None:
    self._tok = hf_tokenizer
    self.eos_id, self.bos_id = int(eos_id), int(bos_id)
    self.base_vocab_size = min(hf_tokenizer.get_vocab_size(with_added_tokens=True), vocab_size)
    self.vocab_size = int(vocab_size)
    self.name = name
    added = hf_tokenizer.get_added_tokens_decoder()
    self._special = {int(i) for i, t in added.items() if t.special} | {self.eos_id, self.bos_id}

  def prompt_ids(self, text: str) -> list[int]:
    """A generation prompt as the checkpoint's tokenizer frames one (its post-processor's
    special tokens, e.g. BOS for Mixtral and DeepSeek, none for Qwen), as transformers'
    `tokenizer(text)` does."""
    if not isinstance(text, str):
      raise ValueError(f"text must be a str, got {type(text).__name__}")
    return self._tok.encode(text, add_special_tokens=True).ids

  def hf_tokenizer(self) -> HfTokenizer:
    """The checkpoint's own tokenizer, as it came."""
    return self._tok

  def save(self, directory: PathLike) -> pathlib.Path:
    """Writes `directory/tokenizer.json` and `directory/tokenizer_meta.json`."""
    directory = pathlib.Path(directory)
    atomic.write_text_atomic(directory / BPE_FILE, self._tok.to_str())
    atomic.write_json_atomic(
      directory / META_FILE,
      {
        "type": KIND,
        "name": self.name,
        "vocab_size": self.vocab_size,
        "eos_id": self.eos_id,
        "bos_id": self.bos_id,
        # Not in tokenizer.json: special tokens' text encoded as text (tokenizer_config's split_special_tokens).
        "encode_special_tokens": bool(self._tok.encode_special_tokens),
      },
    )
    return directory

  @classmethod
  def load(cls, directory: PathLike) -> PretrainedTokenizer:
    """Reads a directory written by `save`."""
    directory = pathlib.Path(directory)
    meta = atomic.read_json(directory / META_FILE)
    tok = HfTokenizer.from_file(str(directory / BPE_FILE))
    tok.encode_special_tokens = bool(meta.get("encode_special_tokens", False))
    return cls(
      tok, vocab_size=meta["vocab_size"], eos_id=meta["eos_id"], bos_id=meta["bos_id"], name=meta.get("name", KIND)
    )

  def __repr__(self) -> str:
    return f"PretrainedTokenizer(name={self.name!r}, vocab_size={self.vocab_size})"


class MissingTokenizer:
  """Stands in for a checkpoint without `tokenizer.json`: token-id prompts still work."""

  name = "missing"
  cache_key = "missing"

  def __init__(self, source: PathLike, *, vocab_size: int, eos_id: int, bos_id: int) -> None:
    self.source = str(source)
    self.vocab_size, self.eos_id, self.bos_id = int(vocab_size), int(eos_id), int(bos_id)

  def _fail(self, *_args: object, **_kwargs: object) -> NoReturn:
    raise ValueError(
      f"the model at {self.source} has no tokenizer.json: pass prompts as token-id "
      "lists, or add the model's tokenizer.json to its directory"
    )

  encode = prompt_ids = decode = encode_corpus = token_byte_lengths = _fail

  def hf_tokenizer(self) -> None:
    """None: there is no tokenizer to write."""
    return None

  def save(self, directory: PathLike) -> pathlib.Path:
    directory = pathlib.Path(directory)
    atomic.write_json_atomic(
      directory / META_FILE,
      {
        "type": "missing",
        "name": self.name,
        "source": self.source,
        "vocab_size": self.vocab_size,
        "eos_id": self.eos_id,
        "bos_id": self.bos_id,
      },
    )
    return directory

  @classmethod
  def load(cls, directory: PathLike) -> MissingTokenizer:
    meta = atomic.read_json(pathlib.Path(directory) / META_FILE)
    return cls(
      meta.get("source", directory), vocab_size=meta["vocab_size"], eos_id=meta["eos_id"], bos_id=meta["bos_id"]
    )

  def __repr__(self) -> str:
    return f"MissingTokenizer(source={self.source!r})"
