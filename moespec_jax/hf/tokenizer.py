"""The tokenizer of a Hugging Face model directory (`tokenizer.json`, read with the `tokenizers` library;
the classes live in `data.tokenizer`, which loads them back from a saved model)."""

from __future__ import annotations

import json
import pathlib

from tokenizers import Tokenizer as HfTokenizer

from moespec_jax.data.tokenizer import MissingTokenizer, PretrainedTokenizer
from moespec_jax.io.atomic import PathLike


def load_for_checkpoint(
  directory: PathLike, *, vocab_size: int, eos_id: int, bos_id: int
) -> PretrainedTokenizer | MissingTokenizer:
  """The tokenizer of an HF directory, or a MissingTokenizer when it has no tokenizer.json.
  tokenizer_config.json's `split_special_tokens` is honoured as transformers honours it: special
  tokens' text in the input is then encoded as text."""
  directory = pathlib.Path(directory)
  path = directory / "tokenizer.json"
  if not path.is_file():
    return MissingTokenizer(directory, vocab_size=vocab_size, eos_id=eos_id, bos_id=bos_id)
  tok = HfTokenizer.from_file(str(path))
  config = directory / "tokenizer_config.json"
  if config.is_file() and json.loads(config.read_text()).get("split_special_tokens"):
    tok.encode_special_tokens = True
  return PretrainedTokenizer(tok, vocab_size=vocab_size, eos_id=eos_id, bos_id=bos_id)
