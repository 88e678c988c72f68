"""The whole jitted generation on a mesh: greedy tokens equal one device's for plain decoding, MTP
and n-gram drafts, auto K, the budgeted mode and draft trees; sampled tokens equal for a fixed seed;
a router that sends every token to one rank; the per-rank statistics."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moespec_jax as msj
from moespec_jax.decoding import loop, passes, programs
from moespec_jax.model.cache import KVCache
from moespec_jax.parallel import mesh as mesh_lib
from moespec_jax.parallel import placement
from tests.mesh.conftest import MESHES

PROMPTS = [[5 + i, 6, 7, 8, 9, 10][: 2 + i % 5] for i in range(8)]
NEW = 20
SPECS = {
  "plain": msj.SpecParams(),
  "mtp3": msj.SpecParams(drafter="mtp", num_draft=3),
  "ngram3": msj.SpecParams(drafter="ngram", num_draft=3),
  "auto": msj.SpecParams(drafter="mtp", num_draft="auto", max_draft=3),
  "budgeted": msj.SpecParams(drafter="mtp", num_draft=3, mode="budgeted", expert_budget=3),
  "tree": msj.SpecParams(drafter="mtp", num_draft=2, tree_nodes=4),
}
# Every spec on the two-by-four mesh; plain and MTP drafts on the others too.
CASES = [((2, 4), name) for name in SPECS] + [
  (shape, name) for shape in MESHES if shape != (2, 4) for name in ("plain", "mtp3")
]


@pytest.fixture(scope="module")
def one_device_tokens(one_device):
  cache = {}

  def tokens(name, sampling=None):
    key = (name, sampling)
    if key not in cache:
      cache[key] = msj.generate(one_device, PROMPTS, NEW, sampling=sampling, spec=SPECS[name]).tokens
    return cache[key]

  return tokens


@pytest.mark.parametrize(("shape", "name"), CASES)
def test_greedy_tokens_equal_one_device(on_mesh, one_device_tokens, shape, name):
  out = msj.generate(on_mesh[shape], PROMPTS, NEW, spec=SPECS[name])
  np.testing.assert_array_equal(out.tokens, one_device_tokens(name))
  assert out.stats["expert_ranks"] == shape[1]


def test_sampled_tokens_equal_one_device_for_a_seed(on_mesh, one_device_tokens):
  sampling = msj.SamplingParams(temperature=1.0, top_p=0.95)
  for name in ("plain", "mtp3"):
    out = msj.generate(on_mesh[(2, 4)], PROMPTS, NEW, sampling=sampling, spec=SPECS[name])
    np.testing.assert_array_equal(out.tokens, one_device_tokens(name, sampling), err_msg=name)


def test_per_rank_statistics_add_up(on_mesh, one_device_tokens, mtp_config):
  stats = msj.generate(on_mesh[(2, 4)], PROMPTS, NEW, spec=SPECS["plain"]).stats
  assert np.all(one_device_tokens("plain") >= 0)  # no row ends early: every pass runs all 8 rows
  load = np.asarray(stats["assignments_per_rank_per_pass"])
  assert load.shape == (4,) and load.sum() == pytest.approx(len(PROMPTS) * mtp_config.top_k)
  unique = np.asarray(stats["unique_experts_per_rank_per_pass"])
  assert np.all(unique <= mtp_config.n_routed_experts // 4)
  assert unique.sum() == pytest.approx(np.mean(stats["unique_experts_per_pass"]))
  assert 1.0 <= stats["max_over_mean_rank_load"] <= 4.0
  # A plain pass of 8 rows: each MoE layer's [8, d_model] float32 output summed over 4 ranks.
  layer_bytes = len(PROMPTS) * mtp_config.d_model * 4
  assert stats["combine_bytes_per_pass"] == pytest.approx(mtp_config.n_moe_layers * 1.5 * layer_bytes)


def test_a_router_that_sends_every_token_to_one_rank(mtp_config):
  # The score bias steers selection only: experts 0 and 1 (rank 0's of four) win every choice.
  config = mtp_config.replace(use_score_bias=True)
  model = msj.Model.init(config, seed=3)
  module = model.module()
  for layer in module.layers[config.first_k_dense :]:
    layer.ffn.score_bias_E[...] = jnp.zeros((config.n_routed_experts,)).at[:2].set(10.0)
  skewed = msj.Model.from_module(module, model.tokenizer)
  placed = skewed.on_mesh(mesh_lib.make_mesh(2, 4))
  want = msj.generate(skewed, PROMPTS, NEW, spec=SPECS["mtp3"]).tokens
  out = msj.generate(placed, PROMPTS, NEW, spec=SPECS["mtp3"])
  np.testing.assert_array_equal(out.tokens, want)
  load = np.asarray(out.stats["assignments_per_rank_per_pass"])
  assert load[0] > 0 and np.all(load[1:] == 0)
  assert out.stats["max_over_mean_rank_load"] == pytest.approx(4.0)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_the_mesh_program_lowers_for_accelerators(on_mesh, platform):
  # As tests/decoding/test_lowering.py, on the mesh: the Pallas kernels inside the shard_map, the
  # partial outputs summed across the expert axis, no call into the C++ CPU library.
  model, spec = on_mesh[(2, 4)], msj.SpecParams(drafter="mtp", num_draft=3, kernel="dedup")
  policy = programs.kernel_policy(model, spec, platform=platform)
  assert policy.experts == model.expert_sharding()
  # Private on purpose: generate()'s program (`_generate_spec`) and its arguments have no public name.
  _, ls, args = loop._prepare(model, PROMPTS[:2], 8, None, spec, 0, None)
  ls = dataclasses.replace(ls, kernels=policy)
  params = programs.decode_params(model, policy, jax.tree.leaves(model.state))
  args = (args[0], params, *args[2:], np.zeros((ls.max_k + 1,), np.float32), np.zeros(2, np.float32), np.bool_(False))
  program = jax.jit(loop._generate_spec, static_argnums=(0,), static_argnames=("ls",))
  text = program.trace(*args, ls=ls).lower(lowering_platforms=(platform,)).as_text()
  assert {"tpu": "tpu_custom_call", "cuda": "triton"}[platform] in text.lower()
  assert "all_reduce" in text and "moespec_" not in text


def test_the_kv_cache_is_sharded_on_the_data_axis(on_mesh, mtp_config):
  # Each data shard holds its own rows' cache (the cache's leading axis is rows x KV heads).
  model = on_mesh[(2, 4)]
  _, ls, _ = loop._prepare(model, PROMPTS, NEW, None, SPECS["plain"], 0, None)
  cache = KVCache.for_config(mtp_config, len(PROMPTS), 32)
  placed = jax.jit(lambda c: passes.cache_on_rows(c, ls))(cache)
  for leaf in jax.tree.leaves(placed):
    assert leaf.sharding.spec == jax.sharding.PartitionSpec("data")
    assert {shard.data.shape[0] for shard in leaf.addressable_shards} == {leaf.shape[0] // 2}
  # Without a data axis it is left as it is.
  _, ls_one, _ = loop._prepare(on_mesh[(1, 8)], PROMPTS, NEW, None, SPECS["plain"], 0, None)
  assert passes.cache_on_rows(cache, ls_one) is cache


def test_a_placement_realised_by_renumbering_keeps_the_tokens(one_device, one_device_tokens):
  # Experts placed by their popularity (here: a random one), realised as the mesh's contiguous
  # shards by renumbering them: an equivalent model, the same greedy tokens on the mesh.
  config = one_device.config
  popularity = np.random.default_rng(0).random((config.n_moe_layers, config.n_routed_experts))
  order = placement.expert_order(placement.by_popularity(popularity, 8))
  placed = one_device.renumber_experts(order).on_mesh(mesh_lib.make_mesh(1, 8))
  assert not np.array_equal(order, np.tile(np.arange(config.n_routed_experts), (config.n_moe_layers, 1)))
  out = msj.generate(placed, PROMPTS, NEW, spec=SPECS["mtp3"])
  np.testing.assert_array_equal(out.tokens, one_device_tokens("mtp3"))
