"""Hugging Face import: config mapping, safetensors loading, weight mapping, tokenizer.

`moespec_jax.Model.load(hf_dir)` calls `load_checkpoint` for a directory whose
config.json has a `model_type`. Nothing here imports torch or transformers.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from moespec_jax.config import ModelConfig
from moespec_jax.data.tokenizer import Tokenizer
from moespec_jax.hf.config import FAMILIES, ImportSpec, to_model_config
from moespec_jax.hf.tokenizer import MissingTokenizer, PretrainedTokenizer, load_for_checkpoint
from moespec_jax.hf.weights import TensorSource, count_mtp_layers, map_mtp, map_params, mtp_own_head
from moespec_jax.io import atomic
from moespec_jax.parallel import mesh as mesh_lib

__all__ = [
  "FAMILIES",
  "ImportSpec",
  "MissingTokenizer",
  "PretrainedTokenizer",
  "TensorSource",
  "load_checkpoint",
  "to_model_config",
]

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32"}


def _resolve_dtype(hf: dict, dtype: str | None) -> str:
  if dtype is not None:
    if dtype not in ("float32", "bfloat16"):
      raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    return dtype
  if jax.default_backend() == "cpu":
    return "float32"  # bf16 matmuls are far slower on CPU (docs/findings/2026-11-29-cpu-f32-over-bf16.md).
  stored = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
  return _DTYPES.get(stored, "float32")


def load_checkpoint(
  path: atomic.PathLike, dtype: str | None = None, mesh: Mesh | None = None
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State, Tokenizer, dict[str, Any]]:
  """Reads an HF model directory.

  Args:
    path: directory with config.json and *.safetensors (optionally sharded with an index).
    dtype: "float32" or "bfloat16"; None keeps the checkpoint's (float32 on a CPU backend).
    mesh: place each parameter on this mesh as it is read (`parallel.mesh`: each device receives
      its share of the routed experts; the host holds one stacked weight at a time); None: the
      default device.

  Returns:
    (config, graphdef, state, tokenizer, extras); DeepSeek-V3's MTP layers become the model's
    MTP modules (config.num_mtp_modules, usable by drafter="mtp"); extras["spec"] is the
    ImportSpec.
  """
  from moespec_jax.model import Transformer  # pylint: disable=g-import-not-at-top

  path = pathlib.Path(path).expanduser()
  hf = atomic.read_json(path / "config.json")
  config, spec = to_model_config(hf, _resolve_dtype(hf, dtype))
  src = TensorSource(path)
  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  if mesh is not None:
    mesh_lib.check_model(config, mesh)

  def place(param_path: tuple, value: np.ndarray) -> jax.Array:
    if mesh is None:
      return jax.numpy.asarray(value)
    return jax.device_put(value, mesh_lib.param_sharding(param_path, mesh))

  pure = map_params(src, config, spec, nnx.to_pure_dict(state), place)
  n_mtp = count_mtp_layers(src, config, spec)
  if n_mtp:
    # DeepSeek-V3's MTP layers become the model's MTP drafter modules (drafter="mtp").
    lm_head_DV = pure["embed_VD"].T if config.tie_embeddings else pure["lm_head_DV"]
    config = config.replace(
      num_mtp_modules=n_mtp, mtp_head_norm=True, mtp_own_head=mtp_own_head(src, config, n_mtp, lm_head_DV)
    )
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    pure["mtp"] = map_mtp(src, config, spec, nnx.to_pure_dict(state)["mtp"], place)
  nnx.replace_by_pure_dict(state, pure)
  unused = sorted(n for n in src.names() - src.used if not n.endswith("rotary_emb.inv_freq"))
  if unused:
    logging.warning("Hugging Face import of %s: %d checkpoint tensors unused, e.g. %s", path, len(unused), unused[:3])
  tokenizer = load_for_checkpoint(path, vocab_size=config.vocab_size, eos_id=config.eos_id, bos_id=config.bos_id)
  return config, graphdef, state, tokenizer, {"spec": spec}
