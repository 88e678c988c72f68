"""Statistical exactness of speculative sampling.

With a deliberately poor drafter (random MTP heads), the first generated tokens under
speculative sampling (K = 2: drafts, residuals and the bonus token all occur within the first
four tokens) must follow the target's exact distribution, computed from full forward passes
over every prefix. A small-vocabulary variant of the tiny test model keeps the exact
enumeration cheap; many rows of one prompt in one jitted call give the samples. The planted-bug
test shows the check fails when the residual max(p - q, 0) is replaced by p.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moespec_jax as msj
from moespec_jax.decoding import programs, rejection
from moespec_jax.decoding.sampling import filtered_logprobs

VOCAB, EOS = 32, 31
PROMPT = [3, 7, 11]
N_TOKENS, K, N_ROWS = 4, 2, 6000
SETTINGS = {
    "t1": msj.SamplingParams(temperature=1.0),
    "t0.7_top_p0.9": msj.SamplingParams(temperature=0.7, top_p=0.9),
    "top_k5": msj.SamplingParams(temperature=1.0, top_k=5),
}


@pytest.fixture(scope="module")
def stat_model(tiny_config):
  config = tiny_config.replace(vocab_size=VOCAB, eos_id=EOS, num_mtp_modules=1)
  return msj.Model.init(config, seed=2)


@pytest.fixture(scope="module")
def prefix_logits(stat_model):
  """Target logits after every prefix of up to N_TOKENS - 1 generated tokens: {level: [V^l, V]}."""
  width = len(PROMPT) + N_TOKENS - 1
  chunk = 4096
  out = {}
  for level in range(N_TOKENS):
    combos = np.array(list(itertools.product(range(VOCAB), repeat=level)), np.int32)
    combos = combos.reshape(VOCAB ** level, level)
    rows = np.zeros((len(combos), width), np.int32)
    rows[:, :len(PROMPT)] = PROMPT
    rows[:, len(PROMPT):len(PROMPT) + level] = combos
    logits = []
    for start in range(0, len(rows), chunk):
      block = np.zeros((chunk, width), np.int32)
      part = rows[start:start + chunk]
      block[:len(part)] = part
      got = np.asarray(stat_model.forward(block))[:len(part), len(PROMPT) + level - 1]
      logits.append(got)
    out[level] = np.concatenate(logits)
  return out


def exact_joint(prefix_logits, sampling):
  """P(t_1..t_N) over V + 1 symbols per token (symbol V: stopped after EOS)."""
  s = VOCAB + 1
  joint = np.ones(())
  for level in range(N_TOKENS):
    p = np.exp(np.asarray(filtered_logprobs(jnp.asarray(prefix_logits[level]), sampling), np.float64))
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
  """Pearson chi-square p-value; cells with expected count < 5 are pooled. A count in a cell
  of probability 0 returns 0."""
  counts, probs = np.asarray(counts, np.float64).ravel(), np.asarray(probs, np.float64).ravel()
  if counts[probs <= 0].sum() > 0:
    return 0.0
  n = counts.sum()
  expected = n * probs
  big = expected >= 5
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  keep = exp > 0
  obs, exp = obs[keep], exp[keep]
  stat = float(np.sum((obs - exp) ** 2 / exp))
  df = max(len(obs) - 1, 1)
  return float(jax.scipy.special.gammaincc(df / 2.0, stat / 2.0))


def sample_tokens(model, sampling):
  out = msj.generate(model, [PROMPT] * N_ROWS, max_new_tokens=N_TOKENS, sampling=sampling,
                     spec=msj.SpecParams(drafter="mtp", num_draft=K), seed=11)
  tokens = np.where(out.tokens < 0, VOCAB, out.tokens)
  return tokens, out.stats


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


@pytest.mark.parametrize("name", list(SETTINGS))
def test_speculative_sampling_matches_the_target_distribution(stat_model, prefix_logits, name):
  sampling = SETTINGS[name]
  tokens, stats = sample_tokens(stat_model, sampling)
  # The drafter is poor but not useless: both the accept and the residual paths run often.
  assert 0.05 < stats["acceptance_by_depth"][0] < 0.95, stats["acceptance_by_depth"]
  p = pvalues(tokens, exact_joint(prefix_logits, sampling))
  print(name, p)
  assert min(p.values()) > 1e-3, p


@pytest.fixture
def planted_residual_bug(monkeypatch):
  """Replaces the residual by p for one test; traces are dropped before and after."""
  monkeypatch.setattr(rejection, "residual_probs", lambda p, q: p)
  monkeypatch.setattr(programs, "PROGRAMS", programs.ProgramCache())
  jax.clear_caches()
  yield
  jax.clear_caches()


def test_planted_bug_residual_replaced_by_p_is_detected(stat_model, prefix_logits, planted_residual_bug):
  sampling = SETTINGS["t1"]
  tokens, _ = sample_tokens(stat_model, sampling)
  p = pvalues(tokens, exact_joint(prefix_logits, sampling))
  print("planted bug", p)
  assert min(p.values()) < 1e-6, p
