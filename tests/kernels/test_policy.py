"""The kernel policy (pallas_kernels.policy): resolved once per program for a platform, frozen and
hashable, with what each platform runs and clear refusals."""

import dataclasses

import jax
import pytest

from pallas_kernels import cpu
from pallas_kernels.policy import KernelPolicy, platform_family, resolve_backend


def test_auto_on_this_cpu_runs_the_cpp_kernels():
  assert jax.default_backend() == "cpu" and cpu.available()
  policy = KernelPolicy.resolve()
  assert policy == KernelPolicy(
    expert_method="auto", platform="cpu", head="cpu", dense="cpu", attention="cpu", row_invariant_norms=True
  )
  assert policy.backend == "cpu" and policy.on_cpu
  assert KernelPolicy.resolve(platform="cpu") == policy
  assert hash(KernelPolicy.resolve()) == hash(policy)  # programs are cached per policy
  with pytest.raises(dataclasses.FrozenInstanceError):
    policy.head = "xla"  # type: ignore[misc]


def test_each_choice_resolves_apart():
  policy = KernelPolicy.resolve(kernel="per_slot", head="xla", dense="auto", attention="xla")
  assert (policy.expert_method, policy.head, policy.dense, policy.attention) == ("per_slot", "xla", "cpu", "xla")
  assert not policy.row_invariant_norms  # they go with the C++ attention
  assert KernelPolicy.resolve(attention="cpu").row_invariant_norms


@pytest.mark.parametrize("platform,family", [("tpu", "tpu"), ("gpu", "gpu"), ("cuda", "gpu"), ("rocm", "gpu")])
def test_another_platform_runs_its_own_kernels(platform, family):
  """A CPU machine resolves a program for an accelerator: its Pallas kernels for the experts and
  XLA's ops for the rest, whatever this process's backend."""
  policy = KernelPolicy.resolve(kernel="dedup", platform=platform)
  assert policy == KernelPolicy(expert_method="dedup", platform=family)
  assert policy.backend == family and not policy.on_cpu
  with pytest.raises(ValueError, match="head='cpu' needs the C\\+\\+ CPU kernels"):
    KernelPolicy.resolve(head="cpu", platform=platform)


def test_without_the_library_auto_is_xla(monkeypatch):
  monkeypatch.setattr(cpu, "available", lambda: False)
  assert KernelPolicy.resolve() == KernelPolicy(expert_method="auto", platform="cpu")
  with pytest.raises(ValueError, match="dense='cpu' needs the C\\+\\+ CPU kernels"):
    KernelPolicy.resolve(dense="cpu")


def test_the_default_policy_is_xla_on_the_traced_platform():
  policy = KernelPolicy()
  assert policy.expert_method is None and policy.platform is None and policy.backend == "auto"
  assert (policy.head, policy.dense, policy.attention, policy.row_invariant_norms) == ("xla", "xla", "xla", False)
  assert policy.on_cpu == (resolve_backend("auto") == "cpu")


def test_refusals_name_the_argument():
  with pytest.raises(ValueError, match="kernel must be one of"):
    KernelPolicy.resolve(kernel="pallas")
  with pytest.raises(ValueError, match="attention must be one of"):
    KernelPolicy.resolve(attention="pallas")
  with pytest.raises(ValueError, match="platform must be one of"):
    KernelPolicy.resolve(platform="metal")
  with pytest.raises(ValueError, match="head must be one of"):
    KernelPolicy(head="auto")
  with pytest.raises(ValueError, match="platform must be one of"):
    KernelPolicy(platform="cuda")
  assert platform_family("cuda") == "gpu"
  with pytest.raises(ValueError, match="backend must be one of"):
    resolve_backend("cuda")
