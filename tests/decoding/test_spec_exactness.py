"""Statistical exactness of speculative sampling in the whole loop (`msj.generate`, MTP drafter).

With a deliberately poor drafter (random MTP heads, K = 2), N_ROWS rows of one prompt in one
jitted call. A small-vocabulary variant of the tiny test model keeps exact enumeration cheap.

- Against the target computed apart (`Model.forward` over every prefix): the joint law of the
  first four tokens (marginals and a pair; drafts, residuals and the bonus all occur there), and
  the conditional of each of tokens 2-4 given the tokens before it, pooled over the rows
  (exactness.pooled_chi_square_test: each row's token against its own exact conditional). Token
  2 is the first drafted position: its conditional given token 1 is where a verification fault
  shows undiluted, not spread over the joint's hundreds of cells.
- Inside the loop: `rejection.verify_sampled` is replaced by a stand-in (recorded.py) that runs
  the real rule and records every pass's p, q, drafts and outcome (a host callback). Then: the p
  handed to verification equals plain sampling's p from `Model.forward` at the same positions
  (a deterministic check: a filter missing on the target side fails it); the drafts follow the q
  handed to verification (what they were drawn from: a q mismatch fails it); the realised
  acceptance at each depth matches Sum_x min(p, q) summed over the passes that reached it; every
  token verification emits follows its p (`emitted`), and `q>p mass`, the share of emitted tokens
  the draft overweights against its expectation, is the one-degree-of-freedom test where a biased
  acceptance, residual or bonus moves mass.
- Planted faults (faults.py), chosen at run time inside the same compiled program (one
  compilation per setting), must fail the checks that name them.

Power (exactness.py computes it; each test prints it and docs/findings/2026-12-06-exactness-power.md
lists it): with MAX_NEW_TOKENS = 6, 16,000-20,000 passes reach depth 1 at acceptance 0.3-0.5, so
`accept@1` detects a relative error of 5-12% and `q>p mass` (22,000-28,000 emitted tokens) one of
7-16% in that share, at alpha 1e-4 with power 0.99. The conditionals of 4,300-5,300 rows over 32
tokens detect only large excesses in one cell (25-50% at best): they guard the target's
independence from the instrumentation, the recorded checks carry the power.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moespec_jax as msj
from moespec_jax.decoding import drafters, rejection
from moespec_jax.decoding.sampling import filtered_logprobs
from tests.decoding import exactness, recorded

VOCAB, EOS = 32, 31
PROMPT = [3, 7, 11]
N_TOKENS, K, N_ROWS = 4, 2, 6000
MAX_NEW_TOKENS = 6
SEED = 11
SETTINGS = {
  "t1": msj.SamplingParams(temperature=1.0),
  "t0.7_top_p0.9": msj.SamplingParams(temperature=0.7, top_p=0.9),
  "top_k5": msj.SamplingParams(temperature=1.0, top_k=5),
}
# Planted faults run in the loop (setting t1) -> the checks that must reject them.
PLANTED = {
  "residual_is_p": ("emitted", "q>p mass", "t2 given t1"),
  "bonus_from_q": ("emitted", "q>p mass"),
  "accept_inflated": ("accept@1", "q>p mass"),
}


def stat_model_config(tiny_config):
  return tiny_config.replace(vocab_size=VOCAB, eos_id=EOS, num_mtp_modules=1)


@pytest.fixture(scope="module")
def stat_model(tiny_config):
  return msj.Model.init(stat_model_config(tiny_config), seed=2)


def enumerate_prefix_logits(model):
  """Target logits after every prefix of up to N_TOKENS - 1 generated tokens: {level: [V^l, V]}."""
  width = len(PROMPT) + N_TOKENS - 1
  chunk = 4096
  out = {}
  for level in range(N_TOKENS):
    combos = np.array(list(itertools.product(range(VOCAB), repeat=level)), np.int32)
    combos = combos.reshape(VOCAB**level, level)
    rows = np.zeros((len(combos), width), np.int32)
    rows[:, : len(PROMPT)] = PROMPT
    rows[:, len(PROMPT) : len(PROMPT) + level] = combos
    logits = []
    for start in range(0, len(rows), chunk):
      block = np.zeros((chunk, width), np.int32)
      part = rows[start : start + chunk]
      block[: len(part)] = part
      got = np.asarray(model.forward(block))[: len(part), len(PROMPT) + level - 1]
      logits.append(got)
    out[level] = np.concatenate(logits)
  return out


def prefix_probabilities(prefix_logits) -> dict[str, dict[int, np.ndarray]]:
  """The exact target after every prefix, per setting: {setting: {level: [V^l, V]}} (float64)."""
  return {
    name: {level: _probs(logits, sampling) for level, logits in prefix_logits.items()}
    for name, sampling in SETTINGS.items()
  }


@pytest.fixture(scope="module")
def prefix_probs(stat_model):
  return prefix_probabilities(enumerate_prefix_logits(stat_model))


def _probs(logits, sampling) -> np.ndarray:
  return np.exp(np.asarray(filtered_logprobs(jnp.asarray(logits), sampling), np.float64))


def exact_joint(probs_by_level):
  """P(t_1..t_N) over V + 1 symbols per token (symbol V: stopped after EOS)."""
  s = VOCAB + 1
  joint = np.ones(())
  for level in range(N_TOKENS):
    p = probs_by_level[level]
    cond = np.zeros((s,) * level + (s,))
    cond[(slice(0, VOCAB),) * level + (slice(0, VOCAB),)] = p.reshape((VOCAB,) * level + (VOCAB,))
    if level:
      stopped = np.zeros((s,) * level, bool)
      stopped[(slice(None),) * (level - 1) + (EOS,)] = True
      stopped[(slice(None),) * (level - 1) + (VOCAB,)] = True
      cond[stopped] = 0.0
      cond[stopped, VOCAB] = 1.0
    joint = joint[..., None] * cond
  return joint


def chi_square_pvalue(counts, probs):
  """Pearson chi-square p-value, sparse cells pooled (exactness.chi_square_test). A count in a
  cell of probability 0 returns 0."""
  return exactness.chi_square_test(counts, probs).pvalue


def pvalues(tokens, joint):
  s = VOCAB + 1
  result = {}
  for i in range(1, N_TOKENS):
    marginal = joint.sum(axis=tuple(a for a in range(N_TOKENS) if a != i))
    result[f"t{i + 1}"] = chi_square_pvalue(np.bincount(tokens[:, i], minlength=s), marginal)
  pair = joint.sum(axis=tuple(a for a in range(N_TOKENS) if a not in (1, 2)))
  pair_counts = np.bincount(tokens[:, 1] * s + tokens[:, 2], minlength=s * s)
  result["t2,t3"] = chi_square_pvalue(pair_counts, pair)
  return result


def conditional_checks(tokens, probs_by_level) -> dict[str, exactness.Check]:
  """Token i + 1 (i = 1..N_TOKENS - 1) of each row still running, against its exact conditional
  given the row's tokens 1..i (pooled over rows)."""
  checks = {}
  for i in range(1, N_TOKENS):
    running = np.all((tokens[:, :i] >= 0) & (tokens[:, :i] != EOS), axis=1)
    index = np.ravel_multi_index(tuple(tokens[running, :i].T), (VOCAB,) * i)
    given = ",".join(f"t{g + 1}" for g in range(i))
    checks[f"t{i + 1} given {given}"] = exactness.pooled_chi_square_test(tokens[running, i], probs_by_level[i][index])
  return checks


