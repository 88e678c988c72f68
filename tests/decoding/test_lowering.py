"""Generation programs built for another platform: with the kernel policy resolved for "tpu" or
"cuda", this CPU machine lowers the whole generate program (prefill and loop; plain, MTP drafts,
budgeted) with the Pallas expert kernels inside and no call into the C++ CPU library."""

import dataclasses

import jax
import numpy as np
import pytest

import moespec_jax as msj
from moespec_jax.decoding import loop, programs
from moespec_jax.model import PackedWeights

MLA = dict(attention_type="mla", n_kv_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
SPECS = {
  "plain": msj.SpecParams(kernel="dedup"),
  "mtp3": msj.SpecParams(drafter="mtp", num_draft=3, kernel="dedup"),
  "budgeted": msj.SpecParams(drafter="mtp", num_draft=3, kernel="dedup", mode="budgeted", expert_budget=3),
}
# What each platform's Pallas lowering leaves in the program text.
PALLAS_MARK = {"tpu": "tpu_custom_call", "cuda": "triton"}


@pytest.fixture(scope="module", params=["gqa", "mla"])
def model(request):
  # Powers of two for the Triton blocks (d_model, expert_hidden); two heads sharing one KV head (GQA).
  config = msj.ModelConfig(
    vocab_size=264,
    d_model=64,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    head_dim=32,
    max_seq_len=64,
    n_routed_experts=8,
    top_k=2,
    n_shared_experts=1,
    expert_hidden=32,
    dense_hidden=64,
    first_k_dense=1,
    num_mtp_modules=1,
  )
  if request.param == "mla":
    config = config.replace(**MLA)
  return msj.Model.init(config, seed=0)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("name", list(SPECS))
def test_generate_program_lowers_for_an_accelerator(model, platform, name):
  assert jax.default_backend() == "cpu"  # resolved for the target, not by patching the backend
  spec = SPECS[name]
  policy = programs.kernel_policy(model, spec, platform=platform)
  assert (policy.expert_method, policy.head, policy.dense, policy.attention) == ("dedup", "xla", "xla", "xla")
  # Private on purpose: generate()'s program (`_generate_spec`) and its arguments have no public name.
  _, ls, args = loop._prepare(model, [[1, 2, 3], [4, 5]], 8, None, spec, 0, None)
  ls = dataclasses.replace(ls, kernels=policy)
  params = programs.decode_params(model, policy, jax.tree.leaves(model.state))
  assert params[1] == PackedWeights()  # nothing packed for the C++ products
  args = (args[0], params, *args[2:], np.zeros((ls.max_k + 1,), np.float32), np.zeros(2, np.float32), np.bool_(False))
  program = jax.jit(loop._generate_spec, static_argnums=(0,), static_argnames=("ls",))
  text = program.trace(*args, ls=ls).lower(lowering_platforms=(platform,)).as_text()
  assert PALLAS_MARK[platform] in text.lower()
  assert "moespec_" not in text  # the C++ library's FFI targets
