"""What a model call runs besides its mathematics: the program's kernel policy and the weights the C++
CPU products read, handed to every module call as one argument (`Kernels`).

The policy (`pallas_kernels.policy.KernelPolicy`) is static; the packed weights are arrays, made once
per parameter set by `model.packing.pack_weights` and passed into a compiled program beside the
parameters. Each module hands its children their part of the packed weights (`Kernels.child`).
Without them (the default, `PLAIN`) a module runs XLA's ops with its config's expert method.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import struct

from pallas_kernels import cpu
from pallas_kernels.policy import KernelPolicy

# Products of at most this many rows (batch x tokens) read the packed weights with the C++ product,
# which streams each column block once for all the rows of a pass; larger passes (prefills) keep
# XLA's dot, which re-packs a weight on every multi-row product.
PACKED_MAX_ROWS = 128


@struct.dataclass
class PackedSwiGLU:
  """A dense SwiGLU's weights as column blocks (`pallas_kernels.cpu.pack_columns`): [Wg | Wu], Wd."""

  gate_up_NDC: jax.Array
  down_NDC: jax.Array


@struct.dataclass
class PackedAttention:
  """GQA's projections as column blocks: [Wq | Wk | Wv] (one product per pass) and Wo."""

  qkv_NDC: jax.Array
  o_NDC: jax.Array


@struct.dataclass
class PackedMLA:
  """MLA's products of x side by side ([Wq or Wqa | Wkv | Wkr]), Wqb (None without a query latent)
  and Wo as column blocks; W_uk and W_uv head-major (XLA's batched products of passes against the
  cache) and as column blocks per head (the C++ product of passes of few rows)."""

  x_NDC: jax.Array
  o_NDC: jax.Array
  qb_NDC: jax.Array | None
  uk_HNC: jax.Array
  uv_HCV: jax.Array
  uk_HNDC: jax.Array
  uv_HNDC: jax.Array


@struct.dataclass
class PackedMoE:
  """The router's columns, then the shared-expert gate's, as column blocks; the shared experts'."""

  router_NDC: jax.Array
  shared: PackedSwiGLU | None


@struct.dataclass
class PackedBlock:
  attn: PackedAttention | PackedMLA
  ffn: PackedSwiGLU | PackedMoE


@struct.dataclass
class PackedMTP:
  """An MTP module's W_p and own head (None: it reads the target's) as column blocks, its block's."""

  proj_NDC: jax.Array
  head_NDC: jax.Array | None
  block: PackedBlock


@struct.dataclass
class PackedWeights:
  """Everything the C++ products read: the output head (None: XLA's head) and the dense projections
  of every block and MTP module (None: XLA's products)."""

  head_NDC: jax.Array | None = None
  layers: tuple[PackedBlock, ...] | None = None
  mtp: tuple[PackedMTP, ...] | None = None


@struct.dataclass
class Kernels:
  """A program's kernel policy (static) and one module's part of the packed weights (None: nothing
  packed). The policy decides which products run on the C++ kernels; the packed weights are what
  those read (`model.packing.pack_weights` packs what the policy asks for)."""

  policy: KernelPolicy = struct.field(pytree_node=False, default=KernelPolicy())
  packed: Any = None

  @property
  def dense(self) -> Any:
    """This module's packed weights where the policy runs the dense projections on the C++ product
    (`policy.dense == "cpu"`), else None (XLA's products)."""
    return self.packed if self.policy.dense == "cpu" else None

  def child(self, field: str, index: int | None = None) -> Kernels:
    """The same policy with a child module's part of the packed weights (field `field` of this
    module's, entry `index` of it for a list of modules)."""
    part = None if self.packed is None else getattr(self.packed, field)
    if part is not None and index is not None:
      part = part[index]
    return Kernels(self.policy, part)


# No policy: XLA's ops and the config's expert method (training, `Model.forward`).
PLAIN = Kernels()


def use_packed(packed_NDC: jax.Array | None, x_BTD: jax.Array) -> bool:
  """Whether a product of `x_BTD` reads the packed weight `packed_NDC` (None: not packed)."""
  return packed_NDC is not None and x_BTD.shape[0] * x_BTD.shape[1] <= PACKED_MAX_ROWS


def packed_product(x_BTD: jax.Array, packed_NDC: jax.Array, n_cols: int) -> jax.Array:
  """x [B, T, D] @ W for W packed by `pallas_kernels.cpu.pack_columns`: float32 [B, T, n_cols]."""
  b, t, d = x_BTD.shape
  return cpu.packed_matmul(x_BTD.reshape(b * t, d), packed_NDC, n_cols).reshape(b, t, n_cols)
