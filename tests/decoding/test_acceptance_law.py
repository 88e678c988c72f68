"""The acceptance law of exact verification, checked on `rejection.verify_sampled` itself.

Fixed target rows p_1..p_{K+1} and draft rows q_1..q_K over V = 16 tokens (both through
`sampling.filtered_logprobs`, as the loop builds them); N rows of drafts drawn from q and verified
in one vectorised call. Exactness means, at every depth j a row reaches:
- the draft is accepted with probability Sum_x min(p_j(x), q_j(x)) (`accept@j`);
- the token emitted at j, the accepted draft or the draw after a rejection, follows p_j (`token@j`);
- the draw after a rejection follows norm(max(p_j - q_j, 0)) (`residual@j`);
- after K acceptances the bonus token follows p_{K+1} (`bonus`);
- a token with p = 0 is never emitted (a chi-square cell of probability 0 with a count: p-value 0).
q = p accepts always; disjoint supports never accept; a one-hot q accepts with probability p(x).

Power (exactness.acceptance_test, which computes it and which the tests assert): N = 2^16 rows.
At depth 1, acceptance a near 0.5, the two-sided binomial test at ALPHA = 1e-4 has power 0.99
against a relative error delta where N (a delta)^2 = (z_{1-ALPHA/2} sqrt(a(1-a)) + z_{0.99}
sqrt(a'(1-a')))^2, z = 3.89 and 2.33: delta = 6.22 sqrt(a(1-a)) / (a sqrt(N)) = 2.4%. Depth 2
sees the a N rows that accepted at depth 1: about 3.4%. A 5% error in an acceptance rate fails
with power above 0.99. The chi-square checks' detectable biases are computed the same way (noncentral
chi-square; exactness.py) and listed in docs/findings/2026-12-06-exactness-power.md.

Each planted fault (faults.py for the verification's own line; here for faults of its inputs)
runs through the same checks with the same keys as the real rule: a test asserts that its
designated checks reject the fault and accept the real code.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moespec_jax.decoding import rejection
from moespec_jax.decoding.params import SamplingParams
from moespec_jax.decoding.sampling import filtered_logprobs
from tests.decoding import exactness, faults

V, K, N = 16, 2, 1 << 16
SEED = 0
CASES = {
  "t1": SamplingParams(temperature=1.0),
  "top_k6": SamplingParams(temperature=1.0, top_k=6),
  "t0.8_top_p0.8": SamplingParams(temperature=0.8, top_p=0.8),
}
# Faults of the verification's inputs (those of its own rule are faults.FAULTS).
INPUT_FAULTS = {
  "q_bf16": "drafts drawn from bf16 logits, q in the ratio from the same logits in f32",
  "filter_p_only": "drafts drawn from the filtered q, q in the ratio without the top-k / top-p filter",
  "filter_bonus_only": "the target's filter applied at the bonus position only, not at the verified ones",
}
# fault -> (case, the checks that must reject it).
PLANTED = {
  "accept_inflated": ("t1", ("accept@1", "accept@2")),
  "q_bf16": ("t1", ("residual@1", "residual@2")),
  "filter_p_only": ("top_k6", ("accept@1", "token@1")),
  "filter_bonus_only": ("top_k6", ("token@1", "token@2")),
  "residual_unnormalised": ("t1", ("residual@1", "token@1")),
  "residual_is_p": ("t1", ("residual@1", "token@1")),
  "bonus_from_q": ("t1", ("bonus",)),
}


def case_logits():
  """Target logits [K + 1, V] and draft logits [K, V], correlated (acceptance near 0.5), at the
  magnitude language models produce: around 20, where bf16's spacing (0.125 in [16, 32)) moves a
  probability by up to 6%."""
  rng = np.random.default_rng(SEED)
  z_p = rng.normal(0.0, 1.5, (K + 1, V))
  z_q = 0.6 * z_p[:K] + 0.8 * rng.normal(0.0, 1.5, (K, V))
  return 20.0 + z_p, 20.0 + z_q


@dataclasses.dataclass(frozen=True)
class Rows:
  """One case's rows: what verification is handed and what the law says (float64)."""

  logp_SV: jax.Array  # the target log-probabilities verification reads
  q_ratio_KV: jax.Array  # the q it divides by
  logq_draw_KV: jax.Array  # the distribution the drafts are drawn from
  p_SV: np.ndarray  # the target: what plain sampling draws from
  q_KV: np.ndarray  # the drafts' distribution


