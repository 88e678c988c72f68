"""MoE-Spec expert budgeting (approximate mode) at the routing and model level."""

import jax.numpy as jnp
import numpy as np
import pytest

from moespec_jax.config import ModelConfig
from moespec_jax.model.budget import ExpertBudget, kept_experts
from moespec_jax.model.moe import route

CFGS = {
  "softmax_renorm": dict(score_func="softmax", norm_topk_prob=True),
  "softmax_plain": dict(score_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.5),
  "sigmoid_bias_groups": dict(
    score_func="sigmoid", norm_topk_prob=True, n_groups=4, topk_groups=2, use_score_bias=True, routed_scaling_factor=2.5
  ),
}


def _cfg(name):
  return ModelConfig(
    vocab_size=264,
    d_model=16,
    n_layers=1,
    n_heads=1,
    n_kv_heads=1,
    head_dim=8,
    n_routed_experts=16,
    top_k=3,
    first_k_dense=0,
    **CFGS[name],
  )


def _inputs(seed, b=2, t=5, e=16):
  rng = np.random.default_rng(seed)
  logits = jnp.asarray(rng.normal(size=(b * t, e)) * 2, jnp.float32)
  bias = jnp.asarray(rng.normal(size=(e,)) * 0.2, jnp.float32)
  return logits, bias


@pytest.mark.parametrize("name", sorted(CFGS))
@pytest.mark.parametrize("policy", ["truncate", "substitute"])
def test_a_budget_covering_every_chosen_expert_is_bit_identical(name, policy):
  cfg = _cfg(name)
  logits, bias = _inputs(0)
  bias = bias if cfg.use_score_bias else None
  ids, gates, probs = route(logits, cfg, bias)
  allowed = jnp.zeros((10, 16), bool).at[:, np.unique(np.asarray(ids))].set(True)
  ids_b, gates_b, _ = route(logits, cfg, bias, allowed_TE=allowed, budget_policy=policy)
  np.testing.assert_array_equal(np.asarray(ids_b), np.asarray(ids))
  np.testing.assert_array_equal(np.asarray(gates_b), np.asarray(gates))


@pytest.mark.parametrize("name", sorted(CFGS))
@pytest.mark.parametrize("scope", ["batch", "row"])
@pytest.mark.parametrize("policy", ["truncate", "substitute"])
def test_tight_budget_uses_only_kept_experts(name, scope, policy):
  cfg = _cfg(name)
  logits, bias = _inputs(1)
  bias = bias if cfg.use_score_bias else None
  ids0, _, probs = route(logits, cfg, bias)
  budget = ExpertBudget(4, policy=policy, scope=scope)
  valid = jnp.ones((2, 5), bool)
  allowed = kept_experts(probs.reshape(2, 5, 16), ids0.reshape(2, 5, -1), valid, budget).reshape(10, 16)
  ids, gates, _ = route(logits, cfg, bias, allowed_TE=allowed, budget_policy=policy)
  ids, gates, allowed = np.asarray(ids), np.asarray(gates), np.asarray(allowed)
  assert np.all(allowed[np.arange(10)[:, None], ids]), "a kernel would read a cut expert"
  groups = [ids] if scope == "batch" else [ids[:5], ids[5:]]
  for g in groups:
    assert len(np.unique(g)) <= 4
  assert np.all(gates >= 0)
  if cfg.norm_topk_prob:
    np.testing.assert_allclose(gates.sum(-1), cfg.routed_scaling_factor, rtol=1e-5)
  if policy == "substitute":
    assert all(len(set(row)) == cfg.top_k for row in ids.tolist()), "substitutes must be distinct"


def test_kept_experts_rank_selected_experts_by_aggregate_probability_of_valid_tokens():
  probs = np.full((1, 3, 4), 0.0, np.float32)
  probs[0, 0] = [0.7, 0.1, 0.1, 0.1]
  probs[0, 1] = [0.1, 0.6, 0.2, 0.1]
  probs[0, 2] = [0.0, 0.0, 0.0, 1.0]  # an invalid token: must not count
  ids = jnp.asarray([[[0], [1], [3]]])
  valid = jnp.asarray([[True, True, False]])
  kept = kept_experts(jnp.asarray(probs), ids, valid, ExpertBudget(2))
  assert np.asarray(kept)[0, 0].tolist() == [True, True, False, False]
  # Both valid tokens chose expert 0: it ranks first; the unselected follow by probability
  # (expert 1: 0.7 > expert 2: 0.3), whatever the invalid token chose.
  ids = jnp.asarray([[[0], [0], [3]]])
  kept = kept_experts(jnp.asarray(probs), ids, valid, ExpertBudget(2))
  assert np.asarray(kept)[0, 0].tolist() == [True, True, False, False]
  kept = kept_experts(jnp.asarray(probs), ids, valid, ExpertBudget(1))
  assert np.asarray(kept)[0, 0].tolist() == [True, False, False, False]


def test_truncation_renormalises_the_remaining_gates():
  cfg = _cfg("softmax_renorm")
  logits = jnp.asarray([[5.0, 4.0, 3.0] + [0.0] * 13], jnp.float32)
  allowed = jnp.asarray([[True, False] + [True] * 14])
  ids, gates, _ = route(logits, cfg, allowed_TE=allowed, budget_policy="truncate")
  p = np.exp([5.0, 3.0])
  assert np.asarray(ids)[0].tolist()[0] == 0 and np.asarray(ids)[0].tolist()[2] == 2
  np.testing.assert_allclose(np.asarray(gates)[0], [p[0] / p.sum(), 0.0, p[1] / p.sum()], rtol=1e-5)
  ids_s, gates_s, _ = route(logits, cfg, allowed_TE=allowed, budget_policy="substitute")
  assert np.asarray(ids_s)[0].tolist()[:2] == [0, 2] and 1 not in np.asarray(ids_s)[0].tolist()


def test_budgeted_model_pass(tiny_model, tiny_config):
  module = tiny_model.module()
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, 6)), jnp.int32)
  exact = module(tokens)
  wide = module(tokens, expert_budget=ExpertBudget(tiny_config.n_routed_experts))
  np.testing.assert_array_equal(np.asarray(wide.logits), np.asarray(exact.logits))
  tight = module(tokens, expert_budget=ExpertBudget(tiny_config.top_k))
  for layer_ids in np.asarray(tight.routing.expert_ids):
    assert len(np.unique(layer_ids)) <= tiny_config.top_k
  assert not np.array_equal(np.asarray(tight.logits), np.asarray(exact.logits))


@pytest.mark.parametrize(
  "kwargs,name",
  [
    (dict(budget=0), "expert_budget"),
    (dict(budget=2.5), "expert_budget"),
    (dict(budget=3, policy="x"), "budget_policy"),
    (dict(budget=3, scope="x"), "budget_scope"),
  ],
)
def test_bad_budgets_name_the_argument(kwargs, name):
  with pytest.raises(ValueError, match=name):
    ExpertBudget(**kwargs)
