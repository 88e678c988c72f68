"""Safetensors reading and the Hugging Face -> moespec-jax parameter mapping.

Checkpoints come as one `*.safetensors` file or as shards listed by
`model.safetensors.index.json`. Routed experts may be stored one tensor per expert
(`experts.{e}.gate_proj.weight`, Mixtral `w1/w3/w2`) or fused
(`experts.gate_up_proj [E, 2F, D]`, `experts.down_proj [E, D, F]`, as transformers 5 holds
them in memory). Linear weights are [out, in] on disk and become [in, ...] here.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
from safetensors import safe_open

from moespec_jax.config import ModelConfig
from moespec_jax.hf.config import ImportSpec
from moespec_jax.io import atomic

INDEX_FILE = "model.safetensors.index.json"


class TensorSource:
  """Lazy access to the tensors of a checkpoint directory (single file or sharded)."""

  def __init__(self, directory: pathlib.Path) -> None:
    directory = pathlib.Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
      weight_map = atomic.read_json(index)["weight_map"]
      self._file_of = {name: directory / f for name, f in weight_map.items()}
    else:
      files = sorted(directory.glob("*.safetensors"))
      if not files:
        raise FileNotFoundError(f"no *.safetensors file (nor {INDEX_FILE}) in {directory}")
      self._file_of = {}
      for f in files:
        with safe_open(str(f), "numpy") as handle:
          for name in handle.keys():
            self._file_of[name] = f
    self._handles: dict[pathlib.Path, Any] = {}
    self.used: set[str] = set()

  def names(self) -> set[str]:
    return set(self._file_of)

  def __contains__(self, name: str) -> bool:
    return name in self._file_of

  def get(self, name: str) -> np.ndarray:
    if name not in self._file_of:
      raise KeyError(f"checkpoint tensor {name!r} is missing")
    f = self._file_of[name]
    if f not in self._handles:
      if not f.is_file():
        raise FileNotFoundError(f"shard {f} listed in {INDEX_FILE} is missing")
      self._handles[f] = safe_open(str(f), "numpy")
    self.used.add(name)
    return self._handles[f].get_tensor(name)


def _lin(w_OI: np.ndarray) -> np.ndarray:
  """[out, in] -> [in, out]."""
  return np.ascontiguousarray(w_OI.T)


def _rope_perm(rope_dim: int) -> np.ndarray:
  """Index order that turns interleaved rotary pairs into the half-split layout."""
  return np.concatenate([np.arange(0, rope_dim, 2), np.arange(1, rope_dim, 2)])


class _Mapper:
  """Builds {path tuple: array} for one checkpoint."""

  def __init__(self, src: TensorSource, config: ModelConfig, spec: ImportSpec) -> None:
    self.src, self.c, self.spec = src, config, spec

  def attention(self, p: str) -> dict[tuple, np.ndarray]:
    c, g = self.c, self.src.get
    h = c.n_heads
    if c.attention_type == "mla":
      return self._mla(p)
    hkv, dh, d = c.n_kv_heads, c.head_dim, c.d_model
    out = {
      ("w_q_DHK",): _lin(g(f"{p}.q_proj.weight")).reshape(d, h, dh),
      ("w_k_DHK",): _lin(g(f"{p}.k_proj.weight")).reshape(d, hkv, dh),
      ("w_v_DHK",): _lin(g(f"{p}.v_proj.weight")).reshape(d, hkv, dh),
      ("w_o_HKD",): _lin(g(f"{p}.o_proj.weight")).reshape(h, dh, d),
    }
    if c.qkv_bias:
      out[("b_q_HK",)] = g(f"{p}.q_proj.bias").reshape(h, dh)
      out[("b_k_GK",)] = g(f"{p}.k_proj.bias").reshape(hkv, dh)
      out[("b_v_GK",)] = g(f"{p}.v_proj.bias").reshape(hkv, dh)
    if c.qk_norm != "none":
      out[("q_norm", "weight")] = g(f"{p}.q_norm.weight")
      out[("k_norm", "weight")] = g(f"{p}.k_norm.weight")
    return out

  def _mla(self, p: str) -> dict[tuple, np.ndarray]:
    c, g = self.c, self.src.get
    h, d = c.n_heads, c.d_model
    n, r, v, kv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    perm = _rope_perm(r) if self.spec.rope_interleaved else np.arange(r)
    head_perm = np.concatenate([np.arange(n), n + perm])
    out = {}
    if c.q_lora_rank:
      ql = c.q_lora_rank
      out[("w_qa_DQ",)] = _lin(g(f"{p}.q_a_proj.weight"))
      out[("q_norm", "weight")] = g(f"{p}.q_a_layernorm.weight")
      out[("w_qb_QHK",)] = _lin(g(f"{p}.q_b_proj.weight")).reshape(ql, h, n + r)[..., head_perm]
    else:
      out[("w_q_DHK",)] = _lin(g(f"{p}.q_proj.weight")).reshape(d, h, n + r)[..., head_perm]
    kv_a = _lin(g(f"{p}.kv_a_proj_with_mqa.weight"))  # [D, C + R]
    out[("w_kv_DC",)] = np.ascontiguousarray(kv_a[:, :kv])
    out[("w_kr_DR",)] = np.ascontiguousarray(kv_a[:, kv:][:, perm])
    out[("kv_norm", "weight")] = g(f"{p}.kv_a_layernorm.weight")
    kv_b_HXC = g(f"{p}.kv_b_proj.weight").reshape(h, n + v, kv)
    out[("w_uk_CHN",)] = np.ascontiguousarray(kv_b_HXC[:, :n].transpose(2, 0, 1))
    out[("w_uv_CHV",)] = np.ascontiguousarray(kv_b_HXC[:, n:].transpose(2, 0, 1))
    out[("w_o_HVD",)] = _lin(g(f"{p}.o_proj.weight")).reshape(h, v, d)
    return out

  def dense(self, p: str) -> dict[tuple, np.ndarray]:
    g = self.src.get
    return {
      ("w_gate_DF",): _lin(g(f"{p}.gate_proj.weight")),
      ("w_up_DF",): _lin(g(f"{p}.up_proj.weight")),
      ("w_down_FD",): _lin(g(f"{p}.down_proj.weight")),
    }

  def _experts(self, p: str) -> dict[tuple, np.ndarray]:
    c, g, src = self.c, self.src.get, self.src
    e, f, d = c.n_routed_experts, c.expert_hidden, c.d_model
    gate_n, up_n, down_n = self.spec.expert_names
    if f"{p}.experts.gate_up_proj" in src:
      gu = g(f"{p}.experts.gate_up_proj")
      down = g(f"{p}.experts.down_proj")
      if gu.shape == (e, 2 * f, d):  # transformers 5: [E, 2F, D], gate rows first.
        gate_EDF, up_EDF = gu[:, :f].transpose(0, 2, 1), gu[:, f:].transpose(0, 2, 1)
      elif gu.shape == (e, d, 2 * f):
        gate_EDF, up_EDF = gu[..., :f], gu[..., f:]
      else:
        raise ValueError(f"{p}.experts.gate_up_proj has shape {gu.shape}, expected {(e, 2 * f, d)} or {(e, d, 2 * f)}")
      if down.shape == (e, d, f):
        down_EFD = down.transpose(0, 2, 1)
      elif down.shape == (e, f, d):
        down_EFD = down
      else:
        raise ValueError(f"{p}.experts.down_proj has shape {down.shape}, expected {(e, d, f)}")
      return {
        ("w_gate_EDF",): lambda: np.ascontiguousarray(gate_EDF),
        ("w_up_EDF",): lambda: np.ascontiguousarray(up_EDF),
        ("w_down_EFD",): lambda: np.ascontiguousarray(down_EFD),
      }
    # Per-expert tensors, stacked only when `_fill` places them: the host holds one stacked weight
    # at a time, not every layer's experts.
    names = [name for name in (gate_n, up_n, down_n) for i in range(e) if f"{p}.experts.{i}.{name}.weight" not in src]
    if names:
      raise ValueError(f"Hugging Face import: {p}.experts.*.{names[0]}.weight is missing")
    return {
      (param,): (lambda name=name: np.stack([_lin(g(f"{p}.experts.{i}.{name}.weight")) for i in range(e)]))
      for param, name in (("w_gate_EDF", gate_n), ("w_up_EDF", up_n), ("w_down_EFD", down_n))
    }

  def moe(self, layer_prefix: str) -> dict[tuple, np.ndarray]:
    c, g, src = self.c, self.src.get, self.src
    p = f"{layer_prefix}.{self.spec.moe_prefix}"
    if f"{p}.gate.weight" not in src:
      p = f"{layer_prefix}.mlp"  # in-memory naming of transformers 5 (fused experts)
    out = {("w_router_DE",): _lin(g(f"{p}.gate.weight")).astype(np.float32)}
    if c.use_score_bias:
      out[("score_bias_E",)] = g(f"{p}.gate.e_score_correction_bias").astype(np.float32)
    out.update(self._experts(p))
    if c.n_shared_experts:
      name = "shared_expert" if self.spec.family == "qwen2_moe" else "shared_experts"
      out.update({("shared",) + k: v for k, v in self.dense(f"{p}.{name}").items()})
    if c.shared_expert_gate:
      out[("w_shared_gate_D",)] = g(f"{p}.shared_expert_gate.weight").reshape(-1)
    return out

  def block(self, i: int) -> dict[tuple, np.ndarray]:
    g = self.src.get
    p = f"model.layers.{i}"
    out = {
      ("attn_norm", "weight"): g(f"{p}.input_layernorm.weight"),
      ("ffn_norm", "weight"): g(f"{p}.post_attention_layernorm.weight"),
    }
    out.update({("attn",) + k: v for k, v in self.attention(f"{p}.self_attn").items()})
    ffn = self.moe(p) if self.c.is_moe_layer(i) else self.dense(f"{p}.mlp")
    out.update({("ffn",) + k: v for k, v in ffn.items()})
    return out

  def model(self) -> dict[tuple, np.ndarray]:
    c, g = self.c, self.src.get
    out = {("embed_VD",): g("model.embed_tokens.weight"), ("final_norm", "weight"): g("model.norm.weight")}
    if not c.tie_embeddings:
      out[("lm_head_DV",)] = _lin(g("lm_head.weight"))
    for i in range(c.n_layers):
      out.update({("layers", i) + k: v for k, v in self.block(i).items()})
    return out

  def mtp(self, k: int, own_head: bool) -> dict[tuple, np.ndarray]:
    """DeepSeek-V3's k-th MTP layer (stored as decoder layer n_layers + k) in `MTPModule` naming.

    DeepSeek-V3 projects cat[enorm(embedding), hnorm(hidden)]; MTPModule projects
    cat[hidden_norm(hidden), embed_norm(embedding)], so the two halves of eh_proj swap.
    """
    c, g, src = self.c, self.src.get, self.src
    p = f"model.layers.{c.n_layers + k}"
    eh_2DD = _lin(g(f"{p}.eh_proj.weight"))
    out = {
      ("hidden_norm", "weight"): g(f"{p}.hnorm.weight"),
      ("embed_norm", "weight"): g(f"{p}.enorm.weight"),
      ("w_proj_CD",): np.concatenate([eh_2DD[c.d_model :], eh_2DD[: c.d_model]], axis=0),
      ("head_norm", "weight"): g(f"{p}.shared_head.norm.weight"),
    }
    if own_head:
      out[("head_DV",)] = _lin(g(f"{p}.shared_head.head.weight"))
    elif f"{p}.shared_head.head.weight" in src:
      src.used.add(f"{p}.shared_head.head.weight")  # equal to lm_head (checked by mtp_own_head)
    if f"{p}.embed_tokens.weight" in src:
      src.used.add(f"{p}.embed_tokens.weight")  # DeepSeek-V3 repeats the shared embedding here.
    out.update({("block",) + key: v for key, v in self.block(c.n_layers + k).items()})
    return out


# Where a mapped parameter goes: (its path in the pure dict, its value) -> what the dict holds.
Place = Callable[[tuple, np.ndarray], Any]


def _fill(abstract: Any, flat: dict[tuple, Any], place: Place, path: tuple = ()) -> Any:
  """A pure dict shaped like `abstract` with the mapped arrays (shape- and completeness-checked),
  each handed to `place` as it is read (a value may be a function that reads it)."""
  if isinstance(abstract, dict):
    return {k: _fill(v, flat, place, path + (k,)) for k, v in abstract.items()}
  name = "/".join(map(str, path))
  if path not in flat:
    raise ValueError(f"Hugging Face import: no checkpoint tensor maps to parameter {name}")
  value = flat.pop(path)
  value = np.asarray(value() if callable(value) else value)
  if tuple(value.shape) != tuple(abstract.shape):
    raise ValueError(f"Hugging Face import: {name} has shape {value.shape}, expected {abstract.shape}")
  return place(path, value.astype(abstract.dtype))


def _kept(path: tuple, value: np.ndarray) -> np.ndarray:
  del path
  return value


def map_params(
  src: TensorSource, config: ModelConfig, spec: ImportSpec, abstract_pure: dict, place: Place = _kept
) -> dict:
  """The model's pure parameter dict from the checkpoint, in the abstract state's dtypes, each
  parameter as `place` puts it (default: a NumPy array)."""
  flat = _Mapper(src, config, spec).model()
  pure = _fill(abstract_pure, flat, place)
  if flat:
    raise ValueError(f"Hugging Face import: mapped tensors without a parameter: {sorted(flat)[:5]}")
  return pure


def count_mtp_layers(src: TensorSource, config: ModelConfig, spec: ImportSpec) -> int:
  """DeepSeek-V3 MTP layers present in the checkpoint (decoder layers n_layers, n_layers + 1, ...)."""
  n = 0
  while n < spec.num_mtp_layers and f"model.layers.{config.n_layers + n}.eh_proj.weight" in src:
    n += 1
  return n


def mtp_own_head(src: TensorSource, config: ModelConfig, n_layers: int, lm_head_DV: np.ndarray) -> bool:
  """Whether any MTP layer's output head differs from the model's lm_head."""
  names = [f"model.layers.{config.n_layers + k}.shared_head.head.weight" for k in range(n_layers)]
  return any(name in src and not np.array_equal(_lin(src.get(name)), lm_head_DV) for name in names)


def map_mtp(src: TensorSource, config: ModelConfig, spec: ImportSpec, abstract_mtp: dict, place: Place = _kept) -> dict:
  """The MTP layers as the model's `mtp` pure dict (config.num_mtp_modules of them)."""
  out = {}
  for k in range(config.num_mtp_modules):
    flat = _Mapper(src, config, spec).mtp(k, config.mtp_own_head)
    out[k] = _fill(abstract_mtp[k], flat, lambda path, value, k=k: place(("mtp", k, *path), value))
    if flat:
      raise ValueError(f"Hugging Face import: MTP tensors without a parameter: {sorted(flat)[:5]}")
  return out
