"""The transformer: cached decoding vs full forward, dropless MoE vs dense reference, routers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels
from moespec_jax.config import ModelConfig
from moespec_jax.model import PLAIN, Kernels, Transformer
from moespec_jax.model import attention as attention_lib
from moespec_jax.model.budget import ExpertBudget
from moespec_jax.model.cache import TreeMask
from moespec_jax.model.kernels import PackedSwiGLU
from moespec_jax.model.moe import masked_to_read_experts, route
from pallas_kernels.policy import KernelPolicy

# Passes against the cache on the C++ attention kernels (XLA's products otherwise, norms as XLA sums).
CPU_ATTENTION = Kernels(KernelPolicy(attention="cpu"))


def test_cached_decoding_equals_full_forward_ragged(tiny_model):
  module = tiny_model.module()
  rng = np.random.default_rng(0)
  lengths = [5, 9, 3]
  total = 14
  tokens = rng.integers(0, 256, size=(3, total)).astype(np.int32)
  full = np.asarray(module(jnp.asarray(tokens)).logits)
  # Prefill each row's own prompt length (right-padded), then feed one token at a time per row.
  prefill = np.zeros((3, 16), np.int32)
  for b, n in enumerate(lengths):
    prefill[b, :n] = tokens[b, :n]
  cache = module.new_cache(3, 32)
  out = module(jnp.asarray(prefill), None, cache)
  for b, n in enumerate(lengths):
    np.testing.assert_allclose(np.asarray(out.logits)[b, :n], full[b, :n], atol=2e-5, rtol=2e-5)
  cache = out.cache
  pos = np.array(lengths)
  step = jax.jit(lambda tok, p, c: module(tok, p, c))
  while (pos < total).any():
    feed = np.minimum(pos, total - 1)
    tok = tokens[np.arange(3), feed][:, None]
    out = step(jnp.asarray(tok), jnp.asarray(feed[:, None]), cache)
    cache = out.cache
    for b in range(3):
      if pos[b] < total:
        np.testing.assert_allclose(np.asarray(out.logits)[b, 0], full[b, pos[b]], atol=2e-5, rtol=2e-5)
    pos = pos + 1


@pytest.mark.slow
def test_multi_token_pass_with_cache_equals_full_forward(tiny_model):
  module = tiny_model.module()
  tokens = np.random.default_rng(1).integers(0, 256, size=(2, 12)).astype(np.int32)
  full = np.asarray(module(jnp.asarray(tokens)).logits)
  cache = module.new_cache(2, 16)
  out1 = module(jnp.asarray(tokens[:, :7]), None, cache)
  pos = jnp.broadcast_to(jnp.arange(7, 12), (2, 5))
  out2 = module(jnp.asarray(tokens[:, 7:]), pos, out1.cache)
  np.testing.assert_allclose(np.asarray(out2.logits), full[:, 7:], atol=2e-5, rtol=2e-5)


def test_cpu_cached_attention_equals_full_forward(tiny_model):
  """Passes against the cache on the C++ kernel (what decoding programs on CPU run): a 7-token
  pass into the cache (and a prefill into a fresh one), then 5 more at ragged positions, against
  the full forward."""
  module = tiny_model.module()
  tokens = np.random.default_rng(1).integers(0, 256, size=(2, 12)).astype(np.int32)
  full = np.asarray(module(jnp.asarray(tokens)).logits)
  step = jax.jit(lambda tok, p, c: module(tok, p, c, kernels=CPU_ATTENTION))
  first = (jnp.asarray(tokens[:, :7]), jnp.broadcast_to(jnp.arange(7), (2, 7)), module.new_cache(2, 16))
  assert step.lower(*first).as_text().count("moespec_attention_f32") == len(module.layers)  # every block's
  out1 = step(*first)
  np.testing.assert_allclose(np.asarray(out1.logits), full[:, :7], atol=2e-5, rtol=2e-5)
  # A prefill into a fresh cache (what generate runs) takes the kernel too, with the same cache.
  prefill = jax.jit(lambda tok, c: module(tok, None, c, kernels=CPU_ATTENTION, fresh_cache=True))
  assert "moespec_attention_f32" in prefill.lower(jnp.asarray(tokens[:, :7]), module.new_cache(2, 16)).as_text()
  fresh = prefill(jnp.asarray(tokens[:, :7]), module.new_cache(2, 16))
  np.testing.assert_allclose(np.asarray(fresh.logits), full[:, :7], atol=2e-5, rtol=2e-5)
  for a, b in zip(jax.tree.leaves(fresh.cache), jax.tree.leaves(out1.cache)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Row 1 re-feeds positions 5..9 (a rollback: what it wrote at 5 and 6 is overwritten).
  pos = jnp.asarray([np.arange(7, 12), np.arange(5, 10)])
  out2 = step(jnp.asarray(np.stack([tokens[0, 7:], tokens[1, 5:10]])), pos, out1.cache)
  np.testing.assert_allclose(np.asarray(out2.logits)[0], full[0, 7:], atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(out2.logits)[1], full[1, 5:10], atol=2e-5, rtol=2e-5)


def test_fresh_cache_prefill_equals_cached_prefill_and_skips_nothing_it_needs(tiny_model):
  """A prefill with fresh_cache=True (own keys only) gives the same hidden states and cache
  as one that also reads the empty cache; the next pass then sees the same cache."""
  module = tiny_model.module()
  tokens = np.random.default_rng(2).integers(0, 256, size=(2, 10)).astype(np.int32)
  prompt = jnp.asarray(tokens[:, :6])
  plain = module(prompt, None, module.new_cache(2, 16))
  fresh = module(prompt, None, module.new_cache(2, 16), fresh_cache=True, compute_logits=False)
  assert fresh.logits is None
  np.testing.assert_allclose(np.asarray(fresh.hidden), np.asarray(plain.hidden), atol=1e-5, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(fresh.cache), jax.tree.leaves(plain.cache)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  assert fresh.cache.keys[0].shape == (2 * module.config.n_kv_heads, module.config.head_dim, 16)
  assert fresh.cache.values[0].shape == (2 * module.config.n_kv_heads, 16, module.config.head_dim)
  pos = jnp.broadcast_to(jnp.arange(6, 10), (2, 4))
  nxt = module(jnp.asarray(tokens[:, 6:]), pos, fresh.cache)
  np.testing.assert_allclose(
    np.asarray(nxt.logits), np.asarray(module(jnp.asarray(tokens)).logits)[:, 6:], atol=2e-5, rtol=2e-5
  )


@pytest.mark.parametrize(
  "attention,cpu_attention,fresh,batch",
  [
    ("gqa", False, True, 2),
    ("gqa", True, True, 2),
    ("gqa", True, False, 1),
    ("mla", False, True, 2),
    ("mla", False, False, 2),
    ("mla", False, False, 1),
    ("mla", True, False, 2),
  ],
)
def test_hidden_at_one_index_gives_the_full_pass_there(
  tiny_config, monkeypatch, attention, cpu_attention, fresh, batch
):
  """`hidden_at_B` (a prefill whose last prompt position alone is read; the MTP fill's last
  module) gives the hidden state and logits of the pass over every index there and every cache
  entry bit for bit, into a fresh cache and against one with earlier entries, on XLA's products
  and on the C++ attention kernels; the last block alone gets `output_at_B`, and its attention
  takes that index's queries only."""
  config = tiny_config.replace(**MLA) if attention == "mla" else tiny_config
  module = Transformer(config, rngs=nnx.Rngs(0))
  kernels = CPU_ATTENTION if cpu_attention else PLAIN
  at_block, kernel_rows = [], []
  block_call = type(module.layers[0]).__call__

  def recording_block(self, *args, **kwargs):
    at_block.append(kwargs.get("output_at_B") is not None)
    return block_call(self, *args, **kwargs)

  def recording(kernel):
    def call(q_NQK, *args):
      kernel_rows.append(q_NQK.shape[1])
      return kernel(q_NQK, *args)

    return call

  monkeypatch.setattr(type(module.layers[0]), "__call__", recording_block)
  for name in ("cached_attention", "mla_attention"):
    monkeypatch.setattr(attention_lib.cpu, name, recording(getattr(attention_lib.cpu, name)))
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(0, 256, size=(batch, 8)).astype(np.int32))
  valid = (jnp.arange(8)[None] < jnp.asarray([[8], [5]]))[:batch]
  at = jnp.asarray([7, 4])[:batch]
  cache, start = module.new_cache(batch, 16), 0
  if not fresh:  # earlier entries at positions 0..3
    cache = module(
      jnp.asarray(rng.integers(0, 256, size=(batch, 4)).astype(np.int32)), None, cache, kernels=kernels
    ).cache
    start = 4
  positions = jnp.broadcast_to(jnp.arange(start, start + 8), (batch, 8))
  at_block.clear(), kernel_rows.clear()
  every = module(tokens, positions, cache, kernels=kernels, valid_BT=valid, fresh_cache=fresh)
  one = module(tokens, positions, cache, kernels=kernels, valid_BT=valid, fresh_cache=fresh, hidden_at_B=at)
  n_layers = config.n_layers
  assert at_block == [False] * n_layers + [False] * (n_layers - 1) + [True]
  if cpu_attention and not (attention == "mla" and fresh):  # MLA's prefills keep XLA's products
    rows_per_index = kernel_rows[0] // 8
    assert kernel_rows == [8 * rows_per_index] * (2 * n_layers - 1) + [rows_per_index]
  rows = np.arange(batch)
  assert one.hidden.shape == (batch, 1, config.d_model) and one.routing is None
  np.testing.assert_allclose(one.hidden[:, 0], every.hidden[rows, at], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(one.logits[:, 0], every.logits[rows, at], atol=1e-5, rtol=1e-5)
  for got, want in zip(jax.tree.leaves(one.cache), jax.tree.leaves(every.cache)):
    np.testing.assert_array_equal(got, want)


def test_hidden_at_index_with_an_expert_budget_is_refused(tiny_config):
  """The last block would rank its budget over the selected indices only: refused, not approximated
  differently from the whole pass."""
  module = Transformer(tiny_config, rngs=nnx.Rngs(0))
  tokens = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="hidden_at_B with expert_budget"):
    module(tokens, None, module.new_cache(1, 8), expert_budget=ExpertBudget(2), hidden_at_B=jnp.asarray([3]))


