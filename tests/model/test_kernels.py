"""`Kernels`, what a model call runs besides its mathematics: the policy, each module's part of the
packed weights, and modules that keep no backend state of their own."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from moespec_jax.model import PLAIN, Kernels, Transformer
from moespec_jax.model.kernels import PACKED_MAX_ROWS, PackedBlock, PackedSwiGLU, PackedWeights, use_packed
from pallas_kernels.policy import KernelPolicy


def test_modules_hold_the_mathematics_only(tiny_config):
  """No packed weights, backend flags or packing methods on any module: a model is its parameters
  and its configuration, whatever program it runs in."""
  module = Transformer(
    tiny_config.replace(
      num_mtp_modules=1, attention_type="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8
    ),
    rngs=nnx.Rngs(0),
  )
  for path, sub in nnx.iter_modules(module):
    names = set(vars(sub))
    assert not {n for n in names if n.startswith(("packed", "cpu_")) or n == "row_invariant"}, (path, names)
    assert not hasattr(sub, "pack") and not hasattr(sub, "set_packed"), path


def test_children_get_their_part_of_the_packed_weights():
  swiglu = PackedSwiGLU(jnp.zeros((1, 2, 3)), jnp.zeros((1, 3, 2)))
  packed = PackedWeights(head_NDC=jnp.zeros((1, 2, 3)), layers=(PackedBlock(attn=None, ffn=swiglu),))
  kernels = Kernels(KernelPolicy(dense="cpu"), packed)
  block = kernels.child("layers", 0)
  assert block.policy is kernels.policy and block.packed.ffn is swiglu
  assert block.child("ffn").dense is swiglu
  assert Kernels(KernelPolicy(dense="xla"), swiglu).dense is None  # the policy decides, not the arrays
  assert Kernels(kernels.policy).child("mtp", 0).packed is None  # nothing packed: nothing for the children
  assert PLAIN.policy == KernelPolicy() and PLAIN.packed is None and PLAIN.child("layers", 1) == PLAIN


def test_packed_products_are_for_passes_of_few_rows():
  w_NDC = np.zeros((1, 4, 64), np.float32)
  assert use_packed(w_NDC, np.zeros((2, PACKED_MAX_ROWS // 2, 4)))
  assert not use_packed(w_NDC, np.zeros((1, PACKED_MAX_ROWS + 1, 4)))
  assert not use_packed(None, np.zeros((1, 1, 4)))