@pytest.fixture(scope="module")
def loop_runs(stat_model):
  """`get(setting, fault=None)`: a generation under the instrumented verification (cached)."""
  with recorded.instrumented_verification(tuple(PLANTED)) as instrumented:
    yield functools.cache(lambda setting, fault=None: generate_recorded(stat_model, instrumented, setting, fault))


@pytest.fixture(scope="module")
def loop_check_results(loop_runs, prefix_probs):
  """`get(setting, fault=None)`: `loop_checks` of that generation (cached)."""
  return functools.cache(lambda setting, fault=None: loop_checks(loop_runs(setting, fault), prefix_probs[setting]))


def generate_recorded(model, instrumented: recorded.Instrumented, setting: str, fault: str | None) -> recorded.LoopRun:
  return recorded.generate(
    instrumented,
    fault,
    model,
    [PROMPT] * N_ROWS,
    MAX_NEW_TOKENS,
    SETTINGS[setting],
    msj.SpecParams(drafter="mtp", num_draft=K),
    SEED,
  )


def loop_checks(run: recorded.LoopRun, probs_by_level) -> dict[str, exactness.Check]:
  """The recorded checks and the conditionals against the exact target."""
  return dict(recorded.recorded_checks(run), **conditional_checks(first_tokens(run), probs_by_level))


