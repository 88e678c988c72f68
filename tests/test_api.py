"""The public API: generate, bad inputs, save/load round trip."""

import jax
import numpy as np
import pytest

import moespec_jax as msj


def _greedy_by_forward(model, prompt, n):
  """Plain greedy through repeated full forward passes (no cache): the oracle."""
  seq = list(prompt)
  out = []
  for _ in range(n):
    logits = np.asarray(model.forward(np.asarray([seq], np.int32)))[0, -1]
    tok = int(np.argmax(logits))
    out.append(tok)
    seq.append(tok)
    if tok == model.config.eos_id:
      break
  return out


@pytest.mark.slow
def test_greedy_generate_equals_forward_oracle_on_a_ragged_batch(tiny_model):
  prompts = [[5, 9, 30, 41], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
  out = msj.generate(tiny_model, prompts, max_new_tokens=10)
  assert out.tokens.shape == (3, 10) and out.tokens.dtype == np.int32
  for row, prompt in zip(out.tokens, prompts):
    want = _greedy_by_forward(tiny_model, prompt, 10)
    assert row[: len(want)].tolist() == want


def test_eos_stops_a_row_and_pads_with_minus_one(tiny_model, tiny_config):
  prompts = [[5, 9, 30], [11, 12]]
  ref = msj.generate(tiny_model, prompts, max_new_tokens=8)
  # Declare the third generated token of row 0 to be EOS: generation must stop right after it.
  eos = int(ref.tokens[0, 2])
  model = msj.Model.init(tiny_config.replace(eos_id=eos), seed=0)  # same weights, another EOS id
  out = msj.generate(model, prompts, max_new_tokens=8)
  row = out.tokens[0].tolist()
  first = row.index(eos)
  assert first <= 2 and all(t == -1 for t in row[first + 1 :])
  assert out.stats["generated_tokens"] == int((out.tokens >= 0).sum())


def test_sampling_is_reproducible_and_rows_are_independent(tiny_model):
  params = msj.SamplingParams(temperature=1.0)
  a = msj.generate(tiny_model, [[3, 4, 5]] * 4, max_new_tokens=12, sampling=params, seed=7)
  b = msj.generate(tiny_model, [[3, 4, 5]] * 4, max_new_tokens=12, sampling=params, seed=7)
  c = msj.generate(tiny_model, [[3, 4, 5]] * 4, max_new_tokens=12, sampling=params, seed=8)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert not np.array_equal(a.tokens, c.tokens)
  # Identical prompts in one batch draw different continuations.
  assert len({tuple(r) for r in a.tokens.tolist()}) > 1


def test_stats_have_the_documented_keys(tiny_model, tiny_config):
  out = msj.generate(tiny_model, ["abc", "de"], max_new_tokens=6)
  for key in ("passes", "mean_accepted_length", "acceptance_by_depth", "tokens_per_second", "unique_experts_per_pass"):
    assert key in out.stats
  assert len(out.stats["unique_experts_per_pass"]) == tiny_config.n_moe_layers
  assert all(tiny_config.top_k <= u <= 2 * tiny_config.top_k for u in out.stats["unique_experts_per_pass"])
  assert out.stats["mean_accepted_length"] == pytest.approx(1.0)


def test_string_prompts_use_the_tokenizer(tiny_model):
  out = msj.generate(tiny_model, ["def f(x):"], max_new_tokens=4)
  ids = [tiny_model.config.eos_id] + tiny_model.tokenizer.encode("def f(x):")
  ref = msj.generate(tiny_model, [ids], max_new_tokens=4)
  np.testing.assert_array_equal(out.tokens, ref.tokens)


@pytest.mark.parametrize(
  "prompts,kwargs,name",
  [
    ([[]], {}, "prompts"),
    ([""], {}, "prompts"),
    ([], {}, "prompts"),
    ([[1, 2, 9999]], {}, "vocabulary"),
    ([[1, -2]], {}, "vocabulary"),
    ([[1.5, 2]], {}, "integer token ids"),
    ([[1, 2]], dict(max_new_tokens=63), "max_seq_len"),
    ([[1, 2]], dict(max_new_tokens=0), "max_new_tokens"),
    ([[1, 2]], dict(sampling="greedy"), "sampling"),
  ],
)
def test_bad_inputs_raise_value_error_naming_the_argument(tiny_model, prompts, kwargs, name):
  with pytest.raises(ValueError, match=name):
    msj.generate(tiny_model, prompts, **kwargs)


def test_forward_rejects_bad_tokens(tiny_model):
  with pytest.raises(ValueError, match="vocabulary"):
    tiny_model.forward(np.array([[1, 300]]))
  with pytest.raises(ValueError, match="tokens"):
    tiny_model.forward(np.array([1, 2]))


def test_save_load_round_trip_is_bit_exact(tiny_model, tmp_path):
  path = tiny_model.save(tmp_path / "m")
  loaded = msj.Model.load(path)
  assert loaded.config == tiny_model.config
  for a, b in zip(jax.tree.leaves(tiny_model.state), jax.tree.leaves(loaded.state)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  tokens = np.array([[4, 8, 15, 16, 23, 42]], np.int32)
  np.testing.assert_array_equal(np.asarray(tiny_model.forward(tokens)), np.asarray(loaded.forward(tokens)))
  assert loaded.tokenizer.decode(loaded.tokenizer.encode("héllo")) == "héllo"
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_load_errors_are_clear(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    msj.Model.load(tmp_path / "nothing")
  (tmp_path / "hf").mkdir()
  (tmp_path / "hf" / "config.json").write_text('{"model_type": "mixtral"}')
  with pytest.raises(ValueError, match="Hugging Face"):
    msj.Model.load(tmp_path / "hf")
  (tmp_path / "hf" / "config.json").write_text('{"model_type": "mixtral",')  # cut short
  with pytest.raises(ValueError, match=r"hf/config\.json is not valid JSON"):
    msj.Model.load(tmp_path / "hf")
  (tmp_path / "hf" / "config.json").write_text('{"model_type": "mixtral"}')
  (tmp_path / "hf" / "model.safetensors.index.json").write_text("")
  with pytest.raises(ValueError, match=r"index\.json is not valid JSON"):
    msj.hf.TensorSource(tmp_path / "hf")


def test_greedy_tokens_are_the_same_whichever_expert_kernel(tiny_model):
  prompts = [[5, 9, 30, 41], [7, 8], [1, 2, 3, 4, 5, 6]]
  ref = msj.generate(tiny_model, prompts, max_new_tokens=8, spec=msj.SpecParams(kernel="xla"))
  for kernel in ("dedup", "per_slot", "auto"):
    out = msj.generate(tiny_model, prompts, max_new_tokens=8, spec=msj.SpecParams(kernel=kernel))
    np.testing.assert_array_equal(out.tokens, ref.tokens, err_msg=kernel)


def test_module_is_a_fresh_module_whose_changes_leave_the_model_alone(tiny_model):
  before = np.asarray(tiny_model.state["embed_VD"][...]).copy()
  module = tiny_model.module()
  module.embed_VD[...] = module.embed_VD[...] + 1.0
  np.testing.assert_array_equal(np.asarray(tiny_model.state["embed_VD"][...]), before)
