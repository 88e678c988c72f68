"""The MoE transformer: layers, attention with an explicit KV cache, routing, experts."""

from moespec_jax.model.cache import KVCache
from moespec_jax.model.transformer import ForwardOutput, Routing, Transformer

__all__ = ["ForwardOutput", "KVCache", "Routing", "Transformer"]