def first_tokens(run: recorded.LoopRun) -> np.ndarray:
  """The first N_TOKENS tokens, symbol V after EOS."""
  return np.where(run.tokens < 0, VOCAB, run.tokens)[:, :N_TOKENS]


def plain_sampling_logits(model, run: recorded.LoopRun) -> np.ndarray:
  """Logits of every output index from `Model.forward` over the prompt and the tokens before it: [B, N, V]."""
  seq = np.concatenate([np.tile(PROMPT, (run.tokens.shape[0], 1)), np.maximum(run.tokens[:, :-1], 0)], axis=1)
  return np.asarray(model.forward(seq))[:, len(PROMPT) - 1 :]


def near_filter_cut(logits_RV, sampling, tol: float = 1e-5) -> np.ndarray:
  """Rows whose top-k or top-p cut is within `tol` of moving (scaled logits at the k-th place;
  mass before a token at top_p): two computations of the same logits that differ in their last
  bits may keep different tokens there, which is no fault of the wiring."""
  scaled_RV = np.asarray(logits_RV, np.float64) / sampling.temperature
  near_R = np.zeros(len(scaled_RV), bool)
  if 0 < sampling.top_k < VOCAB:
    sorted_RV = -np.sort(-scaled_RV, axis=1)
    near_R |= sorted_RV[:, sampling.top_k - 1] - sorted_RV[:, sampling.top_k] < tol
  if sampling.top_p < 1.0:
    p_RV = _probs(logits_RV, dataclasses.replace(sampling, top_p=1.0))
    sorted_RV = -np.sort(-p_RV, axis=1)
    near_R |= np.any(np.abs(np.cumsum(sorted_RV, axis=1) - sorted_RV - sampling.top_p) < tol, axis=1)
  return near_R


def p_wiring_error(model, run: recorded.LoopRun, sampling: msj.SamplingParams | None = None) -> tuple[float, float]:
  """Largest difference between the p verification read and plain sampling's p (under the run's
  setting, or `sampling`) at the same position, over the positions whose tokens the row committed
  and whose filter cut is not at a near tie (`near_filter_cut`); and the share set aside so."""
  sampling = run.sampling if sampling is None else sampling
  rec, logits_BNV = recorded.replay(run), plain_sampling_logits(model, run)
  plain_BNV = _probs(logits_BNV.reshape(-1, VOCAB), sampling).reshape(logits_BNV.shape)
  near_BN = near_filter_cut(logits_BNV.reshape(-1, VOCAB), sampling).reshape(logits_BNV.shape[:2])
  length_R = np.sum(run.tokens >= 0, axis=1)[rec.row_R]
  worst, compared, near = 0.0, 0, 0
  for j in range(1, K + 2):
    index_R = rec.start_R + j - 1
    sel = (rec.n_R >= j - 1) & (index_R <= np.minimum(length_R, MAX_NEW_TOKENS - 1))
    rows, index = rec.row_R[sel], index_R[sel]
    tie = near_BN[rows, index]
    diff = np.abs(rec.p_RSV[sel, j - 1] - plain_BNV[rows, index])[~tie]
    worst = max(worst, float(diff.max(initial=0.0)))
    compared, near = compared + sel.sum(), near + tie.sum()
  return worst, near / compared


