"""`ModelHandle`: what the layers below `moespec_jax.api` (decoding, the Hugging Face export) use of a
model handle. `moespec_jax.api.Model` satisfies it; the protocol lets those layers name the type
without importing the layer above them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from flax import nnx

from moespec_jax.config import ModelConfig

if TYPE_CHECKING:
  import jax
  from jax.sharding import Mesh

  from moespec_jax.data.tokenizer import Tokenizer
  from moespec_jax.model.expert_table import ExpertTable
  from moespec_jax.model.kernels import PackedWeights
  from moespec_jax.model.transformer import Transformer
  from pallas_kernels.expert_parallel import ExpertSharding


@runtime_checkable
class ModelHandle(Protocol):
  """A target model as (config, NNX graph definition, parameter state, tokenizer)."""

  config: ModelConfig
  graphdef: nnx.GraphDef
  state: nnx.State
  tokenizer: Tokenizer
  mesh: Mesh | None

  def packed_weights(
    self, *, head: bool = True, dense: bool = True, leaves: list[jax.Array] | None = None
  ) -> PackedWeights: ...

  def expert_method(self, kernel: str = "auto") -> str: ...

  def module(self) -> Transformer: ...

  def expert_table(self) -> ExpertTable: ...

  def expert_sharding(self) -> ExpertSharding | None: ...
