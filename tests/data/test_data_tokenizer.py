"""Tests of the byte and BPE tokenizers and of bits per byte."""

import math

import numpy as np
import pytest

from moespec_jax.data import corpus
from moespec_jax.data import tokenizer as tok_lib

TEXT = "naïve café — 日本語 \U0001f600\n\tdef f(x):\n        return x  # ∑\n"


@pytest.fixture(scope="module")
def bpe():
  docs = [d.decode("utf-8") for d in corpus.documents("validation")[:20]]
  return tok_lib.BpeTokenizer.train(docs + [TEXT], vocab_size=403)


def test_byte_tokenizer_round_trip_and_specials():
  tok = tok_lib.ByteTokenizer()
  ids = tok.encode(TEXT)
  assert ids == list(TEXT.encode("utf-8"))
  assert tok.decode(ids) == TEXT
  assert (tok.eos_id, tok.bos_id, tok.vocab_size, tok.name) == (256, 257, 264, "byte")
  # Special, padding and -1 (after EOS in generate output) ids are dropped.
  assert tok.decode([tok.bos_id] + ids + [tok.eos_id, 263, -1, -1]) == TEXT
  assert tok.decode(np.asarray([[104, 105]])) == "hi"
  assert tok.decode([0xE6, 0x97]) == "\ufffd"  # truncated UTF-8 is replaced, not raised
  with pytest.raises(ValueError):
    tok.encode(b"bytes")


def test_byte_encode_corpus_and_lengths():
  tok = tok_lib.ByteTokenizer()
  data = np.frombuffer(b"ab\xffc\xff", np.uint8)
  np.testing.assert_array_equal(tok.encode_corpus(data), [97, 98, 256, 99, 256])
  lengths = tok.token_byte_lengths()
  assert lengths.shape == (264,) and lengths[:256].sum() == 256
  assert lengths[tok.eos_id] == 1 and lengths[tok.bos_id] == 0


def test_byte_save_load(tmp_path):
  tok_lib.ByteTokenizer().save(tmp_path / "tok")
  loaded = tok_lib.load_tokenizer(tmp_path / "tok")
  assert isinstance(loaded, tok_lib.ByteTokenizer)
  assert isinstance(tok_lib.load_tokenizer("byte"), tok_lib.ByteTokenizer)
  with pytest.raises(ValueError, match="unknown tokenizer"):
    tok_lib.load_tokenizer("sentencepiece")
  with pytest.raises(FileNotFoundError):
    tok_lib.load_tokenizer(tmp_path / "nothing")


def test_bpe_round_trip_specials_and_padding(bpe):
  ids = bpe.encode(TEXT)
  assert bpe.decode(ids) == TEXT
  code = corpus.documents("validation")[30].decode("utf-8")
  assert bpe.decode(bpe.encode(code)) == code
  assert len(bpe.encode(code)) < 0.75 * len(code.encode("utf-8"))  # it compresses
  assert bpe.vocab_size % 8 == 0 and bpe.vocab_size == 408 and bpe.base_vocab_size == 403
  assert {bpe.eos_id, bpe.bos_id} == {0, 1}
  padded = [bpe.bos_id] + ids + [bpe.eos_id, 405, -1]
  assert bpe.decode(padded) == TEXT


def test_bpe_byte_lengths_match_text(bpe):
  lengths = bpe.token_byte_lengths()
  for text in (TEXT, corpus.documents("validation")[5].decode("utf-8")):
    assert lengths[bpe.encode(text)].sum() == len(text.encode("utf-8"))


def test_bpe_encode_corpus_and_bpb_comparable(bpe):
  docs = corpus.documents("validation")[:3]
  data = np.frombuffer(b"".join(d + b"\xff" for d in docs), np.uint8)
  ids = bpe.encode_corpus(data)
  assert ids.dtype == np.int32
  assert int((ids == bpe.eos_id).sum()) == 3 and ids[-1] == bpe.eos_id
  # Both tokenizers spell the same number of bytes: bits per byte is comparable.
  byte_tok = tok_lib.ByteTokenizer()
  n_bpe = bpe.token_byte_lengths()[ids].sum()
  n_byte = byte_tok.token_byte_lengths()[byte_tok.encode_corpus(data)].sum()
  assert n_bpe == n_byte == data.size


