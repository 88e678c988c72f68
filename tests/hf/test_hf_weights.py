"""Safetensors checkpoints onto the model's parameters (moespec_jax/hf/weights.py), without
transformers: our own Qwen2-MoE export, in one file or sharded with an index, maps back onto the
parameters it was written from."""

import json

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from moespec_jax.hf import config as hf_config
from moespec_jax.hf import export, weights
from moespec_jax.model import Transformer


@pytest.fixture(scope="module")
def checkpoint(tiny_model):
  pure = nnx.to_pure_dict(tiny_model.state)
  return pure, export.qwen2_moe_tensors(tiny_model.config, pure), export.qwen2_moe_config(tiny_model.config)


def _write(tensors, directory, shards):
  directory.mkdir()
  names = sorted(tensors)
  if shards == 1:
    save_file(tensors, str(directory / "model.safetensors"))
    return
  weight_map = {}
  for i in range(shards):
    part = names[i::shards]
    save_file({n: tensors[n] for n in part}, str(directory / f"part-{i}.safetensors"))
    weight_map.update({n: f"part-{i}.safetensors" for n in part})
  (directory / weights.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("shards", [1, 3])
def test_an_exported_checkpoint_maps_back_onto_the_parameters(checkpoint, tmp_path, shards):
  pure, tensors, hf = checkpoint
  _write(tensors, tmp_path / "ckpt", shards)
  src = weights.TensorSource(tmp_path / "ckpt")
  assert src.names() == set(tensors) and "model.embed_tokens.weight" in src
  config, spec = hf_config.to_model_config(hf)
  abstract = nnx.to_pure_dict(nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))[1])
  mapped = weights.map_params(src, config, spec, abstract)
  assert src.used == set(tensors)  # every tensor of the checkpoint has its parameter
  assert weights.count_mtp_layers(src, config, spec) == 0
  np.testing.assert_array_equal(mapped["embed_VD"], pure["embed_VD"])
  np.testing.assert_array_equal(mapped["lm_head_DV"], pure["lm_head_DV"])
  for name in ("w_gate_EDF", "w_up_EDF", "w_down_EFD", "w_router_DE"):
    np.testing.assert_array_equal(mapped["layers"][1]["ffn"][name], pure["layers"][1]["ffn"][name])
  for name in ("w_q_DHK", "w_k_DHK", "w_v_DHK", "w_o_HKD"):
    np.testing.assert_array_equal(mapped["layers"][0]["attn"][name], pure["layers"][0]["attn"][name])
  # The shared expert as exported: a zero gate, sigmoid(0) = 1/2, and its down projection doubled.
  shared, original = mapped["layers"][2]["ffn"]["shared"], pure["layers"][2]["ffn"]["shared"]
  np.testing.assert_array_equal(shared["w_down_FD"], 2.0 * original["w_down_FD"])
  np.testing.assert_array_equal(mapped["layers"][2]["ffn"]["w_shared_gate_D"], 0.0)


def test_missing_tensors_and_files_are_named(checkpoint, tmp_path):
  _, tensors, _ = checkpoint
  _write(tensors, tmp_path / "ckpt", 2)
  src = weights.TensorSource(tmp_path / "ckpt")
  with pytest.raises(KeyError, match="'no.such.tensor' is missing"):
    src.get("no.such.tensor")
  (tmp_path / "ckpt" / "part-1.safetensors").unlink()
  name = sorted(tensors)[1]  # in part 1
  with pytest.raises(FileNotFoundError, match="part-1.safetensors"):
    weights.TensorSource(tmp_path / "ckpt").get(name)
  with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
    weights.TensorSource(tmp_path)
