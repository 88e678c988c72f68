"""The MoE transformer: layers, attention with an explicit KV cache, routing, experts; the kernels a
model call runs (`Kernels`: the policy and the packed weights of the C++ CPU products, `pack_weights`)."""

from moespec_jax.model.cache import KVCache
from moespec_jax.model.handle import ModelHandle
from moespec_jax.model.kernels import PLAIN, Kernels, PackedWeights
from moespec_jax.model.packing import pack_weights
from moespec_jax.model.transformer import ForwardOutput, Routing, Transformer

__all__ = [
  "PLAIN",
  "ForwardOutput",
  "KVCache",
  "Kernels",
  "ModelHandle",
  "PackedWeights",
  "Routing",
  "Transformer",
  "pack_weights",
]