def test_forward_returns_hidden_and_routing(tiny_model, tiny_config):
  out = tiny_model.forward_full(np.zeros((2, 5), np.int32))
  c = tiny_config
  assert out.logits.shape == (2, 5, c.vocab_size) and out.logits.dtype == jnp.float32
  assert out.hidden.shape == (2, 5, c.d_model)
  assert out.routing.expert_ids.shape == (c.n_moe_layers, 2, 5, c.top_k)
  assert out.routing.gates.shape == (c.n_moe_layers, 2, 5, c.top_k)
  np.testing.assert_allclose(np.asarray(out.routing.probs).sum(-1), 1.0, atol=1e-5)


def test_masked_tokens_read_no_expert_of_their_own():
  rng = np.random.default_rng(3)
  ids = jnp.asarray(rng.integers(0, 16, size=(6, 2)), jnp.int32)
  gates = jnp.asarray(rng.random((6, 2)), jnp.float32)
  valid = jnp.asarray([False, True, True, False, True, False])
  run_ids, run_gates = masked_to_read_experts(ids, gates, valid)
  np.testing.assert_array_equal(run_ids[valid], ids[valid])
  np.testing.assert_array_equal(run_gates[valid], gates[valid])
  assert not np.any(np.asarray(run_gates)[~np.asarray(valid)])
  assert set(np.asarray(run_ids).ravel()) == set(np.asarray(ids)[np.asarray(valid)].ravel())


