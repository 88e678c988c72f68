"""The Pallas TPU (Mosaic) kernels: interpret mode on CPU against the reference, lowering for tpu."""

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import tpu
from tests.kernels.problems import CASES, check, problem


@pytest.mark.parametrize("method", ["dedup", "per_slot"])
@pytest.mark.parametrize("case", list(CASES))
def test_tpu_interpret_f32(method, case):
  check(functools.partial(tpu.expert_ffn_tpu, method=method, interpret=True), case)


@pytest.mark.parametrize("method", ["dedup", "per_slot"])
def test_tpu_interpret_bf16(method):
  check(
    functools.partial(tpu.expert_ffn_tpu, method=method, interpret=True),
    "unused_expert_n_not_block_multiple",
    jnp.bfloat16,
  )


@pytest.mark.parametrize("method", ["dedup", "per_slot"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tpu_lowers_for_tpu(method, dtype):
  # Real-ish tiles: D 256, F 384 (3 x 128: a hidden size that is not a power of two).
  args = problem(3, 8, 2, "random", dtype=dtype, d_model=256, hidden=384)
  f = functools.partial(tpu.expert_ffn_tpu, method=method)
  lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",))
  text = lowered.as_text()
  assert "tpu_custom_call" in text


def test_tpu_kernels_refuse_an_unknown_method():
  with pytest.raises(ValueError, match="method must be 'dedup' or 'per_slot', got 'grouped'"):
    tpu.expert_ffn_tpu(*problem(*CASES["n1"]), method="grouped", interpret=True)
