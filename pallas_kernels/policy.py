"""The kernel policy of a compiled program: which kernels read the experts and which run the output
head, the dense projections and attention against the KV cache, resolved once for one platform.

A `KernelPolicy` is frozen and hashable (programs are compiled per policy). `KernelPolicy.resolve`
turns user choices ("auto", or a named kernel) into the kernels a platform runs: on the CPU
platform with the C++ library built, "auto" is the C++ kernel for the head, the dense projections
and attention, with norms whose rows do not depend on each other (so that a token's logits are the
same bits in a plain step and in a verification pass); elsewhere XLA's ops. The platform may be
another than this machine's: a CPU machine resolves (and lowers) a program for "tpu" or "gpu".
"""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels import cpu
from pallas_kernels.expert_parallel import ExpertSharding

METHODS = ("xla", "dedup", "per_slot", "auto")
BACKENDS = ("auto", "cpu", "tpu", "gpu", "interpret")
PLATFORMS = ("cpu", "tpu", "gpu")
# The output head's, dense projections' and attention's kernels: "cpu" the C++ kernel, "xla" XLA's ops.
KERNELS = ("cpu", "xla")
CHOICES = ("auto", *KERNELS)
# Names of the GPU platforms (JAX's and lowering's) that run the GPU kernels.
_GPU_NAMES = ("gpu", "cuda", "rocm")


def platform_family(name: str) -> str:
  """'cpu', 'tpu' or 'gpu' for a platform name (JAX's backends, or lowering platforms: 'cuda',
  'rocm'); ValueError for any other."""
  if name in _GPU_NAMES:
    return "gpu"
  if name in ("cpu", "tpu"):
    return name
  raise ValueError(f"platform must be one of {PLATFORMS} (or cuda / rocm), got {name!r}")


def resolve_backend(backend: str) -> str:
  """An `expert_ffn` backend, with 'auto' resolved to the kernel family of jax.default_backend()."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if backend != "auto":
    return backend
  platform = jax.default_backend()
  return platform if platform in ("tpu", "gpu") else "gpu" if platform in _GPU_NAMES else "cpu"


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
  """What a program's model calls run. The defaults are XLA's ops with the model config's expert
  method on the platform a program is traced for (what training and `Model.forward` run)."""

  # The routed experts' method (METHODS; "auto": chosen per pass size by `choose_method`);
  # None: the model config's `expert_method`.
  expert_method: str | None = None
  # "cpu" | "tpu" | "gpu": the platform whose kernels run; None: jax.default_backend() when traced.
  platform: str | None = None
  # KERNELS: the output head's product, the dense projections' (attention, dense and shared SwiGLUs,
  # routers, MTP projections) and attention against the KV cache.
  head: str = "xla"
  dense: str = "xla"
  attention: str = "xla"
  # RMSNorm sums its squares by halving, so that a row's result does not depend on the other rows.
  row_invariant_norms: bool = False
  # False: no routed expert runs (their output is zero and no expert weight is read), a diagnostic
  # that times a pass without them; its tokens are not the model's.
  routed_experts: bool = True
  # The routed experts' weights are sharded over a mesh's expert axis (expert_parallel.py); None:
  # every expert on the program's device.
  experts: ExpertSharding | None = None

  def __post_init__(self) -> None:
    if self.expert_method is not None and self.expert_method not in METHODS:
      raise ValueError(f"expert_method must be one of {METHODS} or None, got {self.expert_method!r}")
    if self.platform is not None and self.platform not in PLATFORMS:
      raise ValueError(f"platform must be one of {PLATFORMS} or None, got {self.platform!r}")
    for name in ("head", "dense", "attention"):
      if getattr(self, name) not in KERNELS:
        raise ValueError(f"{name} must be one of {KERNELS}, got {getattr(self, name)!r}")

  @property
  def backend(self) -> str:
    """The backend `expert_ffn` is called with ('auto' where the platform is left to tracing)."""
    return self.platform or "auto"

  @property
  def on_cpu(self) -> bool:
    """Whether the program runs on the CPU platform (the platform it is traced for when None)."""
    return (self.platform or resolve_backend("auto")) == "cpu"

  @classmethod
  def resolve(
    cls,
    kernel: str = "auto",
    head: str = "auto",
    dense: str = "auto",
    attention: str = "auto",
    platform: str | None = None,
    experts: ExpertSharding | None = None,
  ) -> KernelPolicy:
    """The policy of a program for `platform` (None: jax.default_backend(); 'cpu', 'tpu', 'gpu', or
    'cuda' / 'rocm' for 'gpu'). `kernel`: the expert method (METHODS), kept as given. `head`,
    `dense`, `attention`: 'auto' (the C++ kernel on the CPU platform where the library builds,
    XLA's ops elsewhere), 'cpu' (ValueError where it cannot run) or 'xla'. The norms are
    row-invariant where attention runs the C++ kernel. `experts`: the routed experts' mesh, if any."""
    if kernel not in METHODS:
      raise ValueError(f"kernel must be one of {METHODS}, got {kernel!r}")
    family = platform_family(jax.default_backend() if platform is None else platform)
    choices = {"head": head, "dense": dense, "attention": attention}
    for name, choice in choices.items():
      if choice not in CHOICES:
        raise ValueError(f"{name} must be one of {CHOICES}, got {choice!r}")
    needs_cpu = any(choice != "xla" for choice in choices.values())
    cpu_kernels = needs_cpu and family == "cpu" and cpu.available()
    resolved = {}
    for name, choice in choices.items():
      if choice == "cpu" and not cpu_kernels:
        why = (
          f"a program for the {family} platform"
          if family != "cpu"
          else (cpu.unavailable_reason() or "the C++ library is unavailable")
        )
        raise ValueError(f"{name}='cpu' needs the C++ CPU kernels, which cannot run here ({why})")
      resolved[name] = "cpu" if choice != "xla" and cpu_kernels else "xla"
    return cls(
      expert_method=kernel,
      platform=family,
      row_invariant_norms=resolved["attention"] == "cpu",
      experts=experts,
      **resolved,
    )
