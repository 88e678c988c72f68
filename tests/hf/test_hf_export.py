"""Export to a Hugging Face Qwen2-MoE checkpoint: transformers computes our logits and greedy
tokens; Model.load reads it back; layouts Qwen2-MoE cannot express are refused."""

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the HF export tests need torch (dev extra)")
transformers = pytest.importorskip("transformers", reason="the HF export tests need transformers (dev extra)")

from flax import nnx  # noqa: E402

import moespec_jax as msj  # noqa: E402
from moespec_jax.hf import export  # noqa: E402

ATOL = 1e-4


@pytest.fixture(scope="module")
def exported(tiny_config, tmp_path_factory):
  """A random model shaped like the default one (dense first layer, ungated shared expert, no
  biases), its norms perturbed; its export; transformers' model of it."""
  model = msj.Model.init(tiny_config, seed=3)
  pure = nnx.to_pure_dict(model.state)
  rng = np.random.default_rng(0)
  pure = jax.tree_util.tree_map_with_path(
    lambda path, x: (
      (x + 0.2 * rng.standard_normal(x.shape).astype(x.dtype))
      if any(getattr(k, "key", None) == "weight" for k in path)
      else x
    ),
    pure,
  )
  nnx.replace_by_pure_dict(model.state, pure)
  path = model.save_hf(tmp_path_factory.mktemp("export") / "qwen2_moe")
  ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  return model, path, ref