def test_a_masked_pass_keeps_the_valid_tokens_outputs(tiny_model):
  """Decoding masks finished rows and empty draft slots (a suffix of a row's pass): the valid
  tokens' logits are those of the unmasked pass, the masked ones run no routed expert."""
  module = tiny_model.module()
  rng = np.random.default_rng(4)
  prompt = jnp.asarray(rng.integers(0, 256, size=(2, 8)), jnp.int32)
  cache = module(prompt, None, module.new_cache(2, 16)).cache
  tokens = jnp.asarray(rng.integers(0, 256, size=(2, 4)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(8, 12, dtype=jnp.int32), (2, 4))
  valid = jnp.asarray([[True, True, False, False], [True, True, True, True]])
  full = module(tokens, positions, cache)
  masked = module(tokens, positions, cache, valid_BT=valid)
  np.testing.assert_allclose(
    np.asarray(masked.logits)[np.asarray(valid)], np.asarray(full.logits)[np.asarray(valid)], atol=1e-6, rtol=1e-6
  )
  moe_block = next(block for block in module.layers if block.is_moe)
  h = jnp.asarray(rng.normal(size=(2, 4, module.config.d_model)), jnp.float32)
  y, _ = moe_block.ffn(h, kernels=Kernels(KernelPolicy(expert_method="xla")), valid_BT=valid)
  np.testing.assert_allclose(np.asarray(y)[0, 2:], np.asarray(moe_block.ffn.shared(h))[0, 2:], atol=1e-6)
  assert not np.allclose(np.asarray(y)[0, :2], np.asarray(moe_block.ffn.shared(h))[0, :2], atol=1e-3)


@pytest.mark.parametrize("tied", [False, True])
def test_packed_head_gives_the_xla_head_logits(tiny_config, tied):
  import moespec_jax as msj  # pylint: disable=g-import-not-at-top

  model = msj.Model.init(tiny_config.replace(tie_embeddings=tied), seed=3)
  module = model.module()
  hidden_BTD = jax.random.normal(jax.random.key(0), (2, 3, tiny_config.d_model))
  ref_BTV = module.head(hidden_BTD)
  packed = model.packed_weights(dense=False)
  assert packed.head_NDC is not None and packed.layers is None
  got_BTV = module.head(hidden_BTD, Kernels(KernelPolicy(head="cpu"), packed))
  assert got_BTV.shape == ref_BTV.shape == (2, 3, tiny_config.vocab_size)
  np.testing.assert_allclose(got_BTV, ref_BTV, rtol=1e-5, atol=1e-5)
  assert model.packed_weights(dense=False) is model.packed_weights(dense=False)  # packed once per parameter set


MLA = dict(attention_type="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)


@pytest.mark.parametrize("batch", [1, 2])
def test_cpu_mla_attention_equals_full_forward(tiny_config, batch):
  """MLA passes against the compressed cache on the C++ kernel: a 7-token pass into the cache,
  then 5 more (row 1 re-feeding positions 5..9: a rollback), against the full forward."""
  import moespec_jax as msj  # pylint: disable=g-import-not-at-top

  module = msj.Model.init(tiny_config.replace(**MLA), seed=6).module()
  tokens = np.random.default_rng(1).integers(0, 256, size=(batch, 12)).astype(np.int32)
  full = np.asarray(module(jnp.asarray(tokens)).logits)
  step = jax.jit(lambda tok, p, c: module(tok, p, c, kernels=CPU_ATTENTION))
  first = (jnp.asarray(tokens[:, :7]), jnp.broadcast_to(jnp.arange(7), (batch, 7)), module.new_cache(batch, 16))
  assert step.lower(*first).as_text().count("moespec_mla_attention_f32") == len(module.layers)  # every block's
  out1 = step(*first)
  np.testing.assert_allclose(np.asarray(out1.logits), full[:, :7], atol=2e-5, rtol=2e-5)
  starts = [7, 5][:batch]
  pos = jnp.asarray([np.arange(s0, s0 + 5) for s0 in starts])
  out2 = step(jnp.asarray(np.stack([tokens[b, s0 : s0 + 5] for b, s0 in enumerate(starts)])), pos, out1.cache)
  for b, s0 in enumerate(starts):
    np.testing.assert_allclose(np.asarray(out2.logits)[b], full[b, s0 : s0 + 5], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
  "change", [{}, {"qkv_bias": True, "qk_norm": "head"}, {"qk_norm": "full"}, MLA, dict(MLA, q_lora_rank=24)]
)
def test_packed_dense_projections_give_the_xla_pass(tiny_config, change):
  """Decoding programs on CPU read the attention projections and the dense / shared SwiGLUs
  packed (`Model.packed_weights`, handed to the model as `Kernels`): prefill and cached pass give
  XLA's logits, with q/k/v biases, q/k norms and MLA (queries projected directly or through a
  latent) too. (A row's products do not depend on the other rows of the pass:
  tests/kernels/cpu/test_cpu_ffi.py.)"""
  import moespec_jax as msj  # pylint: disable=g-import-not-at-top

  config = tiny_config.replace(n_shared_experts=1, **change)
  model = msj.Model.init(config, seed=4)
  packed = model.packed_weights(head=False)
  assert model.packed_weights(head=False) is packed  # packed once per parameter set
  assert packed.layers[0].attn is not None and isinstance(packed.layers[0].ffn, PackedSwiGLU)
  assert packed.head_NDC is None and packed.layers[1].ffn.shared.gate_up_NDC is not None
  attn = packed.layers[2].attn
  assert (attn.x_NDC if change.get("attention_type") == "mla" else attn.qkv_NDC) is not None
  tokens = np.random.default_rng(3).integers(0, 256, size=(3, 9)).astype(np.int32)

  def logits(use_packed):
    module = model.module()
    kernels = Kernels(KernelPolicy(dense="cpu"), packed) if use_packed else PLAIN
    prefill = module(jnp.asarray(tokens[:, :6]), None, module.new_cache(3, 16), kernels=kernels)
    pos = jnp.broadcast_to(jnp.arange(6, 9), (3, 3))
    return prefill.logits, module(jnp.asarray(tokens[:, 6:]), pos, prefill.cache, kernels=kernels).logits

  for ref, got in zip(logits(False), logits(True)):
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("own_head", [False, True])
def test_packed_mtp_module_gives_the_xla_logits(tiny_config, own_head):
  """An MTP module's W_p, own head and block are packed with the target's."""
  import moespec_jax as msj  # pylint: disable=g-import-not-at-top
  from moespec_jax.model.layers import rope_tables  # pylint: disable=g-import-not-at-top

  config = tiny_config.replace(num_mtp_modules=1, mtp_own_head=own_head, mtp_head_norm=own_head)
  model = msj.Model.init(config, seed=5)
  packed = model.packed_weights(head=False)
  module_packed = packed.mtp[0]
  assert module_packed.proj_NDC is not None and module_packed.block.attn is not None
  assert module_packed.block.ffn.shared is not None
  assert (module_packed.head_NDC is not None) == own_head
  hidden_BTD, emb_BTD = (jax.random.normal(jax.random.key(i), (2, 5, config.d_model)) for i in range(2))
  positions_BT = jnp.broadcast_to(jnp.arange(5), (2, 5))
  rope = rope_tables(positions_BT, config.head_dim, config.rope_theta)

  def logits(use_packed):
    module = model.module()
    policy = KernelPolicy(expert_method="xla", dense="cpu" if use_packed else "xla")
    model_kernels = Kernels(policy, packed if use_packed else None)
    kernels = model_kernels.child("mtp", 0)
    h_BTD, _, _ = module.mtp[0](hidden_BTD, emb_BTD, positions_BT, rope, None, kernels=kernels)
    return module.mtp[0].logits(module, h_BTD, kernels=kernels, model_kernels=model_kernels)

  np.testing.assert_allclose(logits(True), logits(False), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("change", [{}, {"use_score_bias": True, "score_func": "sigmoid"}])
def test_param_counts_match_the_module(tiny_config, change):
  config = tiny_config.replace(**change)
  _, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
  n = sum(x.size for x in jax.tree.leaves(nnx.to_pure_dict(state)))
  assert n == config.param_counts()["total"]


def test_dropless_moe_equals_dense_all_experts_reference():
  rng = np.random.default_rng(2)
  t, d, e, f, k = 37, 16, 8, 12, 3
  x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
  wg, wu = (jnp.asarray(rng.normal(size=(e, d, f)) / 4, jnp.float32) for _ in range(2))
  wd = jnp.asarray(rng.normal(size=(e, f, d)) / 4, jnp.float32)
  ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), jnp.int32)
  gates = jnp.asarray(rng.random((t, k)), jnp.float32)
  dense = pallas_kernels.expert_ffn_dense(x, ids, gates, wg, wu, wd)
  # Hand-written loop: every token, every chosen expert.
  loop = np.zeros((t, d), np.float32)
  for i in range(t):
    for j in range(k):
      ex = int(ids[i, j])
      h = jax.nn.silu(x[i] @ wg[ex]) * (x[i] @ wu[ex])
      loop[i] += float(gates[i, j]) * np.asarray(h @ wd[ex])
  np.testing.assert_allclose(np.asarray(dense), loop, atol=1e-4, rtol=1e-4)
  got = pallas_kernels.expert_ffn(x, ids, gates, wg, wu, wd, method="xla")
  np.testing.assert_allclose(np.asarray(got), loop, atol=1e-4, rtol=1e-4)


def _route_by_hand(logits, cfg: ModelConfig, bias=None):
  """Per-token numpy reference of every router variant."""
  ids_all, gates_all = [], []
  for row in np.asarray(logits, np.float64):
    if cfg.score_func == "softmax":
      scores = np.exp(row - row.max())
      scores /= scores.sum()
    else:
      scores = 1 / (1 + np.exp(-row))
    choice = scores + (0 if bias is None else np.asarray(bias))
    if cfg.n_groups > 1:
      size = len(row) // cfg.n_groups
      group_scores = []
      for g in range(cfg.n_groups):
        members = np.sort(choice[g * size : (g + 1) * size])[::-1]
        group_scores.append(members[:2].sum() if bias is not None else members[0])
      keep = np.argsort(group_scores)[::-1][: cfg.topk_groups]
      masked = np.full_like(choice, -np.inf)
      for g in keep:
        masked[g * size : (g + 1) * size] = choice[g * size : (g + 1) * size]
      choice = masked
    ids = np.argsort(-choice, kind="stable")[: cfg.top_k]
    gates = scores[ids]
    if cfg.norm_topk_prob:
      gates = gates / gates.sum()
    ids_all.append(ids)
    gates_all.append(gates * cfg.routed_scaling_factor)
  return np.array(ids_all), np.array(gates_all)


ROUTERS = {
  "mixtral_softmax_renorm": dict(score_func="softmax", norm_topk_prob=True),
  "qwen_olmoe_softmax_no_renorm": dict(score_func="softmax", norm_topk_prob=False),
  "deepseek_v2_group_limited": dict(
    score_func="softmax", norm_topk_prob=False, n_groups=4, topk_groups=2, routed_scaling_factor=1.5
  ),
  "deepseek_v3_sigmoid_bias_groups": dict(
    score_func="sigmoid", norm_topk_prob=True, n_groups=4, topk_groups=2, use_score_bias=True, routed_scaling_factor=2.5
  ),
  "sigmoid_no_groups": dict(score_func="sigmoid", norm_topk_prob=True),
}


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_router_variants_match_hand_written_reference(name):
  cfg = ModelConfig(
    vocab_size=264,
    d_model=16,
    n_layers=1,
    n_heads=1,
    n_kv_heads=1,
    head_dim=8,
    n_routed_experts=16,
    top_k=3,
    first_k_dense=0,
    **ROUTERS[name],
  )
  rng = np.random.default_rng(3)
  logits = rng.normal(size=(50, 16)).astype(np.float32) * 2
  bias = rng.normal(size=(16,)).astype(np.float32) * 0.3 if cfg.use_score_bias else None
  ids, gates, probs = route(jnp.asarray(logits), cfg, None if bias is None else jnp.asarray(bias))
  want_ids, want_gates = _route_by_hand(logits, cfg, bias)
  # Same expert sets with the same gates (top_k returns them in score order).
  np.testing.assert_array_equal(np.asarray(ids), want_ids)
  np.testing.assert_allclose(np.asarray(gates), want_gates, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, atol=1e-5)


def test_config_rejects_bad_values():
  with pytest.raises(ValueError, match="top_k"):
    ModelConfig(n_routed_experts=4, top_k=5)
  with pytest.raises(ValueError, match="n_kv_heads"):
    ModelConfig(n_heads=3, n_kv_heads=2)
  with pytest.raises(ValueError, match="n_groups"):
    ModelConfig(n_routed_experts=32, n_groups=3)
  with pytest.raises(ValueError, match="unknown fields"):
    ModelConfig.from_dict({"d_modle": 3})


TREE_PARENTS = [-1, -1, 0, 0, 1, 2]  # the root (pending token) has nodes 0 and 1; 0 has 2 and 3; ...


@pytest.mark.parametrize(
  "change,kernels", [({}, PLAIN), ({}, CPU_ATTENTION), (MLA, PLAIN)], ids=["gqa", "gqa-cpu", "mla"]
)
@pytest.mark.parametrize("batch", [1, 2])
def test_a_tree_pass_gives_each_node_its_paths_logits_and_moving_the_path_continues_it(
  tiny_config, change, kernels, batch
):
  """A tree pass (ancestor mask, positions by depth, written at consecutive slots; XLA's attention,
  or the C++ kernel with the mask as bits): every node's logits are those of the full forward over
  the prompt and the node's path; once the cache has moved an accepted path to consecutive slots
  (`KVCache.move_path`), the next pass continues it as if the path had been the pass."""
  import moespec_jax as msj  # pylint: disable=g-import-not-at-top
  from moespec_jax.decoding import rejection  # pylint: disable=g-import-not-at-top

  config = tiny_config.replace(**change)
  module = msj.Model.init(config, seed=7).module()
  rng = np.random.default_rng(2)
  lengths = [5, 3][:batch]  # row 1: a shorter prompt (its own positions)
  prompt = rng.integers(0, 256, size=(batch, 5)).astype(np.int32)
  root = rng.integers(0, 256, size=(batch,)).astype(np.int32)
  nodes = rng.integers(0, 256, size=(batch, len(TREE_PARENTS))).astype(np.int32)
  parent_BN = jnp.broadcast_to(jnp.asarray(TREE_PARENTS), (batch, len(TREE_PARENTS)))
  depth = np.asarray(rejection.node_depths(parent_BN))
  cache = module.new_cache(batch, 20)
  pre = module(jnp.asarray(prompt), None, cache, fresh_cache=True)
  pos = np.asarray(lengths)
  tree = module(
    jnp.asarray(np.concatenate([root[:, None], nodes], axis=1)),
    jnp.asarray(pos[:, None] + np.concatenate([np.zeros((batch, 1), int), depth], axis=1)),
    pre.cache,
    kernels=kernels,
    tree=TreeMask.over_pass(jnp.asarray(pos), rejection.ancestor_mask(parent_BN)),
  )

  def path_of(j):  # node j's path, root first
    path = [j]
    while TREE_PARENTS[path[-1]] >= 0:
      path.append(TREE_PARENTS[path[-1]])
    return path[::-1]

  for b, n in enumerate(lengths):
    # Every node's sequence in one causal forward, padded at the end: the logits at its last token.
    seqs = [np.concatenate([prompt[b, :n], [root[b]], nodes[b, path_of(j)] if j >= 0 else []]) for j in range(-1, 6)]
    padded = np.stack([np.pad(q, (0, 10 - len(q))) for q in seqs]).astype(np.int32)
    ref = np.asarray(module(jnp.asarray(padded)).logits)[np.arange(len(seqs)), [len(q) - 1 for q in seqs]]
    np.testing.assert_allclose(np.asarray(tree.logits)[b], ref, atol=2e-5, rtol=2e-5, err_msg=f"row {b}")
  # Accept node 1 then its child 4: their entries move to the slots after the root.
  source = np.asarray([1, 4, 2, 3, 4, 5])
  moved = tree.cache.move_path(
    jnp.asarray(pos + 1),
    jnp.broadcast_to(jnp.asarray(source), (batch, len(source))),
    key_major=config.attention_type != "mla",
  )
  nxt = rng.integers(0, 256, size=(batch, 1)).astype(np.int32)
  out = module(jnp.asarray(nxt), jnp.asarray(pos[:, None] + 3), moved)
  for b, n in enumerate(lengths):
    seq = np.concatenate([prompt[b, :n], [root[b]], nodes[b, [1, 4]], nxt[b]]).astype(np.int32)
    ref = np.asarray(module(jnp.asarray(seq[None])).logits)[0, -1]
    np.testing.assert_allclose(np.asarray(out.logits)[b, 0], ref, atol=2e-5, rtol=2e-5)


def test_a_tree_level_reads_the_earlier_levels_its_window_marks(tiny_config):
  """A drafter's tree built level by level (`TreeMask` with a window beyond the pass): level 2's
  nodes, written after level 1's slots, see the committed cache, their level-1 parent and
  themselves, and get the logits of the full forward over the prompt and their path."""
  import moespec_jax as msj  # pylint: disable=g-import-not-at-top

  module = msj.Model.init(tiny_config, seed=8).module()
  rng = np.random.default_rng(4)
  prompt = rng.integers(0, 256, size=(2, 6)).astype(np.int32)
  level1 = rng.integers(0, 256, size=(2, 3)).astype(np.int32)  # three children of the prompt's end
  level2 = rng.integers(0, 256, size=(2, 3)).astype(np.int32)  # under level-1 nodes 2, 0, 2
  parents = np.asarray([2, 0, 2])
  pre = module(jnp.asarray(prompt), None, module.new_cache(2, 24), fresh_cache=True)
  base = jnp.full((2,), 6, jnp.int32)
  window = 6
  mask1 = np.zeros((2, 3, window), bool)
  mask1[:, np.arange(3), np.arange(3)] = True
  out1 = module(
    jnp.asarray(level1), jnp.full((2, 3), 6, jnp.int32), pre.cache, tree=TreeMask(base, base, jnp.asarray(mask1))
  )
  mask2 = mask1[:, parents] | np.eye(3, window, 3, dtype=bool)[None]
  out2 = module(
    jnp.asarray(level2), jnp.full((2, 3), 7, jnp.int32), out1.cache, tree=TreeMask(base, base + 3, jnp.asarray(mask2))
  )
  for i in range(3):
    seq = np.concatenate([prompt, level1[:, parents[i] : parents[i] + 1], level2[:, i : i + 1]], axis=1)
    ref = np.asarray(module(jnp.asarray(seq)).logits)[:, -1]
    np.testing.assert_allclose(np.asarray(out2.logits)[:, i], ref, atol=2e-5, rtol=2e-5)