@pytest.mark.parametrize("name", list(SETTINGS))
def test_speculative_sampling_matches_the_target_distribution(loop_runs, loop_check_results, prefix_probs, name):
  run = loop_runs(name)
  stats = run.stats
  # The drafter is poor but not useless: both the accept and the residual paths run often.
  assert 0.05 < stats["acceptance_by_depth"][0] < 0.95, stats["acceptance_by_depth"]
  p = pvalues(first_tokens(run), exact_joint(prefix_probs[name]))
  print(name, p)
  assert min(p.values()) > 1e-3, p
  conditional = {key: check for key, check in loop_check_results(name).items() if " given " in key}
  print(name, {key: check.describe() for key, check in conditional.items()})
  assert len(conditional) == N_TOKENS - 1
  assert not [key for key, check in conditional.items() if check.rejects], conditional


@pytest.mark.parametrize("name", list(SETTINGS))
def test_loop_verifies_plain_samplings_p_against_the_drafts_q(stat_model, loop_runs, loop_check_results, name):
  run = loop_runs(name)
  assert len(recorded.replay(run).n_R) > N_ROWS
  # p is exactly what plain sampling draws from (the cached passes against a full forward).
  error, near_ties = p_wiring_error(stat_model, run)
  assert error < 1e-4 and near_ties < 0.01, (error, near_ties)
  if run.sampling.top_k or run.sampling.top_p < 1.0:  # the check sees a filter missing on one side
    unfiltered = msj.SamplingParams(temperature=run.sampling.temperature)
    assert p_wiring_error(stat_model, run, unfiltered)[0] > 1e-2
  checks = {key: loop_check_results(name)[key] for key in ("emitted", "q>p mass", "drafts")}
  print(
    name,
    f"p error {error:.2g} ({near_ties:.2%} at a near tie)",
    {key: check.describe() for key, check in checks.items()},
  )
  assert not [key for key, check in checks.items() if check.rejects], checks


@pytest.mark.parametrize("name", list(SETTINGS))
def test_loop_acceptance_by_depth_matches_its_expectation(loop_runs, loop_check_results, name):
  run, rec = loop_runs(name), recorded.replay(loop_runs(name))
  checks = {f"accept@{j}": loop_check_results(name)[f"accept@{j}"] for j in range(1, K + 1)}
  print(name, {key: check.describe() for key, check in checks.items()})
  assert not [key for key, check in checks.items() if check.rejects], checks
  # The reported statistic is the realised rate over the active rows' passes.
  realised = [rec.accept_RK[rec.n_R >= j - 1, j - 1].mean() for j in range(1, K + 1)]
  np.testing.assert_allclose(run.stats["acceptance_by_depth"], realised, rtol=1e-5)


def test_planted_bug_residual_replaced_by_p_is_detected(loop_runs, prefix_probs):
  # The draw after a rejection from p instead of max(p - q, 0) (faults.verify_variant): the joint fails.
  run = loop_runs("t1", "residual_is_p")
  p = pvalues(first_tokens(run), exact_joint(prefix_probs["t1"]))
  print("planted bug", p)
  assert min(p.values()) < 1e-6, p


@pytest.mark.parametrize("fault", list(PLANTED))
def test_planted_loop_fault_is_caught(loop_check_results, fault):
  real, planted = loop_check_results("t1"), loop_check_results("t1", fault)
  print(fault, {key: (f"{real[key].pvalue:.3g}", f"{planted[key].pvalue:.3g}") for key in real})
  for key in PLANTED[fault]:
    assert not real[key].rejects, (key, real[key])
    assert planted[key].rejects, (key, planted[key])


