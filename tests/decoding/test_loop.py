"""The generation loop's host side (moespec_jax/decoding/loop.py): prompts validated and encoded, the
expert budget resolved for a model, and whether programs can read a clock. generate() itself runs in
test_spec_decoding.py and the tests of each feature."""

import jax
import numpy as np
import pytest

import moespec_jax as msj
from moespec_jax.config import ModelConfig
from moespec_jax.data.tokenizer import ByteTokenizer
from moespec_jax.decoding import loop
from moespec_jax.model.budget import ExpertBudget
from pallas_kernels import cpu

TOKENIZER = ByteTokenizer()


def _encode(prompts):
  return loop.encode_prompts(prompts, TOKENIZER, 264, TOKENIZER.eos_id)


def test_strings_are_framed_by_the_tokenizer_and_ids_kept():
  encoded = _encode(["hi", [5, 7, 263], np.array([3], np.int64)])
  np.testing.assert_array_equal(encoded[0], [256, ord("h"), ord("i")])
  np.testing.assert_array_equal(encoded[1], [5, 7, 263])
  np.testing.assert_array_equal(encoded[2], [3])
  assert all(p.dtype == np.int32 for p in encoded)


@pytest.mark.parametrize(
  "prompts, message",
  [
    ([], "non-empty list"),
    ("a string", "non-empty list"),
    ([""], r"prompts\[0\] is an empty string"),
    ([[1], []], r"prompts\[1\] is empty"),
    ([[1.5, 2.0]], r"prompts\[0\] must hold integer token ids"),
    ([[1, 264]], r"prompts\[0\] has token id 264 outside the vocabulary \[0, 264\)"),
    ([[-1]], "token id -1"),
    ([[2**70]], f"token id {2**70} outside"),  # beyond int64: refused, not wrapped
  ],
)
def test_bad_prompts_are_refused_naming_the_prompt(prompts, message):
  with pytest.raises(ValueError, match=message):
    _encode(prompts)


def test_the_expert_budget_resolves_for_the_model():
  config = ModelConfig(n_routed_experts=8, top_k=2)
  assert loop.resolve_budget(msj.SpecParams(), config) is None
  budgeted = msj.SpecParams(mode="budgeted", expert_budget=4, budget_policy="substitute", budget_scope="row")
  assert loop.resolve_budget(budgeted, config) == ExpertBudget(4, "substitute", "row")
  # A budget that cuts nothing is exact mode.
  assert loop.resolve_budget(msj.SpecParams(mode="budgeted", expert_budget=8), config) is None
  with pytest.raises(ValueError, match=r"expert_budget \(1\) must be >= the model's top_k \(2\)"):
    loop.resolve_budget(msj.SpecParams(mode="budgeted", expert_budget=1), config)
  with pytest.raises(ValueError, match="needs a model with MoE layers"):
    loop.resolve_budget(msj.SpecParams(mode="budgeted", expert_budget=4), ModelConfig(n_layers=1, first_k_dense=1))


def test_programs_read_a_clock_on_the_cpu_with_the_library():
  assert loop.loop_clock_available() == (jax.default_backend() == "cpu" and cpu.available())
