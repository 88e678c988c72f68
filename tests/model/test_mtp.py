"""The MTP modules' bookkeeping (moespec_jax/model/mtp.py): which module and offset serve a draft
depth, their cache, and the teacher-forced logits of training. Their drafts in decoding are checked in
test_spec_decoding.py, their parameters in test_model.py."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from moespec_jax.config import ModelConfig
from moespec_jax.model import Transformer, mtp
from tests.conftest import TINY


@pytest.mark.parametrize(
  "depth, modules, expected", [(1, 1, (0, 0)), (3, 1, (0, 2)), (1, 2, (0, 0)), (2, 2, (1, 0)), (4, 2, (1, 2))]
)
def test_depths_beyond_the_modules_reuse_the_last_one_further_on(depth, modules, expected):
  assert mtp.module_for_depth(depth, modules) == expected


def test_one_cache_layer_per_module():
  config = ModelConfig(num_mtp_modules=2, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8)
  cache = mtp.new_cache(config, batch=3, max_len=16)
  assert len(cache.keys) == 2 and cache.keys[0].shape == (3 * 2, 8, 16)


def test_teacher_forced_logits_per_depth_are_aligned_with_their_targets():
  config = ModelConfig(**{**TINY, "num_mtp_modules": 2})
  model = Transformer(config, rngs=nnx.Rngs(0))
  tokens_BT = jax.random.randint(jax.random.key(1), (2, 10), 0, config.vocab_size)

  @jax.jit
  def run(tokens_BT):
    hidden_BTD = model(tokens_BT).hidden
    return mtp.forward_train(model, hidden_BTD, tokens_BT, 2)

  logits = run(tokens_BT)
  assert [x.shape for x in logits] == [(2, 10 - k - 1, config.vocab_size) for k in (1, 2)]
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in logits)