# Draft trees in the loop: three children of the pending token and two under each (depth 2, 9
# nodes), every token drawn i.i.d. from one fixed q (SpecInfer's trees from a poor drafter).
TREE_PARENTS = (-1, -1, -1, 0, 0, 1, 1, 2, 2)
TREE_Q_LOGITS = np.random.default_rng(5).normal(size=VOCAB).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class IidTreeDrafter(drafters.Drafter):
  branches: ClassVar[bool] = True

  def propose(self, model, state, k, keys_B, ls):
    logq_V = jax.nn.log_softmax(jnp.asarray(TREE_Q_LOGITS))
    n = len(TREE_PARENTS)
    tokens_BN = jax.vmap(lambda key: jax.random.categorical(key, logq_V, shape=(n,)))(keys_B).astype(jnp.int32)
    tree = drafters.DraftTree(
      tokens_BN=tokens_BN,
      parent_BN=jnp.broadcast_to(jnp.asarray(TREE_PARENTS, jnp.int32), tokens_BN.shape),
      q_BNV=jnp.broadcast_to(jnp.exp(logq_V), (*tokens_BN.shape, VOCAB)),
      valid_BN=jnp.ones(tokens_BN.shape, bool),
    )
    return tree, state.draft_state


@dataclasses.dataclass(frozen=True)
class FaultyIidTreeDrafter(IidTreeDrafter):
  """The same drafter under another name: its program is compiled with the planted fault."""


@pytest.fixture
def tree_drafters(monkeypatch):
  monkeypatch.setitem(drafters.REGISTRY, "iid_tree", IidTreeDrafter)
  monkeypatch.setitem(drafters.REGISTRY, "iid_tree_faulty", FaultyIidTreeDrafter)


def tree_tokens(model, setting: str, drafter: str) -> tuple[np.ndarray, dict]:
  """The first N_TOKENS tokens (symbol V after EOS) of N_ROWS rows decoded with depth-2 trees: the
  test drafter's, or the MTP heads' likeliest six paths (deterministic children)."""
  spec = msj.SpecParams(drafter=drafter, num_draft=2, tree_nodes=6 if drafter == "mtp" else len(TREE_PARENTS))
  out = msj.generate(
    model, [PROMPT] * N_ROWS, max_new_tokens=MAX_NEW_TOKENS, sampling=SETTINGS[setting], spec=spec, seed=SEED
  )
  return np.where(out.tokens < 0, VOCAB, out.tokens)[:, :N_TOKENS], out.stats


@pytest.mark.parametrize("drafter", ["iid_tree", "mtp"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_tree_sampling_matches_the_target_distribution(stat_model, prefix_probs, tree_drafters, name, drafter):
  """Whole generations verifying draft trees (rejection.verify_tree_sampled, the path moved into
  place in the cache; i.i.d. children with their q, or the MTP heads' deterministic children):
  the first four tokens' marginals and a pair, and each token's conditional given those before
  it, against the target computed apart."""
  tokens, stats = tree_tokens(stat_model, name, drafter)
  assert 0.05 < stats["acceptance_by_depth"][0] < 0.95, stats["acceptance_by_depth"]
  p = pvalues(tokens, exact_joint(prefix_probs[name]))
  conditional = conditional_checks(tokens, prefix_probs[name])
  print(name, p, {key: check.describe() for key, check in conditional.items()})
  assert min(p.values()) > 1e-3, p
  assert not [key for key, check in conditional.items() if check.rejects], conditional


def test_planted_tree_fault_is_caught(stat_model, prefix_probs, tree_drafters, monkeypatch):
  """Siblings tried against the target's distribution instead of the running residual
  (`update_residual=False`): the same checks reject it."""
  faulty = functools.partial(rejection.verify_tree_sampled, update_residual=False)
  monkeypatch.setattr(rejection, "verify_tree_sampled", faulty)
  tokens, _ = tree_tokens(stat_model, "t1", "iid_tree_faulty")
  p = pvalues(tokens, exact_joint(prefix_probs["t1"]))
  conditional = conditional_checks(tokens, prefix_probs["t1"])
  print("planted tree fault", p, {key: check.describe() for key, check in conditional.items()})
  assert min(p.values()) < 1e-6 or conditional["t2 given t1"].rejects, (p, conditional)
