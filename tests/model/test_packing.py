"""`pack_weights`: the head and dense projections as column blocks, laid out as the module tree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moespec_jax as msj
from moespec_jax.model import pack_weights
from moespec_jax.model.kernels import PackedAttention, PackedMLA, PackedMoE, PackedSwiGLU
from pallas_kernels.cpu import PACK_COLUMNS


def _unpacked(w_NDC, n_cols):
  """Column blocks [N, D, C] back to the [D, n_cols] weight."""
  return np.concatenate(list(np.asarray(w_NDC)), axis=1)[:, :n_cols]


@pytest.mark.parametrize(
  "change",
  [
    {},
    dict(attention_type="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=24),
  ],
)
def test_pack_weights_follows_the_module_tree(tiny_config, change):
  config = tiny_config.replace(num_mtp_modules=1, mtp_own_head=True, shared_expert_gate=True, **change)
  module = msj.Model.init(config, seed=2).module()
  packed = pack_weights(module)
  d, v = config.d_model, config.vocab_size
  assert packed.head_NDC.shape == (-(-v // PACK_COLUMNS), d, PACK_COLUMNS)
  np.testing.assert_array_equal(_unpacked(packed.head_NDC, v), module.lm_head_DV[...])
  assert len(packed.layers) == config.n_layers and len(packed.mtp) == 1
  attention = PackedMLA if change else PackedAttention
  for block, layer in zip(packed.layers, module.layers):
    assert isinstance(block.attn, attention)
    assert isinstance(block.ffn, PackedMoE if layer.is_moe else PackedSwiGLU)
  moe, layer = packed.layers[1].ffn, module.layers[1].ffn
  router_DC = np.concatenate([layer.w_router_DE[...], layer.w_shared_gate_D[...][:, None]], axis=1)
  np.testing.assert_array_equal(_unpacked(moe.router_NDC, config.n_routed_experts + 1), router_DC)
  np.testing.assert_array_equal(_unpacked(moe.shared.down_NDC, d), layer.shared.w_down_FD[...])
  if change:
    assert packed.layers[0].attn.qb_NDC is not None
    assert packed.layers[0].attn.uk_HNDC.shape[0] == config.n_heads
  mtp = packed.mtp[0]
  np.testing.assert_array_equal(_unpacked(mtp.head_NDC, v), module.mtp[0].head_DV[...])
  assert isinstance(mtp.block.ffn, PackedMoE)


def test_a_part_not_asked_for_is_not_packed(tiny_config):
  module = msj.Model.init(tiny_config.replace(tie_embeddings=True), seed=0).module()
  head_only = jax.jit(lambda: pack_weights(module, dense=False))()
  np.testing.assert_array_equal(_unpacked(head_only.head_NDC, tiny_config.vocab_size), module.embed_VD[...].T)
  assert head_only.layers is None and head_only.mtp is None
  dense_only = pack_weights(module, head=False)
  assert dense_only.head_NDC is None and dense_only.layers is not None and dense_only.mtp is None
  assert jnp.asarray(dense_only.layers[0].attn.qkv_NDC).dtype == jnp.float32
