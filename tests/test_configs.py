"""configs/*.py: every file builds a ModelConfig; the shape-only ones carry the published models'
dimensions (their parameter totals) and the model built from them has exactly the parameters
ModelConfig.param_counts counts (shapes only: nothing is allocated)."""

import importlib
import pathlib

import jax
import pytest
from flax import nnx

import configs
from moespec_jax.config import model_config_from
from moespec_jax.model.cache import KVCache
from moespec_jax.model.transformer import Transformer

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"
NAMES = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if not p.stem.startswith("_"))
# Published parameter totals (model cards), without MTP layers.
PUBLISHED_TOTAL = {
  "mixtral_8x7b": 46.7e9,
  "qwen3_30b_a3b": 30.5e9,
  "olmoe_1b_7b": 6.9e9,
  "deepseek_v2_lite": 15.7e9,
  "deepseek_v3": 671e9,
  "gpt_oss_20b": 20.9e9,  # attention sinks and biases (about 0.01%) not modelled
}


# Random-init configs of the memory-bound regime (`--model=config:NAME`), each with a test-size tiny().
MEMBOUND = ("membound_coarse", "membound_fine")


def test_every_published_config_is_checked():
  assert set(PUBLISHED_TOTAL) == set(NAMES) - {"tiny", "small", *MEMBOUND}


@pytest.mark.parametrize("name", MEMBOUND)
def test_membound_configs_have_mtp_heads_and_a_tiny_layout(name):
  full, small = configs.model_config(name), model_config_from(importlib.import_module(f"configs.{name}").tiny().model)
  assert full.num_mtp_modules == small.num_mtp_modules == 1 and full.d_model >= 1024
  assert (small.n_routed_experts, small.top_k, small.n_shared_experts) == (
    full.n_routed_experts,
    full.top_k,
    full.n_shared_experts,
  )
  assert small.param_counts()["total"] < full.param_counts()["total"] / 100


@pytest.mark.parametrize("name", NAMES)
def test_config_builds(name):
  cfg = configs.load(name)
  assert cfg.name == name
  configs.model_config(name)


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTAL))
def test_published_parameter_total(name):
  total = configs.model_config(name).param_counts()["total"]
  assert total == pytest.approx(PUBLISHED_TOTAL[name], rel=0.005)


@pytest.mark.parametrize("name", NAMES)
def test_the_module_has_the_counted_parameters(name):
  # The dense prefix and one MoE layer at the published widths: the counts are linear in layers.
  config = configs.model_config(name)
  config = config.replace(n_layers=config.first_k_dense + 1)
  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(nnx.state(abstract))
  mtp = params.pop("mtp", {})
  assert sum(x.size for x in jax.tree.leaves(params)) == config.param_counts()["total"]
  assert bool(jax.tree.leaves(mtp)) == (config.num_mtp_modules > 0)


@pytest.mark.parametrize(
  "name, values_per_token",
  [
    ("deepseek_v2_lite", 27 * (512 + 64)),
    ("deepseek_v3", 61 * (512 + 64)),  # MLA: latent + rope key
    ("mixtral_8x7b", 32 * 2 * 8 * 128),
    ("qwen3_30b_a3b", 48 * 2 * 4 * 128),
  ],
)
def test_kv_cache_size_per_token(name, values_per_token):
  config = configs.model_config(name)
  cache = jax.eval_shape(lambda: KVCache.for_config(config, 1, 16))
  assert sum(x.size for x in jax.tree.leaves(cache)) == 16 * values_per_token
