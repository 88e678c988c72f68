"""Building the C++ CPU library (pallas_kernels.cpu.build): a missing compiler reported (and the
entry point falling back to XLA), a failed build leaving nothing, the library cached by hash."""

import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import cpu
from pallas_kernels.cpu import build
from pallas_kernels.reference import expert_ffn_reference
from tests.kernels.problems import CASES, problem


@pytest.fixture(scope="module")
def cpu_kernel():
  if not cpu.available():
    pytest.fail(f"C++ CPU kernel unavailable: {cpu.unavailable_reason()}")


def test_cpu_kernel_missing_compiler_is_reported(monkeypatch, tmp_path, caplog):
  monkeypatch.setenv("MOESPEC_CXX", "no-such-compiler-xyz")
  monkeypatch.setenv("MOESPEC_CACHE", str(tmp_path))
  # Private state on purpose: no public call unloads a built library (`reset_for_tests` forgets only a
  # failure), nor forgets the warnings logged and the kernels resolved per (method, backend) once.
  monkeypatch.setitem(build._state, "lib", None)  # pylint: disable=protected-access
  monkeypatch.setattr(pallas_kernels, "_warned", set())
  pallas_kernels._with_grouped_vjp.cache_clear()  # pylint: disable=protected-access
  try:
    with pytest.raises(cpu.CpuKernelUnavailable, match="no-such-compiler-xyz"):
      cpu.ensure_built()
    args = problem(*CASES["n1"])
    with caplog.at_level("WARNING"):
      y = pallas_kernels.expert_ffn(*args, method="dedup", backend="cpu")
    assert "falling back to the XLA path" in caplog.text and "no-such-compiler-xyz" in caplog.text
    np.testing.assert_allclose(y, expert_ffn_reference(*args), atol=1e-4)
  finally:
    pallas_kernels._with_grouped_vjp.cache_clear()  # pylint: disable=protected-access


def test_cpu_build_failure_names_the_source_and_leaves_nothing(monkeypatch, tmp_path):
  broken = tmp_path / "broken.cc"
  broken.write_text("int f() { return undefined_name; }\n")
  monkeypatch.setattr(build, "_SOURCES", (broken,))
  out = tmp_path / "build" / "lib.so"
  with pytest.raises(cpu.CpuKernelUnavailable, match="compiling broken.cc failed"):
    # `_build` on purpose: the public `ensure_built` builds only into the cache and would register the library.
    build._build(out)  # pylint: disable=protected-access
  assert list((tmp_path / "build").iterdir()) == []


def test_cpu_build_is_cached_by_hash(cpu_kernel):
  del cpu_kernel
  path = build.library_path()
  assert path.exists() and path.parent.name == "build" and path.suffix == ".so"
