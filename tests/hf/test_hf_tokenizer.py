"""A Hugging Face directory's tokenizer (moespec_jax/hf/tokenizer.py): tokenizer.json read as the
checkpoint frames prompts, tokenizer_config.json's split_special_tokens honoured, none without it."""

import json

import pytest

from moespec_jax.data.tokenizer import ByteTokenizer, MissingTokenizer, PretrainedTokenizer
from moespec_jax.hf.tokenizer import load_for_checkpoint

IDS = dict(vocab_size=264, eos_id=256, bos_id=257)


def test_without_tokenizer_json_prompts_must_be_ids(tmp_path):
  tok = load_for_checkpoint(tmp_path, **IDS)
  assert isinstance(tok, MissingTokenizer) and (tok.vocab_size, tok.eos_id, tok.bos_id) == (264, 256, 257)
  with pytest.raises(ValueError, match="no tokenizer.json"):
    tok.prompt_ids("x")


def test_the_checkpoints_tokenizer_frames_prompts_and_may_split_special_tokens(tmp_path):
  ByteTokenizer().hf_tokenizer().save(str(tmp_path / "tokenizer.json"))
  tok = load_for_checkpoint(tmp_path, **IDS)
  assert isinstance(tok, PretrainedTokenizer) and tok.vocab_size == 264
  assert tok.prompt_ids("ab<eos>") == [256, 97, 98, 256]  # the special token's text is the token
  assert tok.decode([97, 98]) == "ab"
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"split_special_tokens": True}))
  split = load_for_checkpoint(tmp_path, **IDS)
  assert split.prompt_ids("ab<eos>") == ByteTokenizer().prompt_ids("ab<eos>") == [256, 97, 98, *b"<eos>"]
