"""Hugging Face import: logits, cached decoding and greedy tokens against transformers."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the HF parity tests need torch (dev extra)")
transformers = pytest.importorskip("transformers", reason="the HF parity tests need transformers (dev extra)")

from flax import nnx  # noqa: E402

import moespec_jax as msj  # noqa: E402
from moespec_jax import hf  # noqa: E402
from moespec_jax.model import Kernels  # noqa: E402
from moespec_jax.model import mtp as mtp_lib  # noqa: E402
from moespec_jax.research import tiny_families  # noqa: E402
from pallas_kernels.policy import KernelPolicy  # noqa: E402

SEQ = 24
ATOL = 1e-4


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
  """family -> (transformers model, moespec Model, checkpoint dir)."""
  out = {}
  for family in hf.FAMILIES:
    path = tmp_path_factory.mktemp(family)
    ref = tiny_families.build(family, path)
    out[family] = (ref, msj.Model.load(path), path)
  return out


def _tokens(batch=2, seq=SEQ, seed=0):
  return np.random.default_rng(seed).integers(0, 250, size=(batch, seq)).astype(np.int32)


def _ref_logits(ref, tokens):
  with torch.no_grad():
    return ref(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_logits_match_transformers(pairs, family):
  ref, model, _ = pairs[family]
  tokens = _tokens()
  diff = np.abs(np.asarray(model.forward(tokens)) - _ref_logits(ref, tokens)).max()
  assert diff <= ATOL, f"{family}: max |logit diff| {diff}"


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_cached_decoding_matches_transformers(pairs, family):
  ref, model, _ = pairs[family]
  tokens = _tokens(seed=1)
  want = _ref_logits(ref, tokens)
  module = model.module()
  step = jax.jit(lambda tok, pos, cache: module(tok, pos, cache))
  cache, got = module.new_cache(2, 32), []
  # Passes of 4 tokens (the verify-pass shape of speculative decoding), one compiled program.
  for start in range(0, SEQ, 4):
    pos = jnp.broadcast_to(jnp.arange(start, start + 4, dtype=jnp.int32), (2, 4))
    out = step(jnp.asarray(tokens[:, start : start + 4]), pos, cache)
    got.append(np.asarray(out.logits))
    cache = out.cache
  diff = np.abs(np.concatenate(got, axis=1) - want).max()
  assert diff <= ATOL, f"{family}: cached max |logit diff| {diff}"


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_batch_one_cached_mla_matches_transformers(pairs, family):
  """MLA at batch 1 attends to the cache as it was plus the pass's own entries (its own code
  path); passes of 3 tokens."""
  ref, model, _ = pairs[family]
  tokens = _tokens(batch=1, seed=4)
  want = _ref_logits(ref, tokens)
  module = model.module()
  step = jax.jit(lambda tok, pos, cache: module(tok, pos, cache))
  cache, got = module.new_cache(1, 32), []
  for start in range(0, SEQ, 3):
    n = min(3, SEQ - start)
    out = step(jnp.asarray(tokens[:, start : start + n]), jnp.arange(start, start + n, dtype=jnp.int32)[None], cache)
    got.append(np.asarray(out.logits))
    cache = out.cache
  diff = np.abs(np.concatenate(got, axis=1) - want).max()
  assert diff <= ATOL, f"{family}: batch-1 cached max |logit diff| {diff}"


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_greedy_tokens_match_transformers(pairs, family):
  ref, model, _ = pairs[family]
  prompts = _tokens(batch=2, seq=10, seed=2)
  ours = msj.generate(model, [list(p) for p in prompts], max_new_tokens=16).tokens
  with torch.no_grad():
    theirs = ref.generate(
      torch.tensor(prompts, dtype=torch.long), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
    )[:, prompts.shape[1] :].numpy()
  for row in range(2):
    valid = ours[row][ours[row] >= 0]  # -1 after our EOS
    assert len(valid) >= 1
    np.testing.assert_array_equal(valid, theirs[row, : len(valid)], err_msg=family)


def test_mapped_config_fields(pairs):
  c = pairs["deepseek_v3"][1].config
  assert (c.attention_type, c.score_func, c.use_score_bias, c.n_groups, c.topk_groups) == ("mla", "sigmoid", True, 4, 2)
  assert c.first_k_dense == 1 and c.routed_scaling_factor == 2.5 and c.rope_scaling == "yarn"
  c2 = pairs["deepseek_v2"][1].config
  assert c2.q_lora_rank == 0 and c2.score_func == "softmax" and c2.n_shared_experts == 2
  q2 = pairs["qwen2_moe"][1].config
  assert q2.qkv_bias and q2.shared_expert_gate and q2.tie_embeddings and q2.shared_width == 40
  assert pairs["qwen3_moe"][1].config.qk_norm == "head"
  assert pairs["olmoe"][1].config.qk_norm == "full"
  assert pairs["mixtral"][1].config.norm_topk_prob


def test_mla_cache_holds_latent_and_rope_key(pairs):
  model = pairs["deepseek_v2"][1]
  cache = model.module().new_cache(1, 16)
  c = model.config
  assert cache.keys[0].shape == (1, 16, c.kv_lora_rank)
  assert cache.values[0].shape == (1, 16, c.qk_rope_head_dim)


def test_sharded_and_fused_checkpoints_load_identically(pairs, tmp_path):
  from safetensors.torch import save_file

  ref, model, path = pairs["qwen2_moe"]
  want = np.asarray(model.forward(_tokens()))
  sharded = tmp_path / "sharded"
  ref.save_pretrained(sharded, max_shard_size="40KB")
  assert (sharded / "model.safetensors.index.json").is_file()
  assert len(list(sharded.glob("*.safetensors"))) > 1
  np.testing.assert_array_equal(np.asarray(msj.Model.load(sharded).forward(_tokens())), want)
  # Fused experts, as transformers 5 holds them in memory: experts.gate_up_proj [E, 2F, D].
  fused = tmp_path / "fused"
  fused.mkdir()
  state = {k: v.contiguous() for k, v in ref.state_dict().items() if k != "lm_head.weight"}
  assert any(k.endswith("experts.gate_up_proj") for k in state)
  save_file(state, str(fused / "model.safetensors"))
  (fused / "config.json").write_text((path / "config.json").read_text())
  np.testing.assert_allclose(np.asarray(msj.Model.load(fused).forward(_tokens())), want, atol=1e-6)


def test_bfloat16_cast_option(pairs):
  _, _, path = pairs["mixtral"]
  m = msj.Model.load(path, dtype="bfloat16")
  assert m.config.dtype == "bfloat16"
  assert m.state["embed_VD"][...].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="dtype"):
    msj.Model.load(path, dtype="float64")


def test_tokenizer_json_and_missing_tokenizer(pairs, tmp_path):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  _, model, path = pairs["olmoe"]
  with pytest.raises(ValueError, match="tokenizer.json"):
    model.tokenizer.encode("def f(x):")
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(
    ["def f(x):\n    return x + 1\n"] * 20,
    trainers.BpeTrainer(vocab_size=120, special_tokens=["<|endoftext|>"], show_progress=False),
  )
  with_tok = tmp_path / "with_tok"
  with_tok.mkdir()
  for f in path.iterdir():
    (with_tok / f.name).write_bytes(f.read_bytes())
  tok.save(str(with_tok / "tokenizer.json"))
  loaded = msj.Model.load(with_tok)
  text = "def f(x):\n    return x"
  ids = loaded.tokenizer.encode(text)
  assert loaded.tokenizer.decode(ids) == text and max(ids) < loaded.config.vocab_size
  saved = loaded.save(tmp_path / "resaved")
  again = msj.Model.load(saved)
  assert again.tokenizer.encode(text) == ids
  np.testing.assert_array_equal(np.asarray(again.forward([ids])), np.asarray(loaded.forward([ids])))
  # A string prompt is framed as the checkpoint's tokenizer frames it (as transformers'
  # tokenizer(text) does): no special token here; a BOS where its post-processor adds one.
  assert loaded.tokenizer.prompt_ids(text) == ids
  from tokenizers import processors

  bos = tok.token_to_id("<|endoftext|>")
  tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
  tok.save(str(with_tok / "tokenizer.json"))
  framed = msj.Model.load(with_tok)
  assert framed.tokenizer.prompt_ids(text) == [bos] + ids
  out = msj.generate(framed, [text], max_new_tokens=3)
  np.testing.assert_array_equal(out.tokens, msj.generate(framed, [[bos] + ids], max_new_tokens=3).tokens)


def test_unsupported_layouts_are_refused(pairs):
  q2 = json.loads((pairs["qwen2_moe"][2] / "config.json").read_text())
  with pytest.raises(ValueError, match="mlp_only_layers"):
    hf.to_model_config({**q2, "mlp_only_layers": [1]})
  prefix, _ = hf.to_model_config({**q2, "mlp_only_layers": [1, 0], "intermediate_size": 80})
  assert prefix.first_k_dense == 2 and prefix.dense_hidden == 80
  with pytest.raises(ValueError, match="decoder_sparse_step"):
    hf.to_model_config({**q2, "decoder_sparse_step": 2})
  mx = json.loads((pairs["mixtral"][2] / "config.json").read_text())
  with pytest.raises(ValueError, match="rope scaling type 'linear'"):
    hf.to_model_config({**mx, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}})
  with pytest.raises(ValueError, match="sliding_window"):
    hf.to_model_config({**mx, "sliding_window": 16})
  with pytest.raises(ValueError, match="model_type"):
    hf.to_model_config({**mx, "model_type": "llama"})
  v3 = json.loads((pairs["deepseek_v3"][2] / "config.json").read_text())
  with pytest.raises(ValueError, match="moe_layer_freq"):
    hf.to_model_config({**v3, "moe_layer_freq": 2})


@pytest.mark.slow
def test_deepseek_v3_mtp_layer_is_loaded(pairs, tmp_path):
  from safetensors.numpy import load_file, save_file

  _, model, path = pairs["deepseek_v3"]
  c = model.config
  tensors = load_file(str(path / "model.safetensors"))
  rng = np.random.default_rng(0)
  last, mtp = f"model.layers.{c.n_layers - 1}.", f"model.layers.{c.n_layers}."
  for name in [n for n in tensors if n.startswith(last)]:
    tensors[mtp + name[len(last) :]] = tensors[name].copy()
  d, v = c.d_model, c.vocab_size
  tensors.update(
    {
      mtp + "enorm.weight": np.ones(d, np.float32),
      mtp + "hnorm.weight": np.ones(d, np.float32),
      mtp + "eh_proj.weight": rng.normal(size=(d, 2 * d)).astype(np.float32),
      mtp + "shared_head.norm.weight": np.ones(d, np.float32),
      mtp + "shared_head.head.weight": rng.normal(size=(v, d)).astype(np.float32),
    }
  )
  out = tmp_path / "v3_mtp"
  out.mkdir()
  save_file(tensors, str(out / "model.safetensors"))
  (out / "config.json").write_text((path / "config.json").read_text())
  loaded = msj.Model.load(out)
  (layer,) = nnx.to_pure_dict(loaded.state)["mtp"].values()
  assert layer["w_proj_CD"].shape == (2 * d, d) and layer["head_DV"].shape == (d, v)
  block = jax.tree.map(np.shape, layer["block"])
  assert block["attn"]["w_kv_DC"] == (d, c.kv_lora_rank) and "w_router_DE" in block["ffn"]
  np.testing.assert_array_equal(np.asarray(loaded.forward(_tokens())), np.asarray(model.forward(_tokens())))

  # The layer is the model's MTP drafter module, with its own norm and (here, differing) head.
  lc = loaded.config
  assert (lc.num_mtp_modules, lc.mtp_head_norm, lc.mtp_own_head) == (1, True, True)
  pure = nnx.to_pure_dict(loaded.state)
  for a, b in zip(jax.tree.leaves(pure["mtp"][0]["block"]), jax.tree.leaves(pure["layers"][c.n_layers - 1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Depth-1 logits against DeepSeek-V3's formula written from the raw tensors:
  # head(norm(Block(eh_proj(cat[enorm(emb(t_{i+1})), hnorm(h_i)])))), h the target's final hidden.
  tokens = _tokens(batch=1, seed=3)
  target = loaded.forward_full(tokens)
  (got,) = mtp_lib.forward_train(loaded.module(), target.hidden, jnp.asarray(tokens), 1)

  def rms(x):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.norm_eps)

  emb = tensors["model.embed_tokens.weight"][tokens[0, 1:]]
  h = np.asarray(target.hidden)[0, :-1]
  x = np.concatenate([rms(emb), rms(h)], axis=-1) @ tensors[mtp + "eh_proj.weight"].T
  module = loaded.module()
  n = x.shape[0]
  positions = jnp.arange(n, dtype=jnp.int32)[None]
  rope = module.rope(positions)
  y, _, _ = module.layers[c.n_layers - 1](
    jnp.asarray(x[None], jnp.float32), positions, rope, None, kernels=Kernels(KernelPolicy(expert_method="xla"))
  )
  want = rms(np.asarray(y)[0]) @ tensors[mtp + "shared_head.head.weight"].T
  np.testing.assert_allclose(np.asarray(got)[0], want[: n - 1], atol=1e-4, rtol=1e-4)
  # Usable by the mtp drafter: greedy speculation reproduces plain greedy decoding.
  prompts = [list(range(3, 19)), list(range(40, 52))]
  plain = msj.generate(loaded, prompts, max_new_tokens=12).tokens
  spec = msj.generate(loaded, prompts, max_new_tokens=12, spec=msj.SpecParams(drafter="mtp", num_draft=2))
  np.testing.assert_array_equal(spec.tokens, plain)