def _logprobs(logits, params: SamplingParams):
  return filtered_logprobs(jnp.asarray(logits, jnp.float32), params)


def case_rows(case: str, fault: str | None = None) -> Rows:
  params = CASES[case]
  logits_p, logits_q = case_logits()
  unfiltered = SamplingParams(temperature=params.temperature)
  logp_SV, logq_KV = _logprobs(logits_p, params), _logprobs(logits_q, params)
  rows = Rows(
    logp_SV, jnp.exp(logq_KV), logq_KV, np.exp(np.asarray(logp_SV, np.float64)), np.exp(np.asarray(logq_KV, np.float64))
  )
  if fault == "q_bf16":
    draw_KV = _logprobs(jnp.asarray(logits_q, jnp.bfloat16), params)
    rows = dataclasses.replace(rows, logq_draw_KV=draw_KV, q_KV=np.exp(np.asarray(draw_KV, np.float64)))
  elif fault == "filter_p_only":
    rows = dataclasses.replace(rows, q_ratio_KV=jnp.exp(_logprobs(logits_q, unfiltered)))
  elif fault == "filter_bonus_only":
    rows = dataclasses.replace(rows, logp_SV=rows.logp_SV.at[:K].set(_logprobs(logits_p[:K], unfiltered)))
  elif fault is not None and fault not in faults.FAULTS:
    raise ValueError(f"unknown fault {fault!r}")
  return rows


@dataclasses.dataclass(frozen=True)
class Outcome:
  accept_NK: np.ndarray
  n_N: np.ndarray
  next_N: np.ndarray
  drafts_NK: np.ndarray


def draw_and_verify(verify, key, logp_SV, q_ratio_KV, logq_draw_KV, valid):
  """N rows of K drafts drawn from `logq_draw_KV`, verified by `verify` (verify_sampled's signature)."""
  key_draft, key_verify = jax.random.split(key)
  # Inverse CDF (one uniform per draft, cheaper than Gumbel noise over V): the first token whose
  # cumulative mass reaches u times the total; u > 0, so a token of probability 0 is never drawn.
  # The uniforms are not the rule's (`rejection.uniform_open`), which a test may patch.
  cdf_KV = jnp.cumsum(jnp.exp(logq_draw_KV), axis=-1)
  u_NK = jax.random.uniform(key_draft, (N, K), jnp.float32, minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)
  drafts_NK = jnp.sum(cdf_KV[None] < u_NK[..., None] * cdf_KV[None, :, -1:], axis=-1).astype(jnp.int32)
  accept_NK, n_N, next_N = verify(
    jax.random.split(key_verify, N),
    jnp.broadcast_to(logp_SV, (N, K + 1, V)),
    drafts_NK,
    jnp.broadcast_to(q_ratio_KV, (N, K, V)),
    jnp.full((N, K), valid),
  )
  return accept_NK, n_N, next_N, drafts_NK


def verification(fault: str | None):
  """The real rule (None, or a fault of the inputs) or faults.verify_variant with `fault`."""
  if fault in faults.FAULTS:
    return functools.partial(faults.verify_variant, fault=fault)
  return rejection.verify_sampled


@functools.cache
def program(fault: str | None = None):
  """`draw_and_verify` compiled once per rule (the shapes are fixed)."""
  return jax.jit(functools.partial(draw_and_verify, verification(fault)))


def run(compiled, rows: Rows, valid: bool = True, seed: int = SEED) -> Outcome:
  """N rows drawn and verified with fixed keys by a `program`."""
  out = compiled(jax.random.key(seed), rows.logp_SV, rows.q_ratio_KV, rows.logq_draw_KV, jnp.bool_(valid))
  return Outcome(*(np.asarray(x) for x in out))