def test_transformers_computes_our_logits(exported):
  model, _, ref = exported
  tokens = np.random.default_rng(1).integers(0, 256, size=(2, 24)).astype(np.int32)
  with torch.no_grad():
    want = ref(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
  diff = np.abs(np.asarray(model.forward(tokens)) - want).max()
  assert diff <= ATOL, f"max |logit diff| {diff}"
  assert type(ref).__name__ == "Qwen2MoeForCausalLM"
  assert type(ref.model.layers[0].mlp).__name__ == "Qwen2MoeMLP"  # the dense first layer


def test_export_round_trips_and_greedy_tokens_match(exported):
  model, path, ref = exported
  back = msj.Model.load(path)
  for field in (
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "n_routed_experts",
    "top_k",
    "expert_hidden",
    "dense_hidden",
    "first_k_dense",
    "norm_topk_prob",
    "vocab_size",
  ):
    assert getattr(back.config, field) == getattr(model.config, field), field
  tokens = np.random.default_rng(2).integers(0, 256, size=(1, 12)).astype(np.int32)
  np.testing.assert_allclose(np.asarray(back.forward(tokens)), np.asarray(model.forward(tokens)), atol=1e-5)
  ours = msj.generate(model, [tokens[0].tolist()], max_new_tokens=16).tokens[0]
  with torch.no_grad():
    ids = torch.tensor(tokens, dtype=torch.long)
    theirs = ref.generate(
      ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, 12:].numpy()
  np.testing.assert_array_equal(ours[ours >= 0], theirs[: int(np.sum(ours >= 0))])


@pytest.mark.parametrize(
  "change, field",
  [
    (
      dict(attention_type="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
      "attention_type",
    ),
    (dict(score_func="sigmoid"), "score_func"),
    (dict(qk_norm="head"), "qk_norm"),
    (dict(n_shared_experts=0), "n_shared_experts"),
  ],
)
def test_layouts_qwen2_moe_cannot_express_are_refused(tiny_config, change, field):
  with pytest.raises(ValueError, match=f"Qwen2-MoE export: {field}="):
    export.qwen2_moe_config(tiny_config.replace(**change))


def test_an_imported_qwen2_moe_exports_to_the_same_model(tmp_path):
  """The branches our own models do not take: a gated shared expert, q/k/v biases and tied
  embeddings (a random transformers Qwen2-MoE, imported, exported, loaded by transformers again)."""
  from moespec_jax.research import tiny_families

  ref = tiny_families.build("qwen2_moe", tmp_path / "original")
  model = msj.Model.load(tmp_path / "original")
  c = model.config
  assert c.shared_expert_gate and c.qkv_bias and c.tie_embeddings
  again = transformers.AutoModelForCausalLM.from_pretrained(
    model.save_hf(tmp_path / "exported"), dtype=torch.float32
  ).eval()
  tokens = torch.tensor(np.random.default_rng(3).integers(0, 250, size=(2, 16)), dtype=torch.long)
  with torch.no_grad():
    diff = (ref(tokens).logits - again(tokens).logits).abs().max().item()
  assert diff <= 1e-5, f"max |logit diff| {diff}"


TEXTS = ["abc", "def f(x):\n    return x  # é, 😀", "a<eos>b<bos>", " , . 's  \t", "x"]


def test_transformers_tokenizer_encodes_prompts_as_the_model_frames_them(exported, tmp_path):
  """AutoTokenizer on the export: tokenizer(text) is model.tokenizer.prompt_ids(text) (EOS, the document
  boundary, first), decoding returns the text, and BOS in every config is that first token."""
  import json

  model, path, _ = exported
  tok = transformers.AutoTokenizer.from_pretrained(path)
  for text in TEXTS:
    ids = tok(text).input_ids
    assert ids == model.tokenizer.prompt_ids(text), text
    assert tok.encode(text, add_special_tokens=False) == model.tokenizer.encode(text), text
    assert tok.decode(ids, skip_special_tokens=True) == text
  framing = model.tokenizer.prompt_ids("abc")[0]
  assert framing == model.config.eos_id == 256
  assert tok.bos_token_id == tok.eos_token_id == framing
  generation = transformers.GenerationConfig.from_pretrained(path)
  assert generation.bos_token_id == generation.eos_token_id == framing
  assert json.loads((path / "config.json").read_text())["bos_token_id"] == framing
  # Read back by Model.load, the export frames and decodes prompts as the original does.
  back = msj.Model.load(path)
  again = msj.Model.load(back.save(tmp_path / "ours"))  # and saved in our format, loaded again
  for text in TEXTS:
    assert back.tokenizer.prompt_ids(text) == again.tokenizer.prompt_ids(text) == model.tokenizer.prompt_ids(text)
    ids = model.tokenizer.encode(text)
    assert back.tokenizer.decode(ids) == model.tokenizer.decode(ids) == text


def test_a_transformers_user_gets_our_greedy_continuations_of_text(exported):
  """Text through the exported tokenizer into transformers' generate: the tokens msj.generate gives
  for the same string prompt."""
  model, path, ref = exported
  tok = transformers.AutoTokenizer.from_pretrained(path)
  for text in ("def fib(n):", "import os\n", "x = [1, 2"):
    ours = msj.generate(model, [text], max_new_tokens=12).tokens[0]
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
      theirs = ref.generate(**enc, max_new_tokens=12, do_sample=False)[0, enc.input_ids.shape[1] :].numpy()
    n = int(np.sum(ours >= 0))
    np.testing.assert_array_equal(ours[:n], theirs[:n])


def test_a_bpe_tokenizer_exports_and_round_trips(tiny_config, tmp_path):
  from moespec_jax.data.tokenizer import BpeTokenizer

  docs = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n", "class A:\n    pass\n"] * 20
  bpe = BpeTokenizer.train(docs, vocab_size=300, min_frequency=1)
  config = tiny_config.replace(vocab_size=bpe.vocab_size, eos_id=bpe.eos_id, bos_id=bpe.bos_id)
  model = msj.Model.init(config, seed=0, tokenizer=bpe)
  path = model.save_hf(tmp_path / "bpe")
  tok = transformers.AutoTokenizer.from_pretrained(path)
  back = msj.Model.load(path)
  for text in TEXTS + docs[:3]:
    assert tok(text).input_ids == bpe.prompt_ids(text) == back.tokenizer.prompt_ids(text), text
    assert tok.encode(text, add_special_tokens=False) == bpe.encode(text), text
    # Our BPE reads special tokens' text as those tokens (and decoding drops them): so does the export.
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == bpe.decode(bpe.encode(text))
    if "<" not in text:
      assert bpe.decode(bpe.encode(text)) == text
  assert tok.bos_token_id == tok.eos_token_id == bpe.eos_id
  assert transformers.GenerationConfig.from_pretrained(path).bos_token_id == bpe.eos_id
