"""The tests mirror the core module by module (WORKSPACE.md, "Tests"): every module of moespec_jax/
(less the research harness) and of pallas_kernels/ that defines something has its test file,
tests/<folders>/test_<module>.py or test_<folder>_<module>.py (the folder's name where the bare one is
taken elsewhere; pallas_kernels/ is tests/kernels/), or the file COVERED_BY names."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Modules whose tests are named for what they test rather than for the module.
COVERED_BY = {
  "moespec_jax/cli.py": "tests/test_cli_utils.py",
  "moespec_jax/analysis/ipf.py": "tests/analysis/test_routing_analysis.py",
  "moespec_jax/analysis/routing.py": "tests/analysis/test_routing_analysis.py",
  "moespec_jax/decoding/drafters/__init__.py": "tests/decoding/test_drafters.py",
  "moespec_jax/decoding/drafters/base.py": "tests/decoding/test_drafters.py",
  "moespec_jax/decoding/drafters/controlled.py": "tests/decoding/test_drafters.py",
  "moespec_jax/decoding/drafters/mtp.py": "tests/decoding/test_mtp_drafter.py",
  "moespec_jax/decoding/drafters/ngram.py": "tests/decoding/test_drafters.py",
  "moespec_jax/decoding/drafters/none.py": "tests/decoding/test_drafters.py",
  "moespec_jax/hf/__init__.py": "tests/hf/test_hf_parity.py",
  "moespec_jax/model/attention.py": "tests/model/test_model.py",
  "moespec_jax/model/block.py": "tests/model/test_model.py",
  "moespec_jax/model/transformer.py": "tests/model/test_model.py",
  "moespec_jax/training/mtp.py": "tests/training/test_mtp_training.py",
  "pallas_kernels/__init__.py": "tests/kernels/test_expert_ffn.py",
}


def core_modules() -> list[str]:
  """The core's modules that define a function or class (packages that only re-export are not)."""
  out = []
  for package in ("moespec_jax", "pallas_kernels"):
    for path in sorted((ROOT / package).rglob("*.py")):
      relative = path.relative_to(ROOT)
      if relative.parts[:2] == ("moespec_jax", "research"):
        continue
      body = ast.parse(path.read_text()).body
      if any(isinstance(node, (ast.FunctionDef, ast.ClassDef)) for node in body):
        out.append(relative.as_posix())
  return out


def mirrors(module: str) -> list[str]:
  """The test files the naming rule accepts for `module`."""
  parts = list(pathlib.PurePosixPath(module).with_suffix("").parts)
  folders = ["kernels" if parts[0] == "pallas_kernels" else None, *parts[1:-1]]
  folders = [f for f in folders if f]
  names = [f"test_{parts[-1]}.py"] + ([f"test_{folders[-1]}_{parts[-1]}.py"] if folders else [])
  return [pathlib.PurePosixPath("tests", *folders, name).as_posix() for name in names]


def test_every_core_module_has_its_test_file():
  missing = []
  for module in core_modules():
    found = [m for m in mirrors(module) if (ROOT / m).is_file()]
    if not found and not (module in COVERED_BY and (ROOT / COVERED_BY[module]).is_file()):
      missing.append(f"{module} (expected {' or '.join(mirrors(module))})")
  assert not missing, "core modules without their test file:\n" + "\n".join(missing)


def test_covered_by_names_only_modules_without_a_mirror_and_tests_that_import_them():
  modules = set(core_modules())
  for module, test in COVERED_BY.items():
    assert module in modules, f"{module} is no core module with definitions: drop it from COVERED_BY"
    assert not any((ROOT / m).is_file() for m in mirrors(module)), f"{module} has its own test file now"
    dotted = module.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    package, _, name = dotted.rpartition(".")
    text = (ROOT / test).read_text()
    assert f"import {dotted}" in text or f"from {dotted} import" in text or f"from {package} import" in text, (
      f"{test} does not import {dotted}"
    )