def test_bpe_save_load_and_named_cache(bpe, tmp_path, monkeypatch):
  bpe.save(tmp_path / "bpe")
  loaded = tok_lib.load_tokenizer(tmp_path / "bpe")
  assert isinstance(loaded, tok_lib.BpeTokenizer)
  assert loaded.encode(TEXT) == bpe.encode(TEXT)
  assert loaded.cache_key == bpe.cache_key and loaded.cache_key.startswith("bpe-403-")
  assert (loaded.eos_id, loaded.bos_id, loaded.vocab_size) == (bpe.eos_id, bpe.bos_id, bpe.vocab_size)
  # A named BPE loads from the cache without training.
  monkeypatch.setenv("MOESPEC_CACHE", str(tmp_path / "cache"))
  bpe.save(tmp_path / "cache" / "tokenizers" / "bpe-403")
  assert tok_lib.load_tokenizer("bpe-403").encode(TEXT) == bpe.encode(TEXT)


def test_bits_per_byte():
  assert tok_lib.bits_per_byte(8 * math.log(2) * 100, 100) == pytest.approx(8.0)
  assert tok_lib.bits_per_byte(math.log(2) * 50, 100) == pytest.approx(0.5)
  with pytest.raises(ValueError):
    tok_lib.bits_per_byte(1.0, 0)


def test_bytes_per_token(bpe, tmp_path):
  for i in range(30):
    (tmp_path / f"m{i}.py").write_text(TEXT * 3, encoding="utf-8")
  assert tok_lib.bytes_per_token(tok_lib.ByteTokenizer(), "train", tmp_path) == 1.0
  assert tok_lib.bytes_per_token(bpe, "train", tmp_path) > 1.3


def test_byte_tokenizer_for_hugging_face_is_one_id_per_byte():
  """hf_tokenizer(): every byte its own id (GPT-2's byte characters), EOS first as in prompt_ids,
  special tokens' text kept as bytes, decoding back to the text."""
  from tokenizers import pre_tokenizers

  chars = tok_lib.byte_level_chars()
  assert len(set(chars)) == 256 and set(chars) == set(pre_tokenizers.ByteLevel.alphabet())
  byte = tok_lib.ByteTokenizer()
  hf = byte.hf_tokenizer()
  text = "".join(chr(c) for c in range(1, 0x800)) + " 😀 <eos><bos>\n"
  assert hf.encode(text).ids == byte.prompt_ids(text)
  assert hf.encode(text, add_special_tokens=False).ids == byte.encode(text)
  assert hf.decode(hf.encode(text).ids) == text


def test_bpe_for_hugging_face_frames_prompts_with_eos(bpe):
  hf = bpe.hf_tokenizer()
  text = "def f(x):\n    return x\n"
  assert hf.encode(text).ids == bpe.prompt_ids(text)
  assert hf.encode(text, add_special_tokens=False).ids == bpe.encode(text)


def test_held_out_prompts_end_on_a_token_boundary(bpe):
  """A prompt's tokens are a prefix of its text's with the body that follows: the
  model continues from a token it saw in training. A bare trailing newline is not."""
  val_text = "\n".join(d.decode("utf-8") for d in corpus.documents("validation"))
  for prompt in corpus.held_out_prompts(8, prompt_bytes=160, seed=0):
    start = val_text.index(prompt)
    with_body = val_text[start : val_text.index("\n", start + len(prompt) + 1)]
    ids = bpe.encode(prompt)
    assert bpe.encode(with_body)[: len(ids)] == ids, prompt
    with_newline = bpe.encode(prompt + "\n")
    assert bpe.encode(with_body)[: len(with_newline)] != with_newline, prompt
