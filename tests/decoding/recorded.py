"""Verification inside the loop, recorded, and the exactness checks computed from the records.

`instrumented_verification()` replaces `rejection.verify_sampled` (the loop calls it through its
module) by `Instrumented`: it runs the real rule, or a planted fault of faults.py chosen at run
time (so one compiled program serves the real code and every fault), and records each call's p,
q, drafts and outcome through a host callback. `replay` rebuilds a generation's tokens from the
records (the commit: accepted drafts and the next token, cut at EOS and max_new_tokens) and keeps
the verifications of the rows that were active; the checks below read them. Nothing here names
loop internals: a loop that verifies through `rejection.verify_sampled` can be checked so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import moespec_jax as msj
from moespec_jax.decoding import programs, rejection
from tests.decoding import exactness, faults


@dataclasses.dataclass(frozen=True)
class Call:
  """One verification call of the loop (one pass), as recorded."""

  logp_BSV: np.ndarray
  drafts_BK: np.ndarray
  q_BKV: np.ndarray
  valid_BK: np.ndarray
  accept_BK: np.ndarray
  n_B: np.ndarray
  next_B: np.ndarray


class Instrumented:
  """Stands in for `rejection.verify_sampled`: the real rule or `fault` (one of `faults_`, a
  tuple of faults.FAULTS keys fixed when the program is traced), and a record of every call."""

  def __init__(self, real, faults_: tuple[str, ...]):
    self.real, self.faults, self.fault, self.calls = real, tuple(faults_), None, []

  def __call__(self, keys_B, logp_BSV, drafts_BK, q_BKV, valid_BK):
    args = (keys_B, logp_BSV, drafts_BK, q_BKV, valid_BK)
    which = io_callback(self._which, jax.ShapeDtypeStruct((), jnp.int32), ordered=True)
    branches = [self.real] + [functools.partial(faults.verify_variant, fault=fault) for fault in self.faults]
    out = jax.lax.switch(which, branches, *args)
    io_callback(self._record, None, *args[1:], *out, ordered=True)
    return out

  def _which(self):
    return np.int32(0 if self.fault is None else 1 + self.faults.index(self.fault))

  def _record(self, *arrays):
    self.calls.append(Call(*(np.asarray(a) for a in arrays)))


@contextlib.contextmanager
def instrumented_verification(faults_: tuple[str, ...]):
  """`rejection.verify_sampled` replaced by an `Instrumented` (yielded) while the block runs. The
  compiled programs are set aside meanwhile (the instrumented ones share the real ones' keys) and
  not written to the persistent cache (keyed by the callbacks' addresses, never read back)."""
  instrumented = Instrumented(rejection.verify_sampled, faults_)
  persistent = jax.config.jax_enable_compilation_cache
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(rejection, "verify_sampled", instrumented)
    patch.setattr(programs, "PROGRAMS", programs.ProgramCache())
    jax.clear_caches()
    jax.config.update("jax_enable_compilation_cache", False)
    try:
      yield instrumented
    finally:
      jax.config.update("jax_enable_compilation_cache", persistent)
      jax.clear_caches()


@dataclasses.dataclass(frozen=True, eq=False)
class LoopRun:
  """A generation under `Instrumented`; compared by identity (`replay` caches per run)."""

  tokens: np.ndarray  # [B, max_new_tokens], -1 after EOS
  stats: dict
  calls: list
  sampling: msj.SamplingParams
  eos: int


def generate(
  instrumented: Instrumented,
  fault: str | None,
  model,
  prompts,
  max_new_tokens: int,
  sampling: msj.SamplingParams,
  spec: msj.SpecParams,
  seed: int,
) -> LoopRun:
  """`msj.generate` with `fault` planted (None: the real rule), its verifications recorded."""
  instrumented.fault, instrumented.calls = fault, []
  out = msj.generate(model, prompts, max_new_tokens=max_new_tokens, sampling=sampling, spec=spec, seed=seed)
  return LoopRun(out.tokens, out.stats, instrumented.calls, sampling, model.config.eos_id)


@dataclasses.dataclass(frozen=True)
class Records:
  """The verifications of active rows, one per (pass, row), flattened; position j (1-based) of a
  pass is output index start + j - 1."""

  p_RSV: np.ndarray
  q_RKV: np.ndarray
  drafts_RK: np.ndarray
  accept_RK: np.ndarray
  n_R: np.ndarray
  next_R: np.ndarray
  row_R: np.ndarray
  start_R: np.ndarray


@functools.cache
def replay(run: LoopRun) -> Records:
  """Replays every recorded pass's commit, checks that it rebuilds the returned tokens, and keeps
  the passes of the rows that were active."""
  batch, max_new = run.tokens.shape
  k = run.calls[0].drafts_BK.shape[1]
  out = np.full((batch, max_new + k + 1), -1, np.int64)
  out[:, 0] = run.tokens[:, 0]
  gen = np.ones(batch, np.int64)
  done = (run.tokens[:, 0] == run.eos) | (max_new <= 1)
  j_S = np.arange(k + 1)
  kept = []
  for call in run.calls:
    active = ~done
    cand_BS = np.where(j_S[None] < call.n_B[:, None], np.pad(call.drafts_BK, ((0, 0), (0, 1))), call.next_B[:, None])
    first_eos = np.min(np.where((cand_BS == run.eos) & (j_S[None] <= call.n_B[:, None]), j_S[None], k + 1), axis=1)
    n_commit = np.where(active, np.minimum(np.minimum(call.n_B + 1, first_eos + 1), max_new - gen), 0)
    for b in np.flatnonzero(n_commit):
      out[b, gen[b] : gen[b] + n_commit[b]] = cand_BS[b, : n_commit[b]]
    kept.append((np.flatnonzero(active), gen.copy()))
    done = done | (active & (first_eos < n_commit)) | (gen + n_commit >= max_new)
    gen = gen + n_commit
  assert done.all(), "the loop stopped with rows still active"
  np.testing.assert_array_equal(out[:, :max_new], run.tokens)

  def pick(name):
    return np.concatenate([getattr(call, name)[rows] for call, (rows, _) in zip(run.calls, kept)])

  return Records(
    p_RSV=np.exp(pick("logp_BSV").astype(np.float64)),
    q_RKV=pick("q_BKV").astype(np.float64),
    drafts_RK=pick("drafts_BK"),
    accept_RK=pick("accept_BK"),
    n_R=pick("n_B"),
    next_R=pick("next_B"),
    row_R=np.concatenate([rows for rows, _ in kept]),
    start_R=np.concatenate([start[rows] for rows, start in kept]),
  )


def acceptance_checks(rec: Records) -> dict[str, exactness.Check]:
  """Accepted drafts at each depth, over the passes that reached it, against Sum_x min(p, q)."""
  checks = {}
  for j in range(1, rec.drafts_RK.shape[1] + 1):
    reached = rec.n_R >= j - 1
    rate = np.minimum(rec.p_RSV[reached, j - 1], rec.q_RKV[reached, j - 1]).sum(axis=-1)
    checks[f"accept@{j}"] = exactness.acceptance_test(rec.accept_RK[reached, j - 1], rate)
  return checks


def emitted_checks(rec: Records) -> dict[str, exactness.Check]:
  """Every token verification emitted (accepted draft, draw after a rejection, bonus) against its
  p. `emitted`: cells (position kind, q > p at the token, token), where a verified position
  compares the token's p with its draft's q and the bonus position with the last draft's q.
  `q>p mass`: how often the emitted token is one the draft overweights, against Sum p over those
  tokens (one degree of freedom, where a biased acceptance, residual or bonus moves mass)."""
  k, vocab = rec.drafts_RK.shape[1], rec.p_RSV.shape[-1]
  cells, probs, over, over_mass = [], [], [], []
  for j in range(1, k + 2):
    sel = rec.n_R >= j - 1
    token = np.where(rec.n_R[sel] >= j, rec.drafts_RK[sel, j - 1], rec.next_R[sel]) if j <= k else rec.next_R[sel]
    p_RV = rec.p_RSV[sel, j - 1]
    over_RV = rec.q_RKV[sel, min(j, k) - 1] > p_RV
    kind_RV = 2 * (j > k) + over_RV.astype(np.int64)
    probs_RC = np.zeros((sel.sum(), 4 * vocab))
    np.put_along_axis(probs_RC, kind_RV * vocab + np.arange(vocab)[None], p_RV, axis=1)
    cells.append(np.take_along_axis(kind_RV, token[:, None], axis=1)[:, 0] * vocab + token)
    probs.append(probs_RC)
    over.append(np.take_along_axis(over_RV, token[:, None], axis=1)[:, 0])
    over_mass.append(np.sum(p_RV * over_RV, axis=1))
  return {
    "emitted": exactness.pooled_chi_square_test(np.concatenate(cells), np.concatenate(probs)),
    "q>p mass": exactness.acceptance_test(np.concatenate(over), np.concatenate(over_mass)),
  }


def drafts_check(rec: Records) -> exactness.Check:
  """The drafts at every depth against the q handed to verification (what they were drawn from)."""
  return exactness.pooled_chi_square_test(rec.drafts_RK.reshape(-1), rec.q_RKV.reshape(-1, rec.q_RKV.shape[-1]))


def recorded_checks(run: LoopRun) -> dict[str, exactness.Check]:
  """Every check of this module on one generation."""
  rec = replay(run)
  return dict(acceptance_checks(rec), **emitted_checks(rec), drafts=drafts_check(rec))
