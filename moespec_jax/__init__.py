"""moespec-jax: speculative decoding on Mixture-of-Experts language models."""

from moespec_jax.api import Model
from moespec_jax.config import ModelConfig
from moespec_jax.decoding.loop import GenerateOutput, generate
from moespec_jax.decoding.params import ResearchOptions, SamplingParams, SpecParams, TreeCost
from moespec_jax.parallel.mesh import make_mesh

__all__ = [
  "GenerateOutput",
  "Model",
  "ModelConfig",
  "ResearchOptions",
  "SamplingParams",
  "SpecParams",
  "TreeCost",
  "generate",
  "make_mesh",
]
