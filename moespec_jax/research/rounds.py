"""Generations timed side by side in rounds: plain decoding and each spec once per round (in a
balanced order), each round's prefill subtracted; speedups as medians of per-round ratios, their
bootstrap intervals, how often each K is the best with the rounds resampled, and more rounds
until that best K settles (experiments/cost_model's speedup sweep and auto rows)."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

import numpy as np

import moespec_jax as msj
from moespec_jax.analysis import timing


@dataclasses.dataclass(frozen=True)
class RoundRobin:
  """Per-round decode-phase seconds and stats ({label: [per round]}) and each round's prefill."""

  seconds: dict
  stats: dict
  prefill_s: list

  def speedups(self, label) -> list[float]:
    """Each round's decode-phase speedup of `label` over plain decoding (label None)."""
    return [p / q for p, q in zip(self.seconds[None], self.seconds[label])]

  def extended(self, more: RoundRobin) -> RoundRobin:
    """These rounds followed by `more`'s (the same labels)."""
    return RoundRobin(
      {k: self.seconds[k] + more.seconds[k] for k in self.seconds},
      {k: self.stats[k] + more.stats[k] for k in self.stats},
      self.prefill_s + more.prefill_s,
    )


@dataclasses.dataclass(frozen=True)
class PromptSets:
  """Prompt batches that rounds take in turn (`index`), each with the tokens plain greedy decoding
  gives it (`references`, the same length), the tokens every run of that round must equal and a
  controlled drafter's reference.

  A model drafter's acceptance is a property of the text: under greedy decoding every round of
  one prompt repeats the same passes, so its rounds measure one trajectory however many they
  are; rounds over several prompts measure the drafter on held-out text.
  """

  batches: tuple
  references: tuple

  def __post_init__(self):
    if not self.batches or len(self.batches) != len(self.references):
      raise ValueError(
        f"need one reference per prompt batch (and at least one batch), got "
        f"{len(self.batches)} batches and {len(self.references)} references"
      )

  def __len__(self) -> int:
    return len(self.batches)

  def index(self, r: int) -> int:
    """The batch of round r: every turn of len(self) rounds takes each batch once, shifted by one
    batch a turn, so that a batch does not always meet the same order of runs (the orders of
    `timing.round_order` cycle too: 4 labels and 8 batches in plain turns would pair each batch
    with one order)."""
    n = len(self)
    return (r + r // n) % n

  def rounds_for(self, rounds: int) -> int:
    """`rounds` rounded up to a whole number of turns over the batches (each counts alike)."""
    return -(-rounds // len(self)) * len(self)


def warm_up(model, prompts, max_new_tokens: int, specs: dict, reference=None) -> None:
  """Runs plain decoding and each spec of `specs` once, untimed (on the first batch of a
  `PromptSets`): a program's first run after compilation is slower than its later ones, and
  a first round that ran it cold would set a cold run against warm ones."""
  if isinstance(prompts, PromptSets):
    prompts, reference = prompts.batches[0], prompts.references[0]
  for spec in [msj.SpecParams(), *specs.values()]:
    msj.generate(
      model,
      prompts,
      max_new_tokens=max_new_tokens,
      spec=spec,
      reference_tokens=reference if spec.drafter == "controlled" else None,
    )


def round_robin_runs(
  model, prompts, max_new_tokens: int, specs: dict, rounds: int, reference=None, check_tokens=None, first_round: int = 0
) -> RoundRobin:
  """Decode-phase seconds of plain decoding (label None) and of each spec in `specs` (key: its
  label, e.g. K), `rounds` times each, side by side.

  Each round runs plain decoding and every spec once (in the balanced order of
  `timing.round_order`: no label always runs first or last, or always after the same one), so
  every spec is measured in the same stretch of time as plain and as the others: a
  slow spell of the machine moves them together. The prefill (a one-token generate()) is timed
  at the start and at the end of every round and the faster of the two is subtracted from that
  round's runs: a prefill timed once, in a slow moment, would shrink every decode time by the
  same wrong amount and inflate every ratio. `check_tokens`: every run's tokens must equal
  these (greedy speculative decoding is exact). Round r runs with seed `first_round` + r (more
  rounds of one comparison continue its seeds, and their order). `prompts` may be `PromptSets`:
  round r then decodes its batch (`PromptSets.index`), checked against (and a controlled drafter
  reading) that batch's reference; `reference` and `check_tokens` must then be None.
  """
  if isinstance(prompts, PromptSets):
    if reference is not None or check_tokens is not None:
      raise ValueError("with PromptSets, each batch's reference is its own: pass no reference or check_tokens")
    sets, checks = prompts, prompts.references
  else:
    sets, checks = PromptSets((prompts,), (reference,)), (check_tokens,)
  labels = [None] + list(specs)
  seconds = {k: [] for k in labels}
  stats = {k: [] for k in labels}
  prefills = []
  msj.generate(model, sets.batches[sets.index(first_round)], max_new_tokens=1)
  for r in range(first_round, first_round + rounds):
    i = sets.index(r)
    batch, batch_reference, expected = sets.batches[i], sets.references[i], checks[i]
    totals = {}
    before = msj.generate(model, batch, max_new_tokens=1, seed=r).stats["seconds"]
    for k in timing.round_order(labels, r):
      spec = msj.SpecParams() if k is None else specs[k]
      out = msj.generate(
        model,
        batch,
        max_new_tokens=max_new_tokens,
        spec=spec,
        seed=r,
        reference_tokens=batch_reference if spec.drafter == "controlled" else None,
      )
      if expected is not None and not np.array_equal(out.tokens, expected):
        raise AssertionError(f"speculative greedy output differs from plain ({spec})")
      totals[k] = out.stats["seconds"]
      stats[k].append(out.stats)
    after = msj.generate(model, batch, max_new_tokens=1, seed=r).stats["seconds"]
    prefills.append(min(before, after))
    for k in labels:
      seconds[k].append(max(totals[k] - prefills[-1], 1e-9))
  return RoundRobin(seconds, stats, prefills)


def median_ratio(num, den) -> float:
  """The median over rounds of num[r] / den[r]."""
  return statistics.median(n / d for n, d in zip(num, den))


def median_ratio_interval(num, den, level: float = 0.9, resamples: int = 2000, seed: int = 0):
  """A percentile-bootstrap interval (rounds resampled) for `median_ratio(num, den)`: how far
  this machine's timing noise leaves the median ratio uncertain."""
  return timing.median_interval(np.asarray(num, float) / np.asarray(den, float), level, resamples, seed)


def round_robin_speedups(
  model, prompts, max_new_tokens: int, specs: dict, rounds: int, reference=None, check_tokens=None
):
  """Each spec's decode-phase speedup over plain decoding: the median over rounds of plain's
  time over the spec's in the same round (`round_robin_runs`).

  Returns ({label: speedup}, {label: median tokens/s}, {label: stats of its last run}, [each
  round's prefill seconds], {label: [each round's speedup]}).
  """
  runs = round_robin_runs(model, prompts, max_new_tokens, specs, rounds, reference, check_tokens)
  per_round = {k: runs.speedups(k) for k in specs}
  return (
    {k: statistics.median(per_round[k]) for k in specs},
    {k: statistics.median(s["tokens_per_second"] for s in runs.stats[k]) for k in specs},
    {k: runs.stats[k][-1] for k in specs},
    runs.prefill_s,
    per_round,
  )


def best_k_bootstrap(round_speedups_KR, resamples: int = 2000, seed: int = 0) -> np.ndarray:
  """How often each K is the measured best when the rounds are resampled (percentile bootstrap).

  `round_speedups_KR[k][r]`: K = k's speedup in round r (K = 0: plain, 1.0 in every round).
  Every K of a resample draws the same rounds (they were timed side by side). Returns the share
  of resamples whose best median speedup is at each K: where speedups are flat in K, the
  measured best K moves with timing noise, and this says how far.
  """
  ratios_KR = np.asarray(round_speedups_KR, float)
  n_rounds = ratios_KR.shape[1]
  picks_SR = np.random.default_rng(seed).integers(0, n_rounds, (resamples, n_rounds))
  medians_SK = np.median(ratios_KR[:, picks_SR], axis=2).T
  return np.bincount(np.argmax(medians_SK, axis=1), minlength=ratios_KR.shape[0]) / resamples


def rounds_until_settled(
  more, labels: Sequence, repeats: int, max_repeats: int, settled_share: float, seed: int = 0
) -> RoundRobin:
  """Rounds of plain decoding (label None) and of every K in `labels` (K = 1, 2, ... in order),
  `repeats` at a time (`more(first_round, n)`: n more rounds, a `RoundRobin`), until the measured
  best K is settled: the rounds resampled put it within 1 of the best median speedup in at least
  `settled_share` of resamples (`best_k_bootstrap`, `share_within_one`), or `max_repeats` rounds
  have run."""
  runs = more(0, repeats)
  while len(runs.prefill_s) < max_repeats:
    per_round_KR = [[1.0] * len(runs.prefill_s)] + [runs.speedups(k) for k in labels]
    best = int(np.argmax([statistics.median(r) for r in per_round_KR]))
    if share_within_one(best_k_bootstrap(per_round_KR, seed=seed), best) >= settled_share:
      break
    runs = runs.extended(more(len(runs.prefill_s), min(repeats, max_repeats - len(runs.prefill_s))))
  return runs


def share_within_one(shares_K: Sequence[float], k: int) -> float:
  """The share of bootstrap resamples (`best_k_bootstrap`) whose best K is within 1 of k."""
  return float(sum(s for j, s in enumerate(shares_K) if abs(j - k) <= 1))


def plausible_best_k(shares_K: Sequence[float], floor: float = 0.1) -> tuple[int, int]:
  """The smallest and largest K that are the best in at least `floor` of the bootstrap
  resamples (`best_k_bootstrap`): the range of best K the rounds' timing noise allows."""
  ks = [k for k, s in enumerate(shares_K) if s >= floor] or [int(np.argmax(shares_K))]
  return min(ks), max(ks)
