"""The tokenizer of a Hugging Face model directory (`tokenizer.json`, `tokenizers` library)."""

from __future__ import annotations

import pathlib

from tokenizers import Tokenizer as HfTokenizer

from moespec_jax.data import tokenizer as tokenizer_lib
from moespec_jax.io import atomic

KIND = "pretrained"


class PretrainedTokenizer(tokenizer_lib.BpeTokenizer):
  """A checkpoint's own tokenizer with the framework's tokenizer interface.

  Encoding, decoding and corpus encoding are BpeTokenizer's; the special ids come from
  the model config and `vocab_size` is the model's (embedding rows, often padded).
  """

  def __init__(self, hf_tokenizer, *, vocab_size: int, eos_id: int, bos_id: int,
               name: str = KIND):
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

  def save(self, directory) -> pathlib.Path:
    """Writes `directory/tokenizer.json` and `directory/tokenizer_meta.json`."""
    directory = pathlib.Path(directory)
    atomic.write_text_atomic(directory / tokenizer_lib.BPE_FILE, self._tok.to_str())
    atomic.write_json_atomic(directory / tokenizer_lib.META_FILE, {
        "type": KIND, "name": self.name, "vocab_size": self.vocab_size,
        "eos_id": self.eos_id, "bos_id": self.bos_id})
    return directory

  @classmethod
  def load(cls, directory) -> "PretrainedTokenizer":
    """Reads a directory written by `save`."""
    directory = pathlib.Path(directory)
    meta = atomic.read_json(directory / tokenizer_lib.META_FILE)
    tok = HfTokenizer.from_file(str(directory / tokenizer_lib.BPE_FILE))
    return cls(tok, vocab_size=meta["vocab_size"], eos_id=meta["eos_id"], bos_id=meta["bos_id"],
               name=meta.get("name", KIND))

  def __repr__(self) -> str:
    return f"PretrainedTokenizer(name={self.name!r}, vocab_size={self.vocab_size})"


class MissingTokenizer:
  """Stands in for a checkpoint without `tokenizer.json`: token-id prompts still work."""

  name = "missing"
  cache_key = "missing"

  def __init__(self, source, *, vocab_size: int, eos_id: int, bos_id: int):
    self.source = str(source)
    self.vocab_size, self.eos_id, self.bos_id = int(vocab_size), int(eos_id), int(bos_id)

  def _fail(self, *_args, **_kwargs):
    raise ValueError(f"the model at {self.source} has no tokenizer.json: pass prompts as token-id "
                     "lists, or add the model's tokenizer.json to its directory")

  encode = prompt_ids = decode = encode_corpus = token_byte_lengths = _fail

  def save(self, directory) -> pathlib.Path:
    directory = pathlib.Path(directory)
    atomic.write_json_atomic(directory / tokenizer_lib.META_FILE, {
        "type": "missing", "name": self.name, "source": self.source, "vocab_size": self.vocab_size,
        "eos_id": self.eos_id, "bos_id": self.bos_id})
    return directory

  @classmethod
  def load(cls, directory) -> "MissingTokenizer":
    meta = atomic.read_json(pathlib.Path(directory) / tokenizer_lib.META_FILE)
    return cls(meta.get("source", directory), vocab_size=meta["vocab_size"], eos_id=meta["eos_id"],
               bos_id=meta["bos_id"])

  def __repr__(self) -> str:
    return f"MissingTokenizer(source={self.source!r})"


def load_for_checkpoint(directory, *, vocab_size: int, eos_id: int, bos_id: int):
  """The tokenizer of an HF directory, or a MissingTokenizer when it has no tokenizer.json."""
  directory = pathlib.Path(directory)
  path = directory / "tokenizer.json"
  if not path.is_file():
    return MissingTokenizer(directory, vocab_size=vocab_size, eos_id=eos_id, bos_id=bos_id)
  return PretrainedTokenizer(HfTokenizer.from_file(str(path)), vocab_size=vocab_size,
                             eos_id=eos_id, bos_id=bos_id)
