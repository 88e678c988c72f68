"""The tokenizer of a Hugging Face model directory (`tokenizer.json`, read with the `tokenizers` library;
the classes live in `data.tokenizer`, which loads them back from a saved model)."""

from __future__ import annotations

import pathlib

from tokenizers import Tokenizer as HfTokenizer

from moespec_jax.data.tokenizer import MissingTokenizer, PretrainedTokenizer


def load_for_checkpoint(directory, *, vocab_size: int, eos_id: int, bos_id: int):
  """The tokenizer of an HF directory, or a MissingTokenizer when it has no tokenizer.json."""
  directory = pathlib.Path(directory)
  path = directory / "tokenizer.json"
  if not path.is_file():
    return MissingTokenizer(directory, vocab_size=vocab_size, eos_id=eos_id, bos_id=bos_id)
  return PretrainedTokenizer(HfTokenizer.from_file(str(path)), vocab_size=vocab_size,
                             eos_id=eos_id, bos_id=bos_id)
