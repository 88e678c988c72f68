"""The program cache: one object holding the compiled generation programs, auto K's calibrations and
the model definitions they refer to; definitions hashed once, programs forgotten on request and
the least recently used dropped where the process runs short of memory mappings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moespec_jax as msj
from moespec_jax.decoding import calibration, loop, programs
from moespec_jax.decoding.drafters.none import NoDrafter
from moespec_jax.decoding.state import LoopSpec
from pallas_kernels.policy import KernelPolicy


@pytest.fixture(scope="module")
def mtp_model(tiny_config):
  return msj.Model.init(tiny_config.replace(num_mtp_modules=1), seed=0)


def _use(monkeypatch, cache: programs.ProgramCache) -> programs.ProgramCache:
  """Makes `cache` the one generate() uses for the test."""
  monkeypatch.setattr(programs, "PROGRAMS", cache)
  return cache


def test_generate_uses_the_modules_program_cache(tiny_model, monkeypatch):
  cache = _use(monkeypatch, programs.ProgramCache())
  assert len(cache) == 0
  msj.generate(tiny_model, [[1, 2, 3]], max_new_tokens=2)
  assert len(cache) == 1 and len(cache.signatures()) == 1 and len(cache.definitions()) == 1
  (sig,) = cache.signatures()
  assert cache.program(sig) is not None and cache.signatures_by_use() == (sig,)
  cache.clear()
  assert len(cache) == 0 and not cache.definitions() and not cache.calibration_keys()


def test_program_cache_key_hashes_a_graphdef_once(tiny_model, mtp_model, monkeypatch):
  """generate() finds its compiled program without re-hashing the model's GraphDef (a walk of
  the whole module tree): one hash per graphdef object; equal graphdefs share programs."""
  graphdef = tiny_model.graphdef
  calls = []
  original = type(graphdef).__hash__
  monkeypatch.setattr(type(graphdef), "__hash__", lambda self: calls.append(1) or original(self))
  cache = programs.ProgramCache()
  definition = lambda model: cache.definition(model.graphdef, jax.tree.structure(model.state))  # noqa: E731
  first = definition(tiny_model)
  assert definition(tiny_model) is first and len(calls) == 1
  twin = msj.Model.init(tiny_model.config, seed=1)  # other weights, same structure
  assert twin.graphdef is not graphdef and definition(twin) == first
  assert definition(mtp_model) != first  # MTP heads: another structure
  ls = LoopSpec(
    max_new_tokens=4,
    cache_len=64,
    sampling=msj.SamplingParams(),
    kernels=KernelPolicy(expert_method="xla"),
    drafter=NoDrafter(),
    max_k=0,
  )
  x = jnp.zeros((1, 8), jnp.int32)
  hashed = len(calls)  # one per graphdef object so far
  assert hashed == 3
  # `loop._generate_spec` on purpose: the program generate() compiles has no public name.
  assert programs.signature(loop._generate_spec, ls, definition(tiny_model), x) == programs.signature(
    loop._generate_spec, ls, definition(twin), x
  )
  assert len(calls) == hashed


def test_forget_forgets_models_no_program_refers_to(tiny_config, monkeypatch):
  """A sweep that builds many models and drops their programs does not keep their graphdefs."""
  cache = _use(monkeypatch, programs.ProgramCache())
  kept, other = (msj.Model.init(tiny_config, seed=s) for s in (0, 1))
  assert kept.graphdef is not other.graphdef
  msj.generate(kept, [[1, 2, 3]], max_new_tokens=2)
  keep = cache.signatures()
  msj.generate(other, [[1, 2, 3]], max_new_tokens=2)  # an equal graphdef: the same program
  assert cache.signatures() == keep
  assert len(cache.definitions()) == 2
  cache.forget(keep)
  assert cache.signatures() == keep
  assert [d.graphdef for d in cache.definitions()] == [kept.graphdef]
  assert msj.generate(other, [[1, 2, 3]], max_new_tokens=2).tokens.shape == (1, 2)
  # A calibration ((signature, the drafter's calibration key)) keeps its model.
  cache.set_calibration((next(iter(keep)), 0.5), calibration.Calibration(np.ones(1, np.float32), "held_runs"))
  cache.forget()
  assert not cache.signatures() and [d.graphdef for d in cache.definitions()] == [kept.graphdef]
  cache.clear()
  assert not cache.definitions()


def test_compiled_programs_drop_the_least_recently_used_where_memory_mappings_run_short(tiny_model, monkeypatch):
  """Every compiled program holds memory mappings (hundreds, on CPU); past the process's limit the
  next compilation crashes it, so the cache drops its least recently used programs first."""
  # Each program holds 12 of the process's 100 mappings: dropping starts above 50, stops below 25.
  cache = _use(monkeypatch, programs.ProgramCache(mappings=lambda: (12 * len(cache), 100)))
  tokens = {n: msj.generate(tiny_model, [[1, 2, 3]], max_new_tokens=n).tokens for n in (1, 2, 3, 4)}
  first, _, _, _ = order = list(cache.signatures_by_use())
  msj.generate(tiny_model, [[1, 2, 3]], max_new_tokens=1)  # the first is now the most recently used
  assert list(cache.signatures_by_use()) == order[1:] + [first]
  msj.generate(tiny_model, [[1, 2, 3]], max_new_tokens=5)  # 5 programs, 60 mappings: 2, then 1 dropped
  newest = list(cache.signatures_by_use())
  assert len(newest) == 2 and newest[0] == first and newest[1] not in order
  np.testing.assert_array_equal(msj.generate(tiny_model, [[1, 2, 3]], max_new_tokens=2).tokens, tokens[2])
  assert len(cache.signatures_by_use()) == 3
  assert cache.drop_least_recent() == 0  # 36 of 100 mappings: below the high-water mark
  cache.mappings = lambda: None  # a system that does not say
  assert cache.drop_least_recent() == 0


@pytest.mark.skipif(programs.memory_mappings() is None, reason="the system does not report memory mappings")
def test_dropping_compiled_programs_returns_their_memory_mappings(tiny_model, monkeypatch):
  cache = _use(monkeypatch, programs.ProgramCache())
  tokens = msj.generate(tiny_model, [[1, 2, 3]], max_new_tokens=5).tokens
  (oldest_program,) = [cache.program(sig) for sig in cache.signatures()]
  msj.generate(tiny_model, [[1, 2, 3]], max_new_tokens=6)
  held, limit = programs.memory_mappings()
  assert 0 < held <= limit
  seen = []
  cache.mappings = lambda: seen.append(programs.memory_mappings()) or seen[-1]
  cache.high_water = held / limit  # the next compilation crosses it
  cache.low_water = (held - 1) / limit
  msj.generate(tiny_model, [[1, 2, 3]], max_new_tokens=7)
  assert seen[0][0] > held and len(seen) >= 2
  assert seen[-1][0] < seen[0][0], seen  # the dropped programs' mappings were returned
  remaining = [cache.program(sig) for sig in cache.signatures()]
  assert len(remaining) in (1, 2) and oldest_program not in remaining
  # A dropped program that a caller still holds keeps working.
  # Private on purpose: a generate() call's program arguments and full-run flag have no public name.
  _, _, args = loop._prepare(tiny_model, [[1, 2, 3]], 5, None, None, 0, None)
  out_BN, _ = oldest_program(*args[1:], np.zeros(1, np.float32), loop._NO_PRIOR, loop._FULL_RUN)
  np.testing.assert_array_equal(np.asarray(out_BN), tokens)