@functools.cache
def outcome(case: str, fault: str | None = None) -> Outcome:
  """The real rule (fault None) or a planted fault on a case's rows, with fixed keys."""
  return run(program(fault), case_rows(case, fault if fault in INPUT_FAULTS else None))


def emitted(out: Outcome, j: int) -> np.ndarray:
  """The token emitted at depth j (1-based) by the rows that reached it: the accepted draft, or
  the draw after the rejection (at j = K + 1: the bonus)."""
  reached = out.n_N >= j - 1
  token = out.drafts_NK[:, j - 1] if j <= K else out.next_N
  return np.where(out.n_N >= j, token, out.next_N)[reached]


def law_checks(out: Outcome, p_SV, q_KV) -> dict[str, exactness.Check]:
  """Every check of the acceptance law at every depth (module docstring)."""
  checks = {}
  for j in range(1, K + 2):
    if j <= K:
      reached = out.n_N >= j - 1
      checks[f"accept@{j}"] = exactness.acceptance_test(
        out.accept_NK[reached, j - 1], np.minimum(p_SV[j - 1], q_KV[j - 1]).sum()
      )
      checks[f"token@{j}"] = exactness.chi_square_test(np.bincount(emitted(out, j), minlength=V), p_SV[j - 1])
      residual_V = np.maximum(p_SV[j - 1] - q_KV[j - 1], 0.0)
      if residual_V.sum() > 0:
        checks[f"residual@{j}"] = exactness.chi_square_test(
          np.bincount(out.next_N[out.n_N == j - 1], minlength=V), residual_V
        )
    else:
      checks["bonus"] = exactness.chi_square_test(np.bincount(out.next_N[out.n_N == K], minlength=V), p_SV[K])
  return checks


def zero_probability_emissions(out: Outcome, p_SV) -> int:
  """How many emitted tokens have p = 0 at their depth."""
  return sum(int(np.sum(p_SV[j - 1][emitted(out, j)] == 0.0)) for j in range(1, K + 2))


@functools.cache
def evaluate(case: str, fault: str | None = None) -> dict[str, exactness.Check]:
  """The law's checks on the real rule (fault None) or a planted fault, against the true p and q."""
  rows = case_rows(case, fault if fault in INPUT_FAULTS else None)
  return law_checks(outcome(case, fault), rows.p_SV, rows.q_KV)


def boundary_uniform(key, shape):
  """Uniforms on the grid k / 256 in [0, 1): u = 0 with probability 1/256, the RNG boundary that
  let a zero-probability draft through `u <= p / q` elsewhere."""
  return jnp.floor(jax.random.uniform(key, shape, jnp.float32) * 256.0) / 256.0


def zero_probability_run(fault: str | None) -> int:
  """Zero-probability emissions where drafts often have p = 0: the target filtered to its top 6,
  the drafts drawn from the unfiltered q (a legitimate drafter), u on `boundary_uniform`'s grid.
  Call under a patch of `rejection.uniform_open` by `boundary_uniform`."""
  logits_p, logits_q = case_logits()
  logp_SV = _logprobs(logits_p, CASES["top_k6"])
  logq_KV = _logprobs(logits_q, SamplingParams(temperature=1.0))
  rows = Rows(
    logp_SV, jnp.exp(logq_KV), logq_KV, np.exp(np.asarray(logp_SV, np.float64)), np.exp(np.asarray(logq_KV, np.float64))
  )
  # A fresh program: traced now, under the patched uniforms.
  out = run(jax.jit(functools.partial(draw_and_verify, verification(fault))), rows)
  return zero_probability_emissions(out, rows.p_SV)


def test_the_faults_copy_without_a_fault_is_the_real_rule():
  for case in ("t1", "top_k6"):
    rows = case_rows(case)
    real, copy = outcome(case), run(jax.jit(functools.partial(draw_and_verify, faults.verify_variant)), rows)
    for name in ("accept_NK", "n_N", "next_N"):
      np.testing.assert_array_equal(getattr(copy, name), getattr(real, name), err_msg=f"{case}: {name}")


@pytest.mark.parametrize("case", list(CASES))
def test_acceptance_rate_is_the_overlap_and_emitted_tokens_follow_p(case):
  checks = evaluate(case)
  print(case, {name: check.describe() for name, check in checks.items()})
  assert not [name for name, check in checks.items() if check.rejects], checks
  # The sample size keeps its promise: a 5% error in the depth-1 acceptance rate fails.
  assert checks["accept@1"].detectable <= 0.05, checks["accept@1"]
  assert zero_probability_emissions(outcome(case), case_rows(case).p_SV) == 0


def test_q_equal_to_p_accepts_every_draft():
  rows = case_rows("t1")
  rows = dataclasses.replace(rows, q_ratio_KV=jnp.exp(rows.logp_SV[:K]), logq_draw_KV=rows.logp_SV[:K])
  out = run(program(), rows)
  assert out.accept_NK.all() and (out.n_N == K).all()
  assert not exactness.chi_square_test(np.bincount(out.next_N, minlength=V), rows.p_SV[K]).rejects


def test_disjoint_supports_never_accept_and_draw_from_p():
  logits_p, logits_q = case_logits()
  low = np.arange(V) < V // 2
  logp_SV = _logprobs(np.where(low, logits_p, -np.inf), CASES["t1"])
  logq_KV = _logprobs(np.where(low, -np.inf, logits_q), CASES["t1"])
  out = run(program(), Rows(logp_SV, jnp.exp(logq_KV), logq_KV, None, None))
  assert not out.accept_NK.any() and (out.n_N == 0).all()
  p_V = np.exp(np.asarray(logp_SV[0], np.float64))
  assert not exactness.chi_square_test(np.bincount(out.next_N, minlength=V), p_V).rejects


def test_a_one_hot_draft_is_accepted_with_probability_p():
  rows = case_rows("t1")
  x = int(np.argsort(rows.p_SV[0])[-3])  # a token of middling probability
  logq_KV = jnp.log(jax.nn.one_hot(jnp.full((K,), x), V))
  out = run(program(), Rows(rows.logp_SV, jnp.exp(logq_KV), logq_KV, None, None))
  assert (out.drafts_NK[:, 0] == x).all()
  assert not exactness.acceptance_test(out.accept_NK[:, 0], rows.p_SV[0, x]).rejects
  residual_V = rows.p_SV[0] * (np.arange(V) != x)
  assert not exactness.chi_square_test(np.bincount(out.next_N[out.n_N == 0], minlength=V), residual_V).rejects


def test_an_empty_draft_slot_is_rejected_and_its_token_drawn_from_p():
  rows = case_rows("t1")
  out = run(program(), rows, valid=False)
  assert not out.accept_NK.any()
  assert not exactness.chi_square_test(np.bincount(out.next_N, minlength=V), rows.p_SV[0]).rejects


def test_a_zero_probability_draft_is_never_emitted_even_at_u_zero(monkeypatch):
  """The `<=` fault (sglang #35771's shape): at u = 0 a draft with p = 0 satisfies u q <= p. The real
  strict rule never emits it; the fault does, and `token@j`'s cell of probability 0 fails it."""
  monkeypatch.setattr(rejection, "uniform_open", boundary_uniform)
  assert zero_probability_run(None) == 0
  assert zero_probability_run("accept_le") > 0


@pytest.mark.parametrize("fault", list(PLANTED))
def test_planted_fault_is_caught(fault):
  case, names = PLANTED[fault]
  real, planted = evaluate(case), evaluate(case, fault)
  print(fault, {name: (f"{real[name].pvalue:.3g}", f"{planted[name].pvalue:.3g}") for name in real})
  for name in names:
    assert not real[name].rejects, (name, real[name])
    assert planted[name].rejects, (name, planted[name])
